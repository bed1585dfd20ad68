"""The Orbax integration: CapricornHandler + CheckpointManager, two tiers.

In-process tests use the 4 CPU devices of the pytest process (one host);
multi-host behaviour runs real processes (tests/orbax_worker.py): 2 processes
x 2 devices that save every step and persist every 2 steps, are SIGKILLed
while a persistent step is being written, are restored by plain Orbax in
fresh processes (1x4 and 1x1 devices) that never import capricorn_jax, and
restart from the memory tier.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import capricorn_jax
from capricorn_jax._src.memory.wire.packing import unpack
from capricorn_jax._src.persistent.memory_read import read_own_blocks
from tests.helpers import ROOT, child_env
from tests.orbax_worker import INTERVAL, README_SNIPPET, SHAPES, expected_state
from tests.tree_utils import assert_trees_equal

WORKER = ROOT / "tests" / "orbax_worker.py"
STANDARD_TYPESTR = ocp.StandardCheckpointHandler.typestr()


# --------------------------------------------------------------------------- helpers


def _env(devices: int) -> dict[str, str]:
    return child_env(devices)


def _results(stdout: str) -> list[dict]:
    return [json.loads(x[len("RESULT "):]) for x in stdout.splitlines() if x.startswith("RESULT ")]


def _run(mode: str, args: dict | None = None, devices: int = 4, cwd=None, timeout: float = 120,
         **popen) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(WORKER), mode] + ([] if args is None else [json.dumps(args)])
    proc = subprocess.run(cmd, cwd=cwd or ROOT, env=_env(devices), capture_output=True,
                          text=True, timeout=timeout, **popen)
    assert proc.returncode == 0, f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_job(mode: str, args: dict) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for pid in range(2):
        cmd = [sys.executable, str(WORKER), mode,
               json.dumps({**args, "processes": 2, "process": pid, "port": port})]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(2), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _finish_job(procs: list[subprocess.Popen], timeout: float = 150) -> list[str]:
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"worker failed ({p.returncode}):\n{out[-4000:]}"
    return outs


def _kill_job_at(procs: list[subprocess.Popen], marker: str, timeout: float = 150) -> list[str]:
    """Reads both workers' output until ``marker`` appears, then SIGKILLs both."""
    lines: list[list[str]] = [[] for _ in procs]
    seen = threading.Event()

    def pump(i: int) -> None:
        stdout = procs[i].stdout
        assert stdout is not None
        for line in stdout:
            lines[i].append(line)
            if line.rstrip().endswith(marker):  # gloo prints share the pipe, may share a line
                seen.set()

    threads = [threading.Thread(target=pump, args=(i,), daemon=True) for i in range(len(procs))]
    for t in threads:
        t.start()
    ok = seen.wait(timeout)
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
    for t in threads:
        t.join(5)
    outs = ["".join(x) for x in lines]
    assert ok, "marker never printed:\n" + "\n".join(o[-3000:] for o in outs)
    return outs


def _mesh_state():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "expert"))
    shardings = {k: NamedSharding(mesh, P(*spec)) for k, (_, _, spec) in SHAPES.items()}
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in expected_state(0).items()}
    return mesh, shardings, abstract


def _state(step, shardings):
    return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
            for k, v in expected_state(step).items()}


def _target(shardings, abstract, **changes):
    out = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings[k])
           for k, a in abstract.items()}
    out.update(changes)
    return out


@pytest.fixture
def two_tier(tmp_path, request):
    """A single-host manager over 4 devices: persist every INTERVAL steps."""
    mesh, shardings, abstract = _mesh_state()
    inmem = capricorn_jax.InMemoryCheckpointer(
        capricorn_jax.InMemoryOptions(store_root=str(tmp_path / "shm"), job="j", replicas=1,
                                      chunk_bytes=1024),
        mesh, abstract, shardings, 0, 1)
    handler = capricorn_jax.CapricornHandler(
        inmem, host_memory_kind=getattr(request, "param", "auto"))
    manager = capricorn_jax.CheckpointManager(
        tmp_path / "ckpt", options=ocp.CheckpointManagerOptions(save_interval_steps=INTERVAL),
        handler_registry=handler.registry("state"))
    yield manager, handler, shardings, abstract
    manager.close()


