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

STRATEGIES = ("none", "blocking", "orbax_async", "inmem", "gemini", "capricorn")


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


class Scheduled(InMemory):
    """``gemini`` / ``capricorn``: version t's chunks move inside step t+1.

    The schedule comes from layer profiles (``windows_from_profile``): gemini
    builds it once from the profiles of its first steps and keeps it;
    capricorn re-profiles when the dynamicity detector sees the expert load
    drift and re-partitions from the new profile. Before a schedule exists,
    versions move unscheduled after the step (as ``inmem``).
    """

    def __init__(self, name: str, checkpointer, trainer, first_n: int = 3,
                 drift_threshold: float = 0.1, chunk_cap: int = 1 << 20):
        import capricorn_jax
        from capricorn_jax._src.scheduling import ScheduledTransfers, measure_link

        super().__init__(checkpointer)
        if len(checkpointer.sources) != 1:
            raise ValueError(f"{name} sends one replica per step inside the step; it needs "
                             f"--replicas=2, got {len(checkpointer.sources) + 1}")
        self.name, self.trainer, self.first_n = name, trainer, first_n
        boundaries = [f"block{i}" for i in range(trainer.cfg.n_layers)]
        self.link = measure_link(checkpointer.transport)
        self.transfers = ScheduledTransfers(checkpointer, trainer, boundaries, self.link,
                                            chunk_cap)
        self.detector = (capricorn_jax.DynamicityDetector(
            capricorn_jax.DetectorOptions(threshold=drift_threshold))
            if name == "capricorn" else None)
        self._profiles: list = []
        self._profile_next = True
        self._moved = None
        self._host_states: dict[int, dict] = {}
        self.repartitions: list[int] = []

    def compiled(self, step: int, factors) -> bool:
        """Whether step ``step`` would run an already-compiled variant."""
        if self._wants_profile():
            return False
        if self.transfers.schedule is not None and step in self._host_states:
            return self.transfers.has_step(factors)
        return self.trainer.has_step(factors)

    def _wants_profile(self) -> bool:
        if self.name == "gemini":
            return self.transfers.schedule is None
        return self._profile_next

    def step(self, step: int, factors, state, batch):
        """Runs training step ``step`` (0-based); returns (state, metrics)."""
        import capricorn_jax
        from capricorn_jax._src.partitioner import windows_from_profile
        from capricorn_jax._src.scheduling import average_windows

        self._moved = None
        if self._wants_profile():
            profiled = capricorn_jax.make_profiled_step(self.trainer, factors)
            state, out, profile = profiled(state, batch)
            self._profiles.append(profile)
            if self.name == "gemini" and len(self._profiles) >= self.first_n:
                self.transfers.repartition(average_windows(self._profiles[1:] or self._profiles,
                                                           windows_from_profile))
                self.repartitions.append(step)
            elif self.name == "capricorn" and len(self._profiles) >= 2:
                self.transfers.repartition(windows_from_profile(profile))
                self.repartitions.append(step)
        elif self.transfers.schedule is not None and step in self._host_states:
            trailer = self.ckpt.trailer_rows(self._host_states[step])
            state, out, moved = self.transfers.step_fn(factors)(state, batch, trailer)
            self._moved = (step, moved)
        else:
            state, out = self.trainer.step_fn(factors)(state, batch)
        if self.detector is not None:
            tpe = np.asarray(out["tokens_per_expert"])
            decision = self.detector.observe(step, tpe)
            if self._profile_next:
                self.detector.record_profile(step, tpe, {})
            self._profile_next = decision.profile_next
        return state, out

    def save(self, step: int, state: Any, host_state: dict) -> dict:
        self._host_states = {step: host_state}  # the next step moves this version
        if self._moved is None:
            return super().save(step, state, host_state)
        version, moved = self._moved
        report = self.ckpt.save_transferred(version, moved["own"], [moved["received"]])
        self.bytes_per_step = report.bytes
        return {"bytes": report.bytes, "store_bytes": report.store_bytes,
                "committed": report.committed, "replicated": report.replicated,
                "skipped": report.skipped, "under_replicated": report.under_replicated,
                "moved_in_step": version}

    def close(self) -> None:
        self.ckpt.close()
