"""The long-run accounting's pure parts: where a window's bytes went, a step's
record, the one-time cost, the shift analysis and the tables over them."""

import jax
import numpy as np
import pytest

from capricorn_jax._src.profiling.layer_profile import Recorder
from capricorn_jax._src.profiling.probe import CollectiveProbe, StepCollectives
from capricorn_jax._src.scheduling.plan.window_bytes import WindowBytes, window_bytes
from launch.bench.records import (
    collective_times,
    idle_outside_collectives,
    late_bytes_per_step,
    schedule_at_shifts,
    shift_effect,
    window_collisions,
)
from launch.bench.report import warmup_seconds
from launch.bench.runner import step_record

A, B, C = ("block1", "fwd"), ("block1", "fwd@a2a"), ("block2", "fwd")


def test_window_bytes_splits_at_the_closing_mark():
    # Window 0 opens at A and closes at B (t=10); window 1 opens at B, closes at C (t=20).
    frames = [(A, 0.0, 4.0, 400, A), (A, 8.0, 12.0, 400, A), (A, 12.0, 14.0, 200, A),
              (B, 10.0, 15.0, 500, B)]
    sites = {0: (A, B), 1: (B, C)}
    opened = {A: 0.0, B: 10.0, C: 20.0}
    got = window_bytes(frames, sites, opened, {B: 100, C: 0})
    # Window 0: 400 + half of 400 handed over before t=10, of which 100 were
    # still queued then: 500 sent inside, 500 late of 1000.
    assert got[0] == WindowBytes(planned=1000, sent=500, late=500)
    assert got[1] == WindowBytes(planned=500, sent=500, late=0)


def test_window_bytes_closes_a_window_where_its_collective_began():
    # The same frames; window 0's collective began at t=6 with 300 bytes
    # queued (its closing site B, after the collective ended, saw an empty
    # link): handed before 6: 400 + 0 of the second frame, 300 of it queued.
    frames = [(A, 0.0, 4.0, 400, A), (A, 8.0, 12.0, 400, A), (A, 12.0, 14.0, 200, A)]
    got = window_bytes(frames, {0: (A, B)}, {A: 0.0, B: 10.0}, {B: 0}, closes_at={0: (6.0, 300)})
    assert got[0] == WindowBytes(planned=1000, sent=100, late=900)
    # Windows without an entry keep their closing site's mark.
    got = window_bytes(frames, {0: (A, B)}, {A: 0.0, B: 10.0}, {B: 0}, closes_at={})
    assert got[0] == WindowBytes(planned=1000, sent=600, late=400)


def test_window_bytes_queue_counts_at_most_the_windows_own_bytes():
    frames = [(A, 0.0, 1.0, 300, A)]
    got = window_bytes(frames, {0: (A, B)}, {A: 0.0, B: 5.0}, {B: 10_000})
    assert got[0] == WindowBytes(300, 0, 300)
    # Unknown queue (None) counts 0; a closing site that never opened: all sent.
    assert window_bytes(frames, {0: (A, B)}, {A: 0.0, B: 5.0}, {B: None})[0] == \
        WindowBytes(300, 300, 0)
    assert window_bytes(frames, {0: (A, B)}, {A: 0.0}, {})[0] == WindowBytes(300, 300, 0)


def test_window_bytes_conserves_every_byte():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 6))
        starts = np.sort(rng.uniform(0, 10, n))
        frames = [(A, float(s), float(s + rng.uniform(0.01, 3)), int(rng.integers(1, 10**6)), A)
                  for s in starts]
        close = float(rng.uniform(0, 12))
        got = window_bytes(frames, {0: (A, B)}, {A: 0.0, B: close},
                           {B: int(rng.integers(0, 10**6))})[0]
        assert got.planned == sum(f[3] for f in frames)
        assert got.sent + got.late == got.planned and got.sent >= 0 and got.late >= 0


def test_window_bytes_counts_what_a_deadline_carried():
    # Window A planned 1000 bytes and sent 600 of them; 400 went in window B,
    # which planned 300 of its own.
    frames = [(A, 0.0, 1.0, 600, A), (B, 11.0, 12.0, 400, A), (B, 12.0, 13.0, 300, B)]
    got = window_bytes(frames, {0: (A, B), 1: (B, C)}, {A: 0.0, B: 10.0, C: 20.0}, {},
                       planned={0: 1000, 1: 300})
    assert got[0] == WindowBytes(1000, 600, 0, carried_out=400, carried_in=0)
    assert got[1] == WindowBytes(300, 700, 0, carried_out=0, carried_in=400)
    for w in got.values():
        assert w.sent + w.late == w.planned - w.carried_out + w.carried_in