def _save(manager, step, shardings, **host_state):
    return manager.save(step, args=ocp.args.Composite(state=capricorn_jax.CapricornSave(
        _state(step, shardings), {"pos": step, **host_state})))


# --------------------------------------------------------------------------- one process


# "pinned_host": the memory kind used on accelerators, exercised here on CPU.
@pytest.mark.parametrize("two_tier", ["auto", "pinned_host"], indirect=True)
def test_round_trip_memory_every_step_disk_every_k(two_tier):
    manager, handler, shardings, abstract = two_tier
    persisted = [_save(manager, s, shardings) for s in range(4)]
    manager.wait_until_finished()
    assert persisted == [True, False, True, False]
    assert list(manager.all_steps()) == [0, 2] and manager.persistent_errors == []
    assert handler.checkpointer.store.versions(0)[-1] == 3  # the memory tier ran every step
    # The step is a standard Orbax item: its metadata names the standard handler.
    assert manager.metadata(2).item_handlers == {"state": STANDARD_TYPESTR}
    target = _target(shardings, abstract)

    newest = manager.restore(args=ocp.args.Composite(state=capricorn_jax.CapricornRestore(target)))
    assert (manager.last_restore.step, manager.last_restore.tier) == (3, "memory")
    assert manager.last_restore.host_state == {"pos": 3}
    assert_trees_equal(newest.state, expected_state(3))

    manager.restore(3, args=ocp.args.Composite(state=capricorn_jax.CapricornRestore(target)))
    assert (manager.last_restore.step, manager.last_restore.tier) == (3, "memory")
    disk = manager.restore(2, args=ocp.args.Composite(state=capricorn_jax.CapricornRestore(target)))
    assert (manager.last_restore.step, manager.last_restore.tier) == (2, "persistent")
    assert manager.last_restore.host_state == {"pos": 2}
    assert_trees_equal(disk.state, expected_state(2))
    assert all(disk.state[k].sharding == target[k].sharding for k in target)

    # The persistent tier read the bytes packing.unpack gives for that version
    # (multi-chunk payloads, a replicated leaf split over 4 devices).
    ckpt = handler.checkpointer
    assert ckpt.plan.num_chunks > 1
    blocks, host_state = read_own_blocks(ckpt, 3, 10)
    rows = [np.frombuffer(b"".join(ckpt.store.read_chunk(0, 3, f"d{j}.c{k}")
                                   for k in range(ckpt.plan.num_chunks)), np.uint8)
            for j in range(4)]
    want = unpack(ckpt.plan, 0, rows)
    assert host_state == {"pos": 3} and sorted(blocks) == sorted(want)
    for p in want:
        for got, exp in zip(blocks[p], want[p], strict=True):
            assert got.tobytes() == exp.tobytes() and got.ctypes.data % 64 == 0


def test_save_returns_before_the_persistent_write(two_tier):
    manager, handler, shardings, _ = two_tier
    release, reached = threading.Event(), threading.Event()

    def hook(step, phase):
        if phase == "read":
            reached.set()
            assert release.wait(60)

    handler.on_persist = hook
    try:
        assert _save(manager, 0, shardings) is True  # returned while the write is held
        assert reached.wait(60)
        assert manager.is_saving_in_progress()
        assert not (manager.directory / "0").exists()  # not committed yet
        assert list(ocp.utils.checkpoint_steps(manager.directory)) == []
    finally:
        release.set()
    manager.wait_until_finished()
    assert list(ocp.utils.checkpoint_steps(manager.directory)) == [0]
    assert manager.persistent_errors == []


