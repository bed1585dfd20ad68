"""Capricorn's own decisions, called directly (pure inputs, exact answers):
the profiling gate (``policies.schedule_at_risk``), the shortest-window rule
(``policies.shortest_windows``), the re-plan on a profile by planner
(``strategies.planners``: ``FixedPlanner`` for gemini, ``ReplanningPlanner``
for capricorn) and the spill note and its agreement (``on_windows`` /
``on_committed`` over the checkpointer's status round).

The planners are built over test doubles: a recording stand-in for
``ScheduledTransfers`` (the schedule in force) and ``StatusNotes`` for the
status round; no transport, no chunk path. These tests hold the decisions,
the multi-process bench and training tests the whole path."""

from __future__ import annotations

import collections
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capricorn_jax._src.profiling.detector import DynamicityDetector
from capricorn_jax._src.profiling.layer_profile import LayerProfile, Segment, Span
from capricorn_jax._src.scheduling.plan.load_windows import MODEL_MARGIN, windows_at_load
from capricorn_jax._src.scheduling.plan.partitioner import (
    LinkModel,
    Window,
    partition,
    windows_from_profile,
)
from capricorn_jax._src.scheduling.plan.policies import schedule_at_risk, shortest_windows
from capricorn_jax._src.strategies import planners
from capricorn_jax._src.strategies.planners import (
    FixedPlanner,
    Planner,
    PlanTarget,
    ReplanningPlanner,
)
from tests.helpers import StatusNotes, notes_of

LINK = LinkModel(alpha_s=0.0, bytes_per_s=100.0)  # 1 byte = 10 ms
MOE = [0, 1]


def _profile(step: int, fwd0: float, fwd1: float, a2a: float = 0.2) -> LayerProfile:
    """Two MoE layers' forward segments, each with ``a2a`` of all-to-all."""
    return LayerProfile(step, fwd0 + fwd1, (Segment("block0", "fwd", 0.0, fwd0, a2a),
                                            Segment("block1", "fwd", fwd0, fwd1, a2a)))


def _load(peak0: float, peak1: float = 10.0) -> np.ndarray:
    return np.array([[peak0, 1, 1, 1], [peak1, 1, 1, 1]], np.float64)


def _detector(*points: tuple[float, float]) -> DynamicityDetector:
    """Cost model of (MoE layer 0, fwd) fitted on (peak load, seconds) points."""
    detector = DynamicityDetector()
    for step, (peak, seconds) in enumerate(points):
        detector.record_profile(step, _load(peak), {(0, "fwd"): seconds})
    return detector


# ----------------------------------------------------------------- the gate


def test_gate_without_a_schedule_a_profile_or_with_a_tail_is_at_risk():
    profile = _profile(1, 1.0, 1.0)
    fits = partition(70, windows_from_profile(profile), LINK, chunk_cap=1000)
    overflow = partition(200, windows_from_profile(profile), LINK, chunk_cap=1000)
    assert fits.tail_bytes == 0 and overflow.tail_bytes == 40
    detector = _detector((10, 1.0), (20, 1.5))
    assert schedule_at_risk(None, detector, _load(10), profile, MOE)
    assert schedule_at_risk(fits, detector, _load(10), None, MOE)
    assert schedule_at_risk(overflow, detector, _load(10), profile, MOE)
    assert not schedule_at_risk(fits, detector, _load(10), profile, MOE)


def test_gate_explores_while_a_filled_windows_model_has_one_point():
    profile = _profile(1, 1.0, 1.0)
    fits = partition(70, windows_from_profile(profile), LINK, chunk_cap=1000)
    assert [len(c) for c in fits.chunks] == [1, 0]  # 70 bytes = 0.7 s, all in window 0
    assert schedule_at_risk(fits, _detector((10, 1.0)), _load(10), profile, MOE)
    # Window 1 holds nothing: its layer's missing model does not matter.
    assert not schedule_at_risk(fits, _detector((10, 1.0), (20, 1.5)), _load(10), profile, MOE)


