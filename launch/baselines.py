"""The baselines the library's strategies are measured against.

``none`` saves nothing (a restarted job starts over from step 0);
``blocking`` is a TorchSnapshot-like synchronous checkpoint: every local shard
copied to host and written to local storage (a RAM disk by default) before
the next step starts; ``orbax_async`` is plain Orbax ``CheckpointManager``
async saves of the whole state, what a JAX user does today. Each restores
from its own checkpoint: ``restore`` gives the newest version every host has.

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

from capricorn_jax import Recovered, Strategy
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


def _target(train: Trainer) -> Any:
    """The train state's abstract arrays with their shardings (restore target)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        train.abstract_state, train.state_shardings)


class NoCheckpoint(Strategy):
    """``none``: nothing saved; a restarted job starts again from step 0."""

    name = "none"

    def save(self, step: int, state: Any, host_state: HostState, *,
             tokens_per_expert: np.ndarray | None = None,
             next_step_profiled: bool = False) -> list[Event]:
        return []


class BlockingCheckpoint(Strategy):
    """``blocking``: every local shard to ``directory`` before the next step.

    A version is written to ``v<step>.tmp`` (each file fsynced), renamed to
    ``v<step>`` and then the versions older than the previous one are
    removed, so a crash mid-save leaves the last two complete versions.

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
        os.replace(tmp, self.directory / f"v{step:012d}")
        for old in self._versions()[:-2]:
            shutil.rmtree(self.directory / f"v{old:012d}", ignore_errors=True)
        self.bytes_per_step = total
        return [{"version": step, "bytes": total}]

    def restore(self) -> Recovered | None:
        """The newest version on every host's disk (collective), or None."""
        t0 = time.perf_counter()
        everyone = allgather_json(self._versions())
        common = set.intersection(*(set(v) for v in everyone))
        if not common:
            return None
        step = max(common)
        folder = self.directory / f"v{step:012d}"
        leaves = []
        for i, target in enumerate(jax.tree.leaves(_target(self.train))):
            def fetch(index: tuple[slice, ...], i: int = i) -> np.ndarray:
                return np.load(folder / f"leaf{i}.{_block(index)}.npy")

            leaves.append(jax.make_array_from_callback(target.shape, target.sharding, fetch))
        state = jax.tree.unflatten(jax.tree.structure(self.train.abstract_state), leaves)
        meta = json.loads((folder / "meta.json").read_text())
        return Recovered(state, meta["host_state"], step, "local", ["local"] * len(everyone),
                         time.perf_counter() - t0, 0)


class OrbaxAsync(Strategy):
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
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True,
                                                 cleanup_tmp_directories=True))
        self._host_dir = self.directory / "host_state" / f"host{jax.process_index()}"
        self._host_dir.mkdir(parents=True, exist_ok=True)
        self.bytes_per_step = 0

    def save(self, step: int, state: Any, host_state: HostState, *,
             tokens_per_expert: np.ndarray | None = None,
             next_step_profiled: bool = False) -> list[Event]:
        # Written before the step is, so every committed step has its host state.
        _write_json(self._host_dir / f"{step}.json", host_state)
        for old in self._host_dir.glob("*.json"):
            if old.stem.isdigit() and int(old.stem) < step - 2:  # one save in flight at most
                old.unlink(missing_ok=True)
        self.manager.save(step, args=self._ocp.args.StandardSave(state))
        if not self.bytes_per_step:
            self.bytes_per_step = sum(s.data.nbytes for _, s in _unique_local_shards(state))
        return [{"version": step, "bytes": self.bytes_per_step}]

    def restore(self) -> Recovered | None:
        """The newest committed Orbax step (every host reads the same root), or None."""
        t0 = time.perf_counter()
        step = self.manager.latest_step()
        if step is None:
            return None
        state = self.manager.restore(step, args=self._ocp.args.StandardRestore(_target(self.train)))
        host_state = json.loads((self._host_dir / f"{step}.json").read_text())
        return Recovered(state, host_state, step, self.tier, [self.tier] * jax.process_count(),
                         time.perf_counter() - t0, 0)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
