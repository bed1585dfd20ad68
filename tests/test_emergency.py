"""The emergency manager's surface: ``TwoTierCheckpointManager`` against Orbax's
own emergency ``CheckpointManager`` on the same calls (one process, 4 CPU devices).

Where the behaviour is meant to match (argument forms, return types, the
persistent tier's steps and bytes, the errors) the two managers are compared
call by call; where it differs on purpose (the memory tier saves every step,
so ``should_save``, ``save``'s result and ``latest_step`` see it) the
difference is asserted as documented in ``docs/guide.md``.
"""

from __future__ import annotations

import logging
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint.experimental.emergency import checkpoint_manager as orbax_emergency

import capricorn_jax
from capricorn_jax import emergency
from tests.orbax_worker import SHAPES, expected_state
from tests.test_orbax_handler import _mesh_state, _state
from tests.tree_utils import assert_trees_equal


def _abstract():
    """The test state on a (replica=1, data=2, expert=2) mesh: Orbax's emergency
    manager reads its replica axis (one replica: its single-slice mode, the one
    a single process runs)."""
    _, _, abstract = _mesh_state()
    mesh = Mesh(np.array(jax.devices()).reshape(1, 2, 2), ("replica", "data", "expert"))
    shardings = {k: NamedSharding(mesh, P(*spec)) for k, (_, _, spec) in SHAPES.items()}
    target = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings[k])
              for k, a in abstract.items()}
    return mesh, shardings, target


def _pair(tmp_path):
    mesh, shardings, abstract = _abstract()
    theirs = orbax_emergency.CheckpointManager(
        tmp_path / "theirs_local", tmp_path / "theirs", global_mesh=mesh,
        abstract_state=abstract, options=orbax_emergency.CheckpointManagerOptions(
            local=orbax_emergency.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=1),
            persistent=orbax_emergency.PersistentCheckpointOptions(save_interval_steps=2,
                                                                   max_to_keep=2)))
    # The same loop, switched: one import and the options line.
    ours = emergency.CheckpointManager(
        tmp_path / "ours_local", tmp_path / "ours", global_mesh=mesh, abstract_state=abstract,
        options=emergency.CheckpointManagerOptions(
            local=emergency.LocalCheckpointOptions(save_interval_steps=1),
            persistent=emergency.PersistentCheckpointOptions(save_interval_steps=2,
                                                             max_to_keep=2)))
    return theirs, ours, shardings, abstract


def test_each_method_against_orbax_emergency_manager(tmp_path):
    theirs, ours, shardings, abstract = _pair(tmp_path)
    with theirs, ours:  # both are context managers
        for manager in (theirs, ours):  # nothing saved: a FileNotFoundError from restore
            with pytest.raises(FileNotFoundError):
                manager.restore(None)
            assert manager.latest_step() is None and list(manager.all_steps()) == []
        for step in range(6):
            state = _state(step, shardings)
            # should_save: Orbax's at the persistent interval here (one slice: its local tier
            # is off); ours at every step (the memory tier's interval is 1).
            assert theirs.should_save(step) == (step % 2 == 0)
            assert ours.should_save(step)
            saved = [m.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
                     for m in (theirs, ours)]
            assert saved == [step % 2 == 0, True]
            assert [m.reached_preemption(step) for m in (theirs, ours)] == [False, False]
        for manager in (theirs, ours):
            assert manager.wait_until_finished() is None
        # The persistent tier: the same steps kept, the same bytes restored.
        assert list(theirs.all_steps()) == ours.persistent_steps == [2, 4]
        for step in (2, 4):
            got = [m.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=abstract))) for m in (theirs, ours)]
            assert all(isinstance(g, ocp.args.Composite) and list(g.keys()) == ["state"]
                       for g in got)
            for g in got:
                assert_trees_equal(g.state, expected_state(step))
            assert ours.last_restore.tier == "persistent"
        # The newest step: Orbax's persistent step 4; ours the memory tier's step 5.
        assert theirs.latest_step() == 4 and ours.latest_step() == 5
        assert ours.all_steps() == [2, 4, 5]
        newest = ours.restore(None)  # args optional, as Orbax's
        assert (ours.last_restore.step, ours.last_restore.tier) == (5, "memory")
        assert_trees_equal(newest.state, expected_state(5))
        assert all(newest.state[k].sharding == abstract[k].sharding for k in abstract)


