"""Dynamicity detector: when to profile again, and layer durations in between.

Every step the trainer reports tokens per expert ([moe_layers, experts]). The
detector compares each layer's load with the load of the step last profiled
and scores the drift; past a threshold it asks for the next step to be
profiled (speculative activation: a layer profile is only paid for when the
expert load, which drives the MoE layers' time, has moved). Between profiles
an online cost model per layer, duration ~ a + b * (max tokens on one expert
of this host), least-squares fitted over every profile seen, predicts the
layer durations that the checkpoint schedule is planned on.

Design choice: the drift is a distance between *normalized* loads (shares of
the layer's tokens), so a step with more or fewer tokens in total but the same
routing is no drift; the cost model, in contrast, is fed the absolute max
load, which is what a layer's time follows. Alternative not taken: a fixed
profiling period, which either profiles steady phases for nothing or misses a
shift for up to a period.

With load-dependent (bucketed) dispatch a layer's time follows the capacity
bucket the step runs at, and the load flips between buckets often; a
``ProfileCache`` keyed by the step's capacity tuple lets a tuple be profiled
once and its profile reused when the load flips back (``max_age`` bounds
how long).

``ProfilePolicy`` and ``should_profile`` turn these decisions into "is step t
profiled?", for the strategies compared: never, every step, the first N steps
only (Gemini profiles the first iterations once, at iteration granularity,
and keeps the result: ``FirstNProfiler`` / ``IterationProfile``), or
speculative. Pure Python and numpy: no JAX, so everything here is
property-tested without devices.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
from collections.abc import Hashable, Mapping

import numpy as np
from numpy.typing import ArrayLike

METRICS = ("jsd", "l1", "max_load")


def _shares(load: ArrayLike) -> np.ndarray:
    """Loads -> shares summing to 1 (uniform when the load is all zero)."""
    load = np.asarray(load, np.float64)
    if np.any(load < 0):
        raise ValueError("loads must be non-negative")
    total = load.sum()
    return load / total if total > 0 else np.full(load.shape, 1.0 / load.size)


def _jensen_shannon(p: np.ndarray, q: np.ndarray) -> float:
    m = 0.5 * (p + q)

    def kl(a: np.ndarray) -> float:
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / m[nz])))

    return math.sqrt(max(0.0, 0.5 * kl(p) + 0.5 * kl(q)))


def drift_score(load: ArrayLike, reference: ArrayLike, metric: str = "jsd") -> float:
    """The drift of one layer's expert load from a reference load, in [0, 1].

    Args:
      load, reference: [experts] tokens per expert (non-negative).
      metric: "jsd": Jensen-Shannon distance (base 2) of the shares; "l1":
        total variation, half the L1 distance of the shares; "max_load":
        relative change of the largest share, |m - m_ref| / max(m, m_ref).

    Returns:
      0 for identical shares; symmetric in its arguments; invariant to
      scaling either load.
    """
    p, q = _shares(load), _shares(reference)
    if p.shape != q.shape:
        raise ValueError(f"load shape {p.shape} != reference shape {q.shape}")
    if metric == "jsd":
        return min(1.0, _jensen_shannon(p, q))
    if metric == "l1":
        return min(1.0, 0.5 * float(np.abs(p - q).sum()))
    if metric == "max_load":
        a, b = float(p.max()), float(q.max())
        return abs(a - b) / max(a, b)
    raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")


@dataclasses.dataclass(frozen=True)
class DetectorOptions:
    """How the detector decides.

    Attributes:
      threshold: a layer's drift score above this asks for a profile. 0.05
        (jsd) caught 92-100% of the capacity-bucket changes of ``tiny``
        (batch 16, bucketed dispatch) on the steady and the domain-shift
        workload, 0.1 only 62-89% (launch.speculation_quality, BUILD_NOTES;
        with batch 64, 0.05 caught 78-88% and 0.03 93-94%).
      metric: "jsd" | "l1" | "max_load" (see ``drift_score``).
      min_interval: steps at least between two profiles (1 = any step).
      host_experts: the experts this host holds (indices), for the cost
        model's max load; None = all experts.
    """

    threshold: float = 0.05
    metric: str = "jsd"
    min_interval: int = 1
    host_experts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {self.metric!r}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.min_interval < 1:
            raise ValueError(f"min_interval must be >= 1, got {self.min_interval}")


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the detector concluded from one step's load.

    Attributes:
      step: the step observed.
      scores: drift per MoE layer against the last profiled load (math.inf
        per layer while no profile has been taken).
      profile_next: profile step ``step + 1``.
      repartition: a profile was recorded since the previous decision, so the
        checkpoint schedule should be re-planned from it.
    """

    step: int
    scores: tuple[float, ...]
    profile_next: bool
    repartition: bool


