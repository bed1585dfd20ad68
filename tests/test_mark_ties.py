"""A mark on a collective's input runs before the collective (``probe.tie``).

XLA:CPU drops ``lax.optimization_barrier`` before it schedules, so a mark
tied only by a barrier was placed after the all-to-all it should open, and
both edges of every collective were stamped together after it. These tests
read the compiled, scheduled module: the begin mark, the collective and the
end mark in that order, native and Python marks alike; and the tie changes
no bit of what it ties.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from capricorn_jax._src.native import marks as native_marks
from capricorn_jax._src.profiling.layer_profile import Recorder
from capricorn_jax._src.profiling.probe import MarkKey, edge_marked, tie
from capricorn_jax._src.scheduling.threaded.window_marks import WindowMarks


def _scheduled_lines(recorder) -> list[str]:
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))

    def body(x):
        x = edge_marked(x, ("expert",), MarkKey(recorder, "b", "fwd:dispatch.begin"), None,
                        ordered=False)
        x = jax.lax.all_to_all(x, "expert", 0, 0, tiled=True)
        x = edge_marked(x, ("expert",), MarkKey(recorder, "b", "fwd:dispatch.end"), None,
                        ordered=False)
        return jnp.tanh(x)

    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"),
                                    out_specs=P("expert")))
    text = program.lower(jnp.ones((4, 256))).compile().as_text()
    assert text is not None
    entry = text[text.index("ENTRY"):]
    return [line for line in entry.splitlines()
            if "custom_call_has_side_effect=true" in line or " all-to-all(" in line]


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_the_begin_mark_runs_before_the_collective_and_the_end_mark_after(native):
    if native and not native_marks.available():
        pytest.skip("no C++ compiler: the marks run as host callbacks")
    recorder = WindowMarks(local_devices=2, devices=2) if native else Recorder()
    try:
        lines = _scheduled_lines(recorder)
    finally:
        if native:
            recorder.close()
    kinds = ["collective" if " all-to-all(" in line else "mark" for line in lines]
    assert kinds == ["mark", "collective", "mark"], lines


def test_the_tie_changes_no_bit():
    values = np.array([0.0, -0.0, 1.5, -np.inf, np.inf, np.nan], np.float32)
    values = np.concatenate([values, np.frombuffer(np.uint32(0x7FC00123).tobytes(), np.float32)])
    leaves = [jnp.asarray(values), jnp.asarray(values, jnp.bfloat16),
              jnp.arange(-3, 3, dtype=jnp.int32), jnp.array([True, False])]
    for result in (jnp.float32(0.0), jnp.float32(-0.0), jnp.float32(np.nan)):
        out = jax.jit(tie)(leaves, result)
        for before, after in zip(leaves, out, strict=True):
            assert after.dtype == before.dtype
            assert np.asarray(after).tobytes() == np.asarray(before).tobytes()
