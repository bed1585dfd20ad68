"""The scheduled strategy's parts, each alone (``strategies.planners``,
``strategies.movers``): no JAX process, no channel, no compiled step.

A planner is fed synthetic ``LayerProfile``s and window records over a
recording schedule and a status-note stand-in: the fixed planner plans once
after its first ``first_n`` profiles and acts on no spill; the replanning
planner asks for a profile after a streak of spilled versions (host 0's
agreed note) and a warm profile answers it. The threaded mover runs over a
recording sender and channel keeper: what a moving step hands the sender,
what ``collect`` makes of an arrival, a corrupt version and a lost channel,
a version held over into the next step, and a save while the channel is
lost. (The in-graph mover's steps are compiled: tests/test_window_clock.py
runs it with the replanning planner; the whole strategy runs in
tests/test_strategies.py, test_bench.py and test_emergency_scheduled.py.)
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, cast

import numpy as np
import pytest

from capricorn_jax._src.memory.tier.writer_door import TierWriter
from capricorn_jax._src.profiling.layer_profile import LayerProfile, Segment
from capricorn_jax._src.scheduling.in_graph.transfers import ScheduledTransfers
from capricorn_jax._src.scheduling.plan.partitioner import LinkModel, Window, partition
from capricorn_jax._src.scheduling.threaded.sender import ThreadedSender
from capricorn_jax._src.scheduling.threaded.versions import VersionDropped
from capricorn_jax._src.strategies import movers, registry
from capricorn_jax._src.strategies.channel_loss import ChannelKeeper
from capricorn_jax._src.strategies.movers import Payload, ThreadedMover
from capricorn_jax._src.strategies.planners import (
    PLANNERS,
    SPILL_WINDOW,
    FixedPlanner,
    PlanTarget,
    ReplanningPlanner,
)
from capricorn_jax._src.strategies.scheduled import ScheduledStrategy
from tests.helpers import StatusNotes

LINK = LinkModel(alpha_s=0.0, bytes_per_s=1000.0)
SCHEDULE = partition(1000, [Window("block0", "fwd", 1.0)], LINK, chunk_cap=250)


# ------------------------------------------------------------------ planners


class _Target:
    """The schedule in force, recording each re-partition's windows."""

    link = LINK

    def __init__(self) -> None:
        self.schedule = None
        self.plans: list[list[Window]] = []

    def repartition(self, windows):
        self.plans.append(list(windows))
        self.schedule = partition(1000, windows, LINK, chunk_cap=250)
        return self.schedule

    def summary(self):
        return {"scheduled": self.schedule is not None}


def _profile(step: int, seconds: float) -> LayerProfile:
    return LayerProfile(step, 2 * seconds, (Segment("block0", "fwd", 0.0, seconds),
                                            Segment("block1", "fwd", seconds, seconds)))


def _spilled(spill: bool) -> list[dict[str, Any]]:
    return [{"window": "block0/fwd", "spill_s": 0.5 if spill else 0.0}]


def test_the_spec_names_the_planner():
    assert {s.name: s.planner for s in registry.specs() if s.scheduled} == {
        "gemini": "fixed", "capricorn": "replan", "capricorn_pec": "replan"}
    assert PLANNERS == {"fixed": FixedPlanner, "replan": ReplanningPlanner}
    assert not FixedPlanner.acts_on_windows and ReplanningPlanner.acts_on_windows
    # A name with no planner of its own is refused before the tier is touched.
    with pytest.raises(ValueError, match="planner must be one of"):
        ScheduledStrategy("toy", cast(TierWriter, None), cast(Any, None))


