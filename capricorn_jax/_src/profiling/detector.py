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

The profile cache keyed by capacity tuple (``profiling.cache``) can stand in
front of the detector; the policies and the driver that turn these decisions
into "is step t profiled?" are in ``profiling.policy``. Pure Python and
numpy: no JAX, so everything here is property-tested without devices.
"""

from __future__ import annotations

import dataclasses
import math
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
        workload, 0.1 only 62-89% (launch.experiments.speculation_quality at
        tag experiments-2026-12-05, BUILD_NOTES; with batch 64, 0.05 caught
        78-88% and 0.03 93-94%).
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
        self.x_min, self.x_max = math.inf, -math.inf  # the loads seen

    def update(self, x: float, duration_s: float) -> None:
        """Adds one observation: max tokens on an expert, measured seconds."""
        self.count += 1
        self.x_min, self.x_max = min(self.x_min, float(x)), max(self.x_max, float(x))
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

    def covers(self, x: float, margin: float = 0.0) -> bool:
        """Whether the model interpolates at load ``x``: its slope is known
        (two distinct loads seen) and ``x`` lies within the loads seen,
        widened by ``margin`` (a fraction) on each side."""
        if not margin >= 0.0:
            raise ValueError(f"margin must be >= 0, got {margin!r}")
        return (self._sxx > 0.0
                and self.x_min * (1.0 - margin) <= float(x) <= self.x_max * (1.0 + margin))


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