def test_failed_background_write_is_recorded_and_cleaned_up(two_tier):
    manager, handler, shardings, abstract = two_tier

    def hook(step, phase):
        if step == 0 and phase == "read":
            raise OSError("disk full (injected)")

    handler.on_persist = hook
    assert _save(manager, 0, shardings) is True  # started; fails in the background
    manager.wait_until_finished()  # collects the failure (a later save() would too)
    assert [e["step"] for e in manager.persistent_errors] == [0]
    assert "disk full (injected)" in manager.persistent_errors[0]["error"]
    assert os.listdir(manager.directory) == []  # the failed step's tmp dir is gone
    assert _save(manager, 1, shardings) is True  # no step committed yet: Orbax saves 1
    manager.wait_until_finished()
    assert list(manager.all_steps()) == [1] and len(manager.persistent_errors) == 1
    manager.restore(args=ocp.args.Composite(state=capricorn_jax.CapricornRestore(
        _target(shardings, abstract))))
    assert (manager.last_restore.step, manager.last_restore.tier) == (1, "memory")


def test_handler_under_a_plain_orbax_manager_names_the_fix(tmp_path):
    mesh, shardings, abstract = _mesh_state()
    inmem = capricorn_jax.InMemoryCheckpointer(
        capricorn_jax.InMemoryOptions(store_root=str(tmp_path / "shm"), job="j", replicas=1),
        mesh, abstract, shardings, 0, 1)
    handler = capricorn_jax.CapricornHandler(inmem)
    # Synchronous directory creation: with Orbax's asynchronous one, a handler
    # that raises leaves Orbax's directory-creation thread waiting 300 s for a
    # signal, which would hold this process at exit.
    plain = ocp.CheckpointManager(
        tmp_path / "ckpt", handler_registry=handler.registry("state"),
        options=ocp.CheckpointManagerOptions(
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False)))
    with pytest.raises(RuntimeError, match=r"persists in-memory version None and the memory "
                                           r"tier's newest save is no version.*capricorn_jax\."
                                           r"CheckpointManager.*save_to_memory"):
        plain.save(0, args=ocp.args.Composite(
            state=capricorn_jax.CapricornSave(_state(0, shardings))))
    # The explicit record: a persistent save names the in-memory version it
    # is written from; another version than the newest memory save is refused.
    handler.save_to_memory(1, _state(1, shardings), {"n": 1})
    with pytest.raises(RuntimeError, match="persists in-memory version 0 and the memory tier's "
                                           "newest save is version 1"):
        plain.save(1, args=ocp.args.Composite(
            state=capricorn_jax.CapricornSave(_state(1, shardings), memory_version=0)))
    plain.close()
    with pytest.raises(ValueError, match="CapricornHandler"):
        capricorn_jax.CheckpointManager(tmp_path / "other")


def test_wrong_args_and_mismatched_trees_are_named(two_tier):
    manager, _, shardings, abstract = two_tier
    for s in range(3):
        _save(manager, s, shardings)
    manager.wait_until_finished()
    target = _target(shardings, abstract)
    with pytest.raises(TypeError, match=r"Composite\(state="):
        manager.restore(args=capricorn_jax.CapricornRestore(target))
    with pytest.raises(TypeError, match="CapricornSave is a save argument"):
        manager.restore(args=ocp.args.Composite(state=capricorn_jax.CapricornSave(target)))
    with pytest.raises(TypeError, match="takes CapricornSave, got StandardSave"):
        manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(3, shardings))))
    bad_shape = _target(shardings, abstract, w=jax.ShapeDtypeStruct((8, 7), np.float32,
                                                                    sharding=shardings["w"]))
    missing = {k: v for k, v in target.items() if k != "e"}
    for step, where in ((None, "in-memory"), (2, "persistent")):  # newest (2) is in memory
        with pytest.raises(ValueError, match=rf"{where} checkpoint at leaf w: shape \(8, 6\).*"
                                             r"\(8, 7\) in the target"):
            manager.restore(step, args=ocp.args.Composite(
                state=capricorn_jax.CapricornRestore(bad_shape)))
        with pytest.raises(ValueError, match=rf"leaf e of the {where} checkpoint is not in the "
                                             "target"):
            manager.restore(step, args=ocp.args.Composite(
                state=capricorn_jax.CapricornRestore(missing)))
    with pytest.raises(FileNotFoundError, match="step 1 is neither"):
        manager.restore(1, args=ocp.args.Composite(state=capricorn_jax.CapricornRestore(target)))


