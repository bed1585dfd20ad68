"""The persistent tier survives its own failures (one process, 4 CPU devices).

A step that fails to commit deletes nothing: Orbax picks the steps to delete
when a save starts, counting the new step; they are deleted only once that
step is committed. Each leaf's CRC32C is recorded at save and checked at
restore; a mismatch names the step, the leaf and the tier, and restore falls
back to the previous step.
"""

from __future__ import annotations

import errno
import shutil

import jax
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint.path import atomicity

import capricorn_jax
import capricorn_jax.stores
from capricorn_jax._src.persistent.integrity import PersistentChecksumError
from tests.orbax_worker import expected_state
from tests.test_orbax_handler import (
    _mesh_state,
    _save,
    _target,
    pec_trainer,  # noqa: F401 - a fixture
)
from tests.tree_utils import assert_trees_equal


def _full_disk_at(steps: set[int]) -> type:
    class FullDisk(atomicity.AtomicRenameTemporaryPath):
        async def finalize(self, *args, **kwargs):
            if self.get_final().name in {str(s) for s in steps}:  # the step, not its items
                raise OSError(errno.ENOSPC, f"injected: no space left finalizing "
                                            f"{self.get_final().name}")
            return await super().finalize(*args, **kwargs)

    return FullDisk


def _manager(tmp_path, **options):
    mesh, shardings, abstract = _mesh_state()
    inmem = capricorn_jax.InMemoryCheckpointer(
        capricorn_jax.InMemoryOptions(store_root=str(tmp_path / "shm"), job="j", replicas=1,
                                      chunk_bytes=1024),
        mesh, abstract, shardings, 0, 1)
    handler = capricorn_jax.CapricornHandler(inmem)
    manager = capricorn_jax.CheckpointManager(
        tmp_path / "ckpt", options=ocp.CheckpointManagerOptions(**options),
        handler_registry=handler.registry("state"))
    return manager, shardings, abstract


def _restore(manager, step, shardings, abstract):
    return manager.restore(step, args=ocp.args.Composite(
        state=capricorn_jax.CapricornRestore(_target(shardings, abstract)))).state


@pytest.mark.parametrize("keep", [1, 2])
def test_a_failed_finalize_deletes_no_committed_step(tmp_path, keep):
    manager, shardings, abstract = _manager(
        tmp_path, save_interval_steps=2, max_to_keep=keep,
        temporary_path_class=_full_disk_at({6, 8}))
    try:
        for step in range(10):
            _save(manager, step, shardings)
        manager.wait_until_finished()
        assert sorted(e["step"] for e in manager.persistent_errors) == [6, 8]
        kept = [2, 4][-keep:]
        assert list(manager.all_steps()) == kept
        assert sorted(p.name for p in manager.directory.iterdir()) == [str(s) for s in kept]
        for step in kept:
            assert_trees_equal(_restore(manager, step, shardings, abstract),
                               expected_state(step))
        # The next committed step deletes what its save counted out.
        for step in range(10, 13):
            _save(manager, step, shardings)
        manager.wait_until_finished()
        assert list(manager.all_steps()) == ([10, 12] if keep == 2 else [12])
    finally:
        manager.close()


