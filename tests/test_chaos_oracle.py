"""launch.chaos's oracle (``launch.chaos.oracle``): what must survive each fault,
and the verdict on each resumption, on hand-written records (tables) and on
drawn ones (properties)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launch.chaos import oracle
from launch.chaos.checks import check_trial, ends_attempt, expected
from launch.chaos.config import parse_topology
from launch.chaos.draw import Trial
from launch.chaos.oracle import DiskSnapshot, Expectation, Resumption
from launch.train.fault_plan import Fault

TWO, FOUR, FOUR_R3 = (parse_topology(t) for t in ("2x2", "4x1", "4x1r3"))
REF = {s: 5.0 - 0.1 * s for s in range(12)}


def _steps(*ranges):
    return [{"step": s, "loss": REF[s]} for r in ranges for s in r]


def _safe(v):
    return {"event": "checkpoint", "step": v, "replicated": v}


def _recovery(step, tier):
    return {"event": "recovery", "step": step, "tier": tier, "seconds": 0.1}


def _trial(*faults, topo=TWO, persist=0, keep=3):
    return Trial(0, 0, topo, "inmem", persist, tuple(faults), None, (), keep)


def _oracle(trial, records, disk=()):
    return expected(trial, records, disk)


KILL = Fault((1,), 4, "after_step")


# ------------------------------------------------------------- the required three


def test_a_run_that_lost_every_version_and_restarted_from_step_0_fails():
    """Host 1 killed as a process (its store survives) after version 4 was safe
    everywhere: a job that comes back at step 0 with no recovery lost it."""
    trial = _trial(KILL)
    records = [*_steps(range(5)), _safe(4), *_steps(range(8))]
    problems, happened = check_trial(trial, records, REF, 8, strikes=1)
    assert problems == [
        "restart from step 0 with no recovery: older than version 4, which had to survive "
        "(tier local: version 4 was on every holder and a holder of each owner survived)"]
    assert happened["expected_from"] == {"step": 4, "tier": "local"}


def test_a_persistent_recovery_older_than_the_newest_committed_persistent_step_fails():
    """Every RAM store lost: the recovery must come from the persistent tier, at
    the newest step committed on disk before it (8, not 4)."""
    trial = _trial(Fault((0,), 9, "after_step", wipe_all=True), persist=4)
    records = [*_steps(range(10)), {"event": "persist", "step": 4}, _safe(9),
               {"event": "persist", "step": 8}, _recovery(4, "persistent"),
               *_steps(range(4, 12))]
    disk = [DiskSnapshot(3, frozenset({4})), DiskSnapshot(12, frozenset({4, 8}), polls=5)]
    problems, happened = check_trial(trial, records, REF, 12, strikes=1, disk=disk)
    assert problems == [
        "recovery to 4 via persistent: older than version 8, which had to survive (tier "
        "persistent: persistent step 8 was committed on disk; no RAM version of hosts "
        "[0, 1] survived)"]
    assert happened["expected_from"] == {"step": 8, "tier": "persistent"}
    records[13] = _recovery(8, "persistent")
    records[14:] = _steps(range(8, 12))
    assert check_trial(trial, records, REF, 12, strikes=1, disk=disk)[0] == []


def test_a_correct_recovery_passes():
    trial = _trial(KILL)
    records = [*_steps(range(5)), _safe(3), _safe(4), _recovery(5, "local"),
               *_steps(range(5, 8))]
    problems, happened = check_trial(trial, records, REF, 8, strikes=1)
    assert problems == [] and happened["expected"] == [{"step": 4, "tier": "local"}]


# ------------------------------------------------------------- the rules, as a table


@pytest.mark.parametrize("topo,fault,want", [
    # process kill: every store survives, the safe version, locally
    (TWO, Fault((1,), 4, "after_step"), Expectation(4, "local")),
    # one machine lost of two replicas: the peer's copy
    (TWO, Fault((1,), 4, "after_step", "host"), Expectation(4, "peer", (1,))),
    # both machines of a 2-host job: nothing left, a fresh start is right
    (TWO, Fault((0, 1), 4, "after_step", "host"), Expectation(0, "none", (0, 1), (0, 1))),
    # 4 hosts in groups {0,1}, {2,3}: one host of each group lost -> survives
    (FOUR, Fault((0, 2), 4, "mid_step", "host"), Expectation(4, "peer", (0, 2))),
    # a whole group lost -> owners 0 and 1 have no RAM copy
    (FOUR, Fault((0, 1), 4, "mid_step", "host"), Expectation(0, "none", (0, 1), (0, 1))),
    # three replicas on a ring of 4: any two lost -> survives
    (FOUR_R3, Fault((0, 1), 4, "mid_step", "host"), Expectation(4, "peer", (0, 1))),
    # a corrupted own copy: the replica survives (the tier may be local or peer)
    (TWO, Fault((1,), 4, "after_step", corrupt=True), Expectation(4, "local")),
])
def test_what_must_survive_follows_the_plan_and_the_placement(topo, fault, want):
    trial = _trial(fault, topo=topo)
    got, _ = _oracle(trial, [*_steps(range(5)), _safe(4)])
    assert [(e.step, e.tier, e.wiped, e.lost) for e in got] == [
        (want.step, want.tier, want.wiped, want.lost)]


@pytest.mark.parametrize("want,res,problem", [
    (Expectation(4, "local"), Resumption(9, 4, "local"), None),
    (Expectation(4, "local"), Resumption(9, 5, "peer"), None),  # a bad own copy
    (Expectation(4, "local"), Resumption(9, 3, "local"), "older than version 4"),
    (Expectation(4, "local"), Resumption(9, 0, "none"), "restart from step 0"),
    (Expectation(4, "peer", (1,)), Resumption(9, 4, "local"), "must read from a peer"),
    (Expectation(0, "none", (0, 1), (0, 1)), Resumption(9, 0, "none"), None),
    (Expectation(0, "none", (0, 1), (0, 1)), Resumption(9, 3, "peer"), "no RAM copy"),
    (Expectation(8, "persistent"), Resumption(9, 8, "persistent"), None),
    (Expectation(8, "persistent"), Resumption(9, 9, "local"), None),  # newer, in RAM
    (Expectation(8, "persistent"), Resumption(9, 4, "persistent"), "older than version 8"),
    (Expectation(4, "local"), Resumption(9, 12, "persistent"), "no persistent write"),
])
def test_each_resumption_is_judged_against_its_expectation(want, res, problem):
    records = [{"event": "persist", "step": 4}, {"event": "persist", "step": 8}] + [{}] * 7 + [
        {"event": "recovery"}]
    got = oracle.judge(want, res, records)
    if problem is None:
        assert got == []
    else:
        assert len(got) == 1 and problem in got[0], got


def test_a_memory_recovery_older_than_a_committed_persistent_step_fails():
    """The restore takes the memory tier only when it is at least the newest
    committed persistent step: a recovery from RAM at 6 with step 8 on disk
    is a loss."""
    trial = _trial(Fault((1,), 9, "after_step"), persist=4)
    records = [*_steps(range(10)), _safe(6), _recovery(6, "local"), *_steps(range(6, 12))]
    disk = [DiskSnapshot(4, frozenset({4})), DiskSnapshot(9, frozenset({4, 8}))]
    (want,), _ = _oracle(trial, records, disk)
    assert (want.step, want.tier) == (8, "persistent")
    problems = check_trial(trial, records, REF, 12, strikes=1, disk=disk)[0]
    assert any("older than version 8" in p for p in problems)


def test_a_step_committed_after_the_recovery_does_not_count_before_it():
    trial = _trial(Fault((1,), 5, "after_step"), persist=4)
    records = [*_steps(range(6)), _safe(5), _recovery(6, "local"), *_steps(range(6, 12))]
    late = [DiskSnapshot(len(records) - 2, frozenset({8}))]  # seen after the recovery
    (want,), _ = _oracle(trial, records, late)
    assert (want.step, want.tier) == (5, "local")


def test_a_kill_during_recovery_wipes_too_and_pairs_with_the_next_recovery():
    """Host 1 lost as a machine, then host 0 lost as a machine at the start of
    the recovery: in a 2-host job nothing is left."""
    trial = _trial(Fault((1,), 4, "after_step", "host"), Fault((0,), -1, "recovery", "host"))
    records = [*_steps(range(5)), _safe(4), *_steps(range(8))]
    (want,), (res,) = _oracle(trial, records)
    assert (want.step, want.tier, want.lost) == (0, "none", (0, 1))
    assert res == Resumption(6, 0, "none")
    assert check_trial(trial, records, REF, 8, strikes=2)[0] == []


def test_a_version_recovered_from_a_peer_is_carried_until_a_new_one_is_safe():
    """After host 1's store is wiped and version 4 recovered from host 0, only
    host 0 holds it: a second fault before any new version is safe that
    wipes host 0 loses it (a fresh start is right); with a new safe version,
    that one binds (and in a 2-host job a wipe of host 0 loses it too)."""
    first, second = Fault((1,), 4, "after_step", "host"), Fault((0,), 6, "after_step", "host")
    trial = _trial(first, second)
    records = [*_steps(range(5)), _safe(4), _recovery(5, "peer"), *_steps(range(5, 7)),
               *_steps(range(8))]
    got, _ = _oracle(trial, records)
    assert [(e.step, e.tier) for e in got] == [(4, "peer"), (0, "none")]
    # A process kill instead: version 4 still on host 0, must be recovered.
    trial = _trial(first, Fault((0,), 6, "after_step"))
    got, _ = _oracle(trial, records)
    assert [(e.step, e.tier) for e in got] == [(4, "peer"), (4, "local")]
    assert any("restart from step 0" in p
               for p in check_trial(trial, records, REF, 8, strikes=2)[0])


def test_resumptions_are_recoveries_and_restarts_from_step_0():
    records = [*_steps(range(4)), _recovery(3, "local"), *_steps(range(3, 5)),
               *_steps(range(2)), _recovery(1, "peer"), *_steps(range(1, 3))]
    assert oracle.resumptions(records) == [Resumption(4, 3, "local"), Resumption(7, 0, "none"),
                                           Resumption(9, 1, "peer")]


def test_the_faults_that_end_attempts_group_with_the_kills_of_their_recoveries():
    plan = (Fault((1,), 2, "after_step"), Fault((0,), -1, "recovery"),
            Fault((1,), -1, "recovery"), Fault((0,), 5, "mid_step"),
            Fault((1,), 7, "pause", pause_s=3.0))
    assert oracle.kill_groups(plan, ends_attempt) == [plan[:3], plan[3:4]]


def test_a_missing_or_extra_resumption_is_named():
    trial = _trial(KILL)
    records = [*_steps(range(8))]  # the kill never shows
    assert "0 resumptions (recoveries, or restarts from step 0 with none) where the faults " \
           "end 1 attempts" in check_trial(trial, records, REF, 8, strikes=1)[0]


# ------------------------------------------------------------- the persistent tier on disk


def test_a_committed_step_deleted_before_its_successor_is_committed_is_named():
    """max_to_keep=1, a full disk at step 8's finalize: deleting step 4 then
    (the bug of a finalize that fails) leaves no step on disk."""
    bug = [DiskSnapshot(10, frozenset({4}), 40), DiskSnapshot(30, frozenset(), 20),
           DiskSnapshot(50, frozenset({12}), 5)]
    assert oracle.disk_problems(bug, 1) == [
        "persistent step 4 left the disk while 0 newer committed steps were on it ([]; "
        "max_to_keep 1)"]
    right = [DiskSnapshot(10, frozenset({4}), 40), DiskSnapshot(50, frozenset({4, 12}), 1),
             DiskSnapshot(51, frozenset({12}), 5)]
    assert oracle.disk_problems(right, 1) == []
    # keep 2: 4 may go once 8 and 12 are both on disk, not before
    assert oracle.disk_problems([DiskSnapshot(1, frozenset({4, 8}), 3),
                                 DiskSnapshot(2, frozenset({8, 12}), 3)], 2) == []
    assert oracle.disk_problems([DiskSnapshot(1, frozenset({4, 8}), 3),
                                 DiskSnapshot(2, frozenset({8}), 3)], 2) != []
    # a listing seen once (racing a rename) is not believed
    assert oracle.disk_problems([DiskSnapshot(1, frozenset({4}), 3),
                                 DiskSnapshot(2, frozenset(), 1),
                                 DiskSnapshot(3, frozenset({4, 8}), 3)], 1) == []


def test_a_disk_fault_expects_the_committed_step_before_it_to_stay():
    trial = _trial(Fault((0,), 7, "disk_full_finalize"), persist=4, keep=1)
    records = [*_steps(range(12)), {"event": "persist", "step": 4},
               {"event": "persist", "step": 8}, {"event": "persist_error", "step": 8},
               {"event": "persist", "step": 12}]
    disk = [DiskSnapshot(5, frozenset({4}), 30), DiskSnapshot(11, frozenset(), 10),
            DiskSnapshot(16, frozenset({12}), 4)]
    got, _ = _oracle(trial, records, disk)
    assert [e.to_json() for e in got] == [{"step": 4, "tier": "persistent"}]
    problems, happened = check_trial(trial, records, REF, 12, strikes=0, committed={12},
                                     disk=disk)
    assert happened["expected_from"] == {"step": 4, "tier": "persistent"}
    assert problems == ["persistent step 4 left the disk while 0 newer committed steps were "
                        "on it ([]; max_to_keep 1)"]


# ------------------------------------------------------------- properties


@st.composite
def _kill_and_run(draw):
    topo = draw(st.sampled_from([TWO, FOUR, FOUR_R3]))
    victims = draw(st.lists(st.integers(0, topo.hosts - 1), min_size=1, max_size=2,
                            unique=True))
    mode = draw(st.sampled_from(["process", "host"]))
    step = draw(st.integers(2, 8))
    safe = draw(st.integers(-1, step))
    disk = draw(st.sets(st.sampled_from([4, 8]).filter(lambda s: s <= step + 1)))
    fault = Fault(tuple(sorted(victims)), step, "after_step", mode)
    records = [*_steps(range(step + 1)), *([_safe(safe)] if safe >= 0 else [])]
    snaps = [DiskSnapshot(len(records), frozenset(disk))] if disk else []
    return _trial(fault, topo=topo, persist=4), records, snaps


@settings(max_examples=200, deadline=None)
@given(_kill_and_run(), st.integers(-3, 3))
def test_a_resumption_at_or_after_the_expectation_passes_and_one_before_it_fails(case, delta):
    """Whatever the plan: resuming at the expected version from the expected
    tier is right, and anything older is a loss."""
    trial, records, disk = case
    (want,), _ = _oracle(trial, [*records, _recovery(0, "local")], disk)
    step = max(0, want.step + delta)
    tier = want.tier
    if tier == "persistent" and delta > 0 or tier == "none" and step > 0:
        tier = "persistent" if want.lost else "peer" if want.wiped else "local"
    res = Resumption(len(records), step, tier)
    persisted = [{"event": "persist", "step": s} for snap in disk for s in snap.steps]
    problems = oracle.judge(want, res, [*persisted, *records])
    if step < want.step:
        assert any("older than version" in p for p in problems)
    elif tier != "persistent":
        assert problems == []
    # the expectation never exceeds what the run recorded as committed
    assert want.step <= max([0, *(max(s.steps) for s in disk),
                             *(r["replicated"] for r in records if "replicated" in r)])