@pytest.mark.slow
def test_unwritable_directory_is_recorded_and_memory_tier_goes_on(tmp_path):
    args = {"store": str(tmp_path / "shm"), "ckpt": str(tmp_path / "ckpt")}
    (result,) = _results(_run("readonly", args).stdout)
    if result["privileged"]:
        pytest.skip("this process cannot drop the privilege to write read-only directories")
    # No step ever committed, so Orbax's policy asks for one at every step: each
    # attempt is refused before Orbax starts, and recorded; every step reached RAM.
    assert [r["persisted"] for r in result["reports"]] == [False] * 5
    assert [e["step"] for e in result["errors"]] == [0, 1, 2, 3, 4]
    assert all("not writable" in e["error"] and "Permission denied" in e["error"]
               for e in result["errors"])
    committed = [r["memory_committed"] for r in result["reports"]]  # lags the writers
    assert committed == sorted(committed)
    assert result["memory_versions"][-1] == 4
    assert result["listing"] == []  # no step, no temporary directory


@pytest.mark.slow
def test_readme_snippet_runs_verbatim(tmp_path):
    first = _run("snippet", cwd=tmp_path).stdout
    assert "persistent steps: [2, 4] errors: []" in first
    assert "restored step 5 from the memory tier, host state {'data_position': 5}" in first
    assert "plain Orbax step 4: w[0, 0] = 4.0" in first
    again = _run("snippet", cwd=tmp_path).stdout  # a restart resumes from step 5
    assert "restored step 10 from the memory tier, host state {'data_position': 10}" in again
    assert README_SNIPPET.count("capricorn_jax.TwoTier") == 2  # the one-object form
    # The snippet run here is the one README.md shows, character for character.
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "```python\n" + README_SNIPPET + "```" in readme


def test_the_three_object_form_runs_and_a_leaf_without_sharding_is_named(tmp_path):
    first = _run("three_objects", cwd=tmp_path).stdout
    assert "persistent steps: [2, 4] errors: []" in first
    assert "restored step 5 from the memory tier, host state {'data_position': 5}" in first
    mesh, shardings, abstract = _mesh_state()
    with pytest.raises(ValueError, match=r"abstract_state leaf \['b'\] has no sharding"):
        capricorn_jax.TwoTierCheckpointManager(tmp_path / "shm", tmp_path / "ckpt", mesh,
                                               abstract)


# --------------------------------------------------------------------------- PEC, one process

PEC_TOKENS = 16 * 64  # tiny: global batch x sequence length
PEC_TPE = np.full((2, 8), PEC_TOKENS * 2 // 8)  # top-2, spread evenly


@pytest.fixture(scope="module")
def pec_trainer():
    from launch.trainer import OptimizerOptions, Trainer, make_mesh
    from models import get_config

    return Trainer(get_config("tiny"), make_mesh(2), OptimizerOptions())  # 2 expert ranks


def _pec_manager(trainer, root, store: str, k_persist):
    ckpt = capricorn_jax.InMemoryCheckpointer(
        capricorn_jax.InMemoryOptions(store_root=str(root / store), job="j", replicas=1,
                                      pec=capricorn_jax.PecOptions(k=2, k_persist=k_persist,
                                                                   dynamic=False)),
        trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1,
        model=trainer.cfg, tokens_per_step=PEC_TOKENS)
    handler = capricorn_jax.CapricornHandler(ckpt)
    manager = capricorn_jax.CheckpointManager(
        root / "ckpt", options=ocp.CheckpointManagerOptions(save_interval_steps=3, max_to_keep=1),
        handler_registry=handler.registry("state"))
    return ckpt, manager


def _bump(trainer):
    """A jitted ``(state, v) -> state + v`` in the trainer's shardings."""
    return jax.jit(lambda s, v: jax.tree.map(lambda x: x + v.astype(x.dtype), s),
                   out_shardings=trainer.state_shardings)


def _pec_target(trainer):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        trainer.abstract_state, trainer.state_shardings)


