"""The fault plan of launch.train: parsed and checked without processes."""

import json

import pytest

from launch.errors import FlagError
from launch.train.fault_plan import Fault, FaultConfig, parse_fault_plan

BASE = dict(kill_host=-1, kill_at_step=-1, kill_every=0, kill_mode="process",
            kill_point="after_step", corrupt_store=False, stall_host=-1, stall_at_step=-1,
            stall_seconds=0.0, hosts=4, steps=12, strategy="inmem", replicas=3,
            persist_every=4)


def test_the_single_fault_flags_are_a_plan_of_one_fault_per_kill():
    config = FaultConfig(**{**BASE, "kill_host": 1, "kill_at_step": 3, "kill_every": 4,
                            "kill_mode": "host", "corrupt_store": True})
    assert config.plan(12) == tuple(Fault((1,), s, "after_step", "host", True)
                                    for s in (3, 7, 11))
    assert FaultConfig(**BASE).plan(12) == ()


def test_a_plan_reads_json_and_at_file(tmp_path):
    plan = [{"hosts": [1, 2], "step": 5, "point": "mid_step"},
            {"hosts": [0], "point": "recovery", "wipe_all": True}]
    expected = (Fault((1, 2), 5, "mid_step"), Fault((0,), -1, "recovery", wipe_all=True))
    assert parse_fault_plan(json.dumps(plan)) == expected
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    config = FaultConfig(**{**BASE, "fault_plan": f"@{path}"})
    assert config.plan(12) == expected
    assert [f.to_json() for f in expected] == [
        {"hosts": [1, 2], "step": 5, "point": "mid_step", "mode": "process", "corrupt": False,
         "wipe_all": False},
        {"hosts": [0], "step": -1, "point": "recovery", "mode": "process", "corrupt": False,
         "wipe_all": True}]


@pytest.mark.parametrize("plan, message", [
    ("[{", r"^--fault_plan: not a JSON list of faults"),
    ('{"hosts": [1]}', r"^--fault_plan: not a JSON list of faults"),
    ('[{"hosts": [1], "step": 2, "when": 3}]', r"^--fault_plan: fault 0 .*fields must be"),
    ('[{"step": 2}]', r"^--fault_plan: fault 0 "),
    ('[{"hosts": [4], "step": 2}]', r"^--fault_plan fault 0: hosts \[4\] must be distinct"),
    ('[{"hosts": [1, 1], "step": 2}]', r"^--fault_plan fault 0: hosts \[1, 1\] must be"),
    ('[{"hosts": [1], "step": 12}]', r"^--fault_plan fault 0: step 12 must be in \[0, --steps"),
    ('[{"hosts": [1], "step": 2, "point": "lunch"}]', r"^--fault_plan fault 0: point 'lunch'"),
    ('[{"hosts": [1], "step": 2, "mode": "rack"}]', r"^--fault_plan fault 0: mode 'rack'"),
    ('[{"hosts": [1], "step": 1}, {"hosts": [1], "step": 2, "point": "mid_persist"}]',
     r"^--fault_plan fault 1: mid_persist at step 2 needs --persist_every to write version 3"),
    ('[{"hosts": [1], "step": 3, "point": "persist_error"}, {"hosts": [1], "step": 5}]',
     r"^--fault_plan fault 0: persist_error kills no host and ends no attempt: it must be the "
     r"plan's last fault"),
    ('[{"hosts": [1], "step": 2, "point": "persist_hang"}]',
     r"^--fault_plan fault 0: persist_hang at step 2 needs --persist_every to write version 3"),
])
def test_a_bad_plan_names_the_fault_and_the_field(plan, message):
    with pytest.raises(FlagError, match=message):
        FaultConfig(**{**BASE, "fault_plan": plan})


