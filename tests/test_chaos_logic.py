"""launch.chaos's decisions, without processes: the draws and the checks."""

import pytest

from capricorn_jax.experimental import send_rounds
from launch.chaos.checks import check_trial
from launch.chaos.config import parse_topology
from launch.chaos.draw import Trial, draw_trial, fault_classes
from launch.train.fault_plan import PERSIST_FAULTS, Fault, FaultConfig

TOPOLOGIES = [parse_topology(t) for t in ("2x2", "4x1", "4x1r3")]
STRATEGIES = ["inmem", "gemini", "capricorn", "pec"]


def test_topologies_parse_and_bad_ones_are_named():
    assert parse_topology("4x1r3") == TOPOLOGIES[2]
    assert (TOPOLOGIES[0].hosts, TOPOLOGIES[0].devices_per_host, TOPOLOGIES[0].replicas) == (
        2, 2, 2)
    for bad in ("4", "axb", "1x4", "2x2r3"):
        with pytest.raises(ValueError, match=f"--topologies: '{bad}'"):
            parse_topology(bad)


def test_draws_are_replayable_and_valid():
    """Same (seed, index) -> same trial; every drawn plan is one launch.train
    accepts: steps in order, mid_persist only on a persistent write, a kill
    during recovery only as the last fault, scheduled strategies on 2 replicas."""
    for index in range(300):
        trial = draw_trial(index, 7, TOPOLOGIES, STRATEGIES, 12)
        assert trial == draw_trial(index, 7, TOPOLOGIES, STRATEGIES, 12)
        topo = trial.topology
        assert trial.strategy in ("inmem", "pec") or topo.replicas == 2
        assert 1 <= len(trial.faults) <= 3
        last = ("recovery", "mid_serve", "pause", "corrupt_frame", "disk_full_finalize",
                "stall_channel", *PERSIST_FAULTS)
        kills = [f for f in trial.faults if f.point not in last]
        assert trial.faults[:len(kills)] == tuple(kills)
        rest = trial.faults[len(kills):]  # a kill during recovery, a pause, a persist fault
        if len(rest) == 2:  # double_kill: two recoveries struck in a row
            assert [f.point for f in rest] == ["recovery", "recovery"] and len(kills) == 1
            rest = rest[1:]
        assert len(rest) <= 1 and (kills or rest[0].point in (*PERSIST_FAULTS, "pause",
                                                              "corrupt_frame",
                                                              "stall_channel",
                                                              "disk_full_finalize"))
        on_channel = trial.strategy == "capricorn" or "--chunk_path=threaded" in trial.variant
        if rest and rest[0].point == "stall_channel":  # on the channel, room to reconnect
            assert on_channel and len(rest[0].hosts) == 1
            assert rest[0].pause_s in (3.0, 20.0) and 2 <= rest[0].step <= 12 - 6
            assert "--replication_timeout_s=2" in trial.flags(12, "tiny")
        if rest and rest[0].point == "disk_full_finalize":
            assert rest[0].hosts == (0,) and (rest[0].step + 1) % trial.persist_every == 0
            # keeping one step: a later write (up to the final version) deletes
            assert trial.max_to_keep == 1 and rest[0].step + 1 + trial.persist_every <= 12
        if trial.persist_every:  # Orbax keeps 3 steps, or 1 (deletes within the trial)
            assert trial.max_to_keep in (1, 3)
            assert f"--max_to_keep={trial.max_to_keep}" in trial.flags(12, "tiny")
        if rest and rest[0].point == "corrupt_frame":
            # on the channel; its victim sends to host 0 (whose metrics the oracle reads)
            assert on_channel and len(rest[0].hosts) == 1
            assert send_rounds(topo.hosts, topo.replicas)[0][rest[0].hosts[0]] == 0
        if rest and rest[0].point == "mid_serve":  # the holder of the lost store's replica
            (lost,) = kills
            assert lost.mode == "host" and topo.replicas == 2 and len(lost.hosts) == 1
            assert rest[0].hosts == (send_rounds(topo.hosts, 2)[0][lost.hosts[0]],)
        if rest and rest[0].point == "pause":
            assert len(rest[0].hosts) == 1 and rest[0].pause_s in (3.0, 20.0)
            assert "--peer_timeout_s=8" in trial.flags(12, "tiny")
        if rest and rest[0].point in PERSIST_FAULTS:
            assert len(rest[0].hosts) == 1 and trial.persist_every
            assert (rest[0].step + 1) % trial.persist_every == 0
            assert rest[0].step + 1 + trial.persist_every < 12  # a later write follows
        assert [f.step for f in kills] == sorted({f.step for f in kills})
        if "--chunk_path=threaded" in trial.variant:  # inmem / pec over the chunk channel
            assert trial.strategy in ("inmem", "pec") and topo.replicas == 2
            assert not (trial.strategy == "pec" and trial.persist_every)
        if "--ckpt_budget=0" in trial.variant:  # every fault strikes with versions skipped
            assert trial.stall is None and not {f.point for f in trial.faults} & {
                "mid_replication", "mid_persist", "disk_full_finalize", *PERSIST_FAULTS}
        assert set(trial.flags(12, "tiny")) >= set(trial.variant)
        for f in trial.faults:
            assert len(f.hosts) <= 2 and not (f.corrupt and f.mode == "host")
            assert not f.wipe_all or trial.persist_every
        FaultConfig(kill_host=-1, kill_at_step=-1, kill_every=0, kill_mode="process",
                    kill_point="after_step", corrupt_store=False, stall_host=-1,
                    stall_at_step=-1, stall_seconds=0.0,
                    fault_plan=_plan_flag(trial),
                    hosts=topo.hosts, steps=12, strategy=trial.strategy,
                    replicas=topo.replicas, persist_every=trial.persist_every,
                    chunk_path="threaded" if "--chunk_path=threaded" in trial.variant else "auto")
    seen = {f.point for i in range(300) for f in draw_trial(i, 7, TOPOLOGIES, STRATEGIES,
                                                            12).faults}
    assert any(len(draw_trial(i, 7, TOPOLOGIES, STRATEGIES, 12).faults) == 3
               for i in range(300))  # a double kill in recovery is drawn
    drawn = [draw_trial(i, 7, TOPOLOGIES, STRATEGIES, 12) for i in range(300)]
    assert {t.max_to_keep for t in drawn if t.persist_every} == {1, 3}
    # a full disk at the finalize of version 8, whose write deletes version 4
    assert any(f.point == "disk_full_finalize" and f.step == 7 for t in drawn for f in t.faults)
    assert seen == {"after_step", "mid_step", "mid_replication", "mid_persist", "recovery",
                    "mid_serve", "persist_error", "persist_hang", "disk_full_finalize", "pause",
                    "corrupt_frame", "stall_channel"}


