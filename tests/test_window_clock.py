"""scheduling.in_graph.window_clock: the in-graph path's spill signal.

The clock's arithmetic (pure, exact), then the in-graph scheduled step with
the clock attached on four CPU devices as two simulated hosts (as
``test_executor``), moved by the in-graph mover alone
(``strategies.movers.InGraphMover``): its marks give every filled window a
record, the bytes and the state are those of the step without marks, and
capricorn's spill note and profile request
(``strategies.planners.ReplanningPlanner.on_windows`` / ``on_committed``,
fed by the mover's ``collect``) fire when the link model makes every chunk
far longer than any window of a CPU step, and stay quiet when it makes them
free.
"""

from __future__ import annotations

from typing import cast

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capricorn_jax._src.memory.tier.writer_door import TierWriter
from capricorn_jax._src.memory.wire.packing import encode_trailer
from capricorn_jax._src.scheduling.in_graph.transfers import ScheduledTransfers
from capricorn_jax._src.scheduling.in_graph.window_clock import DONE, WindowClock, window_times
from capricorn_jax._src.scheduling.plan.partitioner import LinkModel, Window, partition
from capricorn_jax._src.scheduling.plan.sites import AFTER, START, window_sites
from capricorn_jax._src.scheduling.plan.spills import window_spills
from capricorn_jax._src.strategies.movers import InGraphMover, Payload
from capricorn_jax._src.strategies.planners import SPILL_WINDOW, ReplanningPlanner
from tests.helpers import StatusNotes, notes_of, two_host_transport
from tests.tree_utils import assert_trees_equal

BOUNDARIES = ["block0", "block1"]
NAMES = [("block0", "fwd"), ("block1", "fwd"), ("head", "fwd"), ("block1", "bwd"),
         ("tail", "bwd")]
SITES = [START, ("block0", "fwd"), ("block1", "fwd"), ("block1", "bwd"), ("block0", "bwd"),
         AFTER]  # the order a step passes them; window i opens at SITES[i]
FACTORS = (2.0, 2.0)
CHUNK = 250_000  # the tiny model's payload is about 1.1 MB: five chunks


def _windows(seconds: float) -> list[Window]:
    return [Window(n, d, seconds) for n, d in NAMES]


# ------------------------------------------------------------ the arithmetic


def test_a_window_is_timed_from_its_opening_mark_to_its_closing_one_and_its_done_mark():
    schedule = partition(5000, _windows(1.0), LinkModel(0.0, 1e3), chunk_cap=100)
    pairs = window_sites(schedule, BOUNDARIES)
    assert pairs == {i: (SITES[i], SITES[i + 1]) for i in range(5)}
    stamps = {
        ("<start>", "fwd", 0): 10.0, ("<start>", "fwd", 1): 10.5,  # the latest device counts
        ("<start>", "fwd" + DONE, 0): 10.75, ("<start>", "fwd" + DONE, 1): 10.25,
        ("block0", "fwd", 0): 11.0, ("block0", "fwd", 1): 11.0,
        ("block0", "fwd" + DONE, 0): 13.0,  # arrived after its closing mark
        ("block1", "fwd", 0): 12.0,
        ("block1", "fwd" + DONE, 0): 12.5,
        # (block1, bwd) never marked: window 2 has no span, window 3 nothing at all
        ("block0", "bwd", 0): 20.0, ("block0", "bwd" + DONE, 0): 20.5,
    }
    spans, done = window_times(pairs, stamps)
    assert spans == {0: 0.5, 1: 1.0}  # window 4 closes at the step's end: no span
    assert done == {0: 0.25, 1: 2.0, 2: 0.5, 4: 0.5}
    # Handed to window_spills: late_s is how long after its closing mark the
    # window's last chunk arrived; a window without both site marks has no record.
    got = window_spills(schedule, spans, None, done)
    assert [(g["window"], g["sent_s"], g["late_s"]) for g in got] == [
        ("block0/fwd", 0.25, 0.0), ("block1/fwd", 2.0, 1.0)]


def test_windows_without_chunks_are_not_paired():
    # A window too short for one chunk holds none; the tail takes the rest.
    windows = [Window(n, d, 1.0 if i % 2 else 1e-9) for i, (n, d) in enumerate(NAMES)]
    schedule = partition(2000, windows, LinkModel(0.0, 1e3), chunk_cap=100)
    assert window_sites(schedule, BOUNDARIES) == {1: (SITES[1], SITES[2]),
                                                  3: (SITES[3], SITES[4])}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 100.0), min_size=6, max_size=6),
       st.lists(st.floats(0.0, 10.0), min_size=5, max_size=5),
       st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6))
def test_times_are_differences_of_the_latest_devices_marks(sites, dones, skew):
    schedule = partition(5000, _windows(1.0), LinkModel(0.0, 1e3), chunk_cap=100)
    pairs = window_sites(schedule, BOUNDARIES)
    stamps = {}
    for k, (name, direction) in enumerate(SITES[:5]):
        stamps[(name, direction, 0)] = sites[k]
        stamps[(name, direction, 1)] = sites[k] + skew[k]
        stamps[(name, direction + DONE, 1)] = sites[k] + dones[k]
    spans, done = window_times(pairs, stamps)
    latest = [sites[k] + skew[k] for k in range(5)]
    assert spans == {i: latest[i + 1] - latest[i] for i in range(4)}
    assert done == {i: sites[i] + dones[i] - latest[i] for i in range(5)}