def test_gate_follows_the_predicted_window_both_ways():
    """Layer 0 fwd costs 0.5 + 0.05 * peak s (fitted on two profiles); its
    window is that less the 0.2 s all-to-all; window 0 holds 0.7 s of chunks."""
    profile = _profile(1, 1.0, 1.0)
    fits = partition(70, windows_from_profile(profile), LINK, chunk_cap=1000)
    detector = _detector((10, 1.0), (20, 1.5))
    at = {peak: schedule_at_risk(fits, detector, _load(peak), profile, MOE)
          for peak in (4, 7, 9, 10, 13, 40)}
    # peak 4: 0.7 - 0.2 = 0.5 s of room < 0.7; peak 7: 0.65; peak 9: 0.75;
    # heavier layers only lengthen the window.
    assert at == {4: True, 7: True, 9: False, 10: False, 13: False, 40: False}
    # Another layer's load does not move layer 0's window.
    assert not schedule_at_risk(fits, detector, _load(10, peak1=1), profile, MOE)


# ------------------------------------------------------ the shortest-window rule


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.floats(0, 5)), min_size=1, max_size=5))
def test_shortest_windows_takes_each_windows_minimum_in_step_order(pairs):
    profiles = [_profile(i, a + 0.2, b + 0.2) for i, (a, b) in enumerate(pairs)]
    got = shortest_windows(profiles, windows_from_profile)
    assert [(w.name, w.direction) for w in got] == [("block0", "fwd"), ("block1", "fwd")]
    expect = [min(w.duration_s for w in (windows_from_profile(p)[i] for p in profiles))
              for i in (0, 1)]
    assert [w.duration_s for w in got] == expect


def test_shortest_windows_keeps_a_window_seen_in_one_profile_only():
    one = LayerProfile(1, 2.0, (Segment("block0", "fwd", 0.0, 1.0),))
    two = LayerProfile(2, 2.0, (Segment("block0", "fwd", 0.0, 0.5),
                                Segment("block0", "bwd", 0.5, 0.75)))
    assert shortest_windows([one, two], windows_from_profile) == [
        Window("block0", "fwd", 0.5), Window("block0", "bwd", 0.75)]


# ------------------------------------------------------------- on_profile


class _Transfers:
    """Records the windows each re-partition got."""

    link = LINK

    def __init__(self) -> None:
        self.schedule = None
        self.plans: list[list[Window]] = []

    def repartition(self, windows):
        self.plans.append(list(windows))
        self.schedule = partition(70, windows, LINK, chunk_cap=1000)
        return self.schedule

    def prepare(self, windows, agreed=False):
        assert agreed  # the planner's thread agrees its windows itself
        return list(windows)

    def install(self, prepared):
        return self.repartition(prepared)

    def summary(self):
        return {"scheduled": self.schedule is not None}


def _planner(kind: str, first_n: int = 3, spans: bool = False,
             background: bool = False) -> Planner:
    """The planner of ``kind`` ("gemini": fixed, "capricorn": replan) over test doubles."""
    target = cast(PlanTarget, _Transfers())
    if kind == "gemini":
        return FixedPlanner(StatusNotes(), target, MOE, spans, first_n)
    return ReplanningPlanner(StatusNotes(), target, MOE, spans, background)


def test_gemini_plans_once_on_the_mean_of_its_first_n_warm_profiles_and_keeps_it():
    s = _planner("gemini", first_n=3)
    assert s.on_profile(1, _profile(1, 9.0, 9.0), cold=True) is None  # counted, not averaged
    assert s.on_profile(2, _profile(2, 1.2, 2.2), cold=False) is None
    summary = s.on_profile(3, _profile(3, 2.2, 1.2), cold=False)
    assert s.target.plans == [[Window("block0", "fwd", 1.5), Window("block1", "fwd", 1.5)]]
    assert summary["windows_s"] == [1.5, 1.5] and s.repartitions == [3]
    assert s.on_profile(4, _profile(4, 0.3, 0.3), cold=False) is None  # kept for good
    assert len(s.target.plans) == 1 and s.planned_on.step == 3


def test_capricorn_replans_on_every_warm_profile_from_the_shortest_of_its_recent_ones():
    s = _planner("capricorn")
    assert s.on_profile(1, _profile(1, 2.2, 2.2), cold=True) is None  # a cold profile: no plan
    s._wants_profile, s._spills = True, collections.deque([True, True], maxlen=4)
    s.on_profile(2, _profile(2, 2.2, 1.2), cold=False)
    assert not s._wants_profile and not s._spills  # a warm profile answers a spill's request
    s.on_profile(3, _profile(3, 1.2, 3.2), cold=False)
    s.on_profile(4, _profile(4, 3.2, 3.2), cold=False)
    s.on_profile(5, _profile(5, 4.2, 4.2), cold=False)  # profile 2 leaves the last three
    assert [[w.duration_s for w in plan] for plan in s.target.plans] == [
        [2.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 3.0]]
    assert s.repartitions == [2, 3, 4, 5] and s.planned_on.step == 5


