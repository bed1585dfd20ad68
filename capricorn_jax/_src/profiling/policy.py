"""When a step is profiled, and the one driver that runs the profiled steps.

The policies compared: never, every step, the first N steps only (Gemini
profiles the first iterations once, at iteration granularity, and keeps the
result: ``FirstNProfiler`` / ``IterationProfile``), or speculative (the
dynamicity detector asks when the expert load drifted, ``profiling.detector``,
optionally with the profile cache in front, ``profiling.cache``).
``should_profile`` is the rule for one step.

``ProfilingDriver`` applies it around a training loop: per step it runs the
instrumented variant (``profiling.profiler``) or the strategy's own step,
notes which variants ran for the first time (a compile and a cold run are no
measurement: the detector takes such a step's load but not its durations,
and the next step is profiled again), feeds the detector, the cache and the
first-N profiler, hands the profile to the checkpoint strategy (which may
re-plan its schedule from it) and lets the strategy veto an activation
(capricorn: only when the schedule in force is at risk at this load). It
returns what happened as plain dicts (the ``profile``, ``iteration_profile``,
``detector`` and ``repartition`` events); the caller writes them where it
keeps its metrics. Every host runs the driver and takes the same decisions:
the detector reads the replicated ``tokens_per_expert``, and a strategy that
plans on profiles gets host 0's durations (``agree_profile``).

Design choice: one driver for the training launcher and the benchmark, with
its defaults in ``ProfilingOptions`` (the detector's and the cache's own
option dataclasses), so a strategy profiles the same steps wherever it runs.
Alternative not taken (the previous state): the launcher's profiling loop
and a second one inside the scheduled strategy for the benchmark, which had
drifted apart (drift threshold 0.05 vs 0.1, Gemini's N 20 vs 3).
"""

from __future__ import annotations

import dataclasses
import enum
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from capricorn_jax._src.multihost.agree import agree_floats
from capricorn_jax._src.profiling.cache import CacheDecision, CacheOptions, ProfileCache
from capricorn_jax._src.profiling.detector import Decision, DetectorOptions, DynamicityDetector
from capricorn_jax._src.profiling.layer_profile import LayerProfile, moe_durations, moe_segments
from capricorn_jax._src.profiling.profiler import make_profiled_step

if TYPE_CHECKING:
    from capricorn_jax._src.strategies.base import Metrics, State, Strategy, TrainStep

DEFAULT_FIRST_N = 20
"""Gemini's profiled iterations: it profiles ~20 at the start and keeps them."""


@dataclasses.dataclass(frozen=True)
class IterationProfile:
    """Whole-step times of the first iterations (Gemini's profile).

    Attributes:
      step_times_s: the measured steps' wall times, in step order.
    """

    step_times_s: tuple[float, ...]

    @property
    def iterations(self) -> int:
        return len(self.step_times_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_times_s)


class FirstNProfiler:
    """Profiles the first ``n`` iterations once, then keeps the result fixed."""

    def __init__(self, n: int = DEFAULT_FIRST_N) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self._times: dict[int, float] = {}
        self.profile: IterationProfile | None = None

    def observe(self, step: int, step_time_s: float) -> IterationProfile | None:
        """Records step ``step`` if it is among the first n.

        Returns:
          The fixed profile once the n steps are in, else None.
        """
        if self.profile is None and 0 <= step < self.n:
            self._times.setdefault(step, float(step_time_s))
            if len(self._times) == self.n:
                self.profile = IterationProfile(tuple(self._times[s] for s in range(self.n)))
        return self.profile


class ProfilePolicy(enum.Enum):
    """When the layer profiler runs."""

    OFF = "off"
    EVERY = "every"
    FIRST_N = "first_n"
    SPECULATIVE = "speculative"


def should_profile(
    policy: ProfilePolicy | str, step: int, decision: Decision | None,
    first_n: int = DEFAULT_FIRST_N,
) -> bool:
    """Whether step ``step`` is profiled.

    Args:
      policy: the policy (or its value, e.g. "speculative").
      step: the step about to run.
      decision: the detector's decision after step - 1 (None before any).
      first_n: the N of FIRST_N.

    Raises:
      ValueError: ``decision`` is not about step - 1.
    """
    policy = ProfilePolicy(policy)
    if decision is not None and decision.step != step - 1:
        raise ValueError(f"decision of step {decision.step} used for step {step}")
    if policy is ProfilePolicy.OFF:
        return False
    if policy is ProfilePolicy.EVERY:
        return True
    if policy is ProfilePolicy.FIRST_N:
        return step < first_n
    return decision is None or decision.profile_next


