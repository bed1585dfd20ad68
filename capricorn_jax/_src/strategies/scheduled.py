"""``gemini`` and ``capricorn``: version t's chunks move inside step t.

Version t is the state step t starts from; the scheduled variant of step t
packs it and moves its chunks in the windows the schedule names, and
``save`` after step t commits it (``InMemoryCheckpointer.save_transferred``).
Under PEC (``capricorn_pec``: the checkpointer has PEC options) each version
is decided when its step starts, and only its K experts per layer move, on
a schedule of their own payload.

The strategy is made of two parts, chosen once, and keeps the lifecycle
between them:

* a planner (``strategies.planners``), chosen by the registry's
  ``StrategySpec.planner``: "fixed" (gemini: planned once on its first
  profiles, kept) or "replan" (capricorn: re-planned from its recent
  profiles, its models at a new load, and its windows' spills). It decides
  the windows of the schedule in force and takes the moved steps' window
  records (``scheduling.plan.spills.window_spills``);
* a mover (``strategies.movers``), chosen by ``chunk_path``: "in_graph"
  (collective-permutes inside the jitted step, GPU) or "threaded" (a sender
  thread over a TCP channel started by the step's marks, CPU); "auto" takes
  in_graph on GPU, threaded otherwise. It runs the step programs, moves a
  version's chunks and collects what arrived. On the threaded path the
  windows are the idle spans between a layer's all-to-alls (``spans``), so a
  window's bytes do not meet the all-to-all that begins its layer's
  backward; the in-graph path keeps one window per layer segment.

The lifecycle (this class): a step that is profiled, or runs before a
schedule exists, moves no chunks: its version is saved unscheduled after the
step (as ``inmem``). A version is never moved twice: ``save`` defers version
t when step t will move it, and saves it now otherwise; the next ``save``
commits it with the records its planner reads. ``finish`` saves the last
state, which no later step moves.

Design choice: the strategy does not decide which steps are profiled; the
profiling driver (``strategies.driver.ProfilingDriver``) does, for every
strategy alike, and hands this one its profiles (``on_profile``), asks its
gate (``allow_profile``), its re-plan at a new load (``replan_at_load``) and
its own request (``profile_requested``): each is the planner's answer.
Alternative not taken (the previous state): one class crossing both axes,
with a branch per strategy kind and a None check per chunk path in its
lifecycle, and a mixin reading the class's state for the window feedback.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from capricorn_jax._src.memory.tier.writer_door import TierWriter
from capricorn_jax._src.memory.wire.transport import Transport
from capricorn_jax._src.profiling.detector import DynamicityDetector
from capricorn_jax._src.profiling.layer_profile import LayerProfile
from capricorn_jax._src.profiling.policy import DEFAULT_FIRST_N
from capricorn_jax._src.scheduling.in_graph.transfers import ScheduledTransfers
from capricorn_jax._src.scheduling.plan.partitioner import LinkModel, Schedule
from capricorn_jax._src.strategies.base import (
    CheckpointEvent,
    HostState,
    Metrics,
    State,
    TrainStep,
)
from capricorn_jax._src.strategies.channel_loss import ChannelKeeper
from capricorn_jax._src.strategies.inmemory import InMemoryStrategy
from capricorn_jax._src.strategies.movers import MOVERS, Mover, Payload, resolve_chunk_path
from capricorn_jax._src.strategies.planners import PLANNERS, Planner

LIBRARY_PLANNERS = {"gemini": "fixed", "gemini_pec": "fixed",
                    "capricorn": "replan", "capricorn_pec": "replan"}
"""The planner of the library's own names when the caller names none (the
registry passes its spec's)."""