def _plan_flag(trial):
    return next(f for f in trial.flags(12, "tiny") if f.startswith("--fault_plan=")).split(
        "=", 1)[1]


def _trial(*faults, strategy="inmem", persist=0):
    return Trial(0, 0, TOPOLOGIES[0], strategy, persist, tuple(faults), None)


REF = {s: 5.0 - 0.1 * s for s in range(8)}


def _steps(*ranges):
    return [{"step": s, "loss": REF[s]} for r in ranges for s in r]


def test_a_clean_recovery_passes_and_reports_what_happened():
    trial = _trial(Fault((1,), 4, "after_step"))
    records = [*_steps(range(5)), {"event": "checkpoint", "replicated": 4},
               {"event": "recovery", "step": 5, "tier": "local", "seconds": 0.25},
               *_steps(range(5, 8))]
    problems, happened = check_trial(trial, records, REF, 8, strikes=1)
    assert problems == []
    assert happened == {"resumed_from": [5], "unlogged_steps": [], "tier": ["local"],
                        "recovery_s": [0.25], "plt": [],
                        "expected_from": {"step": 4, "tier": "local"},
                        "expected": [{"step": 4, "tier": "local"}]}


def test_a_step_checkpointed_but_not_logged_before_the_kill_is_named_not_failed():
    """Host 0 killed between a step's save and its line (hosts lost together
    die wherever they are): the recovery resumes after that step, whose line
    is missing; it is reported, and only such a step may be missing."""
    trial = _trial(Fault((0, 3), 4, "mid_replication"))
    records = [*_steps(range(4)), {"event": "checkpoint", "replicated": 4},
               {"event": "recovery", "step": 5, "tier": "local", "seconds": 0.25},
               *_steps(range(5, 8))]
    problems, happened = check_trial(trial, records, REF, 8, strikes=1)
    assert problems == [] and happened["unlogged_steps"] == [4]
    del records[-2]  # step 6 never logged: a gap no recovery explains
    assert check_trial(trial, records, REF, 8, strikes=1)[0] == [
        "steps logged [0, 1, 2, 3, 5, 7], expected 0..7"]