def test_on_the_threaded_path_capricorn_plans_on_the_spans_between_all_to_alls():
    spans = (Span("", 0.25, 0.1), Span("fwd:dispatch.end", 0.5, 0.1),
             Span("fwd:combine.end", 0.05, 0.0))
    profile = LayerProfile(2, 1.0, (Segment("block0", "fwd", 0.0, 1.0, 0.2, spans),))
    s = _planner("capricorn", spans=True)
    s.on_profile(2, profile, cold=False)
    assert s.target.plans == [[Window("block0", "fwd", 0.25),
                               Window("block0", "fwd", 0.5, "fwd:dispatch.end"),
                               Window("block0", "fwd", 0.05, "fwd:combine.end")]]
    g = _planner("gemini", first_n=1, spans=False)
    g.on_profile(2, profile, cold=False)
    assert g.target.plans == [[Window("block0", "fwd", 0.8)]]


def test_the_gate_is_capricorns_only():
    profile = _profile(1, 1.0, 1.0)
    gemini, capricorn = _planner("gemini"), _planner("capricorn")
    detector = _detector((10, 1.0), (20, 1.5))
    capricorn.on_profile(1, profile, cold=False)  # plans 70 bytes on this profile
    assert not capricorn.allow_profile(detector, _load(10))
    assert capricorn.allow_profile(detector, _load(4))
    assert gemini.allow_profile(detector, _load(10))  # gemini: the driver decides alone


# ------------------------------------------- the re-partition from the cost model


def _two_layer_detector() -> DynamicityDetector:
    """Layer 0 fwd: 0.5 + 0.05 * peak s; layer 1 fwd: 2.0 s at any peak; both
    fitted on peaks 10 and 20."""
    detector = DynamicityDetector()
    for step, peak in enumerate((10, 20)):
        detector.record_profile(step, _load(peak, peak),
                                {(0, "fwd"): 0.5 + 0.05 * peak, (1, "fwd"): 2.0})
    return detector


def test_windows_at_load_predict_each_moe_window_less_its_all_to_all():
    profile = _profile(1, 1.0, 1.0)  # each segment has 0.2 s of all-to-all
    got = windows_at_load(profile, _two_layer_detector(), _load(16, 12), MOE)
    assert [(w.name, w.direction) for w in got] == [("block0", "fwd"), ("block1", "fwd")]
    assert [w.duration_s for w in got] == pytest.approx([1.3 - 0.2, 2.0 - 0.2])
    # A window the model predicts under its all-to-all is empty, not negative.
    tiny = _profile(1, 1.0, 1.0, a2a=2.5)
    assert [w.duration_s for w in windows_at_load(tiny, _two_layer_detector(),
                                                  _load(16, 12), MOE)] == [0.0, 0.0]


def test_windows_at_load_answer_only_near_the_loads_the_models_saw():
    """Peaks 10 and 20 seen, the default 50% margin: 5 to 30 is answered,
    outside is not (the caller profiles there); a layer without a model, or
    with one load seen, answers nothing."""
    assert MODEL_MARGIN == 0.5
    profile, detector = _profile(1, 1.0, 1.0), _two_layer_detector()
    answered = {peak: windows_at_load(profile, detector, _load(peak, 15), MOE) is not None
                for peak in (4, 5, 15, 30, 31)}
    assert answered == {4: False, 5: True, 15: True, 30: True, 31: False}
    assert windows_at_load(profile, detector, _load(15, 31), MOE) is None  # layer 1's load
    assert windows_at_load(profile, detector, _load(23, 15), MOE, margin=0.1) is None
    assert windows_at_load(profile, detector, _load(22, 15), MOE, margin=0.1) is not None
    one_load = DynamicityDetector()
    for step in range(3):
        one_load.record_profile(step, _load(10, 10), {(0, "fwd"): 1.0, (1, "fwd"): 2.0})
    assert windows_at_load(profile, one_load, _load(10, 10), MOE) is None
    assert windows_at_load(profile, _detector((10, 1.0), (20, 1.5)), _load(15), MOE) is None
    # A segment that is no MoE layer keeps its profiled window.
    dense = LayerProfile(1, 3.0, (*profile.segments, Segment("embed", "bwd", 2.0, 1.0)))
    assert windows_at_load(dense, detector, _load(15, 15), MOE)[-1] == Window("embed", "bwd", 1.0)