class ScheduledStrategy(InMemoryStrategy):
    """``gemini`` / ``capricorn`` (see the module docstring).

    Args:
      name: the strategy's name ("gemini", "capricorn", "capricorn_pec", or
        a registered one's); the checkpointer's PEC options decide what a
        version carries.
      checkpointer: the host's memory tier (``TierWriter``); one peer replica.
      train: the caller's TrainStep (the scheduled steps are built on it).
      first_n: the fixed planner's profiled steps (gemini).
      chunk_cap: the partitioner's largest chunk, in bytes.
      chunk_path: "auto", "in_graph" or "threaded" (module docstring).
      spans: plan on span windows
        (``scheduling.plan.partitioner.windows_from_profile``: the idle spans
        between a layer's all-to-alls, opened at their edges)
        rather than one window per layer segment; threaded path only (the
        in-graph path places chunks at boundaries). None: on the threaded
        path.
      planner: "fixed" or "replan" (``registry.PLANNERS``); None: the
        library's for ``name`` (``LIBRARY_PLANNERS``).
      background_plan: the planner's re-plans at a new load run on its own
        thread and come into force a step later (``planners``,
        ``plan_thread``), not inside the step that asked.

    Attributes:
      planner: its ``Planner``; mover: its ``Mover``.
    """

    plans_on_profiles = True

    def __init__(self, name: str, checkpointer: TierWriter, train: TrainStep,
                 first_n: int = DEFAULT_FIRST_N, chunk_cap: int = 1 << 20,
                 chunk_path: str = "auto", spans: bool | None = None,
                 planner: str | None = None, background_plan: bool = True) -> None:
        planner = planner or LIBRARY_PLANNERS.get(name)
        if planner not in PLANNERS:
            raise ValueError(f"scheduled strategy {name!r}: planner must be one of "
                             f"{tuple(PLANNERS)}, got {planner!r}")
        if len(checkpointer.sources) != 1:
            raise ValueError(f"{name} sends one replica per step inside the step; it needs "
                             f"--replicas=2, got {len(checkpointer.sources) + 1}")
        super().__init__(checkpointer, name)
        self.train = train
        self.chunk_path = resolve_chunk_path(chunk_path)
        mover_cls, planner_cls = MOVERS[self.chunk_path], PLANNERS[planner]
        if spans and not mover_cls.marks_edges:
            raise ValueError(f"{name}: span windows open at collective edges, which only the "
                             f"threaded chunk path marks; chunk_path={self.chunk_path!r}")
        self.spans = mover_cls.marks_edges if spans is None else spans
        self.mover: Mover = mover_cls.build(checkpointer, train, chunk_cap,
                                            time_windows=planner_cls.acts_on_windows)
        self.planner: Planner = planner_cls.create(checkpointer, self.mover.transfers,
                                                   train.moe_layers, self.spans, first_n,
                                                   background_plan)
        self.planner.windows_unused = self.mover.sends_at_once
        self._host_states: dict[int, tuple[HostState, np.ndarray | None]] = {}
        self._last_saved = -1
        self._pec_transport: Transport | None = None  # PEC: the program of the last version moved

    # --- the parts' state, as the launchers and tests read it ---

    @property
    def transfers(self) -> ScheduledTransfers:
        return self.mover.transfers

    @property
    def link(self) -> LinkModel:
        return self.mover.link

    @property
    def repartitions(self) -> list[int]:
        return self.planner.repartitions

    @property
    def repartition_sources(self) -> list[str]:
        return self.planner.repartition_sources

    @property
    def spill_requests(self) -> list[int]:
        return self.planner.spill_requests

    @property
    def window_model_replans(self) -> list[int]:
        return self.planner.window_model_replans

    @property
    def held_over(self) -> list[int]:
        return self.mover.held_over

    @property
    def keeper(self) -> ChannelKeeper | None:
        """The chunk channel's keeper (the threaded path's; the launcher's lag
        alarm reads its counts), None on the in-graph path."""
        return self.mover.keeper

    # --- the driver's hooks: the step programs (the mover's) ---

    @property
    def profiles_from_marks(self) -> bool:  # type: ignore[override]
        """The mover's step program is marked at every boundary and
        collective edge (the threaded path with native marks): a profiled
        step runs it (``run_profiled``)."""
        return self.mover.profiles_from_marks

    def run_profiled(self, train: TrainStep, step: int, factors: tuple[float, ...],
                     state: State, batch: jax.Array, estimates: tuple[dict[str, float] | None,
                                                                     float],
                     hooks: tuple = ()) -> tuple[State, Metrics, LayerProfile]:
        """Profiled step ``step`` on this strategy's own program: no version
        moves in it (``save`` saved version ``step`` unscheduled and sent a
        spread one whole); its marks are read after it into a
        ``LayerProfile`` (``Mover.run_profiled``)."""
        if not self.profiles_from_marks:
            raise RuntimeError(f"{self.name}: run_profiled needs the threaded path's native "
                               f"marks; the driver profiles with an instrumented variant")
        assert not self._moves(step)
        return self.mover.run_profiled(train, step, factors, state, batch, estimates, hooks)

    def _moves(self, step: int) -> bool:
        """Whether step ``step`` moves version ``step`` inside it."""
        return self.transfers.schedule is not None and step in self._host_states

    def has_step(self, train: TrainStep, step: int, factors: tuple[float, ...],
                 hooks: tuple = ()) -> bool:
        """Under PEC it assumes the payload of the last version moved (K is
        fixed in the bench; a new K compiles a variant)."""
        if self.mover.carrying_on or not self._moves(step):
            return self.mover.has_plain_step(train, factors, hooks)
        if self.ckpt.pec is not None and self._pec_transport is None:
            return False
        return self.mover.has_move_step(train, factors, hooks,
                                        self._pec_transport or self.ckpt.transport)

    def run_step(self, train: TrainStep, step: int, factors: tuple[float, ...], state: State,
                 batch: jax.Array, hooks: tuple = ()) -> tuple[State, Metrics]:
        """Step ``step``, moving version ``step`` in it when a schedule exists;
        ``hooks``: extra boundary hooks (the bench's CollectiveProbe). While a
        spread version has parts left, the step sends its next part instead."""
        if self.mover.carrying_on:
            return self.mover.carry_on(train, factors, state, batch, hooks)
        if not self._moves(step):
            return self.mover.plain_step(train, factors, hooks)(state, batch)
        host_state, tokens_per_expert = self._host_states[step]
        payload = Payload(self.ckpt.trailer_rows(host_state), self.ckpt.transport)
        if self.ckpt.pec is not None:
            # PEC: decide version ``step`` now (K experts per layer), pack and
            # move only it; its payload has its own schedule.
            version = self.ckpt.plan_pec_version(step, tokens_per_expert)
            payload.transport = self._pec_transport = version.transport
            payload.pec_version = version
            if version.gather is not None:
                payload.gather = (version.transport.gather_input(version.gather),)
        return self.mover.move(train, step, factors, state, batch, hooks, payload)

    # --- the driver's hooks: the plan (the planner's) ---

    def on_profile(self, step: int, profile: LayerProfile, cold: bool) -> dict[str, Any] | None:
        """Re-partitions from the profile when the planner does (fixed: once,
        after its first ``first_n`` profiles; replan: every warm profile)."""
        return self.planner.on_profile(step, profile, cold)

    def replan_at_load(self, step: int, detector: DynamicityDetector,
                       tokens_per_expert: np.ndarray) -> dict[str, Any] | None:
        return self.planner.replan_at_load(step, detector, tokens_per_expert)

    def allow_profile(self, detector: DynamicityDetector, tokens_per_expert: np.ndarray) -> bool:
        return self.planner.allow_profile(detector, tokens_per_expert)

    def profile_requested(self) -> bool:
        return self.planner.profile_requested()

    def settle_plan(self, step: int) -> dict[str, Any] | None:
        return self.planner.settle(step)

    # --- the lifecycle: save, defer, commit ---

    def save(self, step: int, state: State, host_state: HostState, *,
             tokens_per_expert: np.ndarray | None = None,
             next_step_profiled: bool = False) -> list[CheckpointEvent]:
        """After step ``step - 1``: commits the version moved inside it.

        Version ``step`` (``state``) is then either deferred, when step ``step``
        will move it (a schedule exists and that step is not profiled), or
        saved now, unscheduled. A version is never moved twice.

        Returns:
          The ``checkpoint`` events of the versions committed now: the one
          moved in the step, and ``step`` when it is saved now.
        """
        lost = self.mover.while_lost(step, self._event, tokens_per_expert)
        if lost is not None:  # no version moves until the chunk channel is back
            self._host_states = {}
            self._last_saved = step
            return lost
        if self.mover.carries_on(next_step_profiled):
            # A spread version still has steps to go: version ``step`` is not
            # taken (every host alike: the same schedule).
            self._host_states = {}
            report = self.ckpt.skip(
                step, tokens_per_expert if self.ckpt.pec is not None else None)
            return [self._event(step, report)]
        will_move = self.transfers.schedule is not None and not next_step_profiled
        self._host_states = {step: (host_state, tokens_per_expert)} if will_move else {}
        events = self._commit_moved(state, tokens_per_expert)
        if not will_move:
            self._last_saved = step
            events += super().save(step, state, host_state, tokens_per_expert=tokens_per_expert)
        return events

    def _commit_moved(self, state: State, load: np.ndarray | None = None) -> list[CheckpointEvent]:
        """Commits the version the last step(s) moved, if any: its event
        (``state``: the last step's, whose marks the in-graph path reads;
        ``load``: its tokens per expert, which the planner's window model
        reads). The planner notes the version's window records before the
        save's status round and reads the agreed note after it."""
        moved = self.mover.collect(state, self.planner.planned_on)
        if moved is None:
            return []
        version = moved.version
        if moved.dropped is not None:  # nothing usable arrived: no version here, the job goes on
            self._last_saved = version
            report = self.ckpt.drop(version, corrupt=moved.dropped == "corrupt")
            return [{**self._event(version, report), moved.dropped: True}]
        if moved.windows is not None:
            self.planner.on_windows(moved.windows, load)
        report = self.ckpt.save_transferred(  # in-step: its CRC32C verdict, for the writer
            version, moved.own, [moved.received], version=moved.pec_version,
            corrupt=None if moved.corrupt is None else [moved.corrupt])
        self._last_saved = version
        event = {**self._event(version, report), "moved_in_step": version, **moved.fields}
        if moved.windows is not None:
            event["windows"] = moved.windows
            self.planner.on_committed(version)
        return [event]

    def finish(self, step: int, state: State, host_state: HostState) -> list[CheckpointEvent]:
        """Saves the final state (version ``step``), which no later step moves;
        a spread version still on its way is sent whole and committed first
        (with the chunk channel lost on some host: abandoned on every host)."""
        self.mover.settle(step)
        events = self._commit_moved(state)
        if self._last_saved == step:
            return events
        self._last_saved = step
        _, tokens_per_expert = self._host_states.get(step, (None, None))
        return events + super().save(step, state, host_state,
                                     tokens_per_expert=tokens_per_expert)

    def close(self) -> None:
        self.planner.close()
        self.mover.close()
        super().close()

    def schedule(self) -> Schedule | None:
        return self.transfers.schedule

    def schedule_summary(self) -> dict[str, Any] | None:
        return {**self.transfers.summary(), **self.planner.summary(),
                "held_over_versions": self.mover.held_over}


__all__ = ["LIBRARY_PLANNERS", "ScheduledStrategy"]
