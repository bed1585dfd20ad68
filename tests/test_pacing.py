"""The threaded path's pure parts, without threads, sockets or marks: a part's
layout (``threaded.pacing.part_plan``), a version's step records
(``Version.step_records``) and the version book (``threaded.versions.Versions``)."""

import numpy as np
import pytest

from capricorn_jax._src.scheduling.plan.partitioner import Chunk, LinkModel, Schedule, Window
from capricorn_jax._src.scheduling.plan.sites import AFTER, START
from capricorn_jax._src.scheduling.plan.window_bytes import WindowBytes
from capricorn_jax._src.scheduling.threaded.chunk_channel import CorruptFrame
from capricorn_jax._src.scheduling.threaded.pacing import part_plan
from capricorn_jax._src.scheduling.threaded.versions import StartedTooLate, Version, Versions

BOUNDARIES = ["block0", "block1"]
B0F, B1F, B1B, B0B = ("block0", "fwd"), ("block1", "fwd"), ("block1", "bwd"), ("block0", "bwd")
STEP = (Window("block0", "fwd", 0.010), Window("block1", "fwd", 0.020),
        Window("tail", "bwd", 0.030))  # open at START, block0 fwd, block0 bwd


def _schedule(steps: int, chunks: list[list[tuple[int, int]]], tail: list[tuple[int, int]]
              ) -> Schedule:
    """``steps`` steps' windows with the given chunks (hand-built: exact ranges)."""
    return Schedule(windows=STEP * steps,
                    chunks=tuple(tuple(Chunk(i, lo, hi) for lo, hi in cs)
                                 for i, cs in enumerate(chunks)),
                    tail=tuple(Chunk(None, lo, hi) for lo, hi in tail),
                    payload_bytes=300, chunk_cap=1000, link=LinkModel(0.0, 1e6))


ONE = _schedule(1, [[(0, 100)], [(100, 250)], []], [(250, 300)])


def test_one_part_with_deadlines():
    plan = part_plan(ONE, BOUNDARIES, part=0, parts=1, planned_parts=1, per_part=3, rows=2,
                     deadline=True)
    # each window's ranges at the site that opens it, the tail after the step
    assert plan.by_site == {START: [(0, 100)], B0F: [(100, 250)], B0B: [], AFTER: [(250, 300)]}
    assert plan.order == [START, B0F, B1F, B1B, B0B, AFTER]
    assert plan.window_sites == {0: (START, B0F), 1: (B0F, B1F)}  # filled windows only
    assert plan.site_idle == {START: 0.010, B0F: 0.020, B0B: 0.030}
    assert plan.planned == {0: 200, 1: 300, 2: 0}  # all rows' bytes
    assert (plan.upto, plan.last, plan.hold) == (1, True, False)
    no_deadline = part_plan(ONE, BOUNDARIES, 0, 1, 1, 3, rows=2)
    assert no_deadline.site_idle == {} and no_deadline.by_site == plan.by_site


def test_a_flushed_part_goes_at_the_start_untimed():
    plan = part_plan(ONE, BOUNDARIES, 0, 1, 1, 3, rows=1, flush=True, deadline=True,
                     hold_tail=4)
    assert plan.by_site == {START: [(0, 100), (100, 250)], AFTER: [(250, 300)]}
    assert plan.window_sites == {} and plan.site_idle == {}
    assert not plan.hold  # a flushed part holds nothing back


def test_a_spread_version_sends_each_steps_windows_and_the_tail_with_the_last():
    two = _schedule(2, [[(0, 100)], [(100, 200)], [], [(200, 250)], [], []], [(250, 300)])
    first = part_plan(two, BOUNDARIES, part=0, parts=2, planned_parts=2, per_part=3, rows=1,
                      deadline=True)
    assert first.by_site == {START: [(0, 100)], B0F: [(100, 200)], B0B: []}  # no tail yet
    assert first.window_sites == {0: (START, B0F), 1: (B0F, B1F)}
    assert (first.upto, first.last) == (1, False)
    second = part_plan(two, BOUNDARIES, part=1, parts=2, planned_parts=2, per_part=3, rows=1,
                       deadline=True)
    assert second.by_site == {START: [(200, 250)], B0F: [], B0B: [], AFTER: [(250, 300)]}
    assert second.window_sites == {3: (START, B0F)}  # this step's windows, by schedule index
    assert second.planned == {3: 50, 4: 0, 5: 0}
    assert (second.upto, second.last) == (2, True)
    # flushed from part 0: every part left at once, the tail included
    rest = part_plan(two, BOUNDARIES, 0, 2, 2, 3, rows=1, flush=True)
    assert rest.by_site == {START: [(0, 100), (100, 200), (200, 250)], AFTER: [(250, 300)]}
    assert (rest.upto, rest.last) == (2, True)