def test_each_violation_is_named():
    trial = _trial(Fault((1,), 4, "after_step"), Fault((0,), 5, "after_step", wipe_all=True))
    records = [*_steps(range(5)), {"event": "checkpoint", "replicated": 4},
               {"event": "recovery", "step": 3, "tier": "peer", "seconds": 1.0},
               {"step": 3, "loss": 9.0}, *_steps(range(4, 6)),
               {"event": "recovery", "step": 7, "tier": "local", "seconds": 1.0}]
    problems, _ = check_trial(trial, records, REF, 8, strikes=1)
    assert problems == [
        "1 of 2 faults struck",
        "steps logged [0, 1, 2, 3, 4, 5], expected 0..7",
        "step 3: loss 9.0 != reference 4.7",
        "recovery to 3 via peer: older than version 4, which had to survive (tier local: "
        "version 4 was on every holder and a holder of each owner survived)",
        "recovery to 7 via local: no RAM copy of the versions of hosts [0, 1] survived (a "
        "memory recovery cannot have them)",
        "recovery to 7, after the fault at step 5 (after_step)",
    ]


def test_pec_losses_after_the_restore_point_may_differ_but_the_plt_is_reported():
    trial = _trial(Fault((1,), 4, "after_step"), strategy="pec")
    records = [*_steps(range(5)),
               {"event": "recovery", "step": 3, "tier": "local", "seconds": 0.5, "plt": 0.01},
               {"step": 3, "loss": 4.75}, *_steps(range(4, 8))]
    assert check_trial(trial, records, REF, 8, strikes=1)[0] == []
    records[5] = {"event": "recovery", "step": 3, "tier": "local", "seconds": 0.5}
    assert check_trial(trial, records, REF, 8, strikes=1)[0] == [
        "recovery to 3: no PLT reported"]


def test_the_safe_version_starts_over_with_the_job_and_after_a_recovery():
    """A job that lost every copy starts over from step 0 (no recovery event):
    the safe version of the first attempt no longer binds; after a recovery
    to step r, nothing newer than r is safe."""
    trial = _trial(Fault((0, 1), 4, "after_step", "host"), Fault((1,), 2, "after_step"),
                   Fault((1,), 5, "after_step"))
    records = [*_steps(range(5)), {"event": "checkpoint", "replicated": 4},
               *_steps(range(3)),
               {"event": "recovery", "step": 2, "tier": "local", "seconds": 0.1},
               *_steps(range(2, 6)), {"event": "checkpoint", "replicated": 2},
               {"event": "recovery", "step": 2, "tier": "local", "seconds": 0.1},
               *_steps(range(2, 8))]
    assert check_trial(trial, records, REF, 8, strikes=3)[0] == []


def test_a_mid_replication_fault_behind_a_stalled_writer_may_strike_late():
    """The victim's replica writer stalled at the fault's step writes that
    version halfway only when the stall ends, training having gone on: the
    recovery may then resume later than the fault's step (seed 3, trial 1);
    without the stall the same recovery is a violation."""
    fault = Fault((0,), 4, "mid_replication")
    records = [*_steps(range(8)), {"event": "checkpoint", "replicated": 4},
               {"event": "recovery", "step": 8, "tier": "local", "seconds": 0.25}]
    stalled = Trial(0, 0, TOPOLOGIES[0], "inmem", 0, (fault,), (0, 4))
    assert check_trial(stalled, records, REF, 8, strikes=1)[0] == []
    # The fault at step 4 pauses in version 5: a stall at version 5 comes
    # first too (seed 32, trial 15); one at version 6 comes after the pause.
    at_its_version = Trial(0, 0, TOPOLOGIES[0], "inmem", 0, (fault,), (0, 5))
    assert check_trial(at_its_version, records, REF, 8, strikes=1)[0] == []
    after = Trial(0, 0, TOPOLOGIES[0], "inmem", 0, (fault,), (0, 6))
    assert check_trial(after, records, REF, 8, strikes=1)[0] == [
        "recovery to 8, after the fault at step 4 (mid_replication)"]
    other_host = Trial(0, 0, TOPOLOGIES[0], "inmem", 0, (fault,), (1, 4))
    assert check_trial(other_host, records, REF, 8, strikes=1)[0] == [
        "recovery to 8, after the fault at step 4 (mid_replication)"]
    assert check_trial(_trial(fault), records, REF, 8, strikes=1)[0] == [
        "recovery to 8, after the fault at step 4 (mid_replication)"]