class CostModel:
    """Online least squares of duration ~ a + b * x over the points seen.

    Running means and co-moments (Welford), so each update is O(1) and no
    point is stored. With fewer than two distinct x the slope is unknown and
    the model is the constant mean duration (b = 0).
    """

    def __init__(self) -> None:
        self.count = 0
        self._mean_x = self._mean_y = 0.0
        self._sxx = self._sxy = 0.0

    def update(self, x: float, duration_s: float) -> None:
        """Adds one observation: max tokens on an expert, measured seconds."""
        self.count += 1
        dx = float(x) - self._mean_x
        self._mean_x += dx / self.count
        self._mean_y += (float(duration_s) - self._mean_y) / self.count
        self._sxx += dx * (float(x) - self._mean_x)
        self._sxy += dx * (float(duration_s) - self._mean_y)

    @property
    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None before the first observation."""
        if self.count == 0:
            return None
        if self._sxx <= 0.0:
            return self._mean_y, 0.0
        b = self._sxy / self._sxx
        return self._mean_y - b * self._mean_x, b

    def predict(self, x: float) -> float | None:
        """Predicted seconds at max load ``x`` (None before any observation)."""
        coef = self.coefficients
        return None if coef is None else coef[0] + coef[1] * float(x)


LayerKey = tuple[int, Hashable]
"""A cost model's key: (MoE layer index, anything else, e.g. "fwd"/"bwd")."""


class DynamicityDetector:
    """Drift of the expert load since the last profile, and per-layer costs.

    Lifecycle: after every step the trainer calls ``observe`` with the step's
    tokens per expert; when the step was profiled it first calls
    ``record_profile`` with the same load and the measured layer durations.
    ``predict`` gives the durations at any load from the fitted cost models.
    """

    def __init__(self, options: DetectorOptions | None = None) -> None:
        self.options = options or DetectorOptions()
        self.reference: np.ndarray | None = None  # load at the last profile
        self.last_profile_step: int | None = None
        self.cost_models: dict[LayerKey, CostModel] = {}
        self._fresh_profile = False

    def _load(self, tokens_per_expert: ArrayLike) -> np.ndarray:
        load = np.asarray(tokens_per_expert, np.float64)
        if load.ndim != 2:
            raise ValueError(f"tokens_per_expert must be [moe_layers, experts], got {load.shape}")
        if self.reference is not None and load.shape != self.reference.shape:
            raise ValueError(f"load shape {load.shape} != profiled shape {self.reference.shape}")
        return load

    def max_load(self, tokens_per_expert: ArrayLike) -> np.ndarray:
        """[moe_layers] max tokens on one of this host's experts."""
        load = self._load(tokens_per_expert)
        experts = self.options.host_experts
        return (load if experts is None else load[:, list(experts)]).max(axis=1)

    def observe(self, step: int, tokens_per_expert: ArrayLike) -> Decision:
        """Scores step ``step``'s load; decides about profiling step + 1."""
        load = self._load(tokens_per_expert)
        opts = self.options
        if self.reference is None:
            scores = (math.inf,) * load.shape[0]
        else:
            scores = tuple(
                drift_score(now, ref, opts.metric)
                for now, ref in zip(load, self.reference, strict=True)
            )
        due = (self.last_profile_step is None
               or step + 1 - self.last_profile_step >= opts.min_interval)
        drifted = max(scores, default=0.0) > opts.threshold
        decision = Decision(step, scores, drifted and due, self._fresh_profile)
        self._fresh_profile = False
        return decision

    def record_profile(
        self, step: int, tokens_per_expert: ArrayLike, durations: Mapping[LayerKey, float]
    ) -> None:
        """Takes a profiled step: new reference load, cost models updated.

        Args:
          step: the profiled step.
          tokens_per_expert: [moe_layers, experts] load of that step.
          durations: seconds per (MoE layer index, label), e.g. (0, "fwd").
        """
        load = self._load(tokens_per_expert)
        peaks = self.max_load(load)
        for key, seconds in durations.items():
            layer = key[0]
            if not 0 <= layer < load.shape[0]:
                raise ValueError(f"duration key {key!r}: no MoE layer {layer}")
            self.cost_models.setdefault(key, CostModel()).update(peaks[layer], seconds)
        self.reference = load.copy()
        self.last_profile_step = step
        self._fresh_profile = True

    def predict(self, tokens_per_expert: ArrayLike) -> dict[LayerKey, float]:
        """Predicted seconds per cost-model key at this load."""
        peaks = self.max_load(tokens_per_expert)
        out = {}
        for key, model in self.cost_models.items():
            value = model.predict(peaks[key[0]])
            if value is not None:
                out[key] = value
        return out