def test_probe_step_record_phases_spans_and_last_edge():
    rec = Recorder()
    probe = CollectiveProbe(rec)
    stamps = {("block1", "fwd:dispatch.begin"): 1.0, ("block1", "fwd:dispatch.end"): 1.5,
              ("block1", "fwd:combine.begin"): 3.0, ("block1", "fwd:combine.end"): 3.2,
              ("block1", "bwd:combine.end"): 5.0, ("block1", "bwd:combine.begin"): 5.4,
              ("block1", "bwd:dispatch.end"): 8.4, ("block1", "bwd:dispatch.begin"): 9.0}
    for (name, key), t in stamps.items():
        for device in (0, 1):  # device 1 is 0.1 s slower in every span
            late = 0.1 * device if "end" in key and "fwd" in key else 0.0
            rec._raw.append((name, key, np.array([device, 0.0], np.float32), t + late))
    got = probe.step_record()
    assert isinstance(got, StepCollectives)
    assert got.phases[("block1", "fwd", "dispatch")] == pytest.approx(0.6)
    assert got.phases[("block1", "bwd", "combine")] == pytest.approx(0.4)
    assert got.expert_spans[("block1", "fwd")] == pytest.approx(1.5)  # device 0: 3.0 - 1.5
    assert got.expert_spans[("block1", "bwd")] == pytest.approx(3.0)
    assert got.last_edge == 9.0
    assert probe.step_record().phases == {}  # drained


def test_step_record_maps_the_contracts_names():
    events = [{"event": "checkpoint", "windows": [
        {"window": "block1/fwd@x", "planned_s": 0.1, "observed_s": 0.08, "chunks_s": 0.09,
         "spill_s": 0.01, "late_s": 0.02, "bytes_planned": 100, "bytes_sent": 60,
         "bytes_late": 40}]}]
    probe = StepCollectives({("block1", "fwd", "dispatch"): 0.25}, {("block1", "fwd"): 0.5}, 2.0)
    got = step_record(7, events, probe, 0.125)
    assert got["step"] == 7
    assert got["windows"] == [{"name": "block1/fwd@x", "planned_idle_s": 0.1,
                               "observed_idle_s": 0.08, "bytes_planned": 100, "bytes_sent": 60,
                               "bytes_late": 40, "bytes_carried": None,
                               "bytes_carried_in": None, "late_s": 0.02, "spill_s": 0.01}]
    assert got["collectives"] == [{"name": "block1/fwd/dispatch", "seconds": 0.25},
                                  {"name": "grad_all_reduce", "seconds": 0.125}]
    assert got["expert_spans"] == [{"name": "block1/fwd", "seconds": 0.5}]
    empty = step_record(8, [], None, None)
    assert empty["windows"] == [] and empty["collectives"] == []


def test_warmup_seconds_counts_one_time_costs_only():
    # (seconds, profiled, compiled): steady median 1.0.
    steps = [(1.0, False, False), (1.0, False, False), (6.0, False, True), (3.0, True, False)]
    warm = {"seconds": 10.0, "steps": 3}
    # Compile: 5 s beyond steady; warm-up block 7 s beyond 3 steady steps.
    assert warmup_seconds(steps, warm, one_time_profiling=False) == 12.0
    # Gemini's first-N profiling is one-time: its 2 s count too.
    assert warmup_seconds(steps, warm, one_time_profiling=True) == 14.0
    assert warmup_seconds([(2.0, False, True)], None, False) is None


