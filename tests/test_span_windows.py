"""Span windows: the idle spans between a layer's all-to-alls.

The profile's spans from marks (``layer_profile.build_profile``), the windows
they give (``partitioner.windows_from_profile``), where the sender opens them
(``sites.sites_in_order`` / ``window_sites``), the load model's share
(``load_windows.windows_at``), the gate (``policies.schedule_at_risk``) and
the spill check (``spills.window_spills``) on them: pure inputs, exact
answers. The marks in a real step: tests/test_profiler.py; the sender opening
windows at edges in a real step: tests/test_threaded.py."""

from __future__ import annotations

import types
from typing import cast

import numpy as np
import pytest

from capricorn_jax._src.profiling.detector import DynamicityDetector
from capricorn_jax._src.profiling.layer_profile import (
    LayerProfile,
    Segment,
    Span,
    build_profile,
    opens_span,
)
from capricorn_jax._src.scheduling.in_graph.executor import InStepSender
from capricorn_jax._src.scheduling.in_graph.transfers import ScheduledTransfers
from capricorn_jax._src.scheduling.plan.load_windows import windows_at
from capricorn_jax._src.scheduling.plan.partitioner import (
    LinkModel,
    Window,
    partition,
    windows_from_profile,
)
from capricorn_jax._src.scheduling.plan.policies import schedule_at_risk
from capricorn_jax._src.scheduling.plan.sites import (
    AFTER,
    START,
    site_of,
    sites_in_order,
    window_sites,
)
from capricorn_jax._src.scheduling.plan.spills import window_spills

NAMES = ["block0", "block1"]


def _times(edges: dict[tuple[str, str], float], **boundaries: float) -> dict:
    """{(name, direction, device): t} for two devices; device 1 is 1 ms later
    at every mark but the start (a boundary is passed by the last device)."""
    marks = {("step", "start"): 0.0, ("block0", "fwd"): 10.0, ("block1", "fwd"): 30.0,
             ("block1", "bwd"): 40.0, ("block0", "bwd"): 70.0, ("step", "end"): 80.0}
    marks.update({cast("tuple[str, str]", tuple(k.split("__"))): v for k, v in boundaries.items()})
    marks.update(edges)
    out = {}
    for (name, direction), t in marks.items():
        out[(name, direction, 0)] = t
        out[(name, direction, 1)] = t if direction == "start" else t + 0.001
    return out


# block1's all-to-alls: forward in [10, 30], backward in [40, 70].
EDGES = {("block1", "fwd:dispatch.begin"): 14.0, ("block1", "fwd:dispatch.end"): 16.0,
         ("block1", "fwd:combine.begin"): 25.0, ("block1", "fwd:combine.end"): 28.0,
         ("block1", "bwd:combine.end"): 41.0, ("block1", "bwd:combine.begin"): 44.0,
         ("block1", "bwd:dispatch.end"): 60.0, ("block1", "bwd:dispatch.begin"): 63.0}


def test_the_edges_that_open_a_span_end_their_collective_in_step_order():
    assert opens_span("fwd:dispatch.end") and opens_span("bwd:combine.begin")
    assert not opens_span("fwd:dispatch.begin") and not opens_span("bwd:combine.end")


def test_spans_tile_a_segment_between_its_collectives_less_each_marks_cost():
    profile = build_profile(3, 0.09, NAMES, _times(EDGES), mark_cost_s=0.5,
                            tail_collective_s=2.0)
    seg = {(s.name, s.direction): s for s in profile.segments}
    # block1 fwd: [10, 30] with 4 edges inside: 5 gaps, each less a mark.
    assert seg[("block1", "fwd")].duration_s == pytest.approx(20.0 - 5 * 0.5)
    assert seg[("block1", "fwd")].spans == (
        Span("", pytest.approx(3.5), pytest.approx(1.5)),
        Span("fwd:dispatch.end", pytest.approx(8.5), pytest.approx(2.5)),
        Span("fwd:combine.end", pytest.approx(1.5), 0.0))
    assert seg[("block1", "bwd")].spans == (
        Span("", pytest.approx(0.5), pytest.approx(2.5)),
        Span("bwd:combine.begin", pytest.approx(15.5), pytest.approx(2.5)),
        Span("bwd:dispatch.begin", pytest.approx(6.5), 0.0))
    for s in profile.segments:  # idle and busy add up to the segment
        if s.spans:
            assert sum(p.idle_s + p.busy_s for p in s.spans) == pytest.approx(s.duration_s)
    # Segments without edges: no spans, one mark taken off as before.
    assert seg[("block0", "fwd")].spans is None
    assert seg[("block0", "fwd")].duration_s == pytest.approx(10.001 - 0.5)  # from device 0
    assert seg[("head", "fwd")].spans is None


