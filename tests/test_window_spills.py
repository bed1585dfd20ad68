"""scheduling.plan.spills.window_spills: what a filled window really held (pure)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from capricorn_jax._src.profiling.layer_profile import LayerProfile, Segment
from capricorn_jax._src.scheduling.plan.partitioner import LinkModel, Window, partition
from capricorn_jax._src.scheduling.plan.spills import window_spills

LINK = LinkModel(alpha_s=1e-4, bytes_per_s=1e8)
NAMES = [("block0", "fwd"), ("block1", "fwd"), ("head", "fwd"), ("block1", "bwd"),
         ("tail", "bwd")]


def _schedule(durations):
    windows = [Window(n, d, t) for (n, d), t in zip(NAMES, durations, strict=True)]
    return partition(2_000_000, windows, LINK, chunk_cap=1 << 18)


def _profile(durations, collectives):
    start, segments = 0.0, []
    for (n, d), t, c in zip(NAMES, durations, collectives, strict=True):
        segments.append(Segment(n, d, start, t + c, c))
        start += t + c
    return LayerProfile(step=1, total_s=start, segments=tuple(segments))


def test_a_window_shorter_than_planned_spills_the_difference_and_a_longer_one_none():
    schedule = _schedule([0.004, 0.004, 0.004, 0.004, 0.004])
    profile = _profile([0.004] * 5, [0.001, 0.001, 0.0, 0.001, 0.0])
    assert all(schedule.chunks[:4])
    # Window 0 lasted 3 ms with its 1 ms all-to-all: 2 ms idle; window 1 a
    # long 20 ms; window 2 no closing mark (left out); window 3 its plan.
    got = window_spills(schedule, {0: 0.003, 1: 0.020, 3: 0.005}, profile)
    assert [g["window"] for g in got] == ["block0/fwd", "block1/fwd", "block1/bwd"]
    w0, w1, w3 = got
    assert w0["observed_s"] == 0.002
    assert w0["spill_s"] == round(schedule.window_cost_s(0) - 0.002, 6) > 0
    assert w1["spill_s"] == 0.0 and w1["observed_s"] == 0.019
    assert w3["spill_s"] == 0.0  # the partitioner filled a share of the planned window
    assert w0["planned_s"] == 0.004 and w0["chunks_s"] == round(schedule.window_cost_s(0), 6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 0.05), min_size=5, max_size=5),
       st.lists(st.floats(0.0, 0.01), min_size=5, max_size=5),
       st.lists(st.floats(0.0, 0.1), min_size=5, max_size=5),
       st.lists(st.floats(0.0, 0.1), min_size=5, max_size=5))
def test_spill_is_the_chunks_link_time_beyond_the_idle_time(planned, collectives, spans, sends):
    schedule = _schedule(planned)
    profile = _profile(planned, collectives)
    got = window_spills(schedule, dict(enumerate(spans)), profile, dict(enumerate(sends)))
    filled = [i for i in range(5) if schedule.chunks[i]]
    assert [g["window"] for g in got] == [f"{NAMES[i][0]}/{NAMES[i][1]}" for i in filled]
    for i, g in zip(filled, got, strict=True):
        idle = max(0.0, spans[i] - collectives[i])
        cost = schedule.window_cost_s(i)
        assert abs(g["observed_s"] - idle) <= 1e-6
        assert abs(g["spill_s"] - max(0.0, cost - idle)) <= 1e-6
        assert g["spill_s"] >= 0.0
        # Lateness is measured: the last byte's hand-over after the closing mark.
        assert abs(g["late_s"] - max(0.0, sends[i] - spans[i])) <= 1e-6
        assert abs(g["sent_s"] - sends[i]) <= 1e-6
        # A window that lasted its plan never spills: the chunks fit in it.
        if spans[i] >= planned[i] + collectives[i]:
            assert g["spill_s"] <= 1e-6


def test_without_a_profile_the_whole_span_is_idle_and_without_sends_no_lateness():
    schedule = _schedule([0.004] * 5)
    got = window_spills(schedule, {0: 0.001}, None)
    assert got[0]["observed_s"] == 0.001
    assert "late_s" not in got[0] and "sent_s" not in got[0]
    got = window_spills(schedule, {0: 0.001}, None, {0: 0.0035, 1: 0.002})
    assert got[0]["late_s"] == 0.0025 and len(got) == 1  # window 1 had no closing mark


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.floats(0.0, 0.05), min_size=5, max_size=5), min_size=1, max_size=4))
def test_capricorn_plans_each_window_at_its_shortest_in_recent_profiles(runs):
    from capricorn_jax._src.scheduling.plan.partitioner import windows_from_profile
    from capricorn_jax._src.scheduling.plan.policies import average_windows, shortest_windows

    profiles = [_profile(r, [0.0] * 5) for r in runs]
    short = shortest_windows(profiles, windows_from_profile)
    mean = average_windows(profiles, windows_from_profile)
    assert [(w.name, w.direction) for w in short] == NAMES
    for i, w in enumerate(short):
        assert w.duration_s == min(r[i] for r in runs)
        assert w.duration_s <= mean[i].duration_s + 1e-12
    # A profile that caught a slower step (every segment longer) changes nothing.
    slow = _profile([2 * x + 0.01 for x in runs[0]], [0.0] * 5)
    assert shortest_windows([*profiles, slow], windows_from_profile) == short