def test_shift_effect_separates_moves_from_noise():
    # Domains of 4 steps alternate between 100 and 150 ms with +-1 ms noise;
    # step 8 is a block's first step (not recorded).
    steps = [s for s in range(16) if s != 8]
    value = {s: (0.100 if (s // 4) % 2 == 0 else 0.150) + (0.001 if s % 2 else 0.0)
             for s in steps}
    spans = [[{"name": "block1/fwd", "seconds": value[s]}] for s in steps]
    got = shift_effect(steps, spans, 4)["block1/fwd"]
    assert got["shifts"] == 2 and got["shift_s"] == pytest.approx(0.05, abs=5e-4)
    assert got["noise_s"] == pytest.approx(0.001)
    assert got["multiple"] == pytest.approx(50.0, rel=0.01)
    with pytest.raises(ValueError, match="shift_every=0"):
        shift_effect(steps, spans, 0)


def test_window_collisions_and_collective_times():
    w = lambda late: {"name": "b1/fwd", "planned_idle_s": 0.1, "observed_idle_s": 0.2,  # noqa: E731
                      "bytes_planned": 100, "bytes_sent": 100 - late, "bytes_late": late}
    row = {"windows": [[w(0)], [w(50)], []],
           "collectives": [[{"name": "a", "seconds": 1.0}], [{"name": "a", "seconds": 3.0}],
                           [{"name": "a", "seconds": 2.0}]]}
    got = window_collisions(row)
    assert got == [{"name": "b1/fwd", "steps": 2, "planned_idle_s": 0.1, "observed_idle_s": 0.2,
                    "bytes_planned": 100, "bytes_sent": 75, "bytes_late": 25,
                    "late_share": 0.5}]
    assert late_bytes_per_step(row) == pytest.approx(50 / 3)
    assert late_bytes_per_step({"windows": [[], []]}) is None
    assert collective_times(row) == {"a": 2.0}


def test_idle_outside_collectives_takes_steady_steps_with_records():
    c = lambda *s: [{"name": f"c{i}", "seconds": x} for i, x in enumerate(s)]  # noqa: E731
    row = {"step_s": [1.0, 2.0, 1.5, 9.0, 8.0, 1.25],
           "collectives": [c(0.25, 0.25), c(1.0, 0.5), [], c(0.5), c(1.0), c(0.5, 0.5)],
           "step_profiled": [False, False, False, True, False, False],
           "step_compiled": [False, False, False, False, True, False]}
    # Steps 0, 1 and 5 count (2 has no record, 3 is profiled, 4 compiled): 0.5, 0.5, 0.25.
    assert idle_outside_collectives(row) == 0.5
    row["step_s"][5] = 0.5
    assert idle_outside_collectives(row) == 0.5
    assert idle_outside_collectives({"step_s": [1.0], "collectives": [[]]}) is None
    assert idle_outside_collectives({"step_s": [1.0]}) is None


def test_own_step_cache_compiles_again(tmp_path):
    """Each strategy's trainer view compiles its own step program: none
    meets a capacity bucket's compile as any other strategy does."""
    from launch import runtime

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    job = runtime.build_job("tiny", {}, 1, 4, 1e-3, 1, "steady", 4, 0, "none", "")
    state = job.trainer.init_state(0)
    batch = job.trainer.global_batch(job.data.next_batch())
    factors = (1.25,) * len(job.trainer.moe_layers)
    first, second = job.trainer.with_own_steps(), job.trainer.with_own_steps()
    jax.block_until_ready(first.step_fn(factors)(state, batch))
    n = len(compiles)
    state = job.trainer.init_state(0)
    jax.block_until_ready(first.step_fn(factors)(state, batch))
    assert len(compiles) == n  # cached in its own view
    state = job.trainer.init_state(0)
    jax.block_until_ready(second.step_fn(factors)(state, batch))
    assert len(compiles) > n  # the other view compiles its own
    assert not job.trainer.has_step(factors)


def test_schedule_at_shifts_splits_the_first_step_of_a_domain_from_the_others():
    def w(planned, sent, late):
        return {"name": "b0/fwd", "bytes_planned": planned, "bytes_sent": sent,
                "bytes_late": late}

    row = {"record_steps": [3, 4, 5, 6, 8, 9],
           "step_s": [1.0, 2.0, 1.0, 1.5, 9.0, 3.0],
           "step_profiled": [False, False, False, False, False, False],
           "step_compiled": [False, False, False, False, True, False],
           "windows": [[w(100, 100, 0)], [w(100, 40, 20)], [w(100, 90, 0)], [w(100, 100, 0)],
                       [w(100, 0, 0)], []]}
    got = schedule_at_shifts(row, 4)
    # Step 4 opens a domain; step 8 also does but compiled (left out); step 9 has no windows.
    assert got["after_shift"] == {"steps": 1, "step_s": 2.0, "late_bytes": 20.0,
                                  "after_step_bytes": 40.0}
    assert got["other"] == {"steps": 3, "step_s": 1.0, "late_bytes": 0.0,
                            "after_step_bytes": 10 / 3}
    assert schedule_at_shifts({"windows": []}, 4) is None
    with pytest.raises(ValueError, match="shift_every=0"):
        schedule_at_shifts(row, 0)