def _assert_state_from(trainer, base, got, point, data_steps):
    """Each non-expert leaf is base + point; each expert's slices of every expert
    leaf (parameters and Adam moments) are base + the one step its values are from."""
    from capricorn_jax._src.partial.leaves import expert_leaf_axes

    leaves = expert_leaf_axes(trainer.abstract_state, trainer.cfg)
    flat = jax.tree_util.tree_flatten_with_path(got)[0]
    for (path, leaf), b in zip(flat, jax.tree.leaves(base), strict=True):
        name, b = jax.tree_util.keystr(path), np.asarray(b)
        info = leaves[name]
        step = (np.asarray(point) if info is None else np.asarray(data_steps)[
            info.moe_layer].reshape((-1,) + (1,) * (b.ndim - 1)))
        np.testing.assert_array_equal(np.asarray(leaf), b + step.astype(b.dtype), err_msg=name)


@pytest.mark.parametrize("k_persist", [None, 2])
def test_pec_persistent_steps_restore_like_the_memory_tier(pec_trainer, tmp_path, k_persist):
    """PEC memory tier (K=2 of 8, 2 expert ranks), persistent steps every 3
    steps with K_persist = N or 2, max_to_keep=1; each version's values are
    base + its step, so every restored expert names the step it comes from."""
    from capricorn_jax._src.memory.tier.retention import versions_to_keep
    from capricorn_jax._src.partial.plans import newest_copies, persisted_needs

    trainer = pec_trainer
    bump = _bump(trainer)
    base = trainer.init_state(0)
    ckpt, manager = _pec_manager(trainer, tmp_path, "shm", k_persist)
    persisted = {}
    for step in range(1, 10):
        state = bump(base, jnp.int32(step))
        if k_persist is None:  # both tiers through save()
            started = manager.save(step, args=ocp.args.Composite(state=capricorn_jax.CapricornSave(
                state, {"pos": step}, tokens_per_expert=PEC_TPE)))
        else:  # the memory tier saved by the caller (as launch.train does), then persist()
            manager.handler.await_reader()
            ckpt.save(step, state, {"pos": step}, tokens_per_expert=PEC_TPE)
            started = manager.persist(step, ocp.args.Composite(
                state=capricorn_jax.CapricornSave(state)))
        if started:
            persisted[step] = manager.last_persist
    manager.wait_until_finished()
    assert manager.persistent_errors == [] and sorted(persisted) == [1, 3, 6, 9]
    assert persisted[1]["k_persist"] == 8  # no expert has a persisted copy yet
    records = {s: manager.metadata(s).custom_metadata["capricorn_pec"]
               for s in manager.all_steps()}
    carried = {s: np.array([[e in row for e in range(8)] for row in persisted[s]["experts"]])
               for s in persisted}
    newest = newest_copies(carried, (2, 8))
    # max_to_keep=1, plus every step that holds some expert's newest copy.
    assert list(manager.all_steps()) == sorted(np.unique(newest).tolist())
    assert list(manager.all_steps()) == sorted(
        versions_to_keep(persisted_needs(carried, (2, 8)), max(carried), window=0))
    assert sorted(int(p.name) for p in manager.directory.iterdir() if p.name.isdigit()) == \
        list(manager.all_steps())
    if k_persist is None:
        assert list(manager.all_steps()) == [9]
    else:
        assert list(manager.all_steps()) == [1, 3, 6, 9]  # 4 steps of 2 experts cover 8
        for s in (3, 6, 9):  # k_persist/R = 1 expert of each rank and layer
            assert persisted[s]["k_persist"] == 2
            assert [sorted(e // 4 for e in row) for row in persisted[s]["experts"]] == [[0, 1]] * 2
    memory_state, memory = capricorn_jax.recover(
        _pec_manager(trainer, tmp_path, "shm", k_persist)[0])
    assert memory.step == 9
    manager.close()

    shutil.rmtree(tmp_path / "shm")  # the RAM store is lost
    fresh, manager = _pec_manager(trainer, tmp_path, "shm2", k_persist)
    target = _pec_target(trainer)
    restored = manager.restore(args=ocp.args.Composite(
        state=capricorn_jax.CapricornRestore(target))).state
    info = manager.last_restore
    assert (info.step, info.tier, info.host_state) == (9, "persistent", {"pos": 9})
    assert info.pec.source == newest.tolist() and info.pec.plt == persisted[9]["plt"]
    assert info.pec.plt == records[9]["plt"] > 0
    # Each expert's values are those of the memory tier's newest copy when its
    # persisted step was written.
    data = np.array([[records[newest[layer, e]]["data_step"][layer][e] for e in range(8)]
                     for layer in range(2)])
    assert info.pec.data_steps == data.tolist()
    _assert_state_from(trainer, base, restored, 9, data)
    assert all(a.sharding == t.sharding for a, t in zip(jax.tree.leaves(restored),
                                                        jax.tree.leaves(target), strict=True))
    if k_persist is None:
        # K_persist = N: the step is what a memory-tier restore at step 9 gives,
        # and plain Orbax restores it.
        assert_trees_equal(restored, memory_state, check_sharding=True)
        assert info.pec.plt == memory.pec.plt and data.tolist() == memory.pec.source
        plain = ocp.CheckpointManager(tmp_path / "ckpt").restore(9, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target))).state
        assert_trees_equal(plain, memory_state)
    else:
        assert info.pec.versions == [1, 3, 6, 9]  # experts from four steps
    # The memory tier goes on from step 9 with no expert in memory yet and the
    # restore's losses: its next version carries every expert.
    tracker = fresh.pec.tracker
    lost = np.asarray(records[9]["cumulative"]) - np.array(
        [[records[newest[layer, e]]["at_copy"][layer][e] for e in range(8)] for layer in range(2)])
    assert tracker.step == 9 and tracker.restored_lost.tolist() == lost.sum(axis=1).tolist()
    assert fresh.pec.cumulative.tolist() == records[9]["cumulative"]
    assert fresh.save(10, bump(base, jnp.int32(10)), {"pos": 10},
                      tokens_per_expert=PEC_TPE).pec_k == 8
    manager.close()