def test_plan_and_single_fault_flags_exclude_each_other_and_points_need_their_tier():
    with pytest.raises(FlagError, match=r"^--fault_plan and --kill_host both"):
        FaultConfig(**{**BASE, "kill_host": 1, "kill_at_step": 2,
                       "fault_plan": '[{"hosts": [1], "step": 2}]'})
    with pytest.raises(FlagError, match=r"^--kill_point: mid_replication needs --replicas >= 2"):
        FaultConfig(**{**BASE, "kill_host": 1, "kill_at_step": 2,
                       "kill_point": "mid_replication", "replicas": 1})
    with pytest.raises(FlagError, match=r"^--kill_point: mid_replication pauses the in-memory"):
        FaultConfig(**{**BASE, "kill_host": 1, "kill_at_step": 2,
                       "kill_point": "mid_replication", "strategy": "blocking"})
    at = FaultConfig(**{**BASE, "fault_at": "mid_replication:5"})
    assert at.at() == ("mid_replication", 5) and at.pause_mid_replication_at == 6
    assert FaultConfig(**BASE).at() is None and FaultConfig(**BASE).pause_mid_replication_at == -1


def test_hosts_lost_together_die_when_the_first_reaches_its_point(tmp_path):
    """A fault of several hosts strikes them all at once when one of them
    reached its point (the soak found a victim that never reaches it: its
    busy replica writer dropped the version's replicas, and the job hung)."""
    from launch.train.faults import FaultInjector, pause_marker

    class Cluster:
        killed: list[int] = []

        def kill_host(self, host, sig):
            self.killed.append(host)

    injector = FaultInjector((Fault(hosts=(2, 3), step=5, point="mid_replication"),),
                             str(tmp_path))
    cluster = Cluster()
    injector.arm(cluster)
    injector.tick()
    assert cluster.killed == [] and not injector.fired
    pause_marker(tmp_path, 3).write_text("here")
    injector.tick()
    assert cluster.killed == [2, 3] and injector.fired
    injector.tick()  # once
    assert cluster.killed == [2, 3]


def test_a_persist_fault_is_the_plans_last_and_only_its_victim_gets_the_hook():
    from launch.train.faults import persistent_write_fault

    plan = '[{"hosts": [0], "step": 1}, {"hosts": [1], "step": 3, "point": "persist_error"}]'
    assert FaultConfig(**{**BASE, "fault_plan": plan}).plan(12)[1].point == "persist_error"
    armed = FaultConfig(**{**BASE, "fault_plan": plan, "fault_at": "persist_error:3"})
    assert persistent_write_fault(FaultConfig(**{**BASE, "fault_plan": plan}), 1) is None
    hook = persistent_write_fault(armed, 1)
    hook(4, "written")  # only once the version is read
    hook(8, "read")     # only version step + 1
    with pytest.raises(OSError, match=r"injected I/O error in host 1's persistent write of "
                                      r"version 4") as error:
        hook(4, "read")
    assert error.value.errno == 5


@pytest.mark.parametrize("plan, message", [
    ('[{"hosts": [1], "step": 2, "point": "pause"}]',
     r"^--fault_plan fault 0: a pause needs point 'pause' and pause_s > 0 \(got point 'pause', "
     r"pause_s 0\)"),
    ('[{"hosts": [1], "step": 2, "pause_s": 5}]',
     r"^--fault_plan fault 0: a pause needs point 'pause' and pause_s > 0 \(got point "
     r"'after_step', pause_s 5\)"),
    ('[{"hosts": [1], "step": 2, "point": "pause", "pause_s": 5, "mode": "host"}]',
     r"^--fault_plan fault 0: pause damages no store: mode 'process', no corrupt, no wipe_all"),
    ('[{"hosts": [1], "step": 2, "point": "pause", "pause_s": 5}, {"hosts": [1], "step": 4}]',
     r"^--fault_plan fault 0: pause kills no host and ends no attempt: it must be the plan's "
     r"last fault"),
])
def test_a_bad_pause_is_refused_naming_it(plan, message):
    with pytest.raises(FlagError, match=message):
        FaultConfig(**{**BASE, "fault_plan": plan})


def test_a_pause_is_a_plan_of_its_own():
    plan = '[{"hosts": [1], "step": 3}, {"hosts": [2], "step": 6, "point": "pause", "pause_s": 8}]'
    faults = FaultConfig(**{**BASE, "fault_plan": plan}).plan(12)
    assert faults[1] == Fault((2,), 6, "pause", pause_s=8.0)
    assert faults[1].to_json()["pause_s"] == 8
    assert "pause_s" not in faults[0].to_json()  # the kill's record is as before


