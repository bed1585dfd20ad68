"""A PEC trial's reference that takes the same roll-backs, without processes:
the roll-back plan built from a faulted job's records, the comparison (the
differing leaf named), the launcher's roll-back on real stores, and the
state digest."""

import json
import zlib

import pytest

from capricorn_jax.experimental import HostStore, committed_steps
from launch.chaos import pec_reference
from launch.train import digest, rollback
from launch.train.fault_plan import Fault, FaultConfig

DIGEST = {"['params']['w']": "0000000a", "['params']['experts']": "0000000b",
          "['step']": "0000000c"}


def _steps(steps, loss=lambda s: 5.0 - 0.1 * s):
    return [{"step": s, "loss": loss(s)} for s in steps]


def _recovery(step, tier="local", tiers=("local", "local"), sources=((3, 5),)):
    return {"event": "recovery", "step": step, "tier": tier, "tiers": list(tiers),
            "seconds": 0.5, "plt": 0.01, "versions": sorted({step, *sources[0]}),
            "expert_source_steps": [list(s) for s in sources]}


def _digest(leaves=None):
    return {"event": "state_digest", "step": 12, "algorithm": "crc32",
            "leaves": dict(leaves or DIGEST)}


def _faulted():
    """Killed after step 6 (host 0 lost as a machine: read from a peer), resumed
    from 6; killed again after step 9, resumed from 8."""
    return [*_steps(range(7)), {"event": "checkpoint", "step": 7, "committed": True},
            _recovery(6, "peer", ("peer", "local")), *_steps(range(6, 10)),
            _recovery(8, sources=((7, 8),)), *_steps(range(8, 12)), _digest()]


def test_the_reference_rolls_back_to_each_version_the_faulted_job_resumed_from():
    plan = pec_reference.rollbacks(_faulted(), hosts=2, replicas=2, steps=12)
    # Stopped once it trained the step that made the version (after step 5:
    # version 6; after step 7: version 8), losing the store the first
    # recovery read from a peer (another recovery follows it); the last one
    # reads every host's own store.
    assert plan == (Fault((0, 1), 5, "rollback", version=6, lose=(0,)),
                    Fault((0, 1), 7, "rollback", version=8))
    assert plan[0].to_json() == {"hosts": [0, 1], "step": 5, "point": "rollback",
                                 "mode": "process", "corrupt": False, "wipe_all": False,
                                 "version": 6, "lose": [0]}
    # A persistent recovery loses every RAM store; a restart from step 0 is a
    # roll-back to version 0; a second one to the same version comes after
    # the step the reference resumed at.
    records = [*_steps(range(5)), _recovery(4, "persistent", ("persistent",) * 2),
               *_steps(range(4, 6)), *_steps(range(3)), _recovery(2), *_steps(range(2, 8))]
    assert pec_reference.rollbacks(records, hosts=2, replicas=2, steps=12) == (
        Fault((0, 1), 3, "rollback", version=4, wipe_all=True),
        Fault((0, 1), 4, "rollback", version=0),
        Fault((0, 1), 1, "rollback", version=2))
    # As many lost stores as replicas: none lost (nothing could serve them).
    records = [*_steps(range(3)), _recovery(3, "peer", ("peer", "peer")), *_steps(range(3, 5)),
               _recovery(4)]
    assert pec_reference.rollbacks(records, 2, 2, 12)[0].lose == ()
    assert pec_reference.rollbacks(records[:5], 2, 2, 12)[0].lose == ()  # the last: local
    assert pec_reference.rollbacks(records, 4, 3, 12)[0].lose == (0, 1)
    # A strategy that moves a version inside the next step: stopped after that
    # step, within the job's steps.
    assert [f.step for f in pec_reference.rollbacks(_faulted(), 2, 2, 12, in_step=True)] == [
        6, 8]
    assert [f.step for f in pec_reference.rollbacks(
        [*_steps(range(8)), _recovery(8)], 2, 2, 8, in_step=True)] == [7]
    flags = pec_reference.reference_flags(
        ["--hosts=2", '--fault_plan=[{"hosts": [1], "step": 6}]', "--pec_k=2"], plan[:1])
    assert flags[:2] == ["--hosts=2", "--pec_k=2"]
    assert json.loads(flags[2].split("=", 1)[1]) == [plan[0].to_json()]


