"""The partitioner: exact cover, windows respected, minimal tail (no JAX)."""

import functools
import json
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capricorn_jax._src.memory.wire.packing import LeafSlot
from capricorn_jax._src.profiling.layer_profile import Segment
from capricorn_jax._src.scheduling.plan.partition_search import spread
from capricorn_jax._src.scheduling.plan.partitioner import (
    PADDING,
    TRAILER,
    Chunk,
    LinkModel,
    Schedule,
    Window,
    fit_link_model,
    partition,
    scale_windows,
    windows_from_profile,
)
from capricorn_jax.experimental import LayerProfile

# ---------------------------------------------------------------- strategies


@st.composite
def float_cases(draw):
    """Realistic magnitudes: microsecond alphas, MB/s..100 GB/s links, up to 10 MB."""
    payload = draw(st.integers(0, 10_000_000))
    cap = draw(st.integers(max(1, payload // 2000), max(1, payload)))
    min_chunk = draw(st.one_of(st.just(1), st.integers(1, cap)))
    alpha = draw(st.one_of(st.just(0.0), st.floats(1e-7, 1e-3)))
    bandwidth = draw(st.floats(1e6, 1e11))
    # Durations around the time the whole payload needs, so that tails happen.
    unit = (payload + 1) / bandwidth + 4 * alpha
    fractions = st.one_of(st.just(0.0), st.floats(0.0, 0.5), st.floats(0.0, 1e3))
    durations = [f * unit for f in draw(st.lists(fractions, max_size=12))]
    windows = [Window(f"b{i}", "fwd" if i % 2 else "bwd", d) for i, d in enumerate(durations)]
    return payload, windows, LinkModel(alpha, bandwidth), cap, min_chunk


@st.composite
def exact_cases(draw):
    """Small cases whose costs are exact in binary floats (dyadic alpha, 1/B, durations)."""
    payload = draw(st.integers(0, 40))
    cap = draw(st.integers(1, 8))
    min_chunk = draw(st.integers(1, min(3, cap)))
    alpha = draw(st.sampled_from([Fraction(0), Fraction(1, 2), Fraction(1), Fraction(2)]))
    bandwidth = draw(st.sampled_from([1, 2, 4]))
    durations = draw(st.lists(st.integers(0, 16).map(lambda k: Fraction(k, 2)), min_size=1,
                              max_size=3))
    return payload, durations, alpha, bandwidth, cap, min_chunk


def _exact_schedule(case):
    payload, durations, alpha, bandwidth, cap, min_chunk = case
    windows = [Window(f"w{i}", "fwd", float(d)) for i, d in enumerate(durations)]
    return partition(payload, windows, LinkModel(float(alpha), float(bandwidth)), cap, min_chunk)


# ------------------------------------------------------------- invariants


def assert_valid(schedule: Schedule, payload, windows, link, cap, min_chunk):
    """Every byte once, in order; chunk sizes; window costs; tail = the rest."""
    assert schedule.payload_bytes == payload
    assert len(schedule.chunks) == len(windows)
    chunks = schedule.all_chunks()
    pos = 0
    for c in chunks:
        assert c.start == pos, f"gap or overlap at byte {pos}: {c}"
        assert 1 <= c.size <= cap, c
        assert c.size >= min_chunk or c.stop == payload, c
        pos = c.stop
    assert pos == payload
    # Window indices: window i's chunks say i, appear in window order, tail says None.
    assert [c.window for c in chunks] == (
        [i for i, g in enumerate(schedule.chunks) for _ in g] + [None] * len(schedule.tail))
    assert all(c.window == i for i, g in enumerate(schedule.chunks) for c in g)
    for i, w in enumerate(windows):
        assert schedule.window_cost_s(i) <= w.duration_s
        independent = math.fsum(link.alpha_s + c.size / link.bytes_per_s
                                for c in schedule.chunks[i])
        assert independent <= w.duration_s * (1 + 1e-12) + 1e-18
    placed = sum(schedule.bytes_in_window(i) for i in range(len(windows)))
    assert schedule.tail_bytes == payload - placed == sum(c.size for c in schedule.tail)
    # The tail: full chunks, then the last one shorter.
    assert all(c.size == cap for c in schedule.tail[:-1])


@settings(max_examples=150, deadline=None)
@given(float_cases())
def test_partition_invariants(case):
    payload, windows, link, cap, min_chunk = case
    schedule = partition(payload, windows, link, cap, min_chunk)
    assert_valid(schedule, payload, windows, link, cap, min_chunk)
    schedule.validate()


@settings(max_examples=150, deadline=None)
@given(float_cases())
def test_window_is_full_chunks_plus_one_partial(case):
    payload, windows, link, cap, _ = case
    schedule = partition(payload, windows, link, cap)
    for group in schedule.chunks:
        sizes = [c.size for c in group]
        assert all(s == cap for s in sizes[:-1]), sizes
    # A window that leaves bytes behind could not take one more byte.
    cursor = 0
    for i, w in enumerate(windows):
        n, s = len(schedule.chunks[i]), schedule.bytes_in_window(i)
        cursor += s
        if cursor == payload:
            continue
        grow_last = s < n * cap and link.cost_s(n, s + 1) <= w.duration_s
        new_chunk = link.cost_s(n + 1, s + 1) <= w.duration_s
        assert not grow_last and not new_chunk, (i, n, s)


@settings(max_examples=100, deadline=None)
@given(float_cases())
def test_deterministic_and_json_round_trip(case):
    payload, windows, link, cap, min_chunk = case
    schedule = partition(payload, windows, link, cap, min_chunk)
    again = partition(payload, list(windows), LinkModel(link.alpha_s, link.bytes_per_s), cap,
                      min_chunk)
    assert again == schedule
    text = schedule.to_json()
    assert text == again.to_json()
    back = Schedule.from_json(text)
    assert back == schedule
    assert back.to_json() == text


def test_from_json_rejects_a_broken_schedule():
    link = LinkModel(1.0, 1.0)
    schedule = partition(10, [Window("a", "fwd", 5.0)], link, 3)
    assert [(c.start, c.stop) for c in schedule.all_chunks()] == [(0, 3), (3, 6), (6, 9),
                                                                   (9, 10)]
    doc = json.loads(schedule.to_json())
    doc["tail"][0][0] += 1  # a gap
    with pytest.raises(ValueError, match="bad chunk"):
        Schedule.from_json(json.dumps(doc))
    doc = json.loads(schedule.to_json())
    doc["windows"][0]["duration_s"] = 3.5  # window 0 now too short for its chunks
    with pytest.raises(ValueError, match="window 0 needs"):
        Schedule.from_json(json.dumps(doc))
    doc = json.loads(schedule.to_json())
    doc["tail"].pop()  # the payload's end is missing
    with pytest.raises(ValueError, match="covers 9 of 10"):
        Schedule.from_json(json.dumps(doc))


# ------------------------------------------------------------------ slices


@st.composite
def layouts(draw):
    """Leaves (path, offset, segment) with gaps, empty leaves and a trailer, in random order."""
    segments = draw(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 50)), max_size=8))
    leaves, offset = [], 0
    for i, (gap, size) in enumerate(segments):
        offset += gap
        leaves.append((f"['leaf{i}']", offset, size))
        offset += size
    trailer = draw(st.integers(0, 30))
    payload = offset + trailer
    return draw(st.permutations(leaves)), payload


