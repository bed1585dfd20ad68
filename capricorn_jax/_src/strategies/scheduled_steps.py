"""The steps of a ``TwoTierCheckpointManager``: the loop's one call per step.

``TwoTierCheckpointManager.train_step(loss_fn, ...)`` returns a
``ManagedStep``: ``state, metrics = step(state, batch)`` in the loop instead
of the user's own jitted step. Its first call builds the ``TrainStep`` from
the loss (``profiling.loss_step.make_train_step``, the batch as example);
with ``TwoTierOptions.schedule`` it also builds the scheduled strategy by
name over the manager's memory tier (``strategies.registry.build``) and the
``ProfilingDriver`` that runs every step (profiled, or moving a version).

The version semantics are the manager's (Orbax's): ``save(step, state)``
after the step that made ``state``. The scheduled strategy defers version
``step`` to the next step, which moves its chunks inside itself, and commits
it at the next ``save`` (``strategies.scheduled``). So the loop calls
``save`` after every step (two steps with no save between are refused: the
second would move a version again), and a version no step follows is saved
unscheduled: at ``save(force=True)`` (a preemption), at a second ``save``
with no step between, at ``wait_until_finished`` and at ``close`` (``flush``).

Design choice: the driver's step index is the label of the version the step
starts from (the last ``save``'s step, or the restored one), so the
strategy's "step t moves version t" holds whatever the loop's numbering.
Alternative not taken: a counter of our own, which would drift from the
labels after a restore or a skipped save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from capricorn_jax._src.memory.tier.checkpointer import InMemoryCheckpointer
from capricorn_jax._src.persistent.emergency_options import TwoTierOptions
from capricorn_jax._src.profiling.loss_step import TPE, LossTrainStep
from capricorn_jax._src.profiling.policy import ProfilePolicy, ProfilingOptions
from capricorn_jax._src.profiling.train_step import Metrics, State
from capricorn_jax._src.strategies import registry
from capricorn_jax._src.strategies.base import CheckpointEvent, HostState, Strategy
from capricorn_jax._src.strategies.driver import ProfilingDriver


def strategy_name(options: TwoTierOptions) -> str:
    """The registry's name of ``options.schedule`` (with PEC: ``<name>_pec``)."""
    assert options.schedule is not None
    name = options.schedule + ("_pec" if options.pec is not None else "")
    registry.spec(name)  # an unknown pair (gemini with PEC) is refused with the known names
    return name


def profiling_options(options: TwoTierOptions) -> ProfilingOptions:
    """The driver's options: ``options.profiling``, whose policy must be the
    schedule's (the registry's ``profile``), or that policy's defaults."""
    policy = registry.spec(strategy_name(options)).profile
    assert policy is not None, "a scheduled strategy names its profiling policy"
    if options.profiling is None:
        return ProfilingOptions(ProfilePolicy(policy))
    if options.profiling.policy.value != policy:
        raise ValueError(f"TwoTierOptions(schedule={options.schedule!r}) plans on the {policy} "
                         f"profiling policy; profiling= has {options.profiling.policy.value}")
    return options.profiling


class Scheduled:
    """The scheduled strategy and its driver, and the bookkeeping between the
    loop's steps and saves (module docstring)."""

    def __init__(self, options: TwoTierOptions, checkpointer: InMemoryCheckpointer,
                 train: LossTrainStep, version: int | None) -> None:
        name = strategy_name(options)
        profiling = profiling_options(options)
        if train.moe_layers == () and profiling.policy.value == "speculative":
            raise ValueError(f"TwoTierOptions(schedule={options.schedule!r}) re-plans on the "
                             f"experts' load: train_step needs tokens_per_expert=")
        self.strategy: Strategy = registry.build(name, registry.BuildArgs(
            train=train, checkpointer=checkpointer, first_n=profiling.first_n))
        self.driver = ProfilingDriver(train, self.strategy, profiling,
                                      next_factors=lambda metrics: ())
        self.events: list[dict[str, Any]] = []
        self.version = -1 if version is None else version  # what the next step starts from
        self._stepped = False
        self._load: np.ndarray | None = None  # the last step's tokens per expert
        # A version deferred to the next step, which has not run yet.
        self._pending: tuple[int, State, HostState, np.ndarray | None] | None = None

    def run(self, state: State, batch: jax.Array) -> tuple[State, Metrics]:
        if self._stepped:
            raise RuntimeError("with TwoTierOptions(schedule=...) the loop calls save(step, ...) "
                               "after every step: the step after it moves that version")
        if self._pending is not None and not _same(self._pending[1], state):
            raise ValueError(f"the step after save({self._pending[0]}) must start from the "
                             f"state saved (it moves that version's chunks)")
        outcome = self.driver.step(self.version, (), state, batch)
        self.events.extend(outcome.events)
        self._stepped, self._pending = True, None
        load = outcome.metrics.get(TPE)
        self._load = None if load is None else np.asarray(load)
        return outcome.state, outcome.metrics

    def save(self, step: int, state: State, host_state: HostState | None,
             force: bool) -> list[CheckpointEvent]:
        """The versions committed now; version ``step`` among them unless the
        next step moves it."""
        events = self.flush()  # a save with no step since the last deferred one
        events += self.strategy.save(step, state, host_state or {}, tokens_per_expert=self._load,
                                     next_step_profiled=force or self.driver.profile_next)
        deferred = all(e.get("version") != step for e in events)
        self._pending = (step, state, host_state or {}, self._load) if deferred else None
        self.version, self._stepped, self._load = step, False, None
        self.events.extend(events)
        return events

    def flush(self) -> list[CheckpointEvent]:
        """Saves the deferred version now (no step follows to move it)."""
        if self._pending is None:
            return []
        step, state, host_state, load = self._pending
        self._pending = None
        events = self.strategy.save(step, state, host_state, tokens_per_expert=load,
                                    next_step_profiled=True)
        self.events.extend(events)
        return events

    def restored(self, step: int) -> None:
        self.version, self._stepped, self._pending, self._load = step, False, None, None


class ManagedStep:
    """``state, metrics = step(state, batch)``: the loop's step through its
    manager (module docstring). ``train``: the ``LossTrainStep``, once built."""

    def __init__(self, build: Callable[[jax.Array], tuple[LossTrainStep, Scheduled | None]]
                 ) -> None:
        self._build = build
        self.train: LossTrainStep | None = None
        self.scheduled: Scheduled | None = None

    def __call__(self, state: State, batch: jax.Array) -> tuple[State, Metrics]:
        if self.train is None:
            self.train, self.scheduled = self._build(batch)
        if self.scheduled is None:
            return self.train(state, batch)
        return self.scheduled.run(state, batch)


def _same(a: Any, b: Any) -> bool:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(x is y for x, y in zip(leaves_a, leaves_b,
                                                                          strict=True))


__all__ = ["ManagedStep", "Scheduled", "profiling_options", "strategy_name"]