def test_host_state_rides_along_in_both_forms(tmp_path):
    mesh, shardings, abstract = _abstract()
    with capricorn_jax.TwoTierCheckpointManager(
            tmp_path / "shm", tmp_path / "ckpt", mesh, abstract) as manager:
        manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(1, shardings)),
                                                host_state=ocp.args.JsonSave({"pos": 1})))
        manager.save(2, _state(2, shardings), {"pos": 2})  # the plain form
        got = manager.restore(args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), host_state=ocp.args.JsonRestore()))
        assert got.host_state == {"pos": 2} and manager.last_restore.host_state == {"pos": 2}
        assert_trees_equal(got.state, expected_state(2))
        with pytest.raises(ValueError, match=r"items \['dataset', 'state'\]: this manager saves"):
            manager.save(3, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(_state(3, shardings)),
                dataset=ocp.args.JsonSave({})))
        with pytest.raises(TypeError, match="either plainly or in args, not both"):
            manager.save(3, _state(3, shardings), args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(_state(3, shardings))))
        state, info = manager.restore_state()  # 0.18's form, kept for one release
        assert info.step == 2


def test_the_default_options_work_on_one_host_and_say_so_once(tmp_path, caplog):
    """4723d9a: ValueError: replicas=2 exceeds the 1 hosts."""
    mesh, shardings, abstract = _abstract()
    with caplog.at_level(logging.WARNING, logger="capricorn_jax"):
        manager = capricorn_jax.TwoTierCheckpointManager(tmp_path / "shm", tmp_path / "ckpt",
                                                         mesh, abstract)
    assert caplog.text.count("replicas=2 capped at the 1 host(s)") == 1
    assert manager.save(0, _state(0, shardings))
    manager.close()


@pytest.mark.parametrize("options, named", [
    (lambda: emergency.LocalCheckpointOptions(max_to_keep=1), "local.max_to_keep=1"),
    (lambda: emergency.LocalCheckpointOptions(read_only=True), "local.read_only=True"),
    (lambda: emergency.CheckpointManagerOptions(replica_axis_index=1), "replica_axis_index=1"),
    (lambda: emergency.CheckpointManagerOptions(step_name_format=object()), "step_name_format"),
    (lambda: emergency.CheckpointManagerOptions(single_host_load_and_broadcast=False),
     "single_host_load_and_broadcast=False"),
])
def test_orbax_options_without_a_meaning_here_are_refused_by_name(options, named):
    with pytest.raises(emergency.OptionRefused, match=named):
        options()


def test_orbax_options_with_a_meaning_reach_the_persistent_manager(tmp_path):
    mesh, shardings, abstract = _abstract()
    options = emergency.CheckpointManagerOptions(
        replicas=1, enable_async_checkpointing=False, cleanup_tmp_directories=True,
        persistent=emergency.PersistentCheckpointOptions(save_interval_steps=3, max_to_keep=1,
                                                         keep_period=6))
    with emergency.CheckpointManager(tmp_path / "shm", tmp_path / "ckpt", mesh, abstract,
                                     options=options) as manager:
        orbax_options = manager.manager._options
        assert (orbax_options.save_interval_steps, orbax_options.max_to_keep,
                orbax_options.keep_period, orbax_options.cleanup_tmp_directories) == (3, 1, 6, True)
        for step in range(10):
            manager.save(step, _state(step, shardings))
            # enable_async_checkpointing=False: each persistent step is on disk when save returns
            assert not manager.manager.is_saving_in_progress()
        assert manager.persistent_steps == [0, 6, 9]  # max_to_keep 1, plus every 6th kept