def test_the_gradient_all_reduce_is_busy_time_of_the_tails_last_span():
    edges = {("block0", "bwd:combine.end"): 72.0, ("block0", "bwd:combine.begin"): 74.0}
    profile = build_profile(3, 0.09, NAMES, _times(edges), tail_collective_s=1.5)
    tail = profile.segments[-1]
    assert (tail.name, tail.direction) == ("tail", "bwd")
    assert tail.spans == (Span("", pytest.approx(2.0), pytest.approx(2.0)),
                          Span("bwd:combine.begin", pytest.approx(4.5), pytest.approx(1.5)))


def test_a_collective_missing_an_edge_gives_no_spans():
    edges = {k: v for k, v in EDGES.items() if k[1] != "fwd:combine.end"}
    profile = build_profile(3, 0.09, NAMES, _times(edges))
    seg = {(s.name, s.direction): s for s in profile.segments}
    assert seg[("block1", "fwd")].spans is None and seg[("block1", "bwd")].spans is not None


def test_spans_survive_the_profiles_json():
    profile = build_profile(3, 0.09, NAMES, _times(EDGES), mark_cost_s=0.5)
    again = LayerProfile.from_json(profile.to_json())
    assert again == profile
    assert isinstance(again.segments[1].spans[1], Span)


def _profile() -> LayerProfile:
    return build_profile(3, 0.09, NAMES, _times(EDGES))


def test_span_windows_replace_a_segments_window_only_when_asked():
    profile = _profile()
    plain = windows_from_profile(profile)
    assert [w.edge for w in plain] == [""] * len(profile.segments)
    spans = windows_from_profile(profile, spans=True)
    assert [(w.name, w.direction, w.edge) for w in spans] == [
        ("block0", "fwd", ""),
        ("block1", "fwd", ""), ("block1", "fwd", "fwd:dispatch.end"),
        ("block1", "fwd", "fwd:combine.end"),
        ("head", "fwd", ""),
        ("block1", "bwd", ""), ("block1", "bwd", "bwd:combine.begin"),
        ("block1", "bwd", "bwd:dispatch.begin"),
        ("tail", "bwd", "")]
    assert [w.duration_s for w in spans[1:4]] == pytest.approx([4.0, 9.0, 2.0])


def test_the_sender_opens_span_windows_at_their_edges_in_step_order():
    windows = windows_from_profile(_profile(), spans=True)
    assert [site_of(w, NAMES) for w in windows] == [
        START, ("block0", "fwd"), ("block1", "fwd:dispatch.end"),
        ("block1", "fwd:combine.end"), ("block1", "fwd"), ("block1", "bwd"),
        ("block1", "bwd:combine.begin"), ("block1", "bwd:dispatch.begin"), ("block0", "bwd")]
    assert sites_in_order(NAMES, windows) == [
        START, ("block0", "fwd"), ("block1", "fwd:dispatch.end"),
        ("block1", "fwd:combine.end"), ("block1", "fwd"), ("block1", "bwd"),
        ("block1", "bwd:combine.begin"), ("block1", "bwd:dispatch.begin"), ("block0", "bwd"),
        AFTER]
    assert sites_in_order(NAMES) == [START, ("block0", "fwd"), ("block1", "fwd"),
                                     ("block1", "bwd"), ("block0", "bwd"), AFTER]
    # A window closes at the next site a step passes, an edge or a boundary.
    schedule = partition(10_000, windows, LinkModel(0.0, 100.0), chunk_cap=100)
    pairs = window_sites(schedule, NAMES)
    assert pairs[2] == (("block1", "fwd:dispatch.end"), ("block1", "fwd:combine.end"))
    assert pairs[3] == (("block1", "fwd:combine.end"), ("block1", "fwd"))
    assert pairs[7] == (("block1", "bwd:dispatch.begin"), ("block0", "bwd"))


def test_the_in_graph_path_refuses_span_windows_naming_them():
    schedule = partition(100, [Window("block1", "fwd", 1.0, "fwd:dispatch.end")],
                         LinkModel(0.0, 100.0), chunk_cap=100)
    transport = types.SimpleNamespace(plan=types.SimpleNamespace(payload_bytes=100))
    with pytest.raises(ValueError, match=r"block1/fwd@fwd:dispatch.end"):
        InStepSender(transport, None, schedule, NAMES)