@settings(max_examples=150, deadline=None)
@given(layouts(), st.integers(1, 40), st.data())
def test_slices_cover_each_leaf_once(layout, cap, data):
    leaves, payload = layout
    durations = data.draw(st.lists(st.integers(0, 20).map(float), max_size=4))
    windows = [Window(f"w{i}", "bwd", d) for i, d in enumerate(durations)]
    schedule = partition(payload, windows, LinkModel(1.0, 4.0), cap)
    pieces = schedule.slices(leaves)
    assert [c for c, _ in pieces] == schedule.all_chunks()
    covered: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for chunk, parts in pieces:
        pos = chunk.start
        for p in parts:  # pieces tile the chunk in order
            assert p.payload_start == pos and p.stop > p.start
            pos += p.stop - p.start
            # pseudo-leaves are keyed by where their region starts
            region = p.payload_start - p.start if p.path in (TRAILER, PADDING) else 0
            covered.setdefault((p.path, region), []).append((p.start, p.stop))
        assert pos == chunk.stop
    by_path = {path: (offset, size) for path, offset, size in leaves}
    expected = {(path, 0): size for path, (offset, size) in by_path.items() if size}
    ends = sorted((o, o + s) for o, s in by_path.values() if s)
    cursor = 0
    for start, stop in ends:
        if start > cursor:
            expected[(PADDING, cursor)] = start - cursor
        cursor = stop
    if payload > cursor:
        expected[(TRAILER, cursor)] = payload - cursor
    assert set(covered) == set(expected)
    for key, ranges in covered.items():
        pos = 0
        for start, stop in ranges:  # each byte of the segment once, in order
            assert start == pos
            pos = stop
        assert pos == expected[key], key
    # A leaf's piece maps back to the payload bytes it was cut from.
    for _, parts in pieces:
        for p in parts:
            if p.path in by_path:
                assert p.payload_start == by_path[p.path][0] + p.start


