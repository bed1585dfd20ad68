"""agree_measured refuses a NaN (unmeasured) value by name, as documented."""
import math

import pytest

from capricorn_jax._src.multihost.agree import agree_measured


def test_agree_measured_names_the_nan_value_it_refuses():
    with pytest.raises(ValueError) as err:
        agree_measured([1.5, math.nan, 2.0, math.nan], hosts=1, what="step_times")
    assert str(err.value) == "step_times: host 0's values [1, 3] are NaN, not measured values"


def test_agree_measured_returns_float32_rounded_measured_values():
    assert agree_measured([0.1, 2.0], hosts=1) == [float.fromhex("0x1.99999a0000000p-4"), 2.0]