def test_a_step_whose_memory_chain_is_gone_is_refused_before_orbax(pec_trainer, tmp_path):
    """A persistent step some host cannot read from its own store (a version
    holding some expert's newest copy is gone, as on a host whose store was
    lost) is refused, recorded and named before Orbax starts (in a job, every
    host then skips it: no host waits at Orbax's barriers for the one that
    fails); the memory tier goes on and a later step persists."""
    trainer = pec_trainer
    bump = _bump(trainer)
    base = trainer.init_state(0)
    ckpt, manager = _pec_manager(trainer, tmp_path, "shm", None)
    started = {}
    for step in range(1, 10):
        state = bump(base, jnp.int32(step))
        manager.handler.await_reader()
        ckpt.save(step, state, {"pos": step}, tokens_per_expert=PEC_TPE)
        if step == 6:
            ckpt.wait_until_finished(60)
            needed = [v for v in ckpt._needs[6][0] if v < 6]
            assert needed and ckpt.missing_for_read(6) == []
            ckpt.store.remove(0, needed[0])
            assert ckpt.missing_for_read(6) == [needed[0]]
        started[step] = manager.persist(step, ocp.args.Composite(
            state=capricorn_jax.CapricornSave(state)))
    manager.wait_until_finished()
    assert [s for s, ok in started.items() if ok] == [1, 3, 9]
    (error,) = manager.persistent_errors
    assert error["step"] == 6 and error["error"] == (
        f"FileNotFoundError: host 0: its store lacks in-memory versions [{needed[0]}] "
        f"that version 6 reads")
    assert list(manager.all_steps()) == [9]
    manager.close()


# --------------------------------------------------------------------------- real processes