def test_no_stall_delays_a_mid_replication_fault_past_the_faults_after_it():
    """Seed 66 trial 4 drew host 1's replica writer stalled at version 2 and a
    mid_replication fault of host 1 at step 2 followed by a second fault at
    step 6: the stall held the first fault until the job had passed step 6,
    and the second never struck. Such a stall is no longer drawn; the faults
    are drawn as before, and a stall behind a last fault stays (it may
    strike late: the test above)."""
    trial = draw_trial(3, 66, TOPOLOGIES, STRATEGIES, 12)
    assert [(f.hosts, f.step, f.point) for f in trial.faults] == [
        ((1,), 2, "mid_replication"), ((1, 2), 6, "after_step")]
    assert trial.stall is None
    for i in range(400):
        t = draw_trial(i, 66, TOPOLOGIES,
                       STRATEGIES, 12)
        if t.stall is None:
            continue
        assert not any(f.point == "mid_replication" and t.stall[0] in f.hosts
                       and t.stall[1] <= f.step + 1 for f in t.faults[:-1]), t.describe()


def test_a_persist_fault_strikes_no_host_and_needs_its_step_dropped_and_a_later_write():
    trial = _trial(Fault((1,), 3, "persist_error"), persist=4)
    good = [*_steps(range(8)), {"event": "persist", "step": 4},
            {"event": "persist_error", "step": 4, "error": "RuntimeError: ..."},
            {"event": "persist", "step": 8}]
    assert check_trial(trial, good, REF, 8, strikes=0)[0] == []
    assert check_trial(trial, good, REF, 8, strikes=1)[0] == ["1 of 0 faults struck"]
    not_dropped = [r for r in good if r.get("event") != "persist_error"]
    assert check_trial(trial, not_dropped, REF, 8, strikes=0)[0] == [
        "persist_error: no persist_error for version 4"]
    stopped = good[:-1]
    assert check_trial(trial, stopped, REF, 8, strikes=0)[0] == [
        "persist_error: no persistent step started after version 4"]
    # With the disk read: the later step must be complete, the failed one absent.
    assert check_trial(trial, good, REF, 8, strikes=0, committed={8})[0] == []
    assert check_trial(trial, good, REF, 8, strikes=0, committed=set())[0] == [
        "persist_error: no persistent step after version 4 complete on disk (committed: [])"]
    assert check_trial(trial, good, REF, 8, strikes=0, committed={4, 8})[0] == [
        "persist_error: the failed step 4 is committed on disk"]


def test_committed_steps_are_orbax_s_finalized_step_directories(tmp_path):
    from launch.chaos.checks import committed_steps

    assert committed_steps(tmp_path / "none") == set()
    for name in ("4", "8", "12.orbax-checkpoint-tmp-3", "notes"):
        (tmp_path / name).mkdir()
    (tmp_path / "16").write_text("")  # a file, not a step
    assert committed_steps(tmp_path) == {4, 8}


def test_a_pause_the_job_outlasts_ends_nothing_and_a_longer_one_is_a_kill():
    short = _trial(Fault((1,), 3, "pause", pause_s=3.0))
    straight = _steps(range(8))
    assert check_trial(short, straight, REF, 8, strikes=1)[0] == []
    assert check_trial(short, straight, REF, 8, strikes=0)[0] == ["0 of 1 faults struck"]
    restarted = [*_steps(range(4)), {"event": "checkpoint", "replicated": 3},
                 {"event": "recovery", "step": 4, "tier": "local", "seconds": 0.1},
                 *_steps(range(4, 8))]
    assert check_trial(short, restarted, REF, 8, strikes=1)[0] == [
        "1 recoveries where the faults end 0 attempts (a pause or partition shorter than the "
        "peer timeout, a slow link or a corrupted frame must end none)"]
    long = _trial(Fault((1,), 3, "pause", pause_s=20.0))
    assert check_trial(long, restarted, REF, 8, strikes=1)[0] == []
    late = [*_steps(range(8)), {"event": "checkpoint", "replicated": 7},
            {"event": "recovery", "step": 7, "tier": "local", "seconds": 0.1}]
    assert check_trial(long, late, REF, 8, strikes=1)[0] == [
        "recovery to 7, after the fault at step 3 (pause)"]