def test_a_failed_pec_finalize_keeps_the_steps_the_newest_committed_step_reads(
        pec_trainer, tmp_path):  # noqa: F811 - the fixture
    """PEC (K=2 of 8, K_persist=2, max_to_keep=1): persistent steps 1, 3, 6, 9
    hold the newest copies of every expert between them; step 12's save counts
    its own copies and would drop step 1. Its finalize fails: step 9 restores
    from the persistent tier alone, its experts from steps 1, 3, 6, 9."""
    import jax.numpy as jnp
    import numpy as np

    from tests.test_orbax_handler import PEC_TOKENS, PEC_TPE, _bump, _pec_target

    trainer = pec_trainer
    bump, base = _bump(trainer), trainer.init_state(0)

    def build(store):
        ckpt = capricorn_jax.InMemoryCheckpointer(
            capricorn_jax.InMemoryOptions(
                store_root=str(tmp_path / store), job="j", replicas=1,
                pec=capricorn_jax.PecOptions(k=2, k_persist=2, dynamic=False)),
            trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1,
            model=trainer.cfg, tokens_per_step=PEC_TOKENS)
        manager = capricorn_jax.CheckpointManager(
            tmp_path / "ckpt", options=ocp.CheckpointManagerOptions(
                save_interval_steps=3, max_to_keep=1, temporary_path_class=_full_disk_at({12})),
            handler_registry=capricorn_jax.CapricornHandler(ckpt).registry("state"))
        return manager

    manager = build("shm")
    for step in range(1, 13):
        manager.save(step, args=ocp.args.Composite(state=capricorn_jax.CapricornSave(
            bump(base, jnp.int32(step)), {"pos": step}, tokens_per_expert=PEC_TPE)))
    manager.wait_until_finished()
    assert [e["step"] for e in manager.persistent_errors] == [12]
    assert list(manager.all_steps()) == [1, 3, 6, 9]
    manager.close()

    manager = build("shm2")  # the RAM store is lost: the persistent tier alone
    restored = manager.restore(args=ocp.args.Composite(
        state=capricorn_jax.CapricornRestore(_pec_target(trainer)))).state
    info = manager.last_restore
    assert (info.step, info.tier, info.host_state) == (9, "persistent", {"pos": 9})
    assert info.pec.versions == [1, 3, 6, 9]
    leaves = jax.tree.leaves(restored)
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in leaves)
    manager.close()


def _copy_data(src, dst) -> None:
    """Puts the array files of step directory ``src`` in ``dst`` (a mix-up that
    every format check passes: valid files, the wrong step's bytes)."""
    for name in ("d", "ocdbt.process_0", "manifest.ocdbt"):
        for which in (src, dst):
            assert (which / "state" / name).exists(), which / "state" / name
        target = dst / "state" / name
        if target.is_dir():
            shutil.rmtree(target)
            shutil.copytree(src / "state" / name, target)
        else:
            shutil.copy(src / "state" / name, target)


def _flip_a_byte(step_dir) -> None:
    """Flips one bit in the middle of the step's B-tree/data file."""
    (victim,) = (step_dir / "state" / "d").iterdir()
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))


@pytest.mark.parametrize("fault", ["mixed_up_files", "flipped_bit"])
def test_a_corrupt_persistent_step_is_named_and_the_previous_step_restored(tmp_path, caplog,
                                                                          fault):
    manager, shardings, abstract = _manager(tmp_path, save_interval_steps=2, max_to_keep=3)
    for step in range(6):
        _save(manager, step, shardings)
    manager.close()
    ckpt = tmp_path / "ckpt"
    if fault == "mixed_up_files":
        _copy_data(ckpt / "2", ckpt / "4")
        named = r"persistent step 4: leaf \['\w+'\] shard .* recorded at save \(persistent tier"
    else:
        _flip_a_byte(ckpt / "4")
        named = r"persistent step 4: its files are corrupt .*DATA_LOSS.*\(persistent tier\)"

    manager, shardings, abstract = _manager(tmp_path / "fresh", save_interval_steps=2)
    manager = capricorn_jax.CheckpointManager(  # the same disk, an empty RAM store
        ckpt, options=ocp.CheckpointManagerOptions(),
        handler_registry=manager.handler.registry("state"))
    target = _target(shardings, abstract)
    with pytest.raises(PersistentChecksumError, match=named):
        manager.restore(4, args=ocp.args.Composite(state=capricorn_jax.CapricornRestore(target)))
    restored = manager.restore(args=ocp.args.Composite(
        state=capricorn_jax.CapricornRestore(target))).state
    assert (manager.last_restore.step, manager.last_restore.tier) == (2, "persistent")
    assert_trees_equal(restored, expected_state(2))
    assert "persistent step 4 failed its CRC32C check" in caplog.text
    assert "restoring persistent step 2" in caplog.text
    assert manager.handler.last_verdict.checked > 0
    manager.close()