def test_the_fixed_planner_plans_once_after_first_n_profiles_and_acts_on_no_spill():
    notes = StatusNotes()
    target = _Target()
    p = FixedPlanner(notes, cast(PlanTarget, target), (0, 1), spans=False, first_n=2)
    assert p.on_profile(1, _profile(1, 9.0), cold=True) is None  # counted, not averaged
    event = p.on_profile(2, _profile(2, 1.0), cold=False)
    assert event is not None and event["source"] == "profile" and event["windows_s"] == [1.0, 1.0]
    assert p.repartitions == [2] and p.planned_on is not None and p.planned_on.step == 2
    assert p.on_profile(3, _profile(3, 0.5), cold=False) is None and len(target.plans) == 1
    for version in range(SPILL_WINDOW):  # every version spills: noted, never acted on
        p.on_windows(_spilled(True), None)
        notes.agreed_note = notes.status_note
        p.on_committed(version)
    assert notes.status_note == 1000 + SPILL_WINDOW
    assert not p.profile_requested() and p.spill_requests == []
    assert p.replan_at_load(5, cast(Any, None), np.ones((2, 4))) is None
    assert p.allow_profile(cast(Any, None), np.ones((2, 4)))
    assert p.summary()["repartition_steps"] == [2]


def test_the_replanning_planner_asks_for_a_profile_on_a_spill_streak_and_a_profile_answers():
    notes = StatusNotes()
    target = _Target()
    p = ReplanningPlanner(notes, cast(PlanTarget, target), (0, 1), spans=False)
    assert p.on_profile(1, _profile(1, 2.0), cold=True) is None  # a cold profile plans nothing
    p.on_profile(2, _profile(2, 2.0), cold=False)
    asked = []
    for version, spill in enumerate((False, True, True, True, True), start=3):
        p.on_windows(_spilled(spill), None)
        notes.agreed_note = notes.status_note  # the status round: host 0's note
        p.on_committed(version)
        asked.append(p.profile_requested())
    # 3 of the last 4 spilled after version 6: more than half; asked once.
    assert asked == [False, False, False, True, True] and p.spill_requests == [6]
    assert notes.status_note == 1000 + SPILL_WINDOW
    event = p.on_profile(8, _profile(8, 3.0), cold=False)  # the profile it asked for
    assert event is not None and p.repartitions == [2, 8]
    assert not p.profile_requested()
    # Its windows: the shortest of the recent warm profiles (2.0 s, not 3.0).
    assert [w.duration_s for w in target.plans[-1]] == [2.0, 2.0]
    # The spill count restarts under the new schedule (2 schedules so far).
    p.on_windows(_spilled(True), None)
    assert notes.status_note == 2000 + 1


# ---------------------------------------------------------------- the mover


class _Tier(StatusNotes):
    """The memory tier as the threaded mover reads it."""

    transport: Any
    def __init__(self, budget: bool = False) -> None:
        super().__init__(transport=object(), host=0)
        self.options = types.SimpleNamespace(max_wait_s=1.0 if budget else None)
        self.clock = types.SimpleNamespace(phase=lambda name: contextlib.nullcontext())
        self.lost: list[int] = []

    def note_lost(self, versions):
        self.lost += list(versions)


class _Sender:
    """Records what the mover hands it; each version goes in ``parts`` parts."""

    def __init__(self, parts: int = 1, hold_tail: int = 0, held: int = 0) -> None:
        self.parts, self.hold_tail, self.held = parts, hold_tail, held
        self.left: dict[int, int] = {}
        self.calls: list[tuple] = []
        self.marks = types.SimpleNamespace(table=types.SimpleNamespace(native=False))
        self.last_spans, self.last_sends = {0: 0.5}, {0: 0.75}
        self.last_bytes: dict[int, Any] = {}
        self.last_times = {"sent_s": 0.123456}

    def hook(self):
        return "sender-marks"

    def start(self, version, own, schedule, parts=1):
        self.calls.append(("start", version, parts))
        self.left[version] = parts - 1

    def resume(self, version, flush=False):
        self.calls.append(("resume", version, flush))
        self.left[version] = 0 if flush else self.left[version] - 1

    def parts_left(self, version):
        return self.left[version]

    def held_bytes(self, version):
        return self.held

    def extend(self, version):
        self.left[version] += 1

    def abandon(self):
        return sorted(self.left)