CACHE_GRANULARITIES = ("tuple", "layer")


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    """The profile cache keyed by capacity tuple (``ProfileCache``).

    Attributes:
      max_age: a cached profile stands for a step at most this many steps
        after it was measured; older, it no longer counts.
      samples: warm profiles that must be cached (each younger than
        ``max_age``) before the cache answers; it answers with their
        per-segment median. One profile is one noisy sample of the durations
        (on a shared CPU a segment swings by 5-40% from step to step); the
        median of a few is a steadier estimate. The defaults (50, 5) are the
        setting that kept recall >= 0.9 in every measured run (BUILD_NOTES,
        "Profile cache with samples").
      granularity: what a cached profile is filed under. ``"tuple"``: the
        whole capacity tuple; a step is answered from profiles of exactly its
        tuple. ``"layer"``: each MoE layer's capacity factor; a layer's
        segments are answered from every profile in which that layer ran at
        the same factor, whatever the other layers' factors (the model the
        detector's per-layer cost model makes: a layer's time follows its own
        load). With L layers and B buckets that is L x B cells instead of up
        to B ** L tuples, and each profile feeds L of them, so ``samples`` are
        reached with fewer profiles.
    """

    max_age: int = 50
    samples: int = 5
    granularity: str = "tuple"

    def __post_init__(self) -> None:
        if self.max_age < 1:
            raise ValueError(f"max_age must be >= 1, got {self.max_age}")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.granularity not in CACHE_GRANULARITIES:
            raise ValueError(f"granularity must be one of {CACHE_GRANULARITIES}, "
                             f"got {self.granularity!r}")


@dataclasses.dataclass(frozen=True)
class CacheDecision:
    """Whether the step about to run is profiled, with the cache in front.

    Attributes:
      step: the step decided about.
      key: its capacity tuple.
      asked: the detector drifted, the tuple differs from the previous step's,
        or some cell of it (the tuple, or a layer's factor) has fewer than
        ``samples`` profiles.
      cached: every cell of ``key`` holds ``samples`` profiles younger than
        ``max_age``: their medians stand for the step's durations.
      profile: ``asked and not cached``.
    """

    step: int
    key: Hashable
    asked: bool
    cached: bool
    profile: bool

    @property
    def hit(self) -> bool:
        """A profile was asked for and the cache answered it (no instrumented step)."""
        return self.asked and self.cached


