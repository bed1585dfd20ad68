"""The one driver that runs the profiled steps around a training loop.

See ``profiling.policy`` for what it decides and why there is only one. It
lives on the strategies' floor because it drives a checkpoint strategy
(``run_step``, ``on_profile``, ``allow_profile``); its options, outcome and
events stay in ``profiling.policy``, under it.

Design choice: the driver above the strategy protocol, its parts below, so
``profiling`` never imports ``strategies``. Alternative not taken (the
previous state): the driver in ``profiling.policy`` with a type-only import
of ``strategies.base``, an upward arrow between the floors.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from capricorn_jax._src.profiling.cache import CacheDecision, ProfileCache
from capricorn_jax._src.profiling.detector import Decision, DynamicityDetector
from capricorn_jax._src.profiling.layer_profile import LayerProfile, moe_durations
from capricorn_jax._src.profiling.policy import (
    FirstNProfiler,
    ProfilePolicy,
    ProfilingOptions,
    StepOutcome,
    agree_profile,
    profile_event,
    round_us,
    should_profile,
)
from capricorn_jax._src.profiling.profiler import collective_estimates, make_profiled_step
from capricorn_jax._src.profiling.train_step import Metrics, State, TrainStep
from capricorn_jax._src.strategies.base import Strategy


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
      reductions: () -> the per-device gradient buffers the step all-reduces
        over every device after the backward (``make_profiled_step``); None:
        no estimate of that traffic.

    Attributes:
      plan_s: the last step's seconds in the strategy's planning calls after
        its program returned (``settle_plan``, ``on_profile``,
        ``allow_profile``, ``replan_at_load``, ``profile_requested``: its
        re-plans and their agreements, or the wait for a re-plan prepared on
        the planner's thread), work on the training thread between two steps; the
        bench's ``blocked_ms`` ``phase.plan``. Not the wait for the step's
        results, which an asynchronous step's first read of its metrics holds.
      profile_next: whether the next step this driver runs is profiled.
      profiled_steps: every profiled step, cold ones too.
      cache_replans: the steps after which the strategy re-planned from a
        cached profile (a cache hit on another capacity tuple).
      model_replans: the steps after which the strategy re-planned from its
        cost model instead of profiling the next step (``replan_at_load``).
      detector: the dynamicity detector (speculative only, else None).
    """

    def __init__(self, train: TrainStep, strategy: Strategy,
                 options: ProfilingOptions | None = None, *,
                 collectives: Callable[[tuple[float, ...]],
                                       Mapping[str, Sequence[jax.ShapeDtypeStruct]]] | None = None,
                 next_factors: Callable[[Metrics], Sequence[float]] | None = None,
                 reductions: Callable[[], Sequence[jax.ShapeDtypeStruct]] | None = None
                 ) -> None:
        self.train, self.strategy = train, strategy
        self.reductions = reductions
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
        # Steps after which the strategy re-planned from its cost model
        # (``Strategy.replan_at_load``) instead of profiling the next step.
        self.model_replans: list[int] = []
        self._modelled: dict[str, Any] | None = None
        self.iterations = (FirstNProfiler(options.first_n)
                           if options.policy is ProfilePolicy.FIRST_N else None)
        self.decision: Decision | None = None  # the detector's, about the previous step
        self.steps_run = 0
        self.plan_s = 0.0  # the last step's seconds in the strategy's planning calls
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
            reduced = None if self.reductions is None else self.reductions()
            if self.strategy.profiles_from_marks:
                # The strategy's own program is the profile: no variant to compile.
                # The all-to-alls are timed between their marked edges (no
                # probe per buffer shape); the gradient all-reduce is estimated.
                compiled = not self.strategy.has_step(self.train, step, factors, hooks)
                estimates = collective_estimates(self.train, None, reductions=reduced)
                state, metrics, profile = self.strategy.run_profiled(
                    self.train, step, factors, state, batch, estimates, hooks)
            else:
                compiled = factors not in self._variants
                self._variants.add(factors)
                buffers = None if self.collectives is None else self.collectives(factors)
                state, metrics, profile = make_profiled_step(self.train, factors, buffers,
                                                             reductions=reduced)(state, batch)
            if not compiled and self.strategy.plans_on_profiles:
                profile = agree_profile(profile)  # host 0's durations drive every host
            self.profiled_steps.append(step)
        else:
            compiled = not self.strategy.has_step(self.train, step, factors, hooks)
            state, metrics = self.strategy.run_step(self.train, step, factors, state, batch, hooks)
        self.plan_s = 0.0
        events = self._observe(step, factors, metrics, profile, compiled)
        self.steps_run += 1
        self.profile_next = self._decide_next()
        return StepOutcome(state, metrics, profile, compiled, tuple(events))

    def _observe(self, step: int, factors: tuple[float, ...], metrics: Metrics,
                 profile: LayerProfile | None, compiled: bool) -> list[dict[str, Any]]:
        """Feeds the step to the first-N profiler, the strategy and the detector."""
        events: list[dict[str, Any]] = []
        repartition = replanned = None
        # A re-plan prepared off the training thread since the last step, first.
        settled = self._planning(self.strategy.settle_plan, step)
        if profile is not None:
            events.append(profile_event(step, profile, compiled, self.train.moe_layers))
            if self.iterations is not None and self.iterations.profile is None:
                done = self.iterations.observe(self.steps_run, profile.total_s)
                if done is not None:
                    collective = sum(s.collective_s or 0.0 for s in profile.segments)
                    events.append({
                        "event": "iteration_profile", "step": step,
                        "iterations": done.iterations, "median_s": round_us(done.median_s),
                        "step_times_s": [round_us(t) for t in done.step_times_s],
                        "collective_s": round_us(collective)})
            repartition = self._planning(self.strategy.on_profile, step, profile, compiled)
            if not compiled:
                self._warm[factors] = profile
                if repartition is not None:
                    self._planned_key = factors
        if self.detector is not None:
            tpe = np.asarray(metrics["tokens_per_expert"])
            events.append(self._detect(step, factors, metrics, tpe, profile, compiled))
            self._reprofile = profile is not None and compiled
            replanned = self._replan_from_cache(step, events[-1]) or self._modelled
            if self._modelled:  # {}: the model's plan at this load was in force already
                self.model_replans.append(step)
        for plan in (settled, repartition, replanned):
            if plan:
                events.append({"event": "repartition", "step": step,
                               "strategy": self.strategy.name, **plan})
        return events

    def _planning(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, one of the strategy's planning calls, its time
        added to ``plan_s``."""
        t0 = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.plan_s += time.perf_counter() - t0

    def _replan_from_cache(self, step: int, event: dict[str, Any]) -> dict[str, Any] | None:
        """After a cache hit for the next step's tuple, a strategy that plans on
        profiles re-plans from that tuple's newest warm profile (unless its
        schedule was planned on that tuple already): its schedule follows the
        tuple without an instrumented step."""
        key = self._next_key
        if (not event["cache_hit"] or not self.strategy.plans_on_profiles
                or key == self._planned_key or key not in self._warm):
            return None
        repartition = self._planning(self.strategy.on_profile, step, self._warm[key], False)
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
            assert self.next_factors is not None, "__init__ rejects a cache without next_factors"
            key = self._next_key = tuple(float(f) for f in self.next_factors(metrics))
            # The capacity trigger: only the tuple (new, or short of young samples) asks.
            drifted = decision.profile_next and not self.capacity_trigger
            cache = self.cache.decide(step + 1, key, factors, drifted)
            decision = dataclasses.replace(decision, profile_next=cache.profile)
            if cache.cached:
                cells = self.cache.sources(key, step + 1)
                assert cells is not None, "a cached decision means the cache answers its step"
                sources = sorted(set().union(*cells.values()))
        # The load drifted, but the strategy may judge the profile not worth it.
        gated = decision.profile_next and not self._planning(self.strategy.allow_profile,
                                                             self.detector, tpe)
        if gated:
            decision = dataclasses.replace(decision, profile_next=False)
        # A profile is due, unless the strategy re-plans from its cost model.
        self._modelled = None
        if decision.profile_next:
            self._modelled = self._planning(self.strategy.replan_at_load, step, self.detector,
                                            tpe)
            if self._modelled is not None:
                decision = dataclasses.replace(decision, profile_next=False)
        # The strategy's own request (capricorn: its windows spilled in the
        # steps it measured), past the trigger and the cache.
        requested = not decision.profile_next and self._planning(self.strategy.profile_requested)
        if requested:
            decision = dataclasses.replace(decision, profile_next=True)
        self.decision = decision
        return {
            "event": "detector", "step": step,
            "scores": [None if s == float("inf") else round(s, 5) for s in decision.scores],
            "profile_next": decision.profile_next, "repartition": decision.repartition,
            "gated": gated, "requested": requested, "modelled": self._modelled is not None,
            # Profile cache (None without it): a profile was asked for and the
            # next step's capacity tuple has enough young cached profiles;
            # cache_steps: the steps those profiles were measured at (their
            # median stands for the next step), cache_step: the newest.
            "cache_hit": None if cache is None else cache.hit,
            "cache_step": sources[-1] if sources else None,
            "cache_steps": sources or None,
        }
