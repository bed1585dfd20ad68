"""The baselines the library's strategies are measured against.

``none`` saves nothing (a restarted job starts over from step 0);
``blocking`` is a TorchSnapshot-like synchronous checkpoint: every local shard
copied to host and written to local storage (a RAM disk by default) before
the next step starts; ``orbax_async`` is plain Orbax ``CheckpointManager``
async saves of the whole state, what a JAX user does today;
``orbax_emergency`` is Orbax's own multi-tier manager
(``orbax.checkpoint.experimental.emergency``, what MaxText's
``enable_emergency_checkpoint`` turns on): a local tier on each host's RAM
disk every step and a persistent tier on disk every ``persist_every`` steps.
Each restores from its own checkpoint: ``restore`` gives the newest version
every host has.

Design choice: the baselines implement the library's ``Strategy`` protocol
like its own strategies, so launch.train and launch.bench drive all of them
through one factory (``launch.strategies.make_strategy``) and one loop.
Alternative not taken: a bench-only code path for the baselines, which left
them without a restore and out of the kill-and-recover tests.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

import capricorn_jax
from capricorn_jax import RestoreInfo, Strategy
from capricorn_jax.experimental import allgather_json
from launch.trainer import Trainer

HostState = dict[str, Any]
Event = dict[str, Any]


def _unique_local_shards(state: Any) -> Iterator[tuple[int, Any]]:
    """(leaf index, shard) for each distinct block on this process's devices."""
    for i, leaf in enumerate(jax.tree.leaves(state)):
        seen = set()
        for shard in leaf.addressable_shards:
            key = _block(shard.index)
            if key not in seen:
                seen.add(key)
                yield i, shard


def _block(index: tuple[slice, ...]) -> str:
    """A shard's block of its leaf as a file-name part, the same in every process."""
    return "_".join(f"{'' if s.start is None else s.start}-{'' if s.stop is None else s.stop}"
                    for s in index) or "scalar"


def _write_json(path: Path, doc: Any) -> None:
    """Writes ``doc`` to ``path`` atomically (a reader sees the old or the new file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


class _HostStates:
    """Each step's JSON host state (data position...) of this host, in
    ``root/host_state/host<i>``; a file older than the newest three goes
    unless ``keep`` says a tier still holds its step."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "host_state" / f"host{jax.process_index()}"
        self.dir.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, doc: HostState, keep=lambda step: False) -> None:
        # Written before the step is saved, so every committed step has its host state.
        _write_json(self.dir / f"{step}.json", doc)
        for old in self.dir.glob("*.json"):
            if old.stem.isdigit() and int(old.stem) < step - 2 and not keep(int(old.stem)):
                old.unlink(missing_ok=True)

    def read(self, step: int) -> HostState:
        return json.loads((self.dir / f"{step}.json").read_text())