def test_slices_accept_pack_plan_leaves():
    slots = (LeafSlot("['w']", (4,), "float32", (4,), 16, 0, 16),
             LeafSlot("['b']", (2,), "float32", (2,), 8, 16, 8))
    schedule = partition(24 + 8, [Window("b0", "fwd", 2.0)], LinkModel(0.5, 10.0), 10)
    got = [[(p.path, p.start, p.stop) for p in parts] for _, parts in schedule.slices(slots)]
    assert got == [[("['w']", 0, 10)], [("['w']", 10, 16), ("['b']", 0, 4)],
                   [("['b']", 4, 8), (TRAILER, 0, 6)], [(TRAILER, 6, 8)]]
    with pytest.raises(ValueError, match="overlaps"):
        schedule.slices([("a", 0, 10), ("b", 5, 10)])
    with pytest.raises(ValueError, match="past the payload"):
        schedule.slices([("a", 30, 10)])


# ------------------------------------------------------------- optimality


def brute_force_tail(payload, durations, alpha, bandwidth, cap, min_chunk) -> int:
    """The least tail over every cut of the payload into ordered chunks assigned to windows.

    Exact (Fraction) costs. Chunks are 1..cap bytes, at least min_chunk unless
    they end the payload; windows take consecutive ranges in window order; the
    bytes after the last chunk placed are the tail.
    """

    @functools.cache
    def furthest(pos: int, w: int, n: int, s: int) -> int:
        # At byte pos, filling window w, which holds n chunks and s bytes so far.
        best = pos
        if w + 1 < len(durations):
            best = max(best, furthest(pos, w + 1, 0, 0))
        for size in range(1, min(cap, payload - pos) + 1):
            if size < min_chunk and pos + size != payload:
                continue
            if (n + 1) * alpha + Fraction(s + size, bandwidth) <= durations[w]:
                best = max(best, furthest(pos + size, w, n + 1, s + size))
        return best

    if not durations:
        return payload
    return payload - furthest(0, 0, 0, 0)


@settings(max_examples=200, deadline=None)
@given(exact_cases())
def test_tail_is_minimal(case):
    payload, durations, alpha, bandwidth, cap, min_chunk = case
    schedule = _exact_schedule(case)
    for i, group in enumerate(schedule.chunks):  # exact feasibility
        assert sum(alpha + Fraction(c.size, bandwidth) for c in group) <= durations[i]
    assert_valid(schedule, payload, schedule.windows, schedule.link, cap, min_chunk)
    assert schedule.tail_bytes == brute_force_tail(*case)


