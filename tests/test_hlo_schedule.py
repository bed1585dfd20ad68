"""The schedule check (scheduling/in_graph/hlo_schedule.py): on the CPU-compiled
in-graph step of tests/test_executor.py (synchronous permutes: placement
only) and on synthetic HLO in the asynchronous start/done form GPUs use."""

import numpy as np
import pytest

from capricorn_jax._src.scheduling.in_graph import hlo_schedule as hs
from capricorn_jax._src.scheduling.plan.partitioner import LinkModel, Schedule, Window, partition
from capricorn_jax._src.scheduling.plan.sites import AFTER
from tests.test_executor import BOUNDARIES, setup  # noqa: F401 - setup: the executor's fixture


@pytest.fixture(scope="module")
def cpu_step(setup):  # noqa: F811 - the fixture imported above
    trainer, _, sender, step, batch, _, rows = setup
    compiled = step.lower(trainer.init_state(0), batch, rows).compile()
    return compiled, sender, BOUNDARIES


def test_cpu_step_places_every_window_after_its_tie_and_before_its_layer_ends(cpu_step):
    compiled, sender, boundaries = cpu_step
    specs = hs.window_specs(sender.schedule, boundaries)
    assert [(s.window, s.group) for s in specs] == [
        (("block0", "fwd"), "outside"), (("block1", "fwd"), "fwd"), (("head", "fwd"), "fwd"),
        (("block1", "bwd"), "bwd"), (("tail", "bwd"), "bwd"), (AFTER, "outside"),
        (hs.PAYLOAD_CRC, "outside")]
    checks = hs.check_windows(compiled.as_text(), specs, hs.layer_order(boundaries))
    assert len(checks) == sum(len(c) for c in sender.sites.values()) + 1  # + the payload CRC
    assert all(c.after_tie and c.placed for c in checks), checks
    assert all(c.overlapped is None for c in checks)  # XLA:CPU: synchronous permutes
    report = hs.summary(checks)
    assert report["ok"] and report["asynchronous"] == 0 and report["failed"] == []


def test_a_window_moved_before_its_tie_is_reported(cpu_step):
    compiled, sender, boundaries = cpu_step
    specs = hs.window_specs(sender.schedule, boundaries)
    # Claim the start window's permutes wait for block 1: they do not depend on it.
    wrong = [hs.WindowSpec(s.window, s.group, s.count, ("block1", "fwd"), s.layer)
             if s.group == "outside" and s.window not in (AFTER, hs.PAYLOAD_CRC) else s
             for s in specs]
    report = hs.summary(hs.check_windows(compiled.as_text(), wrong))
    assert not report["ok"]
    assert {tuple(f["window"]) for f in report["failed"]} == {("block0", "fwd")}


def test_a_schedule_that_does_not_match_the_module_is_refused(cpu_step):
    compiled, sender, boundaries = cpu_step
    specs = hs.window_specs(sender.schedule, boundaries)[:-1]
    with pytest.raises(ValueError, match="permutes per group"):
        hs.check_windows(compiled.as_text(), specs)


def test_cpu_step_memory_is_reported(cpu_step):
    compiled, *_ = cpu_step
    mem = hs.memory_report(compiled)
    assert mem["argument_bytes"] > 0 and mem["peak_bytes"] >= mem["argument_bytes"]
    assert mem["peak_bytes"] == (mem["argument_bytes"] + mem["output_bytes"]
                                 - mem["alias_bytes"] + mem["temp_bytes"])


