"""Checkpoint strategies on one interface, for launch.train and launch.bench.

Every strategy is called the same way after each training step:
``save(step, state, host_state) -> dict`` (what it did, for the metrics) and
``close()`` at the end. ``none`` does nothing; ``blocking`` is a
TorchSnapshot-like synchronous checkpoint; ``orbax_async`` is plain Orbax
CheckpointManager async saves to a RAM disk, what a JAX user does today;
``inmem`` is capricorn_jax's in-memory tier (every step to host RAM and m-1
peers). ``gemini`` and ``capricorn`` (scheduled chunks) build on ``inmem``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

STRATEGIES = ("none", "blocking", "orbax_async", "inmem")


class NoCheckpoint:
    name = "none"
    bytes_per_step = 0

    def save(self, step: int, state: Any, host_state: dict) -> dict:
        return {}

    def close(self) -> None:
        pass


def _unique_local_shards(state: Any):
    """(leaf index, shard) for each distinct block on this process's devices."""
    for i, leaf in enumerate(jax.tree.leaves(state)):
        seen = set()
        for shard in leaf.addressable_shards:
            key = tuple((s.start, s.stop) for s in shard.index)
            if key not in seen:
                seen.add(key)
                yield i, key, shard


class BlockingCheckpoint:
    """TorchSnapshot-like: copy every local shard to host and write it to local
    storage before the next step starts (one version kept, replaced atomically)."""

    name = "blocking"

    def __init__(self, root: Path, host: int):
        self.root = Path(root) / f"host{host}"
        self.root.mkdir(parents=True, exist_ok=True)
        self.bytes_per_step = 0

    def save(self, step: int, state: Any, host_state: dict) -> dict:
        tmp = self.root / f"step{step}.tmp"
        tmp.mkdir()
        total = 0
        for i, key, shard in _unique_local_shards(state):
            data = np.asarray(shard.data)
            with open(tmp / f"leaf{i}_{abs(hash(key))}.npy", "wb") as f:
                np.save(f, data)
                f.flush()
                os.fsync(f.fileno())
            total += data.nbytes
        final = self.root / "latest"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self.bytes_per_step = total
        return {"bytes": total}

    def close(self) -> None:
        pass


class OrbaxAsync:
    """Plain Orbax: CheckpointManager async save of the whole state every step."""

    name = "orbax_async"

    def __init__(self, root: Path):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.manager = ocp.CheckpointManager(
            Path(root).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True),
        )
        self.bytes_per_step = 0

    def save(self, step: int, state: Any, host_state: dict) -> dict:
        self.manager.save(step, args=self._ocp.args.StandardSave(state))
        if not self.bytes_per_step:
            self.bytes_per_step = sum(s.data.nbytes for _, _, s in _unique_local_shards(state))
        return {"bytes": self.bytes_per_step}

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


class InMemory:
    """capricorn_jax's in-memory tier with the unscheduled (after-step) transfer."""

    name = "inmem"

    def __init__(self, checkpointer):
        self.ckpt = checkpointer
        self.bytes_per_step = 0

    def save(self, step: int, state: Any, host_state: dict) -> dict:
        report = self.ckpt.save(step, state, host_state)
        self.bytes_per_step = report.bytes
        return {"bytes": report.bytes, "store_bytes": report.store_bytes,
                "committed": report.committed, "replicated": report.replicated,
                "skipped": report.skipped, "under_replicated": report.under_replicated}

    def close(self) -> None:
        self.ckpt.close()