# ------------------------------------------------------- the in-graph steps


@pytest.fixture(scope="module")
def setup():
    trainer, plan, transport = two_host_transport()
    batch = trainer.global_batch(
        np.random.default_rng(0).integers(0, 256, (16, 65)).astype(np.int32))
    trailer = encode_trailer({"data": 7})
    rows = jax.make_array_from_process_local_data(
        transport.rows, np.broadcast_to(trailer, (4, trailer.size)).copy())
    return trainer, transport, batch, rows


def _capricorn(trainer, transport, link: LinkModel, seconds: float
               ) -> tuple[InGraphMover, ReplanningPlanner]:
    """Capricorn's in-graph parts: the mover with a real clock and real
    scheduled steps, and the replanning planner with one plan in force; the
    checkpointer is left out (one host: its status round would agree on
    host 0's note, this host's own)."""
    ckpt = cast(TierWriter, StatusNotes(transport=transport))  # a test double
    clock = WindowClock(trainer.mesh, BOUNDARIES)
    transfers = ScheduledTransfers(ckpt, trainer, BOUNDARIES, link, CHUNK, clock=clock)
    mover = InGraphMover(ckpt, trainer, link, transfers, clock)
    planner = ReplanningPlanner(ckpt, transfers, (), spans=False)
    planner._repartition(0, _windows(seconds), "profile")
    return mover, planner


def _run(mover: InGraphMover, planner: ReplanningPlanner, trainer, batch, rows, versions: int):
    """``versions`` in-graph steps, each moving its version and followed by
    the note and its check as the strategy's ``save`` does them; returns the
    last state, the last version moved and its records."""
    state = trainer.init_state(0)
    payload = Payload(rows, mover.ckpt.transport)
    for version in range(versions):
        state, _ = mover.move(trainer, version, FACTORS, state, batch, (), payload)
        moved = mover.collect(state, planner.planned_on)
        assert moved is not None and moved.version == version and moved.windows is not None
        windows = moved.windows
        planner.on_windows(windows, None)
        notes_of(planner).agreed_note = notes_of(planner).status_note  # one host: its note
        planner.on_committed(version)
    return state, moved, windows


@pytest.mark.slow  # long: compiles three variants of the scheduled step
@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_capricorn_asks_for_a_profile_when_its_in_graph_windows_spill(setup):
    trainer, transport, batch, rows = setup
    # Every chunk costs 10^4 s on the link model and the plan's windows (1.5 x
    # 10^4 s, 0.8 of it filled) take one each: no window of a CPU step holds
    # one, so each filled window spills.
    s, planner = _capricorn(trainer, transport, LinkModel(alpha_s=1e4, bytes_per_s=1e9), 1.5e4)
    schedule = s.transfers.schedule
    assert schedule.tail_bytes == 0 and all(schedule.chunks)
    state, moved, windows = _run(s, planner, trainer, batch, rows, SPILL_WINDOW)
    # Every window but the last (closed by the step's end) has its record.
    assert [w["window"] for w in windows] == [f"{n}/{d}" for n, d in NAMES[:4]]
    for i, w in enumerate(windows):
        # Marks tied by data: a window's chunks go after its opening mark and
        # its closing boundary comes after its opening one.
        assert w["sent_s"] >= 0.0 and w["observed_s"] >= 0.0
        assert w["spill_s"] == round(schedule.window_cost_s(i) - w["observed_s"], 6) > 0.0
        assert w["late_s"] == round(max(0.0, w["sent_s"] - w["observed_s"]), 6)
    # Most of the last SPILL_WINDOW versions spilled: one request, after the
    # third (more than half of 4), and not again until a profile answers.
    assert notes_of(planner).status_note == 1000 + SPILL_WINDOW
    assert planner.profile_requested() and planner.spill_requests == [SPILL_WINDOW // 2]

    # The marks change no byte: the same schedule's step without a clock
    # trains and moves bitwise the same.
    plain = ScheduledTransfers(s.ckpt, trainer, BOUNDARIES, s.link, CHUNK)
    plain.repartition(_windows(1.5e4))
    assert plain.schedule == schedule
    want = trainer.init_state(0)
    for _ in range(SPILL_WINDOW):
        want, _, want_moved = plain.step_fn(FACTORS)(want, batch, rows)
    assert_trees_equal(state, want)
    np.testing.assert_array_equal(np.asarray(moved.own), np.asarray(want_moved["own"]))
    np.testing.assert_array_equal(np.asarray(moved.received), np.asarray(want_moved["received"]))
    # And only the clock's step carries callbacks.
    hlo = {name: t.step_fn(FACTORS).lower(trainer.init_state(0), batch, rows).as_text()
           for name, t in (("clock", s.transfers), ("plain", plain))}
    assert "callback" in hlo["clock"] and "callback" not in hlo["plain"]


@pytest.mark.slow  # long: compiles a scheduled step
@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_no_request_when_no_window_spills_on_the_in_graph_path(setup):
    trainer, transport, batch, rows = setup
    # A free link: every chunk's modelled time rounds to 0, so no window spills.
    s, planner = _capricorn(trainer, transport, LinkModel(alpha_s=0.0, bytes_per_s=1e30), 1.0)
    _, _, windows = _run(s, planner, trainer, batch, rows, SPILL_WINDOW)
    assert windows and [w["spill_s"] for w in windows] == [0.0] * len(windows)
    assert notes_of(planner).status_note == 1000
    assert not planner.profile_requested() and planner.spill_requests == []