def test_a_stall_channel_strikes_no_host_loses_versions_only_past_the_bound_and_comes_back():
    def lost(step):
        return {"event": "checkpoint", "step": step, "skipped": True, "channel_lost": True}

    def moved(step):
        return {"event": "checkpoint", "step": step, "moved_in_step": step}

    long = _trial(Fault((1,), 3, "stall_channel", pause_s=20.0), strategy="capricorn")
    good = [*_steps(range(8)), moved(3), lost(4), lost(5), lost(6), moved(7)]
    assert check_trial(long, good, REF, 8, strikes=0)[0] == []
    assert check_trial(long, _steps(range(8)), REF, 8, strikes=0)[0] == [
        "stall_channel of 20s at step 3: versions lost [], expected some at or after it"]
    never_back = [*_steps(range(8)), moved(3), lost(4), lost(5), lost(6)]
    assert check_trial(long, never_back, REF, 8, strikes=0)[0] == [
        "stall_channel at step 3: no version moved after the lost ones [4, 5, 6] (the "
        "channel did not come back)"]
    over_channel = _trial(Fault((1,), 3, "stall_channel", pause_s=20.0), strategy="pec")
    committed = {"event": "checkpoint", "step": 8, "newly_committed": [7]}
    assert check_trial(over_channel, [*never_back, committed], REF, 8, strikes=0)[0] == []
    short = _trial(Fault((1,), 3, "stall_channel", pause_s=3.0), strategy="capricorn")
    assert check_trial(short, [*_steps(range(8)), moved(7)], REF, 8, strikes=0)[0] == []
    assert check_trial(short, good, REF, 8, strikes=0)[0] == [
        "stall_channel of 3s at step 3 (within the channel's bound): versions lost [4, 5, 6], "
        "expected none"]
    restarted = [*_steps(range(4)), {"event": "checkpoint", "replicated": 3},
                 {"event": "recovery", "step": 4, "tier": "local", "seconds": 0.1},
                 *_steps(range(4, 8)), moved(7)]
    assert any("recoveries" in p
               for p in check_trial(short, restarted, REF, 8, strikes=0)[0])


def test_a_corrupt_frame_strikes_no_host_and_needs_exactly_one_version_dropped_after_it():
    trial = _trial(Fault((1,), 3, "corrupt_frame"), strategy="capricorn")
    dropped = {"event": "checkpoint", "step": 4, "corrupt": True}
    good = [*_steps(range(8)), dropped]
    assert check_trial(trial, good, REF, 8, strikes=0)[0] == []
    assert check_trial(trial, _steps(range(8)), REF, 8, strikes=0)[0] == [
        "corrupt_frame at step 3: versions dropped as corrupt [], expected one at or after it"]
    early = [*_steps(range(8)), {**dropped, "step": 2}]
    assert check_trial(trial, early, REF, 8, strikes=0)[0] == [
        "corrupt_frame at step 3: versions dropped as corrupt [2], expected one at or after it"]
    restarted = [*_steps(range(4)), dropped, {"event": "checkpoint", "replicated": 3},
                 {"event": "recovery", "step": 4, "tier": "local", "seconds": 0.1},
                 *_steps(range(4, 8))]
    assert check_trial(trial, restarted, REF, 8, strikes=0)[0] == [
        "1 recoveries where the faults end 0 attempts (a pause or partition shorter than the "
        "peer timeout, a slow link or a corrupted frame must end none)"]


def test_on_shaped_links_the_network_faults_are_drawn_and_valid():
    drawn = [draw_trial(i, 9, TOPOLOGIES, STRATEGIES, 12, shaped=True) for i in range(300)]
    network = [f for t in drawn for f in t.faults if f.point in ("partition", "slow_link")]
    assert {f.point for f in network} == {"partition", "slow_link"}
    assert {f.pause_s for f in network} == {3.0, 20.0} and all(len(f.hosts) == 1 for f in network)
    for trial in drawn:
        if any(f.point in ("partition", "slow_link") for f in trial.faults):
            assert trial.faults[-1].point in ("partition", "slow_link")
            assert "--peer_timeout_s=8" in trial.flags(12, "tiny")
            FaultConfig(kill_host=-1, kill_at_step=-1, kill_every=0, kill_mode="process",
                        kill_point="after_step", corrupt_store=False, stall_host=-1,
                        stall_at_step=-1, stall_seconds=0.0, fault_plan=_plan_flag(trial),
                        hosts=trial.topology.hosts, steps=12, strategy=trial.strategy,
                        replicas=trial.topology.replicas, persist_every=trial.persist_every,
                        shaped=True)