def test_the_deprecated_shortcuts_set_the_persistent_options():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = capricorn_jax.TwoTierOptions(save_interval_steps=4, max_to_keep=3)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    assert (options.persistent.save_interval_steps, options.persistent.max_to_keep) == (4, 3)
    with pytest.raises(ValueError, match="not both"):
        capricorn_jax.TwoTierOptions(save_interval_steps=4, persistent=emergency
                                     .PersistentCheckpointOptions(save_interval_steps=2))


def test_sigterm_to_one_process_makes_the_next_step_the_preemption_step(tmp_path):
    import os
    import signal

    mesh, shardings, abstract = _abstract()
    with capricorn_jax.TwoTierCheckpointManager(tmp_path / "shm", tmp_path / "ckpt", mesh,
                                                abstract) as manager:
        assert not manager.reached_preemption(0)
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the process goes on
        assert manager.reached_preemption(1)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # close() put it back


def test_memory_needs_counts_each_hosts_distinct_shards():
    mesh, shardings, abstract = _abstract()
    # Devices 0, 1 on host 0 and 2, 3 on host 1 (the 2x2 simulated cluster's layout).
    host_of = {d: i // 2 for i, d in enumerate(mesh.devices.flat)}
    needs = capricorn_jax.memory_needs(abstract, shardings, replicas=2,
                                       devices_of_host=host_of.__getitem__)
    # w (8x6 f32) split over expert: host 0 holds rows 0-3 and 4-7 (its two devices
    # are the expert axis), e (16 i32) over data x expert: 8 per host, b and step
    # replicated: once per host.
    assert needs.host_state_bytes == 8 * 6 * 4 + 8 * 4 + 5 * 2 + 4
    assert (needs.slots_per_owner, needs.owners) == (3, 2)
    assert needs.ram_disk_bytes == 2 * 3 * needs.host_state_bytes


def test_a_ram_disk_too_small_is_refused_before_the_first_step_with_its_numbers(tmp_path):
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mesh, _, _ = _abstract()
    big = NamedSharding(mesh, P(("data", "expert")))
    abstract = {"w": jax.ShapeDtypeStruct((1 << 20,), np.float32, sharding=big)}
    disk = tmp_path / "ramdisk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        with pytest.raises(capricorn_jax.HostMemoryTooSmall) as raised:
            capricorn_jax.TwoTierCheckpointManager(disk / "shm", tmp_path / "ckpt", mesh,
                                                   abstract)
        text = str(raised.value)
        assert ("the memory tier needs 12.0 MiB on the RAM disk (1 owner(s) x 3 versions x "
                "4.0 MiB of a host's shards)") in text
        assert f"the RAM disk {disk} holding {disk / 'shm'} has 1.0 MiB" in text
        assert "the store may use 0.8 of it (0.8 MiB)" in text
        assert not (disk / "shm").exists() or not any((disk / "shm").iterdir())
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("found, chosen", [
    ([[0], [1]], [0, 1]),            # the machines' own disks, the same numbering
    ([[1], [0]], [1, 0]),            # process ids swapped across the restart
    ([[], [0]], [0, 0]),             # host 0's machine replaced; host 1's machine was host 0
    ([[1], []], [1, 1]),             # each opens a store of its own disk named host1
    ([[0, 1], [0, 1]], [0, 1]),      # one shared RAM disk: by process index
    ([[0], [0]], [0, 1]),            # one shared disk, host 1's store lost: by index
    ([[2], [0], [1]], [2, 0, 1]),
    ([[], []], [0, 1]),
])
def test_each_host_opens_the_store_its_machine_holds(found, chosen):
    from capricorn_jax._src.memory.tier.store_identity import choose_store_hosts

    assert choose_store_hosts(found) == chosen
