"""The checkpointer's own versions copied straight into their slots by a
SlotCopier (the CPU path here): the store then holds the state bitwise, each
chunk checksummed in place on the writer pool."""

import threading

import jax
import numpy as np
import pytest

import capricorn_jax
from capricorn_jax._src.memory.store import arena as store_module
from capricorn_jax._src.memory.store.pinned import arena_copier
from capricorn_jax._src.memory.wire.host_arrays import global_arrays
from capricorn_jax._src.memory.wire.packing import unpack
from launch.trainer import OptimizerOptions, Trainer, make_mesh
from models import get_config
from tests.tree_utils import assert_trees_equal


def test_own_versions_land_in_their_slots_and_are_checksummed_off_the_caller(tmp_path,
                                                                             monkeypatch):
    trainer = Trainer(get_config("tiny"), make_mesh(4), OptimizerOptions())
    opts = capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="j", replicas=1,
                                         chunk_bytes=100_000, arena_copy="host_plain")
    ckpt = capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1)
    assert ckpt.copier.path.kind == "host_plain"
    assert ckpt.store.registry.dma_map == "unimplemented"  # CPU: slots mapped, not registered
    threads = []
    real = store_module.checksum
    monkeypatch.setattr(store_module, "checksum",
                        lambda d: threads.append(threading.current_thread().name) or real(d))
    written = []
    monkeypatch.setattr(store_module.VersionWriter, "write_chunk",
                        lambda *a, **k: written.append(a[1]))
    batch = trainer.global_batch(np.random.default_rng(0).integers(0, 256, (16, 65), np.int32))
    step = trainer.step_fn((2.0, 2.0))
    state = trainer.init_state(0)
    expected = {}
    for v in (1, 2):
        state, _ = step(state, batch)
        expected[v] = jax.tree.map(np.array, state)
        ckpt.save(v, state, {"data": {"step": v}})
    ckpt.wait_until_finished(60)
    assert written == []  # no chunk went through a host copy of the writer
    chunks = 4 * ckpt.plan.num_chunks
    assert len(threads) == 2 * chunks and all(t.startswith("ckpt-chunk-writer")
                                              for t in threads)
    monkeypatch.setattr(store_module, "checksum", real)
    for v in (1, 2):
        assert ckpt.store.verify(0, v)
        rows = [np.frombuffer(b"".join(ckpt.store.read_chunk(0, v, f"d{j}.c{k}")
                                       for k in range(ckpt.plan.num_chunks)), np.uint8)
                for j in range(4)]
        restored = global_arrays(unpack(ckpt.plan, 0, rows), trainer.abstract_state,
                                 trainer.state_shardings, trainer.mesh)
        assert_trees_equal(restored, expected[v])
        assert ckpt.store.manifest(0, v)["host_state"] == {"data": {"step": v}}
    ckpt.close()


def test_arena_copy_setting_on_cpu():
    device = jax.devices()[0]
    assert arena_copier("auto", device) == (None, None)
    assert arena_copier("off", device) == (None, None)
    registry, copier = arena_copier("host_plain", device)
    assert copier.path.kind == "host_plain" and registry.dma_map == "unimplemented"
    copier.close()
    with pytest.raises(ValueError, match="async_copy.*not possible here"):
        arena_copier("async_copy", device)
    with pytest.raises(ValueError, match="arena_copy must be"):
        capricorn_jax.InMemoryOptions(store_root="/tmp/x", job="j", arena_copy="dma")