def test_holding_the_tail_and_a_held_part():
    # The version's last planned part holds what it leaves while it may take more parts.
    assert part_plan(ONE, BOUNDARIES, 0, 1, 1, 3, rows=1, hold_tail=2).hold
    assert not part_plan(ONE, BOUNDARIES, 0, 1, 1, 3, rows=1, hold_tail=1).hold
    # A held part (``extend``: parts 2 of 1 planned) carries only what was held,
    # in the windows of the schedule's first step; no more parts at the bound.
    held = part_plan(ONE, BOUNDARIES, part=1, parts=2, planned_parts=1, per_part=3, rows=1,
                     deadline=True, hold_tail=2)
    assert held.by_site == {} and held.planned == {}
    assert held.window_sites == {0: (START, B0F), 1: (B0F, B1F)}
    assert held.site_idle == {START: 0.010, B0F: 0.020, B0B: 0.030}
    assert (held.upto, held.last, held.hold) == (2, True, False)


def _version(expect=((0, 10),)) -> Version:
    return Version(0, None, np.zeros((1, 10), np.uint8), list(expect))


def test_step_records_from_the_marks():
    v = _version()
    v.t0 = v.part_t0 = 100.0
    v.times["packed_s"] = 0.001  # window 0 opens when the payload is packed
    v.window_sites = {0: (START, B0F), 1: (B0F, B1F)}
    v.site_sent = {START: 100.005, B0F: 100.040}
    v.planned = {0: 100, 1: 0}
    v.frames = [(START, 99.0, 99.5, 7, START),  # an earlier part's frame: not this step's
                (START, 100.002, 100.003, 100, START)]
    spans, sends, moved = v.step_records({B0F: 100.011, B1F: 100.031}, [(100.009, 5)],
                                         {B0F: 0, B1F: 0})
    assert spans == pytest.approx({0: 0.010, 1: 0.020})
    assert sends == pytest.approx({0: 0.004, 1: 0.029})
    # window 0 closed at the collective's start (100.009), 5 bytes still queued then
    assert moved == {0: WindowBytes(100, 95, 5), 1: WindowBytes(0, 0, 0)}


def test_the_version_book():
    book = Versions()
    v = _version()
    book.add(v)
    assert book.buffer(0, 1.0, host=0, source=1) is v.received
    assert book.remaining(0) == 10
    book.received([(0, 0, 4), (0, 0, 4)], host=0)  # a resend counts once
    assert book.remaining(0) == 6 and not v.complete.is_set()
    book.received([(0, 4, 6)], host=0)
    assert v.complete.is_set() and v.error is None and "received_s" in v.times
    book.finish(0)
    assert book.get(0) is None and book.pending() == []
    assert book.buffer(0, 1.0, host=0, source=1) is None  # late frames are discarded
    bad = Version(1, None, np.zeros((1, 10), np.uint8), [(0, 10)])
    book.add(bad)
    book.received([(1, 8, 5)], host=0)  # past the scheduled ranges: refused
    assert isinstance(bad.error, CorruptFrame) and bad.complete.is_set()
    book.closed = True  # a version never started is not waited for once closed
    assert book.buffer(7, 60.0, host=0, source=1) is None
    assert book.buffer(7, 60.0, host=0, source=1) is None  # and stays dropped


def test_a_version_started_after_its_frames_were_dropped_fails_at_once():
    """``buffer`` dropped version 3's frames (this host had not started it
    within the bound): starting it then fails it, as no frame of it is left.
    A version finished the normal way may start again (a restore in the same
    process saves its steps anew)."""
    book = Versions()
    assert book.buffer(3, 0.01, host=1, source=0) is None  # not started within 10 ms
    late = Version(3, None, np.zeros((1, 10), np.uint8), [(0, 10)])
    book.add(late)
    assert isinstance(late.error, StartedTooLate) and late.complete.is_set()
    book.add(Version(4, None, np.zeros((1, 10), np.uint8), [(0, 10)]))
    book.finish(4)
    anew = Version(4, None, np.zeros((1, 10), np.uint8), [(0, 10)])
    book.add(anew)
    assert anew.error is None and not anew.complete.is_set()
