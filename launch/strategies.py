"""Checkpoint strategies on one interface, for launch.train and launch.bench.

Every strategy is called the same way after each training step:
``save(step, state, host_state) -> list[dict]`` (the ``checkpoint`` events
of the versions it committed: ``version``, ``bytes``, ...), ``finish`` after
the last step (what ``save`` left unsaved) and ``close()`` at the end.
``none`` does nothing; ``blocking`` is a TorchSnapshot-like synchronous
checkpoint; ``orbax_async`` is plain Orbax CheckpointManager async saves to a
RAM disk, what a JAX user does today; ``inmem`` is capricorn_jax's in-memory
tier (every step to host RAM and m-1 peers). ``gemini`` and ``capricorn``
(scheduled chunks) build on ``inmem``; ``pec`` is ``inmem`` with partial
expert checkpointing (K of N experts per version).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

# "pec": inmem with partial expert checkpoints; "capricorn_pec": capricorn with them.
STRATEGIES = ("none", "blocking", "orbax_async", "inmem", "gemini", "capricorn", "pec",
              "capricorn_pec")


class NoCheckpoint:
    name = "none"
    bytes_per_step = 0

    def save(self, step: int, state: Any, host_state: dict) -> list[dict]:
        return []

    def finish(self, step: int, state: Any, host_state: dict) -> list[dict]:
        return []

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

    def save(self, step: int, state: Any, host_state: dict) -> list[dict]:
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
        return [{"version": step, "bytes": total}]

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
        return [{"version": step, "bytes": self.bytes_per_step}]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


class InMemory:
    """capricorn_jax's in-memory tier with the unscheduled (after-step) transfer."""

    name = "inmem"

    def __init__(self, checkpointer):
        self.ckpt = checkpointer
        self.bytes_per_step = 0

    def _event(self, version: int, report) -> dict:
        self.bytes_per_step = report.bytes
        event = {"version": version, "bytes": report.bytes, "store_bytes": report.store_bytes,
                 "store_kib_per_host": report.store_kib_per_host,
                 "committed": report.committed, "replicated": report.replicated,
                 "skipped": report.skipped, "under_replicated": report.under_replicated}
        if report.pec_k is not None:
            event.update(pec_k=report.pec_k, plt=report.pec_plt)
        return event

    def save(self, step: int, state: Any, host_state: dict,
             tokens_per_expert: Any = None) -> list[dict]:
        """Version ``step``; with PEC, ``tokens_per_expert`` of the step that made it."""
        pec = {} if self.ckpt.pec is None else {"tokens_per_expert": tokens_per_expert}
        return [self._event(step, self.ckpt.save(step, state, host_state, **pec))]

    def finish(self, step: int, state: Any, host_state: dict) -> list[dict]:
        """After the last step: saves what ``save`` left unsaved (nothing here)."""
        return []

    def close(self) -> None:
        self.ckpt.close()