KILL_STEP = 6  # persisted steps 0, 2, 4 commit; 6 is written but never committed


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory):
    """2 processes x 2 devices, SIGKILLed inside the persistent write of step 6."""
    root = tmp_path_factory.mktemp("job")
    args = {"store": str(root / "shm"), "ckpt": str(root / "ckpt"), "steps": KILL_STEP + 1,
            "kill_step": KILL_STEP}
    outs = _kill_job_at(_start_job("train", args), f"WRITTEN {KILL_STEP}")
    saves = [{r["step"]: r["persisted"] for r in _results(out) if "step" in r} for out in outs]
    return root, saves


@pytest.mark.slow
def test_killed_write_leaves_no_partial_step(killed_job):
    root, saves = killed_job
    for host_saves in saves:
        assert host_saves == {s: s % INTERVAL == 0 for s in range(KILL_STEP + 1)}
    entries = sorted(os.listdir(root / "ckpt"))
    assert [e for e in entries if e.isdigit()] == ["2", "4"]  # max_to_keep=2
    # The killed write: host 1 had written its files (then stopped before the commit).
    (tmp,) = [e for e in entries if e.startswith(f"{KILL_STEP}.")]
    assert list((root / "ckpt" / tmp).glob("state*/capricorn_host_state.1.json"))
    assert ocp.CheckpointManager(root / "ckpt").latest_step() == 4


@pytest.mark.slow
@pytest.mark.parametrize("devices", [4, 1])
def test_plain_orbax_restores_on_another_topology(killed_job, devices):
    root, _ = killed_job
    (result,) = _results(_run("plain", {"ckpt": str(root / "ckpt")}, devices=devices).stdout)
    assert result == {"step": 4, "all_steps": [2, 4], "devices": devices, "bitwise": True,
                      "sharded_as_target": True, "item_handler": STANDARD_TYPESTR,
                      "capricorn_imported": False}


@pytest.mark.slow
@pytest.mark.parametrize("devices", [4, 1])
def test_capricorn_manager_restores_persistent_step_on_another_topology(killed_job, tmp_path,
                                                                        devices):
    root, _ = killed_job
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    (result,) = _results(_run("reshard", {"ckpt": str(tmp_path / "ckpt"),
                                          "store": str(tmp_path / "shm")}, devices=devices).stdout)
    assert result == {"step": 4, "tier": "persistent", "devices": devices, "bitwise": True,
                      "sharded_as_target": True}


@pytest.mark.slow
def test_restart_takes_the_newest_tier(killed_job, tmp_path):
    root, _ = killed_job
    shutil.copytree(root, tmp_path / "job")  # the plain-restore tests read the original
    args = {"store": str(tmp_path / "job" / "shm"), "ckpt": str(tmp_path / "job" / "ckpt"),
            "explicit_step": 4}
    outs = _finish_job(_start_job("resume", args))
    for host, out in enumerate(outs):
        (r,) = _results(out)
        # Memory (step 6, committed in RAM before the kill) is newer than disk (4).
        assert r["newest"] == {"step": KILL_STEP, "tier": "memory", "bitwise": True,
                               "sharded_as_target": True,
                               "host_state": {"pos": KILL_STEP, "host": host}}
        assert r["explicit"] == {"step": 4, "tier": "persistent", "bitwise": True,
                                 "sharded_as_target": True, "host_state": {"pos": 4, "host": host}}
        assert r["persisted"] == [False, True] and r["errors"] == []
        assert r["all_steps"] == [4, KILL_STEP + 2]
    # cleanup_tmp_directories removed the killed write's directory.
    assert not any(e.startswith(f"{KILL_STEP}.") for e in os.listdir(tmp_path / "job" / "ckpt"))