class _Keeper:
    """The channel keeper: ``arrive`` what a wait returns or raises; ``is_down``."""

    def __init__(self) -> None:
        self.arrive: Any = np.zeros((2, 8), np.uint8)
        self.is_down = False
        self.notes = 0

    def wait(self, version):
        if isinstance(self.arrive, BaseException):
            raise self.arrive
        return self.arrive

    def is_loss(self, error):
        return isinstance(error, TimeoutError)

    def down(self, step):
        return self.is_down

    def note(self):
        self.notes += 1

    def skip_save(self, step, event, tokens_per_expert=None):
        return [{"version": step, "channel_lost": True}]


class _Transfers:
    def __init__(self, parts: int = 1) -> None:
        self.parts = parts

    def spread_for(self, transport, max_steps):
        return SCHEDULE, min(self.parts, max_steps)

    def schedule_for(self, transport):
        return SCHEDULE


class _Train:
    state_shardings = None

    def __init__(self) -> None:
        self.hooks: list[tuple] = []

    def step_fn(self, factors, hooks=(), wrap=None):
        self.hooks.append(hooks)
        return lambda state, batch: (state + 1, {"loss": 0.0})

    def has_step(self, factors, hooks=(), wrap=None):
        return True


def _mover(monkeypatch, budget: bool = False, sender: _Sender | None = None,
           parts: int = 1) -> tuple[ThreadedMover, _Sender, _Keeper, _Tier, _Train]:
    monkeypatch.setattr(movers, "pack_program",
                        lambda transport, shardings: lambda state, trailer, *g: ("own", state))
    tier, keeper, train = _Tier(budget), _Keeper(), _Train()
    sender = sender or _Sender()
    mover = ThreadedMover(cast(TierWriter, tier), cast(Any, train), LINK,
                          cast(ScheduledTransfers, _Transfers(parts)),
                          cast(ThreadedSender, sender), cast(ChannelKeeper, keeper))
    return mover, sender, keeper, tier, train


def _move(mover: ThreadedMover, train: _Train, tier: _Tier, step: int):
    payload = Payload(cast(Any, "trailer"), cast(Any, tier.transport))
    return mover.move(cast(Any, train), step, (), 0, cast(Any, None), ("probe",), payload)


def test_the_threaded_mover_hands_the_version_to_the_sender_and_collects_its_windows(
        monkeypatch):
    mover, sender, _, tier, train = _mover(monkeypatch)
    state, _ = _move(mover, train, tier, 3)
    assert state == 1 and sender.calls == [("start", 3, 1)]
    assert train.hooks == [("probe", "sender-marks")]  # the step carries the sender's marks
    moved = mover.collect(state, None)
    assert moved is not None and moved.version == 3 and moved.dropped is None
    assert moved.own == ("own", 0) and moved.received.shape == (2, 8)
    assert moved.windows is not None and [w["window"] for w in moved.windows] == ["block0/fwd"]
    assert moved.windows[0]["observed_s"] == 0.5 and moved.windows[0]["sent_s"] == 0.75
    assert moved.fields == {"chunk_times_s": {"sent_s": 0.1235}}
    assert mover.collect(state, None) is None  # collected once


@pytest.mark.parametrize("arrive, dropped", [
    (VersionDropped(3, "a frame of version 3 failed its check"), "corrupt"),
    (TimeoutError("no version 3 within the bound"), "channel_lost"),
])
def test_the_threaded_mover_names_what_did_not_arrive(monkeypatch, arrive, dropped):
    mover, _, keeper, tier, train = _mover(monkeypatch)
    _move(mover, train, tier, 3)
    keeper.arrive = arrive
    moved = mover.collect(1, None)
    assert moved is not None and moved.dropped == dropped and moved.windows is None