def test_a_step_is_durable_before_its_rename_names_it(tmp_path, monkeypatch):
    """Every file and directory of the step is fsynced before the rename that
    commits it, the root after; fsync=False skips both."""
    import os

    from capricorn_jax._src.persistent import finalize

    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst, *args, **kwargs):
        events.append(("rename", str(dst)))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    for durable in (True, False):
        events.clear()
        mesh, shardings, abstract = _mesh_state()
        root = tmp_path / str(durable)
        inmem = capricorn_jax.InMemoryCheckpointer(
            capricorn_jax.InMemoryOptions(store_root=str(root / "shm"), job="j", replicas=1),
            mesh, abstract, shardings, 0, 1)
        handler = capricorn_jax.CapricornHandler(inmem, fsync=durable)
        manager = capricorn_jax.CheckpointManager(
            root / "ckpt", options=ocp.CheckpointManagerOptions(),
            handler_registry=handler.registry("state"))
        _save(manager, 0, shardings)
        manager.wait_until_finished()
        assert manager.is_committed(0) and not manager.is_committed(1)
        # The manager recorded its directory beside the RAM stores (stores prune reads it).
        assert capricorn_jax.stores.newest_persistent_step(root / "shm" / "j") == (
            0, str((root / "ckpt").absolute()))
        manager.close()
        step = str((root / "ckpt" / "0").absolute())
        renames = [i for i, (kind, dst) in enumerate(events) if kind == "rename" and dst == step]
        synced = [(i, path) for i, (kind, path) in enumerate(events) if kind == "fsync"]
        if not durable:
            assert renames and not [p for _, p in synced if "ckpt" in p]
            continue
        (at,) = renames
        files = {str(p).replace(step, step + ".orbax-checkpoint-tmp")
                 for p in (root / "ckpt" / "0").rglob("*")}
        before = {p for i, p in synced if i < at}
        assert files <= before, sorted(files - before)
        assert str((root / "ckpt").absolute()) in {p for i, p in synced if i > at}
        assert finalize.fsync_tree(root / "ckpt") > len(files)


@pytest.mark.slow
@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_a_library_program_whose_peer_never_arrives_ends_at_the_bound(tmp_path):
    """Two processes of a program that never parses absl flags: process 1 is
    alive but never builds its manager; process 0's manager fails at Orbax's
    first barrier after ``barrier_timeout_s`` (4 s), not after Orbax's
    unbounded collective."""

    bound = 4
    result, out0 = _process0_result("barrier_worker.py", {"bound": bound, "sleep": 15,
                                                          "root": str(tmp_path)})
    assert result["outcome"] != "built", out0[-3000:]
    assert "DEADLINE_EXCEEDED" in result["outcome"] or "imed out" in result["outcome"], result
    assert bound <= result["seconds"] < bound + 20, result


@pytest.mark.slow
@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_a_collective_whose_peer_never_arrives_ends_at_gloos_bound():
    """launch.runtime sets gloo's collective timeout from the peer timeout
    (3 x 2 s): a live peer that never enters a sum no longer holds the other
    host for ever (the heartbeat only ends a silent one)."""
    result, out0 = _process0_result("collective_worker.py", {"sleep": 30})
    assert "Timed out" in result["outcome"], (result, out0[-2000:])
    assert 5.5 <= result["seconds"] < 30, result


def _process0_result(worker: str, args: dict) -> tuple[dict, str]:
    """Runs tests/``worker`` as a 2-process job (``args`` plus the port and the
    process index); process 0's RESULT line and its output."""
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT, child_env
    from tests.test_orbax_handler import _free_port

    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / worker),
         json.dumps({**args, "port": port, "process": pid})],
        cwd=ROOT, env=child_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for pid in range(2)]
    try:
        out0 = procs[0].communicate(timeout=120)[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    (result,) = [json.loads(x[len("RESULT "):]) for x in out0.splitlines()
                 if x.startswith("RESULT ")]
    return result, out0