@pytest.mark.parametrize("plan, strategy, message", [
    ('[{"hosts": [1], "step": 2, "point": "corrupt_frame"}]', "orbax_async",
     r"^--fault_plan fault 0: corrupt_frame flips a byte in transit from one host: one host, "
     r"and --ckpt in inmem, gemini, capricorn, pec, capricorn_pec \(got orbax_async, hosts "
     r"\[1\]\)"),
    ('[{"hosts": [0, 1], "step": 2, "point": "corrupt_frame"}]', "capricorn",
     r"^--fault_plan fault 0: corrupt_frame flips a byte in transit from one host: one host"),
    ('[{"hosts": [1], "step": 2, "point": "corrupt_frame", "mode": "host"}]', "capricorn",
     r"^--fault_plan fault 0: corrupt_frame damages no store"),
    ('[{"hosts": [1], "step": 2, "point": "corrupt_frame"}, {"hosts": [1], "step": 4}]',
     "capricorn", r"^--fault_plan fault 0: corrupt_frame kills no host and ends no attempt"),
])
def test_a_bad_corrupt_frame_is_refused_naming_it(plan, strategy, message):
    with pytest.raises(FlagError, match=message):
        FaultConfig(**{**BASE, "fault_plan": plan, "strategy": strategy})


def test_a_corrupt_frame_reaches_only_its_victims_channel():
    plan = '[{"hosts": [1], "step": 5, "point": "corrupt_frame"}]'
    config = FaultConfig(**{**BASE, "fault_plan": plan, "strategy": "capricorn"})
    assert config.plan(12) == (Fault((1,), 5, "corrupt_frame"),)
    def worker(fault_at):  # the flags the supervisor gives a worker
        return FaultConfig(**{**BASE, "fault_plan": plan, "strategy": "capricorn",
                              "fault_at": fault_at})

    assert worker("corrupt_frame:5").flip_frame_at == 5
    assert config.flip_frame_at is None and worker("after_step:5").flip_frame_at is None


@pytest.mark.parametrize("plan, strategy, chunk_path, message", [
    ('[{"hosts": [1], "step": 2, "point": "stall_channel", "pause_s": 20}]', "inmem", "auto",
     r"^--fault_plan fault 0: stall_channel hangs one host's chunk channel: one host, and "
     r"a --ckpt whose versions take the channel with --chunk_path=auto on cpu \(gemini, "
     r"capricorn, capricorn_pec\) \(got inmem, hosts \[1\]\)"),
    # On GPU auto is in-graph for every strategy: no channel to hang (the
    # rule once read "scheduled" as "on the channel" whatever the backend).
    ('[{"hosts": [1], "step": 2, "point": "stall_channel", "pause_s": 20}]', "capricorn",
     "auto", r"--chunk_path=auto on gpu \(none\) \(got capricorn"),
    ('[{"hosts": [1], "step": 2, "point": "stall_channel", "pause_s": 20}]', "pec",
     "auto", r"^--fault_plan fault 0: stall_channel hangs one host's chunk channel"),
    ('[{"hosts": [1], "step": 2, "point": "stall_channel"}]', "capricorn", "auto",
     r"^--fault_plan fault 0: stall_channel needs pause_s > 0 \(how long it lasts\)"),
    ('[{"hosts": [1], "step": 2, "point": "stall_channel", "pause_s": 9}, {"hosts": [1], '
     '"step": 4}]', "capricorn", "auto",
     r"^--fault_plan fault 0: stall_channel kills no host and ends no attempt"),
])
def test_a_bad_stall_channel_is_refused_naming_it(plan, strategy, chunk_path, message):
    with pytest.raises(FlagError, match=message):
        FaultConfig(**{**BASE, "fault_plan": plan, "strategy": strategy,
                       "chunk_path": chunk_path,
                       "platform": "gpu" if "on gpu" in message else "cpu"})


