"""The two interfaces between the library and a training loop.

``TrainStep`` (defined in ``profiling.train_step``, the lowest floor that
uses it, and re-exported here) is what the library asks of the caller's
trainer.

``Strategy`` is what a training loop asks of a checkpoint strategy:
``save`` after every step, ``finish`` after the last, ``close`` at the end,
``restore`` at start-up. The capabilities only some strategies have (running
the step themselves to move a version inside it, planning on layer profiles,
vetoing a profile, a schedule to report) are part of the same protocol with
no-op defaults, so a caller drives every strategy the same way and never asks
what a strategy is. A strategy subclasses ``Strategy`` to inherit them.

Design choice: structural protocols (``typing.Protocol``), so the launcher's
baselines and any user strategy need no library base class beyond the
defaults they choose to inherit, and the trainer needs none at all.
Alternative not taken: probing the objects (``hasattr(strategy, "step")``,
private ``trainer._step_with``), which let the library and its callers drift
apart silently.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from capricorn_jax._src.memory.tier.restore_info import NoCheckpoint
from capricorn_jax._src.profiling.train_step import Metrics, State, StepFn, TrainStep

if TYPE_CHECKING:
    import jax

    from capricorn_jax._src.memory.tier.restore_info import RestoreInfo
    from capricorn_jax._src.profiling.detector import DynamicityDetector
    from capricorn_jax._src.profiling.layer_profile import LayerProfile
    from capricorn_jax._src.scheduling.plan.partitioner import Schedule

HostState = dict[str, Any]
"""JSON-able per-host state saved with a version (data position, ...)."""
CheckpointEvent = dict[str, Any]
"""What a save committed: ``{"version": step, "bytes": ..., ...}`` (JSON-able)."""


class Strategy(Protocol):
    """A checkpoint strategy, as a training loop drives it.

    Lifecycle, per process: ``restore`` once before the first step; after
    each step t (0-based) ``save(t + 1, state, ...)`` with the state step t
    produced; after the last step ``finish``; then ``close``. Every host
    calls every method at the same points (a method may run collectives).

    The profiling driver (``strategies.driver.ProfilingDriver``) runs each
    step: a profiled step itself, any other through ``run_step``; it calls
    ``on_profile`` with every profile and ``allow_profile`` before profiling
    on the detector's word. Their defaults make a strategy that saves after
    the step and takes no interest in profiles.

    Attributes:
      name: the strategy's name (metrics, reports).
      bytes_per_step: bytes of this host's last saved version (0: none yet).
      plans_on_profiles: the strategy plans on layer profiles, so every host
        must see the same ones: the driver hands it host 0's durations.
      profiles_from_marks: the strategy's own step program is marked at every
        boundary and collective edge, so a profiled step runs it
        (``run_profiled``) instead of a separately compiled instrumented
        variant.
    """

    name: str
    bytes_per_step: int = 0
    plans_on_profiles: bool = False
    profiles_from_marks: bool = False

    def save(self, step: int, state: State, host_state: HostState, *,
             tokens_per_expert: np.ndarray | None = None,
             next_step_profiled: bool = False) -> list[CheckpointEvent]:
        """Called by the training loop after every step with version ``step``
        (the state that step ``step - 1`` produced).

        Args:
          step, state, host_state: the version and this host's JSON state.
          tokens_per_expert: [moe_layers, experts] of the step that made the
            version (partial expert checkpointing chooses experts by it).
          next_step_profiled: step ``step`` will run instrumented (the
            driver's ``profile_next``); a strategy that moves the version
            inside that step must then save it now.

        Returns:
          The versions committed by this call (``checkpoint`` events).
        """
        ...

    def finish(self, step: int, state: State, host_state: HostState) -> list[CheckpointEvent]:
        """Called once after the last step with the final version: saves what
        ``save`` left for a later step to move. Default: nothing left."""
        return []

    def close(self) -> None:
        """Called once at the end: waits for background work, frees resources."""

    def restore(self) -> tuple[State, RestoreInfo]:
        """Called once at start-up: the newest version every host can restore,
        (state, its RestoreInfo: step, tier, host_state, seconds...).

        Raises:
          NoCheckpoint: nothing to restore (start from scratch), as the
            managers' ``restore`` (one convention since 0.19.0).
        """
        raise NoCheckpoint(f"strategy {self.name!r} keeps no checkpoint to restore")

    def restore_or_none(self) -> tuple[State, RestoreInfo] | None:
        """0.18's convention: ``restore()``, or None where it raises
        ``NoCheckpoint``. Kept for one release."""
        try:
            return self.restore()
        except NoCheckpoint:
            return None

    # --- called by the profiling driver (no-op defaults) ---

    def run_step(self, train: TrainStep, step: int, factors: tuple[float, ...], state: State,
                 batch: jax.Array, hooks: tuple = ()) -> tuple[State, Metrics]:
        """Runs step ``step`` when it is not profiled. Default: the plain step."""
        return train.step_fn(factors, hooks)(state, batch)

    def has_step(self, train: TrainStep, step: int, factors: tuple[float, ...],
                 hooks: tuple = ()) -> bool:
        """Whether ``run_step`` for step ``step`` would run a compiled program."""
        return train.has_step(factors, hooks)

    def run_profiled(self, train: TrainStep, step: int, factors: tuple[float, ...],
                     state: State, batch: jax.Array, estimates: tuple[dict[str, float] | None,
                                                                     float],
                     hooks: tuple = ()) -> tuple[State, Metrics, LayerProfile]:
        """Runs profiled step ``step`` on the strategy's own marked program
        (only where ``profiles_from_marks``); ``estimates``: the collectives'
        (``profiler.collective_estimates``). Returns (state, metrics, this
        process's profile of the step)."""
        raise RuntimeError(f"{self.name}: its step carries no profile marks (profiles_from_marks "
                           f"is False); the driver profiles with an instrumented variant")

    def on_profile(self, step: int, profile: LayerProfile, cold: bool) -> dict[str, Any] | None:
        """Takes the profile of step ``step`` (``cold``: the step ran its
        variant for the first time, its durations are no measurement).

        Returns:
          The fields of a ``repartition`` event when the strategy re-planned
          from it, else None (the default).
        """
        return None

    def allow_profile(self, detector: DynamicityDetector, tokens_per_expert: np.ndarray) -> bool:
        """Whether a profile the detector asks for is worth taking at this
        load (the same answer on every host). Default: always."""
        return True

    def replan_at_load(self, step: int, detector: DynamicityDetector,
                       tokens_per_expert: np.ndarray) -> dict[str, Any] | None:
        """Called after step ``step`` instead of profiling the next step, when
        the detector asked for a profile and ``allow_profile`` agreed: the
        strategy may re-plan from its own model of the step at this load.

        Returns:
          The fields of a ``repartition`` event when it re-planned, ``{}``
          when its plan at this load is in force already (either way no
          profile is taken), else None (the default: the profile is taken).
        """
        return None

    def profile_requested(self) -> bool:
        """Whether the strategy asks for the next step to be profiled, whatever
        the trigger says (the same answer on every host). Default: never."""
        return False

    def settle_plan(self, step: int) -> dict[str, Any] | None:
        """Called after step ``step`` before the other planning calls: puts
        in force a plan prepared off the training thread since the last step
        (the same step on every host). Returns the fields of a
        ``repartition`` event when it did, else None (the default)."""
        return None

    def schedule(self) -> Schedule | None:
        """The in-step transfer schedule in force (None: none)."""
        return None

    def schedule_summary(self) -> dict[str, Any] | None:
        """A JSON-able account of the schedules (None: the strategy has none)."""
        return None

    def blocked_phases(self) -> dict[str, float]:
        """Seconds the training thread spent, per phase, in this strategy's
        work since the last call (its ``run_step`` and ``save``: pack, status
        round, bookkeeping, ...; ``memory.phase_clock``), reset to none.
        Default: no phases measured."""
        return {}

    def resume_at(self, step: int) -> None:
        """The caller ran the steps before ``step`` without this strategy
        (benchmarks interleave strategies); the next ``save`` is version
        ``step + 1``. Default: nothing to catch up."""



__all__ = ["CheckpointEvent", "HostState", "Metrics", "State", "StepFn", "Strategy", "TrainStep"]
