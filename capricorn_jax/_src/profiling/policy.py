"""When a step is profiled; the pieces of the driver that runs the profiled steps.

The policies compared: never, every step, the first N steps only (Gemini
profiles the first iterations once, at iteration granularity, and keeps the
result: ``FirstNProfiler`` / ``IterationProfile``), or speculative (the
dynamicity detector asks when the expert load drifted, ``profiling.detector``,
optionally with the profile cache in front, ``profiling.cache``).
``should_profile`` is the rule for one step.

``ProfilingDriver`` (``strategies.driver``: it drives a checkpoint strategy,
so it sits on the strategies' floor; this module keeps its options, its
outcome and its events) applies it around a training loop: per step it runs the
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
from collections.abc import Sequence
from typing import Any

import numpy as np

from capricorn_jax._src.multihost.agree import agree_floats, broadcast_json
from capricorn_jax._src.profiling.cache import CacheOptions
from capricorn_jax._src.profiling.detector import Decision, DetectorOptions
from capricorn_jax._src.profiling.layer_profile import LayerProfile, Span, moe_segments
from capricorn_jax._src.profiling.train_step import Metrics, State

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
    """``profile`` with host 0's segment durations, all-to-all estimates and
    idle spans, on every host (two broadcasts per profile). A strategy that plans on profiles
    gets only agreed ones, for its schedule and for the detector's cost models,
    so every host takes the same decisions from them (capricorn's gate) with no
    collective per step."""
    segments = profile.segments
    n = len(segments)
    got = agree_floats([s.duration_s for s in segments] + [s.collective_s for s in segments])
    # The idle spans (``Segment.spans``), host 0's, rounded as agree_floats rounds.
    mine = [None if s.spans is None else [[p.edge, p.idle_s, p.busy_s] for p in s.spans]
            for s in segments]
    spans = broadcast_json(mine, what="agree_profile spans")
    agreed = []
    for i, s in enumerate(segments):
        duration = got[i]
        assert duration is not None, "agree_floats keeps a measured duration measured"
        agreed.append(dataclasses.replace(
            s, duration_s=duration, collective_s=got[n + i],
            spans=None if spans[i] is None else tuple(
                Span(edge, float(np.float32(idle)), float(np.float32(busy)))
                for edge, idle, busy in spans[i])))
    return dataclasses.replace(profile, segments=tuple(agreed))


def round_us(x: float | None) -> float | None:
    return None if x is None else round(float(x), 6)


def profile_event(step: int, profile: LayerProfile, compiled: bool,
                  moe_layers: Sequence[int]) -> dict[str, Any]:
    """The ``profile`` event of a profiled step (floats rounded to 1 us;
    ``moe_layer``: the segment's row of tokens_per_expert, None for others;
    ``spans``, where measured: [opening edge, idle_s, busy_s] of each idle
    span between its collectives, ``Segment.spans``)."""
    moe = moe_segments(profile, moe_layers)
    return {
        "event": "profile", "step": step, "total_s": round_us(profile.total_s),
        "compiled": compiled, "devices": profile.devices,
        "mark_cost_s": round_us(profile.mark_cost_s),
        "layers": [{"name": s.name, "direction": s.direction, "start_s": round_us(s.start_s),
                    "duration_s": round_us(s.duration_s), "collective_s": round_us(s.collective_s),
                    "moe_layer": moe.get((s.name, s.direction)),
                    **({} if s.spans is None else {"spans": [
                        [p.edge, round_us(p.idle_s), round_us(p.busy_s)] for p in s.spans]})}
                   for s in profile.segments],
    }