def test_a_stall_channel_reaches_only_its_victims_channel_with_its_length():
    plan = '[{"hosts": [1], "step": 5, "point": "stall_channel", "pause_s": 20}]'
    for strategy, chunk_path in (("capricorn", "auto"), ("inmem", "threaded"),
                                 ("pec", "threaded"), ("capricorn_pec", "auto")):
        config = FaultConfig(**{**BASE, "fault_plan": plan, "strategy": strategy,
                                "chunk_path": chunk_path})
        assert config.plan(12) == (Fault((1,), 5, "stall_channel", pause_s=20.0),)
        assert config.plan(12)[0].to_json()["pause_s"] == 20
        assert config.stall_channel_at is None
    worker = FaultConfig(**{**BASE, "fault_plan": plan, "strategy": "capricorn",
                            "fault_at": "stall_channel:5:20"})
    assert worker.stall_channel_at == (5, 20.0) and worker.at() == ("stall_channel", 5)
    assert worker.flip_frame_at is None


@pytest.mark.parametrize("plan, shaped, message", [
    ('[{"hosts": [1], "step": 2, "point": "partition", "pause_s": 5}]', False,
     r"^--fault_plan fault 0: partition acts on the hosts' shaped links: it needs "
     r"--link_gbps > 0"),
    ('[{"hosts": [1], "step": 2, "point": "slow_link"}]', True,
     r"^--fault_plan fault 0: slow_link needs pause_s > 0 \(how long it lasts\)"),
    ('[{"hosts": [1], "step": 2, "point": "partition", "pause_s": 5}, {"hosts": [1], '
     '"step": 4}]', True,
     r"^--fault_plan fault 0: partition kills no host and ends no attempt"),
])
def test_a_bad_network_fault_is_refused_naming_it(plan, shaped, message):
    with pytest.raises(FlagError, match=message):
        FaultConfig(**{**BASE, "fault_plan": plan, "shaped": shaped})


def test_a_network_fault_records_how_long_it_lasts():
    plan = '[{"hosts": [2], "step": 6, "point": "slow_link", "pause_s": 8}]'
    (fault,) = FaultConfig(**{**BASE, "fault_plan": plan, "shaped": True}).plan(12)
    assert fault == Fault((2,), 6, "slow_link", pause_s=8.0)
    assert fault.to_json()["pause_s"] == 8


@pytest.mark.parametrize("plan", [
    '[{"hosts": [0], "step": -1, "point": "mid_serve"}]',
    '[{"hosts": [1], "step": 3}, {"hosts": [0], "step": -1, "point": "mid_serve"}]',
])
def test_a_mid_serve_kill_needs_a_lost_store_before_it(plan):
    with pytest.raises(FlagError, match=r"^--fault_plan fault \d: mid_serve kills a host serving "
                                        r"a peer's payload in a recovery: it follows a fault "
                                        r"with mode 'host'"):
        FaultConfig(**{**BASE, "fault_plan": plan})


def test_a_mid_serve_kill_after_a_machine_loss_is_a_plan():
    plan = ('[{"hosts": [1], "step": 3, "mode": "host"}, '
            '{"hosts": [0], "step": -1, "point": "mid_serve"}]')
    faults = FaultConfig(**{**BASE, "fault_plan": plan}).plan(12)
    assert faults[1] == Fault((0,), -1, "mid_serve")


@pytest.mark.parametrize("plan, message", [
    ('[{"hosts": [1], "step": 3, "point": "disk_full_finalize"}]',
     r"^--fault_plan fault 0: disk_full_finalize strikes the primary's Orbax finalize: hosts "
     r"\[0\]"),
    ('[{"hosts": [0], "step": 2, "point": "disk_full_finalize"}]',
     r"^--fault_plan fault 0: disk_full_finalize at step 2 needs --persist_every to write "
     r"version 3"),
])
def test_a_bad_full_disk_is_refused_naming_it(plan, message):
    with pytest.raises(FlagError, match=message):
        FaultConfig(**{**BASE, "fault_plan": plan})


def test_a_full_disk_reaches_only_the_primarys_finalize_of_the_next_version():
    plan = '[{"hosts": [0], "step": 3, "point": "disk_full_finalize"}]'
    assert FaultConfig(**{**BASE, "fault_plan": plan, "fault_at": "disk_full_finalize:3"}
                       ).full_disk_at == 4
    assert FaultConfig(**{**BASE, "fault_plan": plan}).full_disk_at is None