def _target(train: Trainer) -> Any:
    """The train state's abstract arrays with their shardings (restore target)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        train.abstract_state, train.state_shardings)


def _restored(step: int, host_state: HostState, where: str, t0: float) -> RestoreInfo:
    """A baseline restore's RestoreInfo, timed from ``t0``: ``where`` "local"
    (this machine's disk or RAM disk on every host: tier "memory", each host
    "local") or "persistent" (a disk every host reads); nothing moved between hosts."""
    local = where == "local"
    return RestoreInfo(step, "memory" if local else "persistent", time.perf_counter() - t0,
                       host_state, [where] * jax.process_count() if local else None, 0)


class _Baseline(Strategy):
    """A baseline strategy: the protocol's no-op ``close`` and ``resume_at``
    spelled out (the protocol's docstring-only bodies read as abstract to
    mypy in an explicit subclass)."""

    def close(self) -> None:
        return None

    def resume_at(self, step: int) -> None:
        return None


class NoCheckpoint(_Baseline):
    """``none``: nothing saved; a restarted job starts again from step 0."""

    name = "none"

    def save(self, step: int, state: Any, host_state: HostState, *,
             tokens_per_expert: np.ndarray | None = None,
             next_step_profiled: bool = False) -> list[Event]:
        return []


class BlockingCheckpoint(_Baseline):
    """``blocking``: every local shard to ``directory`` before the next step.

    A version is written to ``v<step>.tmp`` (each file fsynced), renamed to
    ``v<step>`` and then the versions older than the previous one are
    removed, so a crash mid-save leaves the last two complete versions.
    Versions at or after ``step`` are an abandoned attempt's (the job
    restarted before them: no version on every host's disk after a machine
    loss); the new version supersedes them: each is renamed aside (so a
    crash never leaves a partial ``v<step>``) and removed before the rename.

    Args:
      directory: this host's own folder (local storage).
      train: the trainer whose state it saves and restores.
    """

    name = "blocking"

    def __init__(self, directory: Path, train: Trainer) -> None:
        self.directory, self.train = Path(directory), train
        self.directory.mkdir(parents=True, exist_ok=True)
        self.bytes_per_step = 0

    def _versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.directory.glob("v*")
                      if p.name[1:].isdigit())

    def save(self, step: int, state: Any, host_state: HostState, *,
             tokens_per_expert: np.ndarray | None = None,
             next_step_profiled: bool = False) -> list[Event]:
        tmp = self.directory / f"v{step:012d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        total = 0
        for i, shard in _unique_local_shards(state):
            data = np.asarray(shard.data)
            with open(tmp / f"leaf{i}.{_block(shard.index)}.npy", "wb") as f:
                np.save(f, data)
                f.flush()
                os.fsync(f.fileno())
            total += data.nbytes
        _write_json(tmp / "meta.json", {"step": step, "host_state": host_state})
        for stale in (v for v in self._versions() if v >= step):
            aside = self.directory / f"v{stale:012d}.stale"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(self.directory / f"v{stale:012d}", aside)
            shutil.rmtree(aside)
        os.replace(tmp, self.directory / f"v{step:012d}")
        for old in self._versions()[:-2]:
            shutil.rmtree(self.directory / f"v{old:012d}", ignore_errors=True)
        self.bytes_per_step = total
        return [{"version": step, "bytes": total}]

    def restore(self) -> tuple[Any, RestoreInfo]:
        """The newest version on every host's disk (collective); ``NoCheckpoint``: none."""
        t0 = time.perf_counter()
        everyone = allgather_json(self._versions())
        common = set.intersection(*(set(v) for v in everyone))
        if not common:
            raise capricorn_jax.NoCheckpoint(f"{self.name}: no version on every host's disk")
        step = max(common)
        folder = self.directory / f"v{step:012d}"
        leaves = []
        for i, target in enumerate(jax.tree.leaves(_target(self.train))):
            def fetch(index: tuple[slice, ...] | None, i: int = i) -> np.ndarray:
                # Typed Optional by jax; it asserts every shard's index is set before the call.
                assert index is not None
                return np.load(folder / f"leaf{i}.{_block(index)}.npy")

            leaves.append(jax.make_array_from_callback(target.shape, target.sharding, fetch))
        state = jax.tree.unflatten(jax.tree.structure(self.train.abstract_state), leaves)
        meta = json.loads((folder / "meta.json").read_text())
        return state, _restored(step, meta["host_state"], "local", t0)


class OrbaxAsync(_Baseline):
    """``orbax_async``: Orbax CheckpointManager async save of the whole state
    every step (the newest step kept); each host's JSON state beside it, in
    ``directory/host_state``.

    Args:
      directory: the Orbax root, shared by every host.
      train: the trainer whose state it saves and restores.
      tier: what a restore reports as its tier ("persistent": a disk every
        host reads; "local": a RAM disk of this machine).
    """

    name = "orbax_async"

    def __init__(self, directory: Path, train: Trainer, tier: str = "persistent") -> None:
        import orbax.checkpoint as ocp

        self._ocp, self.train, self.tier = ocp, train, tier
        self.directory = Path(directory).absolute()
        # Its own barrier names: Orbax names a manager's save barriers after
        # its prefix, and a second manager in the process with the same prefix
        # (orbax_emergency's on an expert mesh, in the bench) would enter the
        # same barrier from another thread while this one's last save
        # finalizes ("Barrier ... set_value_start is already ongoing").
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=1, enable_async_checkpointing=True, cleanup_tmp_directories=True,
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    barrier_sync_key_prefix="orbax_async")))
        self._host_states = _HostStates(self.directory)
        self.bytes_per_step = 0

    def save(self, step: int, state: Any, host_state: HostState, *,
             tokens_per_expert: np.ndarray | None = None,
             next_step_profiled: bool = False) -> list[Event]:
        self._host_states.write(step, host_state)  # one save in flight at most
        self.manager.save(step, args=self._ocp.args.StandardSave(state))
        if not self.bytes_per_step:
            self.bytes_per_step = sum(s.data.nbytes for _, s in _unique_local_shards(state))
        return [{"version": step, "bytes": self.bytes_per_step}]

    def restore(self) -> tuple[Any, RestoreInfo]:
        """The newest committed Orbax step (every host reads the same root);
        ``NoCheckpoint``: none."""
        t0 = time.perf_counter()
        step = self.manager.latest_step()
        if step is None:
            raise capricorn_jax.NoCheckpoint(f"{self.name}: no step in {self.manager.directory}")
        state = self.manager.restore(step, args=self._ocp.args.StandardRestore(_target(self.train)))
        host_state = self._host_states.read(step)
        return state, _restored(step, host_state, self.tier, t0)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _orbax_id_maps(multihost: Any) -> None:
    """Orbax's process-id and device-id maps, which its emergency manager
    needs before its first save, built once per process (Orbax's builder
    meets the other processes at a named barrier and is meant to run once; a
    second manager in the same process, e.g. a restore after a save, reuses
    them). In a process without jax.distributed (a single-process job) the
    maps are the identity, set directly: this process is distributed id 0 and
    owns every device, which is what the builder would find."""
    from capricorn_jax.experimental import distributed_client

    if distributed_client() is None and jax.process_count() == 1:
        if not multihost.is_runtime_to_distributed_ids_initialized():
            multihost._RUNTIME_TO_DISTRIBUTED_ID = [0]
        if not multihost.is_distributed_to_device_ids_initialized():
            multihost._DISTRIBUTED_TO_DEVICE_IDS = [[d.id for d in jax.local_devices()]]
        return
    if not multihost.is_runtime_to_distributed_ids_initialized():
        multihost.initialize_runtime_to_distributed_ids()
    multihost.initialize_distributed_to_device_ids()  # returns if already built