def test_the_plan_is_one_launch_train_accepts_and_bad_roll_backs_are_named():
    base = dict(kill_host=-1, kill_at_step=-1, kill_every=0, kill_mode="process",
                kill_point="after_step", corrupt_store=False, stall_host=-1, stall_at_step=-1,
                stall_seconds=0.0, hosts=2, steps=12, strategy="pec", replicas=2,
                persist_every=4)
    plan = pec_reference.reference_flags([], pec_reference.rollbacks(_faulted(), 2, 2, 12))
    config = FaultConfig(**base, fault_plan=plan[0].split("=", 1)[1])
    assert [f.version for f in config.plan(12)] == [6, 8]
    assert FaultConfig(**base, fault_plan=plan[0].split("=", 1)[1],
                       fault_at="rollback:5").at() == ("rollback", 5)
    for entry, message in [
            ({"hosts": [0], "step": 5, "version": 6}, r" stops every host"),
            ({"hosts": [0, 1], "step": 5, "version": 7}, r"version must be in \[0, 6\]"),
            ({"hosts": [0, 1], "step": 5, "version": 6, "lose": [0, 1]},
             r"losing the stores of hosts \[0, 1\]"),
            ({"hosts": [0, 1], "step": 5, "version": 6, "corrupt": True},
             r"restores through the memory tier")]:
        with pytest.raises(ValueError, match=r"^--fault_plan fault 0: rollback.*" + message):
            FaultConfig(**base, fault_plan=json.dumps([{**entry, "point": "rollback"}]))
    with pytest.raises(ValueError, match=r"rollback with wipe_all restores from the persistent"):
        FaultConfig(**{**base, "persist_every": 0}, fault_plan=json.dumps(
            [{"hosts": [0, 1], "step": 7, "version": 8, "wipe_all": True,
              "point": "rollback"}]))


def _reference():
    """The fault-free run that took the faulted job's roll-backs: it stopped
    earlier (after steps 5 and 7), restored the same versions."""
    return [*_steps(range(6)), _recovery(6, "peer", ("peer", "local")), *_steps(range(6, 8)),
            _recovery(8, sources=((7, 8),)), *_steps(range(8, 12)), _digest()]


def test_a_reference_that_restored_the_same_and_ends_in_the_same_state_matches():
    problems, info = pec_reference.compare(_faulted(), _reference())
    assert problems == [] and info == {"resumed_from": [6, 8], "match": True}


def test_a_final_state_that_differs_names_the_leaf():
    reference = _reference()
    reference[-1] = _digest({**DIGEST, "['params']['experts']": "0000ffff"})
    problems, info = pec_reference.compare(_faulted(), reference)
    assert problems == [
        "PEC reference: final state differs from the PEC reference's in 1 of 3 leaves: "
        "['params']['experts'] (0000000b != 0000ffff)"]
    assert info["match"] is False
    assert pec_reference.compare(_faulted(), reference[:-1])[0] == [
        "PEC reference: no state_digest event in the PEC reference's metrics"]


def test_losses_after_each_roll_back_compare_bit_for_bit():
    reference = _reference()
    reference[8] = {"step": 7, "loss": 4.3 + 1e-12}  # after the first roll-back
    problems, _ = pec_reference.compare(_faulted(), reference)
    assert problems == ["PEC reference: step 7 (after resumption 1): loss 4.3 != PEC "
                        "reference 4.300000000001"]


def test_a_reference_that_restored_otherwise_is_a_problem_unless_timing_explains_it():
    reference = _reference()
    reference[6] = _recovery(5, "peer", ("peer", "local"))  # an older version
    problems, info = pec_reference.compare(_faulted(), reference)
    assert problems == [
        "PEC reference: resumption 1: the faulted job restored {'step': 6, 'versions': "
        "[3, 5, 6], 'expert_source_steps': [[3, 5]]}, the PEC reference {'step': 5, "
        "'versions': [3, 5], 'expert_source_steps': [[3, 5]]}"]
    assert info["match"] is False
    # The same version composed from other copies: a wrong expert source.
    reference = _reference()
    reference[6] = _recovery(6, "peer", ("peer", "local"), sources=((3, 4),))
    assert pec_reference.compare(_faulted(), reference)[1]["match"] is False
    # A version skipped by the cost budget before it: the runs took different
    # versions, nothing is compared, and the trial says why.
    reference.insert(3, {"event": "checkpoint", "step": 4, "skipped": True})
    problems, info = pec_reference.compare(_faulted(), reference)
    assert problems == [] and info["match"] is None
    assert info["why"].endswith("the runs took different versions by timing (version 4: "
                                "skipped)")
    # A missing roll-back is a difference too.
    problems, info = pec_reference.compare(_faulted(), _reference()[:9])
    assert info["match"] is False and "the PEC reference None" in problems[0]


def _write(store, owner, step):
    w = store.begin(owner, step)
    w.write_chunk("d0.c0", bytes([step]) * 64)
    w.commit({"fingerprint": "x"})


class _Checkpoint:
    def __init__(self, root):
        self.root = root

    def store_dir(self, host):
        return self.root / f"host{host}"