def test_a_load_change_goes_to_the_span_between_the_all_to_alls():
    profile = _profile()
    seg = {(s.name, s.direction): s for s in profile.segments}
    grown = {(0, "fwd"): seg[("block1", "fwd")].duration_s + 6.0,
             (0, "bwd"): seg[("block1", "bwd")].duration_s - 20.0}
    got = windows_at(profile, lambda layer, d: grown[(layer, d)], [1], spans=True)
    base = windows_from_profile(profile, spans=True)
    change = [g.duration_s - b.duration_s for g, b in zip(got, base, strict=True)]
    # fwd: +6 s to the experts' span; bwd: -20 s, which the span's 16 s cannot
    # give (it stops at 0); every other window as profiled.
    assert change == pytest.approx([0, 0, 6.0, 0, 0, 0, -16.0, 0, 0])
    assert windows_at(profile, lambda layer, d: None, [1], spans=True) is None
    # Segment windows: the predicted duration less the all-to-all estimate.
    plain = windows_at(profile, lambda layer, d: grown[(layer, d)], [1])
    assert [w.duration_s for w in plain][1] == pytest.approx(grown[(0, "fwd")])


def _detector(points: list[tuple[float, float]]) -> DynamicityDetector:
    detector = DynamicityDetector()
    for step, (peak, seconds) in enumerate(points):
        load = np.array([[peak, 1, 1, 1]], np.float64)
        detector.record_profile(step, load, {(0, "fwd"): seconds, (0, "bwd"): 30.0})
    return detector


def test_the_gate_checks_the_predicted_expert_span_of_a_span_schedule():
    profile = _profile()
    windows = windows_from_profile(profile, spans=True)
    # 8.5 s of chunks in the experts' forward span (9 s profiled), nothing elsewhere.
    filled = [0.0 if (w.edge != "fwd:dispatch.end") else 8.5 for w in windows]
    schedule = partition(850, [Window(w.name, w.direction, d, w.edge)
                               for w, d in zip(windows, filled, strict=True)],
                         LinkModel(0.0, 100.0), chunk_cap=1000)
    assert [len(c) for c in schedule.chunks] == [0, 0, 1, 0, 0, 0, 0, 0, 0]
    duration = {(s.name, s.direction): s.duration_s for s in profile.segments}
    fwd = duration[("block1", "fwd")]
    # Layer 0 (block1) fwd costs fwd - 10 + peak s: at peak 10 as profiled.
    detector = _detector([(5, fwd - 5.0), (15, fwd + 5.0)])
    at = {peak: schedule_at_risk(schedule, detector, np.array([[peak, 1, 1, 1]], float),
                                 profile, [1]) for peak in (9, 9.6, 10, 12)}
    # The span holds 9 + (peak - 10) s: below 8.5 s under peak 9.5.
    assert at == {9: True, 9.6: False, 10: False, 12: False}


def test_a_span_windows_spill_is_its_span_less_the_collective_closing_it():
    profile = _profile()
    windows = windows_from_profile(profile, spans=True)
    schedule = partition(10_000, windows, LinkModel(0.0, 100.0), chunk_cap=100)
    # Measured from the opening edge to the next site: idle + the 3 s all-to-all
    # that closes it (the forward combine, the backward dispatch).
    records = window_spills(schedule, {2: 9.0 + 3.0, 6: 14.0 + 3.0}, profile)
    assert [r["window"] for r in records] == ["block1/fwd@fwd:dispatch.end",
                                              "block1/bwd@bwd:combine.begin"]
    assert [r["observed_s"] for r in records] == pytest.approx([9.0, 14.0])
    # Filled to their profiled 9 s and 16 s.
    assert [r["spill_s"] for r in records] == pytest.approx([0.0, 2.0])


def test_segment_windows_keep_the_all_to_all_estimate():
    profile = LayerProfile(1, 1.0, (Segment("block1", "fwd", 0.0, 1.0, 0.25,
                                            (Span("", 0.5, 0.25), Span("x", 0.25, 0.0))),))
    schedule = partition(50, windows_from_profile(profile), LinkModel(0.0, 100.0), 100)
    assert window_spills(schedule, {0: 1.0}, profile)[0]["observed_s"] == 0.75


def test_a_repartition_keeps_each_windows_edge():
    """The schedule in force opens its span windows at their edges (one
    round: host 0's durations are this host's)."""
    windows = windows_from_profile(_profile(), spans=True)
    ckpt = types.SimpleNamespace(transport=types.SimpleNamespace(
        plan=types.SimpleNamespace(payload_bytes=5_000)))
    transfers = ScheduledTransfers(ckpt, None, NAMES, LinkModel(0.0, 100.0), chunk_cap=100,
                                   margin=0.5)
    schedule = transfers.repartition(windows)
    assert [(w.name, w.direction, w.edge) for w in schedule.windows] == [
        (w.name, w.direction, w.edge) for w in windows]
    assert [w.duration_s for w in schedule.windows] == pytest.approx(
        [np.float32(w.duration_s) * 0.5 for w in windows])
