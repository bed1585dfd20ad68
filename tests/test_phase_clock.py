"""The training thread's blocked time by phase (``memory.phase_clock``) and
the bench's per-step means of it (``launch.bench.step_stats.blocked``)."""

import pytest

from capricorn_jax._src.memory.tier import phase_clock
from launch.bench import step_stats


class _FakeTime:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = _FakeTime()
    monkeypatch.setattr(phase_clock, "time", fake)
    return phase_clock.PhaseClock(), fake


def test_phases_accumulate_and_a_nested_phase_pauses_the_outer_one(clock):
    c, t = clock
    with c.phase("pack"):
        t.now += 2.0
    with c.phase("status_round"):
        t.now += 1.0
        with c.phase("bookkeeping"):
            t.now += 4.0
        t.now += 0.5
    with c.phase("pack"):
        t.now += 3.0
    assert c.take() == {"pack": 5.0, "status_round": 1.5, "bookkeeping": 4.0}
    assert c.take() == {}  # reset by the first take


def test_a_phase_that_raises_is_still_counted(clock):
    c, t = clock
    with pytest.raises(RuntimeError), c.phase("peer_wait"):
        t.now += 0.25
        raise RuntimeError("peer gone")
    assert c.take() == {"peer_wait": 0.25}


def test_blocked_means_per_step_with_phases_and_the_steady_steps_apart():
    records = [
        {"step": 0.100, "save": 0.010, "phases": {"pack": 0.004, "status_round": 0.002},
         "steady": True},
        {"step": 0.300, "save": 0.030, "phases": {"pack": 0.006}, "steady": False},
        {"step": 0.200, "save": 0.020, "phases": {"pack": 0.008, "status_round": 0.004},
         "steady": True},
    ]
    out = step_stats.blocked(records)
    assert out["blocked_ms_per_step"] == 20.0
    # A step without a phase counts 0 for it.
    assert out["blocked_ms"] == {"step": 200.0, "save": 20.0, "phase.pack": 6.0,
                                 "phase.status_round": 2.0}
    assert out["blocked_steady_ms"] == {"step": 150.0, "save": 15.0, "phase.pack": 6.0,
                                        "phase.status_round": 3.0}
    assert step_stats.blocked([{"step": 0.1, "save": 0.0, "steady": False}])[
        "blocked_steady_ms"] is None
    assert step_stats.blocked([]) == {}