def test_a_roll_back_waits_for_its_version_then_drops_the_newer_ones(tmp_path):
    """``rollback.ready`` and ``rollback.apply`` on real stores: 2 hosts, each
    holding its own versions and the other's replicas."""
    checkpoint, workdir = _Checkpoint(tmp_path / "stores"), tmp_path / "work"
    for step in (4, 5, 6):
        (workdir / "checkpoints" / str(step)).mkdir(parents=True)
    stores = [HostStore(checkpoint.store_dir(h)) for h in (0, 1)]
    for step in (3, 4, 5):
        for h in (0, 1):
            _write(stores[h], h, step)
            _write(stores[1 - h], h, step)
    _write(stores[0], 0, 6)  # host 1's own version 6 not written yet
    fault = Fault((0, 1), 5, "rollback", version=6)
    assert not rollback.ready(fault, checkpoint, workdir, 2)
    _write(stores[1], 1, 6)
    assert rollback.ready(fault, checkpoint, workdir, 2)
    # Host 0 lost: its shards must be on host 1 (a replica of 6 is not).
    lost = Fault((0, 1), 5, "rollback", version=6, lose=(0,))
    assert not rollback.ready(lost, checkpoint, workdir, 2)
    assert rollback.ready(Fault((0, 1), 5, "rollback", version=5, lose=(0,)), checkpoint,
                          workdir, 2)
    assert not rollback.ready(Fault((0, 1), 5, "rollback", version=8, wipe_all=True),
                              checkpoint, workdir, 2)
    assert rollback.ready(Fault((0, 1), 5, "rollback", version=0), checkpoint, workdir, 2)
    for store in stores:
        store.close()
    lines = rollback.apply(Fault((0, 1), 6, "rollback", version=4, lose=(1,)), checkpoint,
                           workdir, 2)
    assert committed_steps(checkpoint.store_dir(0)) == {0: [3, 4], 1: [3, 4]}
    assert not checkpoint.store_dir(1).exists()
    assert rollback.persistent_steps(workdir) == {4}
    assert lines == ["rollback: the RAM stores of host 1 lost",
                     "rollback: every host back to version 4; stored versions after it "
                     "dropped, persistent steps [5, 6] deleted"]


def test_the_injector_rolls_back_once_every_host_stopped_and_the_version_is_held(tmp_path):
    from launch.train.faults import FaultInjector, pause_marker

    class Cluster:
        def __init__(self):
            self.killed = []

        def kill_host(self, host, sig):
            self.killed.append(host)

    checkpoint = _Checkpoint(tmp_path / "stores")
    stores = [HostStore(checkpoint.store_dir(h)) for h in (0, 1)]
    injector = FaultInjector((Fault((0, 1), 2, "rollback", version=3),), str(tmp_path),
                             checkpoint=checkpoint)
    cluster = Cluster()
    injector.arm(cluster)
    assert injector.extra_args(1) == ("--fault_at=rollback:2",)
    pause_marker(tmp_path, 0).write_text("here")
    injector.tick()  # host 1 still training
    pause_marker(tmp_path, 1).write_text("here")
    _write(stores[0], 0, 3)
    injector.tick()  # host 1's version 3 not in its store yet
    assert cluster.killed == [] and not injector.fired
    _write(stores[1], 1, 3)
    _write(stores[1], 1, 4)
    injector.tick()
    assert cluster.killed == [0, 1] and injector.fired
    for store in stores:
        store.close()
    injector.after_kill(checkpoint, 2)
    assert committed_steps(checkpoint.store_dir(1)) == {1: [3]}
    assert not pause_marker(tmp_path, 0).exists() and not injector.pending


def test_the_state_digest_is_one_crc_per_leaf_over_every_host_s_shards():
    import jax.numpy as jnp
    import numpy as np

    state = {"params": {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3)},
             "step": jnp.asarray(7, jnp.int32)}
    mine = digest.shard_digests(state)
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert mine == {"['params']['w']": {"0:2,0:3": f"{zlib.crc32(w.tobytes()):08x}"},
                    "['step']": {"": f"{zlib.crc32(np.int32(7).tobytes()):08x}"}}
    # Two hosts' halves of a leaf merge in index order, whichever host sent them.
    halves = [{"['w']": {"0:1,0:3": "00000001"}}, {"['w']": {"1:2,0:3": "00000002"}}]
    merged = digest.merge(halves)
    assert merged == digest.merge(halves[::-1]) == {
        "['w']": f"{zlib.crc32(b'0:1,0:3=00000001;1:2,0:3=00000002'):08x}"}
    assert digest.merge([halves[0], {"['w']": {"1:2,0:3": "00000003"}}]) != merged


def test_a_version_committed_at_the_next_save_is_rolled_back_to_after_that_step():
    """inmem and pec over the chunk channel commit version t at save t + 1
    (``ChannelReplication``), as the scheduled strategies do: the reference's
    roll-back must let that step run, or it waits for a version that never
    commits and restores the one before (soak seed 71, trial 2: pec over the
    channel restored 6, its reference 5)."""
    from launch.chaos.config import parse_topology
    from launch.chaos.draw import THREADED, Trial

    def trial(strategy, variant=()):
        return Trial(0, 0, parse_topology("2x2"), strategy, 0, (), None, variant)

    assert trial("pec", (THREADED,)).commits_next_save
    assert trial("inmem", (THREADED,)).commits_next_save
    assert trial("capricorn").commits_next_save and trial("gemini").commits_next_save
    assert not trial("pec").commits_next_save and not trial("inmem").commits_next_save