TRIGGERS = ("capacity", "drift")
"""What makes SPECULATIVE profile a step (``ProfilingOptions.trigger``)."""

CAPACITY_CACHE = CacheOptions(max_age=200, samples=2)
"""The capacity trigger's cache by default: a tuple is profiled cold (its
compile), then warm twice, and its profiles stand for it for 200 steps.
Replayed on 100-step 2x2 runs of ``tiny`` (bucketed, 6 tuples): 14 profiled
steps on the dynamic and on the steady workload, all but two in the first
14 steps (BUILD_NOTES, "The capacity trigger")."""


@dataclasses.dataclass(frozen=True)
class ProfilingOptions:
    """What ``ProfilingDriver`` profiles.

    Attributes:
      policy: off | every | first_n | speculative (``ProfilePolicy`` or its value).
      first_n: FIRST_N: the steps profiled at the start, counted from the
        first step this driver runs (a restarted process profiles again).
      detector: SPECULATIVE: the dynamicity detector's options (drift
        threshold 0.05, jsd: BUILD_NOTES, "Profiling policies").
      trigger: SPECULATIVE: what asks for a profile. ``"capacity"`` (default):
        the next step's capacity tuple, known before it runs, has fewer than
        ``cache.samples`` warm profiles younger than ``cache.max_age``: the
        layer times of a static-shape MoE step follow its capacity tuple and
        nothing else of the load, so the profiles follow the tuple (fixed
        dispatch: profiled until the samples are in, then never again).
        ``"drift"``: the detector's drift of the expert load past its threshold
        (the cache, when given, in front). The detector observes every step
        under both (scores in the ``detector`` events, cost models fitted on
        the profiles, capricorn's gate).
      cache: SPECULATIVE: the profile cache keyed by capacity tuple. With
        ``trigger="drift"``, None means no cache (every drift profiles; only
        for load-dependent dispatch, see ``ProfileCache``); with
        ``trigger="capacity"``, None means ``CAPACITY_CACHE``.
    """

    policy: ProfilePolicy = ProfilePolicy.OFF
    first_n: int = DEFAULT_FIRST_N
    detector: DetectorOptions = dataclasses.field(default_factory=DetectorOptions)
    cache: CacheOptions | None = None
    trigger: str = "capacity"

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", ProfilePolicy(self.policy))
        if self.first_n < 1:
            raise ValueError(f"first_n must be >= 1, got {self.first_n}")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"trigger must be one of {TRIGGERS}, got {self.trigger!r}")
        if self.trigger == "capacity" and self.cache is None:
            object.__setattr__(self, "cache", CAPACITY_CACHE)


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """One step run by ``ProfilingDriver.step``.

    Attributes:
      state, metrics: what the step returned (the same bitwise, profiled or not).
      profile: the step's LayerProfile (host 0's durations when the strategy
        plans on profiles and the step was warm), or None when not profiled.
      compiled: the step ran its variant for the first time in this process.
      events: the profiling events of the step, JSON-able dicts with an
        ``"event"`` key, in the order to write them.
    """

    state: State
    metrics: Metrics
    profile: LayerProfile | None
    compiled: bool
    events: tuple[dict[str, Any], ...]


def agree_profile(profile: LayerProfile) -> LayerProfile:
    """``profile`` with host 0's segment durations and all-to-all estimates, on
    every host (one broadcast per profile). A strategy that plans on profiles
    gets only agreed ones, for its schedule and for the detector's cost models,
    so every host takes the same decisions from them (capricorn's gate) with no
    collective per step."""
    segments = profile.segments
    n = len(segments)
    got = agree_floats([s.duration_s for s in segments] + [s.collective_s for s in segments])
    return dataclasses.replace(profile, segments=tuple(
        dataclasses.replace(s, duration_s=got[i], collective_s=got[n + i])
        for i, s in enumerate(segments)))


def _r6(x: float | None) -> float | None:
    return None if x is None else round(float(x), 6)


def profile_event(step: int, profile: LayerProfile, compiled: bool,
                  moe_layers: Sequence[int]) -> dict[str, Any]:
    """The ``profile`` event of a profiled step (floats rounded to 1 us;
    ``moe_layer``: the segment's row of tokens_per_expert, None for others)."""
    moe = moe_segments(profile, moe_layers)
    return {
        "event": "profile", "step": step, "total_s": _r6(profile.total_s),
        "compiled": compiled, "devices": profile.devices,
        "layers": [{"name": s.name, "direction": s.direction, "start_s": _r6(s.start_s),
                    "duration_s": _r6(s.duration_s), "collective_s": _r6(s.collective_s),
                    "moe_layer": moe.get((s.name, s.direction))}
                   for s in profile.segments],
    }