# ----------------------------------------------------------- the GPU form
def _gpu_module(order: list[str]) -> str:
    """A scheduled entry computation in XLA:GPU's async form: two layers
    forward (l0, l1: three fused ops each), one chunk sent in l1's window
    (tied to l0's output), its start/done placed by ``order``."""
    meta = 'metadata={{op_name="jit(step)/jvp(Net)/{}"}}'
    lines = {
        "p": "%p = f32[64]{0} parameter(0)",
        "w": "%w = u8[1,4096]{1,0} parameter(1)",
        "a0": f"%a0 = f32[64]{{0}} fusion(%p), kind=kLoop, calls=%f0, {meta.format('l0/dot')}",
        "b0": f"%b0 = f32[64]{{0}} fusion(%a0), kind=kLoop, calls=%f1, {meta.format('l0/add')}",
        "c0": f"%c0 = f32[64]{{0}} fusion(%b0), kind=kLoop, calls=%f2, {meta.format('l0/tanh')}",
        "tie": f"%tie = u8[1,4096]{{1,0}} fusion(%w, %c0), kind=kLoop, calls=%f3, "
               f"{meta.format('ppermute/add')}",
        "start": "%collective-permute-start.1 = (u8[1,4096]{1,0}, u8[1,4096]{1,0}) "
                 "collective-permute-start(u8[1,4096]{1,0} %tie), channel_id=3, "
                 "source_target_pairs={{0,1},{1,0}}, "
                 'metadata={op_name="jit(step)/jvp(Net)/ppermute"}',
        "a1": f"%a1 = f32[64]{{0}} fusion(%c0), kind=kLoop, calls=%f4, {meta.format('l1/dot')}",
        "b1": f"%b1 = f32[64]{{0}} fusion(%a1), kind=kLoop, calls=%f5, {meta.format('l1/add')}",
        "c1": f"%c1 = f32[64]{{0}} fusion(%b1), kind=kLoop, calls=%f6, {meta.format('l1/tanh')}",
        "done": "%collective-permute-done.1 = u8[1,4096]{1,0} collective-permute-done("
                "(u8[1,4096]{1,0}, u8[1,4096]{1,0}) %collective-permute-start.1)",
    }
    body = "\n".join("  " + lines[k] for k in order)
    return ("HloModule jit_step, is_scheduled=true\n\n%f0 (x: f32[64]) -> f32[64] {\n"
            "  ROOT %x = f32[64]{0} parameter(0)\n}\n\nENTRY %main (p: f32[64], w: u8[1,4096]) "
            "-> (f32[64], u8[1,4096]) {\n" + body +
            "\n  ROOT %t = (f32[64]{0}, u8[1,4096]{1,0}) "
            "tuple(%c1, %collective-permute-done.1)\n}\n")


SPEC = [hs.WindowSpec(("l1", "fwd"), "fwd", 1, ("l0", "fwd"), ("l1", "fwd"))]
BASE = ["p", "w", "a0", "b0", "c0", "tie"]


def test_async_permute_around_its_layer_is_overlapped():
    text = _gpu_module(BASE + ["start", "a1", "b1", "c1", "done"])
    instrs = hs.entry_instructions(text)
    assert [p.asynchronous for p in hs.permutes(instrs)] == [True]
    assert hs.layer_spans(instrs)[("l1", "fwd")] == (7, 9)
    [check] = hs.check_windows(text, SPEC)
    assert (check.start, check.done, check.after_tie, check.placed, check.overlapped) == (
        6, 10, True, True, True)


@pytest.mark.parametrize("order,overlapped,placed", [
    (BASE + ["start", "done", "a1", "b1", "c1"], False, True),  # done before the layer
    (BASE + ["a1", "b1", "c1", "start", "done"], False, False),  # issued after the layer
])
def test_async_permute_not_overlapping_its_layer_is_reported(order, overlapped, placed):
    [check] = hs.check_windows(_gpu_module(order), SPEC)
    assert check.overlapped is overlapped and check.placed is placed and not check.ok


def test_async_permute_closed_inside_its_layer_still_overlaps_it():
    """XLA:GPU closes a permute before the layer's next collective: part of
    the layer ran while it moved, which is what the window is for."""
    [check] = hs.check_windows(_gpu_module(BASE + ["start", "a1", "b1", "done", "c1"]), SPEC)
    assert (check.placed, check.overlapped, check.ok) == (True, True, True)


def test_a_done_without_its_start_is_an_error():
    text = _gpu_module(BASE + ["a1", "b1", "c1", "done"])
    with pytest.raises(ValueError, match="done of no start"):
        hs.permutes(hs.entry_instructions(text))
    with pytest.raises(ValueError, match="no ENTRY"):
        hs.entry_instructions("HloModule x\n")


def test_window_specs_follow_the_executor_sites():
    windows = [Window("block0", "fwd", 1e-3), Window("block1", "fwd", 1e-3),
               Window("block1", "bwd", 1e-3), Window("block0", "bwd", 1e-3)]
    sched = partition(1000, windows, LinkModel(0.0, 1e5), chunk_cap=100)
    assert isinstance(sched, Schedule) and sched.tail_bytes > 0
    specs = hs.window_specs(sched, ["block0", "block1"])
    assert [(s.window, s.group, s.tie, s.layer) for s in specs] == [
        (("block0", "fwd"), "outside", None, ("block0", "fwd")),
        (("block1", "fwd"), "fwd", ("block0", "fwd"), ("block1", "fwd")),
        (("block1", "bwd"), "bwd", None, ("block1", "bwd")),
        (("block0", "bwd"), "bwd", ("block1", "bwd"), ("block0", "bwd")),
        (AFTER, "outside", ("block1", "bwd"), None),
        (hs.PAYLOAD_CRC, "outside", None, None)]
    # Every chunk's permute, and one for the payloads' CRC32C.
    assert sum(s.count for s in specs) == sum(map(len, sched.chunks)) + len(sched.tail) + 1
    assert np.all([s.count > 0 for s in specs])