class ProfileCache:
    """Per-layer durations of the last warm profiles, keyed by capacity.

    With load-dependent (bucketed) dispatch a step runs the variant compiled
    for its capacity tuple (per MoE layer, the capacity factor chosen from the
    previous step's load, known before the step runs), and on CPU a layer's
    time follows only its factor. The cache then profiles a tuple (or each
    layer's factor, ``granularity="layer"``) ``samples`` times and reuses the
    profiles whenever the load flips back, instead of profiling every flip.
    With a constant tuple (fixed dispatch) the tuple says nothing about the
    load: the cache would hold one entry and mute the drift for ``max_age``
    steps, so callers put it in front of the detector only with
    load-dependent dispatch (launch.train does) and otherwise keep the drift
    and cost-model logic alone.

    Keys are capacity tuples (one factor per MoE layer); durations are keyed
    ``(moe_layer, direction)`` with ``moe_layer`` the position in the tuple.
    ``decide`` is the rule: profile step t (tuple k) only when (a) the
    detector drifted, k differs from step t-1's tuple or a cell of k has
    fewer than ``samples`` profiles, and (b) the cache does not answer for k
    (some cell has fewer than ``samples`` profiles younger than ``max_age``).
    ``record`` stores a warm profile (each cell keeps its newest
    ``samples``); ``lookup`` gives the durations that stand for a step.
    """

    def __init__(self, options: CacheOptions | None = None) -> None:
        self.options = options or CacheOptions()
        # cell -> its newest warm profiles, oldest first: (step, durations).
        self.entries: dict[Hashable, list[tuple[int, dict[LayerKey, float]]]] = {}

    def _cells(self, key: Hashable) -> dict[Hashable, int | None]:
        """The cells a tuple's profile is filed under -> the layer each holds (None: all)."""
        if self.options.granularity == "tuple":
            return {key: None}
        return {(layer, factor): layer for layer, factor in enumerate(key)}

    def record(self, key: Hashable, step: int, durations: Mapping[LayerKey, float]) -> None:
        """Stores the durations measured at step ``step`` for tuple ``key``."""
        for cell, layer in self._cells(key).items():
            entry = self.entries.setdefault(cell, [])
            if entry and step <= entry[-1][0]:
                raise ValueError(f"profile of step {step} recorded after one of step "
                                 f"{entry[-1][0]} for {cell!r}")
            entry.append((step, {k: v for k, v in durations.items()
                                 if layer is None or k[0] == layer}))
            del entry[:-self.options.samples]

    def age(self, key: Hashable, step: int) -> int | None:
        """Steps from the stalest cell's newest profile to ``step`` (None: a cell never measured)."""
        entries = [self.entries.get(cell) for cell in self._cells(key)]
        if not all(entries):
            return None
        return max(step - entry[-1][0] for entry in entries)

    def sources(self, key: Hashable, step: int) -> dict[Hashable, tuple[int, ...]] | None:
        """Cell -> the steps whose profiles stand for ``step`` (None: the cache does not answer)."""
        out = {}
        for cell in self._cells(key):
            young = tuple(s for s, _ in self.entries.get(cell, ())
                          if 0 <= step - s < self.options.max_age)
            if len(young) < self.options.samples:
                return None
            out[cell] = young
        return out

    def layer_sources(self, key: Hashable, step: int) -> dict[int, tuple[int, ...]] | None:
        """MoE layer -> the steps whose profiles stand for its segments at
        ``step`` (``sources`` per layer; None: the cache does not answer)."""
        sources = self.sources(key, step)
        if sources is None:
            return None
        out = {}
        for cell, layer in self._cells(key).items():
            out.update(dict.fromkeys(range(len(key)) if layer is None else [layer],
                                     sources[cell]))
        return out

    def lookup(self, key: Hashable, step: int) -> dict[LayerKey, float] | None:
        """The per-segment medians of ``key``'s cached profiles, if the cache answers at ``step``."""
        sources = self.sources(key, step)
        if sources is None:
            return None
        out: dict[LayerKey, float] = {}
        for cell, steps in sources.items():
            profiles = [d for s, d in self.entries[cell] if s in steps]
            out.update({k: statistics.median(d[k] for d in profiles) for k in profiles[-1]})
        return out

    def decide(self, step: int, key: Hashable, previous_key: Hashable | None,
               drifted: bool) -> CacheDecision:
        """Whether step ``step``, of tuple ``key``, is profiled.

        Args:
          step: the step about to run.
          key: its capacity tuple.
          previous_key: step - 1's tuple (None before any step).
          drifted: the detector asked for a profile after step - 1.
        """
        sampled = all(len(self.entries.get(cell, ())) >= self.options.samples
                      for cell in self._cells(key))
        asked = drifted or key != previous_key or not sampled
        cached = self.sources(key, step) is not None
        return CacheDecision(step, key, asked, cached, asked and not cached)


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

    def __init__(self, n: int = 20) -> None:
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
    policy: ProfilePolicy | str, step: int, decision: Decision | None, first_n: int = 20
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