def test_capricorn_replans_on_its_cost_model_where_it_covers_the_load():
    s = _planner("capricorn")
    detector = _two_layer_detector()
    assert s.replan_at_load(2, detector, _load(16, 12)) is None  # nothing planned on yet
    s.on_profile(3, _profile(3, 1.0, 1.0), cold=False)
    s._spills = collections.deque([True, True], maxlen=4)
    event = s.replan_at_load(5, detector, _load(16, 12))
    assert event["source"] == "cost_model" and event["windows_s"] == [1.1, 1.8]
    assert [w.duration_s for w in s.target.plans[-1]] == pytest.approx([1.1, 1.8])
    assert s.repartitions == [3, 5] and s.repartition_sources == ["profile", "cost_model"]
    assert not s._spills  # the new schedule's spills count afresh
    assert s.planned_on.step == 3  # the profiled base stays
    # The same load again: the model's plan is in force; no profile, no re-plan.
    assert s.replan_at_load(6, detector, _load(16, 12)) == {}
    assert s.repartitions == [3, 5] and len(s.target.plans) == 2
    assert s.replan_at_load(7, detector, _load(40, 12)) is None  # outside: profile
    assert s.repartitions == [3, 5]
    gemini = _planner("gemini", first_n=1)
    gemini.on_profile(3, _profile(3, 1.0, 1.0), cold=False)
    assert gemini.replan_at_load(5, detector, _load(16, 12)) is None  # Gemini stays Gemini


def test_the_driver_replans_from_the_model_instead_of_profiling():
    """A profile is due (the drift trigger, the gate agrees): a strategy that
    re-plans from its cost model takes the place of the profiled step."""
    from capricorn_jax import ProfilingDriver, ProfilingOptions
    from capricorn_jax._src.strategies.base import Strategy

    class Modelling(Strategy):
        name, plans_on_profiles = "modelling", True

        def __init__(self, answer):
            self.answer, self.asked = answer, []

        def replan_at_load(self, step, detector, tokens_per_expert):
            self.asked.append(step)
            return self.answer

    tpe = np.full((1, 4), 8.0)
    for answer, profiled in (({"source": "cost_model"}, False), ({}, False), (None, True)):
        strategy = Modelling(answer)
        driver = ProfilingDriver(object(), strategy, ProfilingOptions("speculative",
                                                                      trigger="drift"))
        event = driver._detect(3, (1.0,), {}, tpe, None, False)  # no reference: drifted
        assert strategy.asked == [3]
        assert event["profile_next"] is profiled and event["modelled"] is not profiled
        assert driver._modelled == answer
    # Not asked when no profile is due (the load has not moved since a profile).
    driver.detector.record_profile(3, tpe, {})
    event = driver._detect(4, (1.0,), {}, tpe, None, False)
    assert strategy.asked == [3] and not event["modelled"]


# ------------------------------------------------- the spill note and its agreement


def _windows(*spills: float) -> list[dict]:
    return [{"spill_s": x} for x in spills]


def test_with_measured_bytes_a_spill_counts_only_when_bytes_met_the_collective():
    """The deadline sender's records: a window shorter than planned whose
    bytes were carried on (at most one frame met the collective) is no
    spill; one whose bytes met it beyond that is."""
    s = _planner("capricorn")
    s.repartitions = [3]
    late = planners.SPILL_LATE_BYTES
    for windows in ([{"spill_s": 0.5, "bytes_late": 0}],
                    [{"spill_s": 0.5, "bytes_late": late}],
                    [{"spill_s": 0.0, "bytes_late": 10 * late}],  # no spill: the link's error
                    [{"spill_s": 0.5, "bytes_late": late + 1}],
                    [{"spill_s": 0.5, "bytes_late": None}]):  # not measured: the spill counts
        s.on_windows(windows, None)
    assert list(s._spills) == [False, False, True, True]  # the last SPILL_WINDOW (4) of 5
    assert notes_of(s).status_note == 1000 + 2  # one schedule so far, 2 spilled of the last 4


def test_the_note_counts_spilled_versions_under_the_schedule_in_force():
    s = _planner("capricorn")
    s.repartitions = [2, 7]
    # A spill within the marks' jitter is none; one window over it is one.
    for windows in (_windows(0.0, planners.SPILL_TOLERANCE_S), _windows(0.0, 0.002),
                    _windows(0.5), _windows()):
        s.on_windows(windows, None)
    assert notes_of(s).status_note == 2 * 1000 + 2
    for _ in range(4):  # only the last SPILL_WINDOW versions count
        s._note_spills(_windows(0.0))
    assert notes_of(s).status_note == 2000