@pytest.mark.slow
@pytest.mark.parametrize("flips", [1, 3])
def test_a_served_row_hit_in_transit_is_served_again_or_fails_on_every_host(killed_job,
                                                                            tmp_path, flips):
    """Issue 39: recovery's serve round is checked end to end. Host 1 lost
    its store; host 0 serves its rows, flipping a byte after the checksum in
    its first ``flips`` tries: one bad try is served again and the restore
    is bit for bit; SERVE_ATTEMPTS bad tries fail the memory tier's restore
    on every host, naming the rows and their server, and the manager takes
    the persistent step."""
    root, _ = killed_job
    shutil.copytree(root, tmp_path / "job")
    shutil.rmtree(tmp_path / "job" / "shm" / "job" / "host1")  # host 1's RAM store lost
    args = {"store": str(tmp_path / "job" / "shm"), "ckpt": str(tmp_path / "job" / "ckpt"),
            "flip_serve": flips}
    outs = _finish_job(_start_job("serve", args))
    results = [_results(out) for out in outs]
    if flips == 1:
        for (r,) in results:
            assert r == {"step": KILL_STEP, "tier": "memory", "tiers": ["local", "peer"],
                         "bitwise": True}
        assert "serve try 1" in outs[0] and "try 1 of 3" in outs[1]
        assert "serve try 2" not in outs[0]
    else:  # every host gives up on the memory tier: the persistent step (4) instead
        for (r,) in results:
            assert r == {"step": 4, "tier": "persistent", "tiers": None, "bitwise": True}
        for out in outs:
            assert (f"memory tier: version {KILL_STEP}: the rows served in recovery failed "
                    f"their check 3 times (host 1 rows [0] from host 0); using the persistent "
                    f"tier") in out


def test_orbax_barrier_timeout_is_the_handlers_write_bound_unless_the_caller_set_it(tmp_path):
    """Orbax's barrier timeout is the handler's commit bound (its write, then
    the wait for the other hosts' outcomes), not Orbax's own 1200 s."""
    mesh, shardings, abstract = _mesh_state()
    inmem = capricorn_jax.InMemoryCheckpointer(
        capricorn_jax.InMemoryOptions(store_root=str(tmp_path / "shm"), job="j", replicas=1),
        mesh, abstract, shardings, 0, 1)
    handler = capricorn_jax.CapricornHandler(inmem, read_timeout_s=45.5)
    assert handler.write_timeout_s == 91.0 and handler.commit_timeout_s == 182.0
    manager = capricorn_jax.CheckpointManager(
        tmp_path / "a", options=ocp.CheckpointManagerOptions(save_interval_steps=3),
        handler_registry=handler.registry("state"))
    assert manager._options.async_options.timeout_secs == 182
    assert manager._options.save_interval_steps == 3
    manager.close()
    handler = capricorn_jax.CapricornHandler(inmem, read_timeout_s=45.5)
    mine = ocp.AsyncOptions(timeout_secs=7)
    manager = capricorn_jax.CheckpointManager(
        tmp_path / "b", options=ocp.CheckpointManagerOptions(async_options=mine),
        handler_registry=handler.registry("state"))
    assert manager._options.async_options.timeout_secs == 7
    manager.close()


def test_an_empty_manager_says_no_checkpoint_which_a_missing_file_is_not(two_tier):
    """NoCheckpoint (a FileNotFoundError) means a fresh start; the launcher
    catches it alone, so a restore that loses a file fails loudly instead of
    starting over at step 0."""
    manager, _, shardings, abstract = two_tier
    target = _target(shardings, abstract)
    with pytest.raises(capricorn_jax.NoCheckpoint, match="no checkpoint in the memory tier"):
        manager.restore(args=ocp.args.Composite(state=capricorn_jax.CapricornRestore(target)))
    assert issubclass(capricorn_jax.NoCheckpoint, FileNotFoundError)
    assert not issubclass(FileNotFoundError, capricorn_jax.NoCheckpoint)


def test_the_manager_names_the_version_it_persists(two_tier):
    manager, handler, shardings, abstract = two_tier
    with pytest.raises(ValueError, match=r"save\(3\): CapricornSave.memory_version is 7, not the "
                                         r"step saved"):
        manager.save(3, args=ocp.args.Composite(
            state=capricorn_jax.CapricornSave(_state(3, shardings), memory_version=7)))
    assert manager.save(INTERVAL, args=ocp.args.Composite(
        state=capricorn_jax.CapricornSave(_state(INTERVAL, shardings), memory_version=INTERVAL)))
    manager.wait_until_finished()
    assert manager.all_steps() == [INTERVAL]