class OrbaxEmergency(_Baseline):
    """``orbax_emergency``: Orbax's emergency (multi-tier) CheckpointManager,
    configured as its users do: the local tier every step (``max_to_keep=2``)
    in this host's folder of ``local_root`` (a RAM disk), the persistent tier
    every ``persist_every`` steps in ``persistent`` (shared, on disk); each
    host's JSON state beside the persistent root, in ``host_state/``.

    Its redundancy comes from the mesh's data-parallel replicas (axis 0):
    with one replica, as on this project's expert-parallel meshes where the
    experts span every host, Orbax builds a plain persistent manager and there
    is no local tier (``local_tier`` False; Orbax's own decision, reported by
    the bench, not hidden). With replicas across hosts, one replica writes the
    persistent tier and the others the local one; a restore broadcasts a
    replica's local copy.

    Args:
      local_root: the RAM disk folder; this host writes ``local_root/host<i>``.
      persistent: the persistent root, shared by every host.
      train: the trainer whose state it saves and restores.
      persist_every: persistent steps every this many steps.
    """

    name = "orbax_emergency"

    def __init__(self, local_root: Path, persistent: Path, train: Trainer,
                 persist_every: int = 10) -> None:
        import orbax.checkpoint as ocp
        from orbax.checkpoint._src.multihost import multihost
        from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency

        if persist_every < 1:
            raise ValueError(f"orbax_emergency: persist_every must be >= 1, got {persist_every}")
        _orbax_id_maps(multihost)
        self._ocp, self.train = ocp, train
        self.local = Path(local_root).absolute() / f"host{jax.process_index()}"
        self.local.mkdir(parents=True, exist_ok=True)
        self.persistent = Path(persistent).absolute()
        self.local_tier = train.mesh.devices.shape[0] > 1
        options = emergency.CheckpointManagerOptions(
            local=emergency.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
            persistent=emergency.PersistentCheckpointOptions(save_interval_steps=persist_every,
                                                             max_to_keep=2),
            replica_axis_index=0)
        self.manager = emergency.CheckpointManager(
            self.local, self.persistent, global_mesh=train.mesh, abstract_state=_target(train),
            options=options)
        self._host_states = _HostStates(self.persistent)
        self.bytes_per_step = 0

    def save(self, step: int, state: Any, host_state: HostState, *,
             tokens_per_expert: np.ndarray | None = None,
             next_step_profiled: bool = False) -> list[Event]:
        # Kept while a tier holds the step (2 local + 2 persistent).
        self._host_states.write(step, host_state, keep=lambda s: s in self._persisted())
        saved = self.manager.save(step, args=self._ocp.args.Composite(
            state=self._ocp.args.PyTreeSave(state)))
        if not self.bytes_per_step:
            self.bytes_per_step = sum(s.data.nbytes for _, s in _unique_local_shards(state))
        return [{"version": step, "bytes": self.bytes_per_step if saved else 0,
                 "skipped": not saved}]

    def _persisted(self) -> set[int]:
        return {int(p.name) for p in self.persistent.iterdir() if p.name.isdigit()}

    def restore(self) -> tuple[Any, RestoreInfo]:
        """The newest step of either tier (Orbax's choice); ``NoCheckpoint``: none."""
        t0 = time.perf_counter()
        step = self.manager.latest_step()
        if step is None:
            raise capricorn_jax.NoCheckpoint(f"{self.name}: no step in {self.manager.directory}")
        local = self.local_tier and step not in self._persisted()
        restored = self.manager.restore(step)
        host_state = self._host_states.read(step)
        return restored.state, _restored(step, host_state, "local" if local else "persistent", t0)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