def test_min_chunk_borrows_from_full_chunks():
    # 2 chunks fit with 7 bytes between them (2 * 1 + 7 / 1 <= 9): 5 + 2 breaks
    # min_chunk = 3, so the window takes 4 + 3; the last window ends the payload.
    link = LinkModel(1.0, 1.0)
    schedule = partition(10, [Window("a", "fwd", 9.0), Window("b", "fwd", 4.0)], link, 5, 3)
    assert [[c.size for c in g] for g in schedule.chunks] == [[4, 3], [3]]
    assert schedule.tail_bytes == 0
    # Without a second window, the rest (3 bytes) is the tail.
    schedule = partition(10, [Window("a", "fwd", 9.0)], link, 5, 3)
    assert [c.size for c in schedule.chunks[0]] == [4, 3] and schedule.tail_bytes == 3
    # The rest of the payload may end in a short chunk.
    schedule = partition(7, [Window("a", "fwd", 9.0)], link, 5, 3)
    assert [c.size for c in schedule.chunks[0]] == [5, 2]


def test_window_shorter_than_alpha_gets_nothing():
    link = LinkModel(2.0, 1e9)
    schedule = partition(100, [Window("a", "fwd", 1.999), Window("b", "fwd", 2.0 + 50e-9)],
                         link, 1000)
    assert schedule.chunks[0] == ()
    assert schedule.chunks[1] == (Chunk(1, 0, 50),)
    assert schedule.tail == (Chunk(None, 50, 100),)


def test_empty_payload_and_no_windows():
    link = LinkModel(0.0, 1.0)
    empty = partition(0, [Window("a", "fwd", 1.0)], link, 4)
    assert empty.chunks == ((),) and empty.tail == () and empty.tail_bytes == 0
    nowhere = partition(9, [], link, 4)
    assert [(c.start, c.stop) for c in nowhere.tail] == [(0, 4), (4, 8), (8, 9)]


# -------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, match", [
    (dict(payload_bytes=-1), "payload_bytes"),
    (dict(payload_bytes=1.5), "payload_bytes"),
    (dict(chunk_cap=0), "chunk_cap"),
    (dict(min_chunk=0), "min_chunk"),
    (dict(min_chunk=5), "min_chunk"),
    (dict(windows=[("a", "fwd", 1.0)]), r"windows\[0\]"),
    (dict(link=(0.0, 1.0)), "link"),
])
def test_partition_rejects_bad_arguments(kwargs, match):
    args = dict(payload_bytes=10, windows=[Window("a", "fwd", 1.0)],
                link=LinkModel(0.0, 1.0), chunk_cap=4, min_chunk=1) | kwargs
    with pytest.raises(ValueError, match=match):
        partition(**args)


@pytest.mark.parametrize("make, match", [
    (lambda: LinkModel(-1e-6, 1.0), "alpha_s"),
    (lambda: LinkModel(0.0, 0.0), "bytes_per_s"),
    (lambda: LinkModel(0.0, -5.0), "bytes_per_s"),
    (lambda: LinkModel(0.0, math.inf), "bytes_per_s"),
    (lambda: LinkModel(math.nan, 1.0), "alpha_s"),
    (lambda: Window("a", "fwd", -1.0), "duration_s"),
    (lambda: Window("a", "fwd", math.inf), "duration_s"),
    (lambda: scale_windows([Window("a", "fwd", 1.0)], -0.5), "factor"),
])
def test_models_reject_bad_values(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---------------------------------------------------------------- link fit


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 10**9), min_size=2, max_size=20, unique=True),
       st.floats(0.0, 1e-3), st.floats(1e6, 1e11))
def test_fit_link_model_recovers_exact_lines(sizes, alpha, bandwidth):
    seconds = [alpha + s / bandwidth for s in sizes]
    link = fit_link_model(sizes, seconds)
    span = max(sizes) - min(sizes)
    assert link.bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    # alpha is only determined up to the rounding of the times it was added to.
    assert link.alpha_s == pytest.approx(alpha, abs=1e-12 + 1e-9 * max(seconds) * max(
        1.0, max(sizes) / span))
    assert link.alpha_s >= 0


