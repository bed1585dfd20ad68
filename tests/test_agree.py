"""Cross-host agreement on one process (the multi-process paths run in the
recovery, Orbax and training tests, whose hosts agree through them)."""

import numpy as np

from capricorn_jax._src.multihost import agree


def test_one_process_exchanges_nothing_and_keeps_the_documents():
    doc = {"inv": {"0": [1, 2]}, "big": "x" * 100_000}  # no size limit
    assert agree.allgather_json(doc) == [doc]
    assert agree.allgather_json(doc, hosts=1) == [doc]
    assert agree.broadcast_json(doc) == doc
    assert agree.allgather_floats([1.5, 2]) == [[1.5, 2.0]]


def test_agreed_floats_are_float32_everywhere_and_none_travels():
    got = agree.agree_floats([0.1, None, 3.0])
    assert got == [float(np.float32(0.1)), None, 3.0]
    assert got[0] != 0.1  # host 0 rounds too, so one process decides like many
