"""The scheduled strategies' planners: when to plan, on which windows, and
what the moved steps' windows tell the plan.

A planner decides the windows a version's chunks are partitioned into and
hands them to the schedule in force (``PlanTarget``: the strategy's
``scheduling.in_graph.transfers.ScheduledTransfers``, which partitions every
payload size over them; the strategy's mover reads the schedule from the
same object). It sees no chunk move: the strategy hands it each profile
(``on_profile``), asks its gate and its own request (``allow_profile``,
``replan_at_load``, ``profile_requested``) for the profiling driver, and
after each moved version the per-window records of its path
(``scheduling.plan.spills.window_spills``): ``on_windows`` before the save's
status round, ``on_committed`` after it.

* ``FixedPlanner`` (``StrategySpec.planner`` "fixed", gemini): the mean
  windows of the warm profiles among its first ``first_n`` profiles (Gemini
  profiles the first iterations and assumes the timeline stays constant),
  partitioned once and kept; it only reports the spills.
* ``ReplanningPlanner`` ("replan", capricorn): re-partitions from every new
  warm profile, each window the shortest it had in its last
  ``PLAN_PROFILES`` warm profiles, so the chunks follow the experts' load;
  gates the detector's profiles on the schedule's risk at the new load
  (``scheduling.plan.policies.schedule_at_risk``); re-plans without a
  profile where its models cover the load (the expert windows' model,
  ``scheduling.plan.window_model``, then the segments' cost models,
  ``scheduling.plan.load_windows``); and asks for a profile when its windows
  spilled in most of host 0's last ``SPILL_WINDOW`` moved versions (agreed
  through the checkpointer's status round), so a schedule planned on slower
  or faster steps than today's is re-planned.

Both note this host's spill count in the status round (``_note_spills``),
so every host's status vector is the same whichever planner runs.

Design choice: a planner object per ``StrategySpec.planner`` value, owning
the plan's state (the profiles kept, the schedule's profile, the spill
count, the window model) and driving the schedule through the small
``PlanTarget`` interface, so it is tested with synthetic profiles and no
JAX process (tests/test_planners.py) and the chunk paths never ask which
planner runs. Alternative not taken (the previous state): a mixin of the
strategy (``WindowFeedback``) reading thirteen attributes of the class it
was mixed into, with ``kind == "capricorn"`` tests in every decision.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from capricorn_jax._src.multihost.agree import agree_measured
from capricorn_jax._src.profiling.layer_profile import LayerProfile, moe_segments
from capricorn_jax._src.profiling.policy import DEFAULT_FIRST_N
from capricorn_jax._src.scheduling.plan.load_windows import windows_at_load
from capricorn_jax._src.scheduling.plan.partitioner import (
    LinkModel,
    Schedule,
    Window,
    windows_from_profile,
)
from capricorn_jax._src.scheduling.plan.policies import (
    average_windows,
    schedule_at_risk,
    shortest_windows,
)
from capricorn_jax._src.scheduling.plan.window_model import WindowModel, moved_windows, window_key
from capricorn_jax._src.strategies.plan_thread import Job, PlanThread, plan_stream

if TYPE_CHECKING:
    from capricorn_jax._src.profiling.detector import DynamicityDetector

PLAN_PROFILES = 3
"""capricorn plans on the shortest of each window over its last this many warm
profiles: one profile is one noisy sample, and on this box a profile that
caught a slow step (1.3-1.7x the others) planned the whole version into one
window that the next steps did not give (BUILD_NOTES, "Where the CPU goes")."""
SPILL_WINDOW = 4
"""capricorn, both paths: the moved versions over which host 0 counts the
ones in which a window spilled; more than half of them ask for a profile."""
SPILL_TOLERANCE_S = 0.001
"""A window spills when its chunks' modelled link time exceeds its measured
idle time by more than this (the marks' own jitter on this box is ~0.1-1 ms)."""
SPILL_LATE_BYTES = 64 << 10
"""Where the bytes of a window are measured (the threaded deadline sender's
records), a spilled window counts only when more than this many of its bytes
met the collective that closed it (one deadline frame,
``scheduling.threaded.sender.PIECE_BYTES``): a window shorter than planned
otherwise only carried its bytes on, which costs the step nothing."""


class PlanTarget(Protocol):
    """Where a planner's windows go: the schedule in force
    (``ScheduledTransfers``, or a test's recording stand-in)."""

    schedule: Schedule | None
    link: LinkModel

    def repartition(self, windows: Sequence[Window]) -> Schedule:
        """Partitions the payload into ``windows`` (host 0's durations)."""
        ...

    def prepare(self, windows: Sequence[Window], agreed: bool = False) -> Any:
        """The schedule of ``windows``, not yet in force (any thread)."""
        ...

    def install(self, prepared: Any) -> Schedule:
        """Puts a prepared schedule in force (the training thread)."""
        ...

    def summary(self) -> dict[str, Any]:
        """The schedule in force, JSON-able."""
        ...


class StatusNote(Protocol):
    """What a planner asks of the memory tier: the small integer its status
    round carries (``TierWriter.note_status`` / ``agreed_note``)."""

    @property
    def agreed_note(self) -> int | None: ...

    def note_status(self, value: int) -> None: ...


class Planner:
    """What a scheduled strategy asks of its planner (module docstring);
    the defaults are the fixed plan's: profile when the driver says, no
    re-plan without a profile, no request of its own.

    Args:
      ckpt: the memory tier's status round (``StatusNote``).
      target: the schedule in force (``PlanTarget``).
      moe_layers: the model's MoE layer indices (``TrainStep.moe_layers``).
      spans: plan on span windows (the idle spans between a layer's
        all-to-alls, ``scheduling.plan.partitioner.windows_from_profile``),
        not one window per layer segment.
      background: re-plans at a new load run on the planner's own thread
        (``plan_thread``) and come into force one step later (``settle``);
        else on the calling thread, at once.

    Attributes:
      acts_on_windows: the plan changes on the moved steps' window records,
        so a chunk path that pays to time them (the in-graph window clock)
        times them.
      planned_on: the profile of the schedule in force (None: none yet).
      repartitions, repartition_sources: the step of each re-partition and
        what it was planned on ("profile", "cost_model", "window_model").
      spill_requests: versions after which it asked for a profile.
      window_model_replans: steps re-planned by the window model.
    """

    acts_on_windows: ClassVar[bool] = False
    windows_unused = False
    """Set by the strategy when its mover sends each version whole at its
    step's start (``InMemoryOptions.chunk_send="at_once"``): once a schedule
    exists (the chunking the sender follows), a re-plan or a profile changes
    nothing a step does, so neither is made (each re-plan cost the timed
    step ~5 ms at the priority point; BUILD_NOTES)."""

    def __init__(self, ckpt: StatusNote, target: PlanTarget, moe_layers: Sequence[int],
                 spans: bool, background: bool = False) -> None:
        self.ckpt, self.target, self.moe_layers, self.spans = ckpt, target, moe_layers, spans
        self.background = background
        self.planned_on: LayerProfile | None = None
        self.repartitions: list[int] = []
        self.repartition_sources: list[str] = []
        self.spill_requests: list[int] = []
        self.window_model_replans: list[int] = []
        # Whether a window spilled in each of this host's last moved versions
        # under the schedule in force.
        self._spills: collections.deque[bool] = collections.deque(maxlen=SPILL_WINDOW)

    @classmethod
    def create(cls, ckpt: StatusNote, target: PlanTarget, moe_layers: Sequence[int],
               spans: bool, first_n: int = DEFAULT_FIRST_N, background: bool = False
               ) -> Planner:
        """The planner from the strategy's arguments (``first_n``: the fixed
        planner's; the others take none)."""
        return cls(ckpt, target, moe_layers, spans, background)

    # --- what the strategy asks (the driver's hooks) ---

    def on_profile(self, step: int, profile: LayerProfile, cold: bool) -> dict[str, Any] | None:
        """Takes the profile of step ``step``; the ``repartition`` event's
        fields when it re-planned from it, else None."""
        raise NotImplementedError

    def allow_profile(self, detector: DynamicityDetector, tokens_per_expert: np.ndarray) -> bool:
        """Whether a profile the detector asks for is worth taking at this load."""
        return True

    def replan_at_load(self, step: int, detector: DynamicityDetector,
                       tokens_per_expert: np.ndarray) -> dict[str, Any] | None:
        """A re-plan at this load without a profile (``Strategy.replan_at_load``)."""
        return None

    def profile_requested(self) -> bool:
        """Whether it asks for the next step to be profiled."""
        return False

    def settle(self, step: int) -> dict[str, Any] | None:
        """After step ``step``, before any other hook: puts in force the
        re-plan its thread prepared since the last step (``background``);
        the ``repartition`` event's fields, or None."""
        return None

    def close(self) -> None:
        """Ends the planner's thread, if any."""

    # --- the moved steps' windows ---

    def on_windows(self, records: list[dict[str, Any]],
                   tokens_per_expert: np.ndarray | None) -> None:
        """The window records of a moved version, before the save's status
        round (which carries the spill note); ``tokens_per_expert``: the
        load of the step that moved it."""
        self._note_spills(records)

    def on_committed(self, version: int) -> None:
        """After the status round of the save that committed ``version``."""

    def summary(self) -> dict[str, Any]:
        return {"repartition_steps": self.repartitions,
                "repartition_sources": self.repartition_sources,
                "spill_request_versions": self.spill_requests,
                "window_model_replan_steps": self.window_model_replans}

    # --- shared ---

    def _windows_of(self, profile: LayerProfile) -> list[Window]:
        """The windows a profile gives this plan (span windows or not)."""
        return windows_from_profile(profile, spans=self.spans)

    def _repartition(self, step: int, windows: list[Window], source: str,
                     prepared: Any = None) -> dict[str, Any]:
        """Re-partitions the payload into ``windows`` (planned on ``source``;
        ``prepared``: already partitioned, ``PlanTarget.prepare``); the
        fields of its ``repartition`` event."""
        if prepared is None:
            self.target.repartition(windows)
        else:
            self.target.install(prepared)
        self.repartitions.append(step)
        self.repartition_sources.append(source)
        link = self.target.link
        return {**self.target.summary(), "link_alpha_s": link.alpha_s,
                "link_bytes_per_s": link.bytes_per_s, "source": source,
                "windows_s": [round(w.duration_s, 6) for w in windows]}

    def _note_spills(self, windows: list[dict[str, Any]]) -> None:
        """Counts this host's recent spilled versions into the status note of
        the save about to run: (schedules so far) * 1000 + spilled versions
        among the last ``SPILL_WINDOW`` under the schedule in force."""
        # The modelled spill (a window shorter than planned), not the measured
        # lateness alone: a new profile fixes the first; the second also holds
        # the link model's error, which a profile would not change. With the
        # deadline sender (bytes measured per window) a spill counts only when
        # it cost: bytes met the collective (issue 38: at R 0.79 capricorn
        # re-profiled 31 of 207 steps, 21 KB per step meeting a collective).
        self._spills.append(any(
            w["spill_s"] > SPILL_TOLERANCE_S
            and (w.get("bytes_late") is None or w["bytes_late"] > SPILL_LATE_BYTES)
            for w in windows))
        self.ckpt.note_status(len(self.repartitions) * 1000 + sum(self._spills))


class FixedPlanner(Planner):
    """Gemini's plan: built once from the warm profiles among its first
    ``first_n`` profiles (their mean windows) and kept for good; a cold
    profile counts towards ``first_n`` but is not averaged (its durations
    are a compile's). It reports its spills and acts on none."""

    def __init__(self, ckpt: StatusNote, target: PlanTarget, moe_layers: Sequence[int],
                 spans: bool, first_n: int = DEFAULT_FIRST_N, background: bool = False) -> None:
        super().__init__(ckpt, target, moe_layers, spans, background)
        self.first_n = first_n
        self._profiles: list[LayerProfile] = []  # its warm profiles, until it plans
        self._seen = 0  # profiles seen (cold ones too)

    @classmethod
    def create(cls, ckpt: StatusNote, target: PlanTarget, moe_layers: Sequence[int],
               spans: bool, first_n: int = DEFAULT_FIRST_N, background: bool = False
               ) -> Planner:
        return cls(ckpt, target, moe_layers, spans, first_n, background)

    def on_profile(self, step: int, profile: LayerProfile, cold: bool) -> dict[str, Any] | None:
        if self.repartitions:
            return None
        self._seen += 1
        if not cold:
            self._profiles.append(profile)
        if self._seen < self.first_n:
            return None
        # The iteration timeline of the first n steps, kept for good.
        windows = average_windows(self._profiles or [profile], self._windows_of)
        self._profiles.clear()
        self.planned_on = profile
        return self._repartition(step, windows, "profile")


class ReplanningPlanner(Planner):
    """Capricorn's plan: re-planned on every warm profile, at a new load from
    its models, and asked for again when its windows spill (module docstring)."""

    acts_on_windows = True

    def __init__(self, ckpt: StatusNote, target: PlanTarget, moe_layers: Sequence[int],
                 spans: bool, background: bool = False) -> None:
        super().__init__(ckpt, target, moe_layers, spans, background)
        self._thread = PlanThread() if background else None
        self._stream = plan_stream() if background else ""
        self._pending: Job | None = None  # a re-plan its thread is preparing
        self.model_profile_requests: list[int] = []  # steps a background re-plan asked one at
        self._recent: collections.deque[LayerProfile] = collections.deque(maxlen=PLAN_PROFILES)
        self._wants_profile = False
        self._plan_windows: list[Window] = []  # the windows of the plan in force
        self._modelled_windows: list[Window] | None = None  # the models' plan in force, if any
        # The expert windows' model, fitted on every moved step's records.
        self.window_model = WindowModel()

    @property
    def _settled(self) -> bool:
        """The plan in force is the last one (``windows_unused``)."""
        return self.windows_unused and self.target.schedule is not None

    def on_profile(self, step: int, profile: LayerProfile, cold: bool) -> dict[str, Any] | None:
        if cold or self._settled:
            return None
        self._recent.append(profile)
        windows = shortest_windows(list(self._recent), self._windows_of)
        self._wants_profile = False  # a warm profile answers a spill's request
        self._spills.clear()
        self.planned_on, self._modelled_windows = profile, None
        return self._repartition(step, windows, "profile")

    def _repartition(self, step: int, windows: list[Window], source: str,
                     prepared: Any = None) -> dict[str, Any]:
        event = super()._repartition(step, windows, source, prepared)
        self._plan_windows = list(windows)
        return event

    def allow_profile(self, detector: DynamicityDetector, tokens_per_expert: np.ndarray) -> bool:
        """Whether the schedule in force may overflow at this load. The same
        answer on every host with no collective: a profiled step (other
        collectives) must run on every host or on none, and every input is
        the same everywhere: the expert load is replicated, and the
        schedule, the profile it was planned on and the cost models' points
        are host 0's (the driver hands a planning strategy agreed profiles
        only)."""
        if self._settled:
            return False
        return schedule_at_risk(self.target.schedule, detector, tokens_per_expert,
                                self.planned_on, self.moe_layers)

    def replan_at_load(self, step: int, detector: DynamicityDetector,
                       tokens_per_expert: np.ndarray) -> dict[str, Any] | None:
        """When the load shifted enough to put its schedule at risk,
        re-partitions on the windows its models predict at this load, with
        no profiled step: the expert windows' model first
        (``_replan_by_window_model``), then the segments' cost models
        (``scheduling.plan.load_windows``) where every filled MoE window's
        model covers the load. The same answer on every host: the models are
        fitted on host 0's agreed profiles and the load is replicated (as for
        ``allow_profile``, the detector reads every expert's load).

        Returns:
          The ``repartition`` event's fields; ``{}`` when the schedule in
          force already is the model's at this load (no profile either);
          None to profile."""
        if self._settled:
            return {}
        if self.planned_on is None:
            return None
        if self._thread is not None:
            return self._submit(step, detector, tokens_per_expert)
        by_model = self._replan_by_window_model(step, tokens_per_expert)
        if by_model is not None:
            return by_model
        windows = windows_at_load(self.planned_on, detector, tokens_per_expert,
                                  self.moe_layers, spans=self.spans)
        if windows is None:
            return None
        if windows == self._modelled_windows:
            return {}  # the plan in force already is the model's at this load
        self._modelled_windows = windows
        self._spills.clear()  # a new schedule in force: its spills count afresh
        return self._repartition(step, windows, "cost_model")

    # --- the re-plans at a new load, on the planner's thread (``background``) ---

    def _submit(self, step: int, detector: DynamicityDetector,
                tokens_per_expert: np.ndarray) -> dict[str, Any]:
        """``replan_at_load`` with its agreement and partition on the
        planner's thread: what its models say at this load is taken here (the
        window model's windows and the segment models' fallback, read on
        this thread), host 0's answer is agreed and partitioned there, and
        ``settle`` puts it in force after the next step (or asks for a
        profile where no model covers the load). Returns ``{}``: no profile
        now (one already on its way waits for its answer, as a profile
        would)."""
        if self._pending is not None:
            return {}
        assert self._thread is not None and self.planned_on is not None  # replan_at_load's
        plan, mine = list(self._plan_windows), self._model_windows(tokens_per_expert)
        fallback = None if mine is not None else windows_at_load(
            self.planned_on, detector, tokens_per_expert, self.moe_layers, spans=self.spans)
        modelled = self._modelled_windows
        self._pending = self._thread.submit(
            step, lambda: self._decide(plan, mine, fallback, modelled))
        return {}

    def _decide(self, plan: list[Window], mine: dict[int, float] | None,
                fallback: list[Window] | None, modelled: list[Window] | None) -> Any:
        """On the planner's thread: host 0's answer, in one agreement on the
        planner's stream (the window model's windows, code n >= 0 moved; the
        segment models' windows, code -1; neither covers the load, code -2),
        then its schedule prepared. Returns None (the plan stands),
        "profile", or (source, windows, prepared)."""
        if mine is not None:
            values = [float(len(mine)), *(mine.get(i, w.duration_s) for i, w in enumerate(plan))]
        elif fallback is not None:
            values = [-1.0, *(w.duration_s for w in fallback)]
        else:
            values = [-2.0]
        code, *durations = agree_measured(values, what="a re-plan at a new load",
                                          stream=self._stream)
        if code == -2:
            return "profile"
        if code == 0:
            return None  # every expert window within its noise
        if code > 0:
            source, base = "window_model", plan
        elif fallback is None:
            raise RuntimeError("host 0's segment models cover the load and this host's do not: "
                               "the hosts' models differ")
        else:
            source, base = "cost_model", fallback
        windows = [dataclasses.replace(w, duration_s=d)
                   for w, d in zip(base, durations, strict=True)]
        if source == "cost_model" and windows == modelled:
            return None  # the plan in force already is the model's at this load
        return source, windows, self.target.prepare(windows, agreed=True)

    def settle(self, step: int) -> dict[str, Any] | None:
        job, self._pending = self._pending, None
        if job is None:
            return None
        outcome = job.outcome()
        if outcome is None or self._settled:
            return None
        if outcome == "profile":  # no model covers the load: profile the next step
            self._wants_profile = True
            self.model_profile_requests.append(step)
            return None
        source, windows, prepared = outcome
        self._modelled_windows = windows
        self._spills.clear()  # a new schedule in force: its spills count afresh
        if source == "window_model":
            self.window_model_replans.append(step)
        return {**self._repartition(step, windows, source, prepared), "decided_at": job.step}

    def close(self) -> None:
        """Waits for a re-plan on its way (every host's thread agrees on it:
        none is left in a store round trip at exit), then ends the thread."""
        if self._pending is not None:
            try:
                self._pending.outcome()
            except (RuntimeError, TimeoutError):
                pass  # ending anyway
            self._pending = None
        if self._thread is not None:
            self._thread.close()

    def profile_requested(self) -> bool:
        """The windows its schedule filled spilled in most of the last
        checked versions (the same answer on every host)."""
        return self._wants_profile and not self._settled

    def on_windows(self, records: list[dict[str, Any]],
                   tokens_per_expert: np.ndarray | None) -> None:
        self._observe_windows(records, tokens_per_expert)
        super().on_windows(records, tokens_per_expert)

    def on_committed(self, version: int) -> None:
        """When host 0's note (agreed through the save's status round, the
        same on every host, no collective of its own) says a window spilled
        in most of its last ``SPILL_WINDOW`` moved versions under the
        schedule in force, asks the driver for a profile
        (``profile_requested``) and re-plans on the step's present timing."""
        note = self.ckpt.agreed_note
        if note is None or self._wants_profile:
            return
        if note // 1000 == len(self.repartitions) and note % 1000 > SPILL_WINDOW // 2:
            self._wants_profile = True
            self.spill_requests.append(version)

    # --- the expert windows' model (issue 38) ---

    def _expert_windows(self) -> dict[str, int]:
        """Window key -> MoE layer (row of ``tokens_per_expert``) of the plan's
        expert windows: each MoE segment's interior spans (between its
        dispatch and its combine), the part of the layer the load changes."""
        if self.planned_on is None or not self.spans:
            return {}
        layer_of = moe_segments(self.planned_on, self.moe_layers)
        out = {}
        for seg in self.planned_on.segments:
            key = (seg.name, seg.direction)
            if key in layer_of and seg.spans and len(seg.spans) > 2:
                for span in seg.spans[1:-1]:
                    out[window_key(Window(seg.name, seg.direction, 0.0, span.edge))] = \
                        layer_of[key]
        return out

    def _observe_windows(self, records: list[dict[str, Any]],
                         tokens_per_expert: np.ndarray | None) -> None:
        """Feeds the window model the expert windows this step measured, at
        the load of the step that moved them."""
        experts = self._expert_windows()
        if tokens_per_expert is None or not experts:
            return
        peaks = np.asarray(tokens_per_expert).max(axis=-1)
        for record in records:
            layer = experts.get(record["window"])
            if layer is not None:
                self.window_model.observe(record["window"], float(peaks[layer]),
                                          record["observed_s"])

    def _model_windows(self, tokens_per_expert: np.ndarray) -> dict[int, float] | None:
        """This host's window model at this load: plan window index -> its
        predicted idle time, for each expert window the load moves beyond its
        noise (``{}``: none moves); None: the model cannot say."""
        experts = self._expert_windows()
        if not experts or not self._plan_windows:
            return None
        peaks = np.asarray(tokens_per_expert).max(axis=-1)
        loads = {key: float(peaks[layer]) for key, layer in experts.items()}
        fits = {key: f for key in experts if (f := self.window_model.fit_of(key))}
        return moved_windows(self._plan_windows, loads, fits)

    def _replan_by_window_model(self, step: int, tokens_per_expert: np.ndarray
                                ) -> dict[str, Any] | None:
        """The plan's windows with each expert window that the next step's
        load moves beyond its noise
        (``scheduling.plan.window_model.moved_windows``) at its predicted
        idle time. Host 0's answer is every host's (one agreement:
        this is called on every host at the same steps). None: the model
        cannot say (no fit covers the load): the caller tries the segments'
        models."""
        mine = self._model_windows(tokens_per_expert)
        (code,) = agree_measured([-1.0 if mine is None else float(len(mine))],
                                 what="window_model")
        if code < 0:
            return None
        if code == 0:
            return {}  # every expert window within its noise: the plan stands
        windows = [dataclasses.replace(w, duration_s=(mine or {}).get(i, w.duration_s))
                   for i, w in enumerate(self._plan_windows)]
        self._modelled_windows = windows
        self._spills.clear()
        self.window_model_replans.append(step)
        return self._repartition(step, windows, "window_model")


PLANNERS: dict[str, type[Planner]] = {"fixed": FixedPlanner, "replan": ReplanningPlanner}
"""The planner of each ``StrategySpec.planner`` value (``registry.PLANNERS``)."""


__all__ = ["PLANNERS", "PLAN_PROFILES", "SPILL_LATE_BYTES", "SPILL_TOLERANCE_S", "SPILL_WINDOW",
           "FixedPlanner", "PlanTarget", "Planner", "ReplanningPlanner", "StatusNote"]