def test_a_short_partition_or_any_slow_link_ends_nothing_and_a_long_partition_is_a_kill():
    straight = _steps(range(8))
    restarted = [*_steps(range(4)), {"event": "checkpoint", "replicated": 3},
                 {"event": "recovery", "step": 4, "tier": "local", "seconds": 0.1},
                 *_steps(range(4, 8))]
    for quiet in (Fault((1,), 3, "partition", pause_s=3.0),
                  Fault((1,), 3, "slow_link", pause_s=3.0),
                  Fault((1,), 3, "slow_link", pause_s=20.0)):
        assert check_trial(_trial(quiet), straight, REF, 8, strikes=1)[0] == []
        assert check_trial(_trial(quiet), restarted, REF, 8, strikes=1)[0] != []
    long = _trial(Fault((1,), 3, "partition", pause_s=20.0))
    assert check_trial(long, restarted, REF, 8, strikes=1)[0] == []


def test_faults_limits_the_drawn_classes_and_each_fault_carries_its_class():
    """--faults: every trial's last fault is of a class asked for, the draw is
    replayable, and the classes name what a plan does (mid_serve is
    kill_mid_serve, a recovery struck after another is double_kill)."""
    classes = ("stall_channel", "kill_mid_serve", "double_kill", "pause")
    seen = set()
    for index in range(60):
        trial = draw_trial(index, 40, TOPOLOGIES, STRATEGIES, 12, classes=classes)
        assert trial == draw_trial(index, 40, TOPOLOGIES, STRATEGIES, 12, classes=classes)
        seen.add(fault_classes(trial.faults)[-1])
    assert seen == set(classes)
    kill = Fault((1,), 3, "after_step", "host")
    assert fault_classes([kill, Fault((0,), -1, "mid_serve")]) == ["after_step",
                                                                   "kill_mid_serve"]
    assert fault_classes([kill, Fault((0,), -1, "recovery"), Fault((1,), -1, "recovery")]) == [
        "after_step", "recovery", "double_kill"]
    with pytest.raises(ValueError, match=r"no trial with a last fault of class partition"):
        draw_trial(0, 40, TOPOLOGIES, STRATEGIES, 12, classes=("partition",))


def test_the_channel_faults_are_drawn_for_every_strategy_on_the_channel():
    """stall_channel and corrupt_frame strike capricorn, and inmem and pec over
    the chunk channel (the threaded variant, drawn with them)."""
    drawn = [draw_trial(i, 11, TOPOLOGIES, STRATEGIES, 12, classes=["stall_channel",
                                                                   "corrupt_frame"])
             for i in range(120)]
    assert {t.strategy for t in drawn} == {"capricorn", "inmem", "pec"}
    for t in drawn:
        assert t.strategy == "capricorn" or "--chunk_path=threaded" in t.variant


def test_a_failed_trial_keeps_its_jobs_console_and_a_passed_one_keeps_nothing(tmp_path,
                                                                              monkeypatch):
    """The job (one part: launch.train stubbed by its console and exit code):
    a failed trial's WORKDIR keeps what the hosts printed (``console.log``);
    a passed one is removed."""
    import subprocess

    from launch.chaos import command, jobs

    def fake_job(returncode):
        def run(flags_, work, store, timeout_s, fast_compile, extra=()):
            work.mkdir(parents=True, exist_ok=True)
            (work / "metrics.jsonl").write_text("")
            return subprocess.CompletedProcess([], returncode, "[host 0] said this\n", ""), []
        return run

    monkeypatch.setattr(jobs, "reference", lambda *a, **k: {})
    trial = _trial(Fault((0,), 3, "after_step"))
    monkeypatch.setattr(jobs, "run_watched", fake_job(1))
    result = command.run_trial(trial, 8, "tiny", tmp_path, {}, 60.0)
    assert not result["ok"] and "job exited with 1" in result["problems"][0]
    kept = tmp_path / f"trial{trial.index}" / command.CONSOLE_LOG
    assert kept.read_text() == "[host 0] said this\n"
    monkeypatch.setattr(command, "check_trial", lambda *a, **k: ([], {}))
    monkeypatch.setattr(jobs, "run_watched", fake_job(0))
    assert command.run_trial(trial, 8, "tiny", tmp_path, {}, 60.0)["ok"]
    assert not (tmp_path / f"trial{trial.index}").exists()