class Scheduled(InMemory):
    """``gemini`` / ``capricorn``: version t's chunks move inside step t.

    Version t is the state step t starts from; the scheduled variant of step t
    packs it and moves its chunks at the layer boundaries the schedule names,
    and ``save`` after step t commits it (``InMemoryCheckpointer.save_transferred``).
    The schedule comes from layer profiles (``windows_from_profile``): gemini
    builds it once from the profiles of its first ``first_n`` steps and keeps
    it; capricorn re-partitions from every new (warm) profile, and profiles
    when the dynamicity detector sees the expert load drift. A step that is
    profiled, or runs before a schedule exists, moves no chunks: its version
    moves unscheduled after the step (as ``inmem``). ``finish`` saves the last
    state, which no later step moves.

    Two drivers: ``step`` decides profiling itself (launch.bench); launch.train
    decides it with its StepProfiling and calls ``unprofiled_step`` and
    ``on_profile``.
    """

    def __init__(self, name: str, checkpointer, trainer, first_n: int = 3,
                 drift_threshold: float = 0.1, chunk_cap: int = 1 << 20):
        import capricorn_jax
        from capricorn_jax._src.scheduling.transfers import ScheduledTransfers, measure_link

        super().__init__(checkpointer)
        if name not in ("gemini", "capricorn"):
            raise ValueError(f"unknown scheduled strategy {name!r}")
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
        self._profiles: list = []  # gemini: its first warm profiles, until it schedules
        self._profiled_variants: set[tuple[float, ...]] = set()
        self._profile_next = True
        self._moved = None
        self._host_states: dict[int, dict] = {}
        self._last_saved = -1
        self._planned_on = None  # the profile the schedule in force was planned on
        self._pec_transport = None  # PEC: the program of the last version moved
        self.repartitions: list[int] = []
        self.profiled_steps: list[int] = []  # every profiled step, cold ones too

    def compiled(self, step: int, factors, hooks: tuple = ()) -> bool:
        """Whether step ``step`` would run an already-compiled variant (bench).
        Under PEC it assumes the payload of the last version moved (K is fixed
        in the bench; a new K compiles a variant)."""
        if self._wants_profile():
            return False
        if self.transfers.schedule is not None and step in self._host_states:
            if self.ckpt.pec is not None and self._pec_transport is None:
                return False
            return self.transfers.has_step(factors, hooks, self._pec_transport)
        return self.trainer.has_step(factors, hooks)

    def _wants_profile(self) -> bool:
        if self.name == "gemini":
            return self.transfers.schedule is None
        return self._profile_next

    def unprofiled_step(self, step: int, factors, state, batch, hooks: tuple = ()):
        """Step ``step``, moving version ``step`` in it when a schedule exists;
        ``hooks``: extra boundary hooks (the bench's CollectiveProbe)."""
        if self.transfers.schedule is not None and step in self._host_states:
            host_state, tokens_per_expert = self._host_states[step]
            trailer = self.ckpt.trailer_rows(host_state)
            version, transport, gather = None, None, ()
            if self.ckpt.pec is not None:
                # PEC: decide version ``step`` now (K experts per layer), pack
                # and move only it; its payload has its own schedule.
                version = self.ckpt.plan_pec_version(step, tokens_per_expert)
                transport = self._pec_transport = version.transport
                if version.gather is not None:
                    gather = (jax.device_put(version.gather, self.trainer.replicated),)
            state, out, moved = self.transfers.step_fn(factors, hooks, transport)(
                state, batch, trailer, *gather)
            self._moved = (step, moved, version)
            return state, out
        return self.trainer.step_fn(factors, hooks)(state, batch)

    def on_profile(self, step: int, profile, cold: bool) -> dict | None:
        """Feeds the profile of step ``step``; re-partitions when the strategy does.

        Args:
          step: the profiled step.
          profile: its LayerProfile.
          cold: the step ran its variant for the first time (compile, cold
            caches): its durations are not windows.

        Returns:
          The ``repartition`` event's fields, or None when it kept the schedule.
        """
        from capricorn_jax._src.scheduling.partitioner import windows_from_profile
        from capricorn_jax._src.scheduling.transfers import average_windows

        self.profiled_steps.append(step)
        if self.name == "gemini":
            if self.transfers.schedule is not None:
                return None
            if not cold:
                self._profiles.append(profile)
            if len(self.profiled_steps) < self.first_n:
                return None
            # Gemini: the iteration timeline of the first n steps, kept for good.
            windows = average_windows(self._profiles or [profile], windows_from_profile)
            self._profiles.clear()
        else:
            if cold:
                return None
            windows = windows_from_profile(profile)
        self.transfers.repartition(windows)
        self._planned_on = profile
        self.repartitions.append(step)
        return {**self.transfers.summary(), "link_alpha_s": self.link.alpha_s,
                "link_bytes_per_s": self.link.bytes_per_s,
                "windows_s": [round(w.duration_s, 6) for w in windows]}

    def at_risk(self, detector, tokens_per_expert) -> bool:
        """Whether the schedule in force may overflow at this load (capricorn's
        gate on the detector's activations; ``scheduling.schedule_at_risk``)."""
        from capricorn_jax._src.scheduling.transfers import schedule_at_risk

        # The same answer on every host with no collective: a profiled step
        # (other collectives) must run on every host or on none, and every
        # input is the same everywhere: the expert load is replicated, and the
        # schedule, the profile it was planned on and the cost models' points
        # are host 0's (only agreed profiles reach them, ``agree_profile``).
        return schedule_at_risk(self.transfers.schedule, detector, tokens_per_expert,
                                self._planned_on, self.trainer.cfg.moe_layers)

    def step(self, step: int, factors, state, batch, hooks: tuple = ()):
        """Runs training step ``step`` (0-based), deciding profiling itself (bench);
        ``hooks`` go to an unprofiled step only (a profiled one has its own marks)."""
        import capricorn_jax
        from capricorn_jax._src.scheduling.transfers import agree_profile, moe_durations

        profile, cold = None, False
        if self._wants_profile():
            factors = tuple(float(f) for f in factors)
            cold = factors not in self._profiled_variants
            self._profiled_variants.add(factors)
            profiled = capricorn_jax.make_profiled_step(
                self.trainer, factors, capricorn_jax.gpt_moe_all_to_alls(self.trainer, factors))
            state, out, profile = profiled(state, batch)
            if not cold:
                profile = agree_profile(profile)
            self.on_profile(step, profile, cold)
        else:
            state, out = self.unprofiled_step(step, factors, state, batch, hooks)
        if self.detector is not None:
            tpe = np.asarray(out["tokens_per_expert"])
            if profile is not None:
                self.detector.record_profile(step, tpe, {} if cold else moe_durations(
                    profile, self.trainer.cfg.moe_layers))
            decision = self.detector.observe(step, tpe)
            # A cold profile is no measurement: profile again; else only when
            # the load drifted and the schedule may no longer fit.
            self._profile_next = cold or (decision.profile_next
                                          and self.at_risk(self.detector, tpe))
        return state, out

    def save(self, step: int, state: Any, host_state: dict,
             next_profiled: bool | None = None, tokens_per_expert: Any = None) -> list[dict]:
        """After step ``step - 1``: commits the version moved inside it.

        Version ``step`` (``state``) is then either deferred, when step ``step``
        will move it (a schedule exists and that step is not profiled), or
        saved now, unscheduled. A version is never moved twice.

        Args:
          step, state, host_state: version ``step``.
          next_profiled: whether step ``step`` will be profiled; None: as this
            strategy decides (``step`` driver).
          tokens_per_expert: PEC: [L, N] of the step that made version
            ``step``; the version's experts are chosen when it is packed.

        Returns:
          The ``checkpoint`` events of the versions committed now: the one
          moved in the step, and ``step`` when it is saved now.
        """
        if next_profiled is None:
            next_profiled = self._wants_profile()
        will_move = self.transfers.schedule is not None and not next_profiled
        self._host_states = {step: (host_state, tokens_per_expert)} if will_move else {}
        moved, self._moved = self._moved, None
        events = []
        if moved is not None:
            version, payloads, pec_version = moved
            report = self.ckpt.save_transferred(version, payloads["own"],
                                                [payloads["received"]], version=pec_version)
            self._last_saved = version
            events.append({**self._event(version, report), "moved_in_step": version})
        if not will_move:
            self._last_saved = step
            events += super().save(step, state, host_state, tokens_per_expert)
        return events

    def finish(self, step: int, state: Any, host_state: dict) -> list[dict]:
        """Saves the final state (version ``step``), which no later step moves."""
        if self._last_saved == step:
            return []
        self._last_saved = step
        _, tokens_per_expert = self._host_states.get(step, (None, None))
        return super().save(step, state, host_state, tokens_per_expert)