class ProfilingDriver:
    """Runs each step profiled or not, and decides about the next (see the
    module docstring).

    Args:
      train: the caller's TrainStep.
      strategy: the checkpoint strategy (``run_step``, ``has_step``,
        ``on_profile``, ``allow_profile``, ``plans_on_profiles``).
      options: the policy and its knobs.
      collectives: factors -> {boundary name: per-device all-to-all buffers}
        of the model (``make_profiled_step``); None: no all-to-all estimate.
      next_factors: a step's metrics -> the next step's capacity tuple; the
        profile cache and the capacity trigger need it (the model's capacity
        rule).

    Attributes:
      profile_next: whether the next step this driver runs is profiled.
      profiled_steps: every profiled step, cold ones too.
      cache_replans: the steps after which the strategy re-planned from a
        cached profile (a cache hit on another capacity tuple).
      detector: the dynamicity detector (speculative only, else None).
    """

    def __init__(self, train: TrainStep, strategy: Strategy,
                 options: ProfilingOptions | None = None, *,
                 collectives: Callable[[tuple[float, ...]],
                                       Mapping[str, Sequence[jax.ShapeDtypeStruct]]] | None = None,
                 next_factors: Callable[[Metrics], Sequence[float]] | None = None) -> None:
        self.train, self.strategy = train, strategy
        self.options = options = options or ProfilingOptions()
        self.collectives, self.next_factors = collectives, next_factors
        speculative = options.policy is ProfilePolicy.SPECULATIVE
        self.detector = DynamicityDetector(options.detector) if speculative else None
        self.cache = ProfileCache(options.cache) if speculative and options.cache else None
        if self.cache is not None and next_factors is None:
            raise ValueError("the profile cache and the capacity trigger need next_factors "
                             "(the next capacity tuple)")
        self.capacity_trigger = speculative and options.trigger == "capacity"
        # The newest warm profile of each capacity tuple, and the tuple the
        # strategy's schedule was last planned on: a cache hit on another
        # tuple re-plans from that tuple's profile (no instrumented step).
        self._warm: dict[tuple[float, ...], LayerProfile] = {}
        self._planned_key: tuple[float, ...] | None = None
        self._next_key: tuple[float, ...] | None = None
        self.cache_replans: list[int] = []  # steps after which a cache hit re-planned
        self.iterations = (FirstNProfiler(options.first_n)
                           if options.policy is ProfilePolicy.FIRST_N else None)
        self.decision: Decision | None = None  # the detector's, about the previous step
        self.steps_run = 0
        self.profiled_steps: list[int] = []
        self._variants: set[tuple[float, ...]] = set()  # profiled variants run here
        self._reprofile = False
        self.profile_next = self._decide_next()

    def _decide_next(self) -> bool:
        return self._reprofile or should_profile(self.options.policy, self.steps_run,
                                                 self.decision, self.options.first_n)

    def step(self, step: int, factors: Sequence[float], state: State, batch: jax.Array,
             hooks: tuple = ()) -> StepOutcome:
        """Runs training step ``step`` (instrumented when ``profile_next``).

        Args:
          step: the step's index (what the events carry).
          factors: its capacity tuple.
          state, batch: its inputs (the state is donated).
          hooks: extra boundary hooks for an unprofiled step (a profiled one
            has its own marks), e.g. a CollectiveProbe.
        """
        factors = tuple(float(f) for f in factors)
        profile = None
        if self.profile_next:
            compiled = factors not in self._variants
            self._variants.add(factors)
            buffers = None if self.collectives is None else self.collectives(factors)
            state, metrics, profile = make_profiled_step(self.train, factors, buffers)(state, batch)
            if not compiled and self.strategy.plans_on_profiles:
                profile = agree_profile(profile)  # host 0's durations drive every host
            self.profiled_steps.append(step)
        else:
            compiled = not self.strategy.has_step(self.train, step, factors, hooks)
            state, metrics = self.strategy.run_step(self.train, step, factors, state, batch, hooks)
        events = self._observe(step, factors, metrics, profile, compiled)
        self.steps_run += 1
        self.profile_next = self._decide_next()
        return StepOutcome(state, metrics, profile, compiled, tuple(events))

    def _observe(self, step: int, factors: tuple[float, ...], metrics: Metrics,
                 profile: LayerProfile | None, compiled: bool) -> list[dict[str, Any]]:
        """Feeds the step to the first-N profiler, the strategy and the detector."""
        events: list[dict[str, Any]] = []
        repartition = replanned = None
        if profile is not None:
            events.append(profile_event(step, profile, compiled, self.train.moe_layers))
            if self.iterations is not None and self.iterations.profile is None:
                done = self.iterations.observe(self.steps_run, profile.total_s)
                if done is not None:
                    collective = sum(s.collective_s or 0.0 for s in profile.segments)
                    events.append({
                        "event": "iteration_profile", "step": step,
                        "iterations": done.iterations, "median_s": _r6(done.median_s),
                        "step_times_s": [_r6(t) for t in done.step_times_s],
                        "collective_s": _r6(collective)})
            repartition = self.strategy.on_profile(step, profile, compiled)
            if not compiled:
                self._warm[factors] = profile
                if repartition is not None:
                    self._planned_key = factors
        if self.detector is not None:
            tpe = np.asarray(metrics["tokens_per_expert"])
            events.append(self._detect(step, factors, metrics, tpe, profile, compiled))
            self._reprofile = profile is not None and compiled
            replanned = self._replan_from_cache(step, events[-1])
        for plan in (repartition, replanned):
            if plan is not None:
                events.append({"event": "repartition", "step": step,
                               "strategy": self.strategy.name, **plan})
        return events

    def _replan_from_cache(self, step: int, event: dict[str, Any]) -> dict[str, Any] | None:
        """After a cache hit for the next step's tuple, a strategy that plans on
        profiles re-plans from that tuple's newest warm profile (unless its
        schedule was planned on that tuple already): its schedule follows the
        tuple without an instrumented step."""
        key = self._next_key
        if (not event["cache_hit"] or not self.strategy.plans_on_profiles
                or key == self._planned_key or key not in self._warm):
            return None
        repartition = self.strategy.on_profile(step, self._warm[key], False)
        if repartition is None:
            return None
        self._planned_key = key
        self.cache_replans.append(step)
        return {**repartition, "from_cache": True}

    def _detect(self, step: int, factors: tuple[float, ...], metrics: Metrics, tpe: np.ndarray,
                profile: LayerProfile | None, compiled: bool) -> dict[str, Any]:
        """The detector's (and the cache's, and the strategy's gate's) word on
        the next step; its ``detector`` event."""
        assert self.detector is not None
        if profile is not None:
            durations = {} if compiled else moe_durations(profile, self.train.moe_layers)
            self.detector.record_profile(self.steps_run, tpe, durations)
            if self.cache is not None and not compiled:
                self.cache.record(factors, step, durations)
        decision = self.detector.observe(self.steps_run, tpe)
        cache: CacheDecision | None = None
        sources: list[int] | None = None
        self._next_key = None
        if self.cache is not None:
            key = self._next_key = tuple(float(f) for f in self.next_factors(metrics))
            # The capacity trigger: only the tuple (new, or short of young samples) asks.
            drifted = decision.profile_next and not self.capacity_trigger
            cache = self.cache.decide(step + 1, key, factors, drifted)
            decision = dataclasses.replace(decision, profile_next=cache.profile)
            if cache.cached:
                sources = sorted(set().union(*self.cache.sources(key, step + 1).values()))
        # The load drifted, but the strategy may judge the profile not worth it.
        gated = decision.profile_next and not self.strategy.allow_profile(self.detector, tpe)
        if gated:
            decision = dataclasses.replace(decision, profile_next=False)
        # The strategy's own request (capricorn: its windows spilled in the
        # steps it measured), past the trigger and the cache.
        requested = not decision.profile_next and self.strategy.profile_requested()
        if requested:
            decision = dataclasses.replace(decision, profile_next=True)
        self.decision = decision
        return {
            "event": "detector", "step": step,
            "scores": [None if s == float("inf") else round(s, 5) for s in decision.scores],
            "profile_next": decision.profile_next, "repartition": decision.repartition,
            "gated": gated, "requested": requested,
            # Profile cache (None without it): a profile was asked for and the
            # next step's capacity tuple has enough young cached profiles;
            # cache_steps: the steps those profiles were measured at (their
            # median stands for the next step), cache_step: the newest.
            "cache_hit": None if cache is None else cache.hit,
            "cache_step": sources[-1] if sources else None,
            "cache_steps": sources or None,
        }