@pytest.mark.parametrize("note, asks", [
    (1000 + planners.SPILL_WINDOW // 2 + 1, True),   # most of the last versions spilled
    (1000 + planners.SPILL_WINDOW // 2, False),      # half is not most
    (0 * 1000 + planners.SPILL_WINDOW, False),       # host 0 counted under an older schedule
    (None, False),                                    # no round agreed yet
])
def test_capricorn_asks_for_a_profile_on_host_0s_agreed_note(note, asks):
    s = _planner("capricorn")
    s.repartitions = [3]
    s.ckpt.note_status(0)  # this host's own count does not decide
    notes_of(s).agreed_note = note
    s.on_committed(9)
    assert s.profile_requested() is asks
    assert s.spill_requests == ([9] if asks else [])
    s.on_committed(10)  # asked once until a profile answers
    assert s.spill_requests == ([9] if asks else [])


def test_gemini_only_reports_its_spills():
    s = _planner("gemini")
    s.repartitions = [3]
    notes_of(s).agreed_note = 1000 + planners.SPILL_WINDOW
    s.on_committed(9)
    assert not s.profile_requested() and s.spill_requests == []


def test_the_note_travels_in_the_save_round_and_host_0s_is_agreed(tmp_path):
    """The agreement itself: a real checkpointer's status round carries the
    note set before a save; ``agreed_note`` is host 0's once the next save
    (or ``confirm``) reads that round."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import capricorn_jax

    mesh = Mesh(np.array(jax.devices()).reshape(-1), ("data",))
    sharding = NamedSharding(mesh, P())
    abstract = {"w": jax.ShapeDtypeStruct((8,), np.float32)}
    ckpt = capricorn_jax.InMemoryCheckpointer(
        capricorn_jax.InMemoryOptions(store_root=str(tmp_path / "shm"), job="j", replicas=1),
        mesh, abstract, {"w": sharding}, 0, 1)
    try:
        state = {"w": jax.device_put(np.arange(8, dtype=np.float32), sharding)}
        assert ckpt.agreed_note is None
        ckpt.note_status(3007)
        ckpt.save(0, state, {})
        assert ckpt.agreed_note is None  # the round is read by the next save
        ckpt.note_status(12)
        ckpt.save(1, state, {})
        assert ckpt.agreed_note == 3007
        ckpt.confirm(60)
        assert ckpt.agreed_note == 12
    finally:
        ckpt.close()


def test_capricorn_replans_an_expert_window_its_load_moves_beyond_its_noise():
    """The window model (issue 38): fitted on the expert window's observed
    idle time at each moved step's load, it re-plans that window alone when
    the next load moves it by more than NOISE_K noises, keeps the plan
    within, and hands back to the segment models where it has no fit."""
    spans = (Span("", 0.25, 0.1), Span("fwd:dispatch.end", 0.5, 0.1),
             Span("fwd:combine.end", 0.05, 0.0))
    profile = LayerProfile(2, 1.0, (Segment("block0", "fwd", 0.0, 1.0, 0.2, spans),))
    s = _planner("capricorn", spans=True)
    s.on_profile(2, profile, cold=False)
    detector = DynamicityDetector()  # no segment model: the window model or a profile
    assert s.replan_at_load(3, detector, _load(10)) is None  # no fit yet
    rng = np.random.default_rng(0)
    for peak in (10, 12, 14, 16, 18, 20, 22, 24):  # idle = 0.3 + 0.02 x peak, +-1 ms
        record = {"window": "block0/fwd@fwd:dispatch.end",
                  "observed_s": 0.3 + 0.02 * peak + rng.uniform(-1e-3, 1e-3)}
        s._observe_windows([record, {"window": "block0/fwd", "observed_s": 9.0}], _load(peak))
    assert s.window_model.samples("block0/fwd") == 0  # not an expert window
    assert s.replan_at_load(4, detector, _load(10)) == {}  # 0.5 predicted: within noise
    event = s.replan_at_load(5, detector, _load(20))
    assert event["source"] == "window_model" and s.window_model_replans == [5]
    assert s.target.plans[-1][0] == Window("block0", "fwd", 0.25)  # not modelled: kept
    assert s.target.plans[-1][1].duration_s == pytest.approx(0.7, abs=2e-3)
    assert s.target.plans[-1][2] == Window("block0", "fwd", 0.05, "fwd:combine.end")
    assert s.replan_at_load(6, detector, _load(20)) == {}  # the plan in force already
    assert s.replan_at_load(7, detector, _load(100)) is None  # beyond the loads seen


def _fitted_window_model_planner(background: bool) -> ReplanningPlanner:
    """capricorn planned on one profile with span windows, its window model
    fitted on the expert window's idle time = 0.3 + 0.02 x peak load (+-1 ms)."""
    spans = (Span("", 0.25, 0.1), Span("fwd:dispatch.end", 0.5, 0.1),
             Span("fwd:combine.end", 0.05, 0.0))
    profile = LayerProfile(2, 1.0, (Segment("block0", "fwd", 0.0, 1.0, 0.2, spans),))
    s = cast(ReplanningPlanner, _planner("capricorn", spans=True, background=background))
    s.on_profile(2, profile, cold=False)
    rng = np.random.default_rng(0)
    for peak in (10, 12, 14, 16, 18, 20, 22, 24):  # +-1 ms of noise
        s._observe_windows([{"window": "block0/fwd@fwd:dispatch.end",
                             "observed_s": 0.3 + 0.02 * peak + rng.uniform(-1e-3, 1e-3)}],
                           _load(peak))
    return s


def test_a_background_replan_runs_off_the_calling_thread_and_comes_into_force_a_step_later():
    """Issue 53 item 7: the re-plan at a new load (its agreement and its
    partition) runs on the planner's thread; the step that asked gets no
    profile and no new plan, the next settles it (the same windows the
    synchronous re-plan builds at once)."""
    import threading

    at_once = _fitted_window_model_planner(background=False)
    expected = at_once.replan_at_load(5, DynamicityDetector(), _load(20))
    s = _fitted_window_model_planner(background=True)
    try:
        plans = len(s.target.plans)
        assert s.replan_at_load(5, DynamicityDetector(), _load(20)) == {}  # no profile either
        assert len(s.target.plans) == plans and s.window_model_replans == []
        assert s.replan_at_load(5, DynamicityDetector(), _load(20)) == {}  # one on its way
        event = s.settle(6)
        assert s._thread is not None and s._thread.ran == 1
        assert s._thread.thread_names == {"capricorn-plan"} != {threading.current_thread().name}
        assert event["source"] == "window_model" and event["decided_at"] == 5
        assert event["windows_s"] == expected["windows_s"]
        # (float32 durations: agreed here; the double's synchronous re-plan agrees none)
        assert [w.duration_s for w in s.target.plans[-1]] == pytest.approx(
            [w.duration_s for w in at_once.target.plans[-1]], rel=1e-6)
        assert [w.edge for w in s.target.plans[-1]] == [w.edge for w in at_once.target.plans[-1]]
        assert s.window_model_replans == [6] and s.repartitions[-1] == 6
        assert s.settle(7) is None  # nothing on its way
        # The same load again: within the new plan's noise, nothing changes.
        assert s.replan_at_load(8, DynamicityDetector(), _load(20)) == {}
        assert s.settle(9) is None and s.repartitions[-1] == 6
    finally:
        s.close()


def test_a_background_replan_no_model_covers_asks_for_a_profile_at_settle():
    s = _fitted_window_model_planner(background=True)
    try:
        assert s.replan_at_load(5, DynamicityDetector(), _load(100)) == {}  # beyond the fit
        assert not s.profile_requested()
        assert s.settle(6) is None
        assert s.profile_requested() and s.model_profile_requests == [6]
    finally:
        s.close()


def test_the_driver_settles_a_background_plan_before_its_other_planning_calls():
    from capricorn_jax import ProfilingDriver
    from capricorn_jax._src.strategies.base import Strategy

    calls = []

    class Settling(Strategy):
        name, plans_on_profiles = "settling", True

        def settle_plan(self, step):
            calls.append(("settle", step))
            return {"source": "window_model", "decided_at": step - 1}

        def on_profile(self, step, profile, cold):
            calls.append(("on_profile", step))

    driver = ProfilingDriver(cast(Any, object()), Settling())
    profile = LayerProfile(4, 1.0, (Segment("block0", "fwd", 0.0, 1.0),))
    driver.train = cast(Any, type("T", (), {"moe_layers": MOE})())
    events = driver._observe(4, (1.0,), {}, profile, False)
    assert calls == [("settle", 4), ("on_profile", 4)]
    assert {"event": "repartition", "step": 4, "strategy": "settling",
            "source": "window_model", "decided_at": 3} in events
