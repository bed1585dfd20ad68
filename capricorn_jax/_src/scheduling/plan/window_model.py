"""The windows the experts' load moves, modelled from every moved step's marks.

Capricorn's second cost model (issue 38): the part of an MoE layer that the
load changes is its experts' compute, the idle span between the layer's
dispatch and combine all-to-alls (a segment's interior span windows,
``load_windows._share``). Every step that moves a version measures each
filled window's idle time from the sender's marks (``window_spills``'
``observed_s``), so the model needs no profiled step: per expert window,
idle = a + b x (the layer's busiest expert's tokens), fitted by least squares
on the last ``history`` observations, with the residuals' robust spread
(1.4826 x their median absolute deviation) as the window's noise.

The re-plan rule (``moved_windows``): a window moves when its predicted idle
time at the next step's load differs from the plan's by more than ``k`` times
its noise; below that the plan's own margin and the deadline sender absorb
the difference. Alternative not taken: the detector's whole-segment models
(``load_windows``), fitted on profiled segments whose noise (the dense
compute, the all-to-alls, the marks) was measured larger than the load's
effect (issue 37's records), so most of their re-plans answered noise.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from capricorn_jax._src.scheduling.plan.partitioner import Window

MIN_SAMPLES = 6
"""Observations a window's fit needs (at two loads at least)."""
NOISE_K = 2.0
"""A window moves when its predicted change exceeds this many times its noise."""


def window_key(window: Window) -> str:
    """A window's name in the records: ``layer/direction`` or ``layer/direction@edge``."""
    return f"{window.name}/{window.direction}" + (f"@{window.edge}" if window.edge else "")


@dataclasses.dataclass(frozen=True)
class SpanFit:
    """One window's fit: idle = intercept + slope x load, its noise, the loads seen."""

    intercept_s: float
    slope_s: float
    noise_s: float
    samples: int
    low: float
    high: float

    def predict(self, load: float) -> float:
        return max(0.0, self.intercept_s + self.slope_s * load)

    def covers(self, load: float, margin: float) -> bool:
        """Whether ``load`` lies within the loads seen, widened by ``margin``
        of their range's ends (as ``DetectorOptions``' cost models)."""
        return self.low * (1 - margin) <= load <= self.high * (1 + margin)


def fit(points: Sequence[tuple[float, float]]) -> SpanFit | None:
    """The least-squares line through (load, idle) points and its robust
    noise; None with fewer than ``MIN_SAMPLES`` points or a single load."""
    if len(points) < MIN_SAMPLES:
        return None
    x = np.array([p[0] for p in points], float)
    y = np.array([p[1] for p in points], float)
    if np.ptp(x) == 0:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    residuals = y - (intercept + slope * x)
    noise = 1.4826 * float(np.median(np.abs(residuals - np.median(residuals))))
    return SpanFit(float(intercept), float(slope), noise, len(points), float(x.min()),
                   float(x.max()))


class WindowModel:
    """Per window key, the (load, observed idle) of the last ``history`` steps
    that moved a version (``observe``), and their fits (``fit_of``)."""

    def __init__(self, history: int = 64) -> None:
        if history < MIN_SAMPLES:
            raise ValueError(f"history={history} must be >= {MIN_SAMPLES}")
        self._points: dict[str, collections.deque[tuple[float, float]]] = {}
        self.history = history

    def observe(self, key: str, load: float, idle_s: float) -> None:
        self._points.setdefault(key, collections.deque(maxlen=self.history)).append(
            (float(load), float(idle_s)))

    def fit_of(self, key: str) -> SpanFit | None:
        points = self._points.get(key)
        return None if points is None else fit(list(points))

    def samples(self, key: str) -> int:
        return len(self._points.get(key, ()))


def moved_windows(planned: Sequence[Window], loads: Mapping[str, float],
                  fits: Mapping[str, SpanFit], k: float = NOISE_K,
                  margin: float = 0.5) -> dict[int, float] | None:
    """The windows the next step's load moves beyond their noise (pure).

    Args:
      planned: the plan's windows (their measured idle, before the margin).
      loads: window key -> the next step's load of its layer (the keys of
        the expert windows the model follows; others are not modelled).
      fits: window key -> its fit.
      k: the rule's multiple of a window's noise.
      margin: how far past the loads seen a fit still answers.

    Returns:
      {window index: predicted idle} of the windows whose |predicted -
      planned| > k x noise (empty: the plan stands); None when a modelled
      window has no fit covering its load (the caller profiles instead).
    """
    out: dict[int, float] = {}
    for i, window in enumerate(planned):
        key = window_key(window)
        if key not in loads:
            continue
        f = fits.get(key)
        if f is None or not f.covers(loads[key], margin):
            return None
        predicted = f.predict(loads[key])
        if abs(predicted - window.duration_s) > k * f.noise_s:
            out[i] = predicted
    return out
