"""launch.experiments.moe_load: the load control and the structure of its result
(no timing checks)."""

import jax
import numpy as np
import pytest

from launch.experiments.moe_load import markdown, measure, routed_inputs


def test_routed_inputs_send_the_chosen_share_of_tokens_to_expert_0():
    x = routed_inputs(num_experts=8, top_k=2, d_model=16, groups=3, tokens=100, skew=0.6, seed=0)
    code = x[..., :8]
    top2 = np.argsort(-code, axis=-1)[..., :2]
    assert x.shape == (3, 100, 16)
    assert np.all(top2[..., 0] != top2[..., 1])
    np.testing.assert_array_equal(np.sum(top2 == 0, axis=(1, 2)), [60, 60, 60])


@pytest.mark.soak
@pytest.mark.slow  # long: compiles or many examples
def test_bucketed_capacity_follows_skew_and_fixed_does_not():
    assert jax.device_count() == 4
    result = measure("tiny", 4, 2, ["uniform", "0.4", "0.8"])
    rows = result["rows"]
    assert result["tokens_per_group"] == 256 and result["even_share"] == 64
    assert [r["skew"] for r in rows] == ["uniform", "0.4", "0.8"]
    max_routed = [r["max_routed"] for r in rows]
    assert max_routed == sorted(max_routed) and max_routed[0] >= 64
    assert max_routed[-1] == round(0.8 * 256)  # expert 0's exact share
    factors = [r["capacity_factor_bucketed"] for r in rows]
    assert all(a < b for a, b in zip(factors, factors[1:], strict=False))
    assert {r["capacity_factor_fixed"] for r in rows} == {2.0}
    assert all(r["dropped_bucketed"] == 0 for r in rows)
    assert rows[-1]["dropped_fixed"] == 4 * (205 - 128)
    for r in rows:
        for mode in ("bucketed_ms", "fixed_ms"):
            assert len(r[mode]["samples"]) == 2
            assert 0 < r[mode]["min"] <= r[mode]["median"] <= r[mode]["max"]
        assert r["ratio"] > 0
    assert len(markdown(result).splitlines()) == 4 + len(rows)


def test_skew_below_uniform_is_rejected():
    with pytest.raises(ValueError, match="outside"):
        measure("tiny", 4, 1, ["0.1"])