def test_fit_link_model_clips_alpha_and_rejects_degenerate_input():
    link = fit_link_model([1, 2, 3], [0.5, 1.5, 2.5])  # intercept -0.5 -> refit through 0
    assert link.alpha_s == 0.0
    assert link.bytes_per_s == pytest.approx(14 / 11)
    with pytest.raises(ValueError, match="2 distinct sizes"):
        fit_link_model([8, 8, 8], [1.0, 1.1, 0.9])
    with pytest.raises(ValueError, match="2 distinct sizes"):
        fit_link_model([8], [1.0])
    with pytest.raises(ValueError, match="bandwidth"):
        fit_link_model([1, 2, 3], [3.0, 2.0, 1.0])
    with pytest.raises(ValueError, match="bandwidth"):
        fit_link_model([1, 2, 3], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="length"):
        fit_link_model([1, 2, 3], [1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        fit_link_model([1, 2], [1.0, math.nan])


# ----------------------------------------------------------------- profile


def test_windows_from_profile_and_scaling():
    segs = (Segment("b0", "fwd", 0.0, 0.010, 0.004), Segment("b1", "fwd", 0.010, 0.020, 0.030),
            Segment("head", "fwd", 0.030, 0.005), Segment("b1", "bwd", 0.035, 0.040, 0.010),
            Segment("tail", "bwd", 0.075, 0.020))
    windows = windows_from_profile(LayerProfile(3, 0.1, segs))
    assert [(w.name, w.direction) for w in windows] == [
        ("b0", "fwd"), ("b1", "fwd"), ("head", "fwd"), ("b1", "bwd"), ("tail", "bwd")]
    expected = [0.006, 0.0, 0.005, 0.030, 0.020]  # compute_s when known, else duration_s
    assert [w.duration_s for w in windows] == pytest.approx(expected)
    shuffled = LayerProfile(3, 0.1, segs[::-1])  # step order comes from the start times
    assert windows_from_profile(shuffled) == windows
    half = scale_windows(windows, 0.5)
    assert [w.duration_s for w in half] == pytest.approx([d / 2 for d in expected])
    assert [(w.name, w.direction) for w in half] == [(w.name, w.direction) for w in windows]


def test_agree_profile_keeps_the_profile_in_one_process():
    """One process: host 0 is this one; the values go through float32 (as on
    every host of a multi-host job) and a missing estimate stays missing."""
    from capricorn_jax._src.profiling.policy import agree_profile

    profile = LayerProfile(7, 0.5, (Segment("block0", "fwd", 0.0, 0.1, 0.01),
                                    Segment("head", "fwd", 0.1, 0.3, None)), 4)
    got = agree_profile(profile)
    assert (got.step, got.total_s, got.devices) == (7, 0.5, 4)
    assert [(s.name, s.direction, s.start_s) for s in got.segments] == [
        ("block0", "fwd", 0.0), ("head", "fwd", 0.1)]
    assert [s.duration_s for s in got.segments] == [float(np.float32(0.1)),
                                                     float(np.float32(0.3))]
    assert got.segments[0].collective_s == float(np.float32(0.01))
    assert got.segments[1].collective_s is None


@settings(max_examples=60, deadline=None)
@given(payload=st.integers(0, 5000), durations=st.lists(st.floats(0, 0.2), min_size=1,
                                                          max_size=4),
       max_steps=st.integers(1, 6))
def test_spread_takes_the_fewest_steps_whose_windows_hold_the_payload(payload, durations,
                                                                      max_steps):
    link = LinkModel(alpha_s=0.001, bytes_per_s=10_000.0)
    windows = [Window(f"block{i}", "fwd", d) for i, d in enumerate(durations)]
    schedule, k = spread(payload, windows, link, chunk_cap=300, max_steps=max_steps)
    schedule.validate()
    assert 1 <= k <= max_steps and schedule.windows == tuple(windows) * k
    if k < max_steps:
        assert schedule.tail_bytes == 0
    if k > 1:  # one step fewer left a tail
        assert partition(payload, windows * (k - 1), link, 300).tail_bytes > 0
    assert schedule == partition(payload, windows * k, link, 300)


@settings(max_examples=150, deadline=None)
@given(payload=st.integers(0, 200_000),
       durations=st.lists(st.floats(0.0, 0.01), min_size=1, max_size=8),
       alpha=st.floats(0.0, 1e-4), cap=st.integers(1_000, 40_000),
       max_share=st.floats(0.05, 1.0))
def test_even_partition_fills_every_window_to_the_same_least_share(payload, durations, alpha,
                                                                   cap, max_share):
    from capricorn_jax._src.scheduling.plan.partition_search import even_partition

    link = LinkModel(alpha, 1e7)
    windows = [Window(f"b{i}", "fwd", d) for i, d in enumerate(durations)]
    schedule, share = even_partition(payload, windows, link, cap, max_share=max_share)
    # Every byte exactly once, in order; the windows keep their own durations.
    assert [c.start for c in schedule.all_chunks()][:1] in ([], [0])
    assert sum(c.size for c in schedule.all_chunks()) == payload
    assert schedule.windows == tuple(windows)
    # No window holds more than the share of its time.
    for i, w in enumerate(windows):
        assert schedule.window_cost_s(i) <= share * w.duration_s + 1e-12
    # The share is the least (to the tolerance) that leaves no tail, or the cap.
    if schedule.tail:
        assert share == max_share
        assert schedule.tail_bytes == partition(
            payload, [Window(w.name, w.direction, w.duration_s * max_share) for w in windows],
            link, cap).tail_bytes
    elif payload and share > 2e-3:
        below = partition(payload, [Window(w.name, w.direction, w.duration_s * (share - 2e-3))
                                    for w in windows], link, cap)
        assert below.tail


def test_even_partition_names_a_bad_share():
    from capricorn_jax._src.scheduling.plan.partition_search import even_partition

    with pytest.raises(ValueError, match="max_share=1.5"):
        even_partition(10, [Window("b0", "fwd", 1.0)], LinkModel(0.0, 1e6), 4, max_share=1.5)
    schedule, share = even_partition(0, [Window("b0", "fwd", 1.0)], LinkModel(0.0, 1e6), 4)
    assert share == 0.0 and not schedule.all_chunks()


@settings(max_examples=300, deadline=None)
@given(payload=st.integers(0, 3_000_000),
       durations=st.lists(st.one_of(st.just(0.0), st.floats(0.0, 0.05), st.floats(0.0, 1e-3)),
                          max_size=12),
       alpha=st.sampled_from([0.0, 1e-5, 2e-4, 3e-3]),
       rate=st.sampled_from([1e6, 1.5e7, 1.2e8]), cap=st.integers(1_000, 3 << 20),
       low=st.integers(1, 1_000), share=st.floats(0.0, 1.0))
def test_placed_bytes_is_what_the_schedule_places(payload, durations, alpha, rate, cap, low,
                                                  share):
    """The even fill's search asks ``placed_bytes`` at each share it tries
    instead of building a schedule: it must be exactly the bytes the
    schedule at that share places (the search then takes the same steps)."""
    from capricorn_jax._src.scheduling.plan.partitioner import placed_bytes

    low = min(low, cap)
    link = LinkModel(alpha, rate)
    windows = [Window(f"b{i}", "fwd", d) for i, d in enumerate(durations)]
    schedule = partition(payload, scale_windows(windows, share), link, cap, low)
    assert placed_bytes(payload, [w.duration_s * share for w in windows], link, cap,
                        low) == payload - schedule.tail_bytes


@settings(max_examples=500, deadline=None)
@given(lo=st.integers(-5, 50), span=st.integers(-3, 5000), answer=st.integers(-60, 5100),
       guess=st.one_of(st.floats(allow_nan=True), st.integers(-10_000, 10_000).map(float)))
def test_the_search_from_a_guess_finds_what_bisection_finds(lo, span, answer, guess):
    from capricorn_jax._src.scheduling.plan.partitioner import _largest, _largest_near

    def ok(x):
        return x <= answer

    assert _largest_near(lo, lo + span, ok, guess) == _largest(lo, lo + span, ok)