def test_any_other_failure_of_the_wait_is_raised(monkeypatch):
    mover, _, keeper, tier, train = _mover(monkeypatch)
    _move(mover, train, tier, 3)
    keeper.arrive = ValueError("a bug")
    with pytest.raises(ValueError, match="a bug"):
        mover.collect(1, None)


def test_under_a_budget_held_bytes_carry_the_version_into_the_next_steps_windows(monkeypatch):
    mover, sender, _, tier, train = _mover(monkeypatch, budget=True,
                                           sender=_Sender(hold_tail=8, held=4096))
    assert mover.spread_steps == movers.MAX_SPREAD
    _move(mover, train, tier, 3)
    assert not mover.carrying_on
    assert mover.carries_on(next_step_profiled=False)  # held bytes: version 4 is not taken
    assert mover.held_over == [3] and mover.carrying_on
    mover.carry_on(cast(Any, train), (), 1, cast(Any, None), ())
    assert sender.calls[-1] == ("resume", 3, False) and not mover.carrying_on
    sender.held = 0
    moved = mover.collect(2, None)
    assert moved is not None and moved.version == 3


def test_a_spread_version_is_sent_whole_before_a_profiled_step(monkeypatch):
    mover, sender, _, tier, train = _mover(monkeypatch, budget=True, parts=3)
    _move(mover, train, tier, 3)
    assert sender.calls == [("start", 3, 3)] and mover.carrying_on
    assert not mover.carries_on(next_step_profiled=True)  # a profiled step has no marks
    assert sender.calls[-1] == ("resume", 3, True) and not mover.carrying_on
    assert mover.collect(1, None).version == 3


def test_a_save_while_the_channel_is_lost_drops_what_is_in_flight(monkeypatch):
    mover, _, keeper, tier, train = _mover(monkeypatch)
    assert mover.while_lost(2, cast(Any, None), None) is None and keeper.notes == 1
    _move(mover, train, tier, 3)
    keeper.is_down = True
    assert mover.while_lost(4, cast(Any, None), None) == [{"version": 4, "channel_lost": True}]
    assert mover.collect(1, None) is None  # abandoned: nothing is committed
    _move(mover, train, tier, 5)
    mover.settle(6)  # the last save with the channel lost: abandoned on every host
    assert tier.lost == [3, 5] and mover.collect(1, None) is None


def test_a_plan_the_mover_does_not_follow_is_not_remade():
    """The mover sends each version whole at its step's start (``at_once``):
    once the first schedule exists (its chunks are what the sender sends), the
    replanning planner neither re-plans (a profile, the cost models) nor asks
    for a profile; without ``at_once`` the same profile re-plans."""
    for unused, replans in ((False, [2, 3]), (True, [2])):
        notes, target = StatusNotes(), _Target()
        p = ReplanningPlanner(notes, cast(PlanTarget, target), (0, 1), spans=False)
        p.windows_unused = unused
        p.on_profile(2, _profile(2, 2.0), cold=False)  # the first schedule: always made
        assert target.schedule is not None
        again = p.on_profile(3, _profile(3, 1.0), cold=False)
        assert p.repartitions == replans and (again is None) == unused
        if unused:
            assert p.replan_at_load(4, cast(Any, None), np.ones((2, 4))) == {}
            assert not p.allow_profile(cast(Any, None), np.ones((2, 4)))
            for version in range(SPILL_WINDOW):  # every version spills: no profile asked
                p.on_windows(_spilled(True), None)
                notes.agreed_note = notes.status_note
                p.on_committed(version)
            assert not p.profile_requested()


def test_the_threaded_mover_says_whether_it_sends_at_once(monkeypatch):
    for at_once in (False, True):
        sender = _Sender()
        sender.at_once = at_once
        mover = _mover(monkeypatch, sender=sender)[0]
        assert mover.sends_at_once is at_once
