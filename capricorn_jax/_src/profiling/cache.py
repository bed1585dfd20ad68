"""The profile cache keyed by capacity tuple: a profile reused when the load flips back.

With load-dependent (bucketed) dispatch a layer's time follows the capacity
bucket the step runs at, and the load flips between buckets often. A
``ProfileCache`` keyed by the step's capacity tuple (known before the step
runs) lets a tuple be profiled ``samples`` times and their per-segment median
stand for it whenever the load returns to it, for up to ``max_age`` steps,
instead of profiling every flip. It stands in front of the dynamicity
detector (``profiling.detector``): the detector says whether the load
drifted, the cache whether a young enough answer exists.

Design choice: the median of a few warm profiles per cell, not the newest
one: on a shared CPU one profile is one noisy sample (a segment swings by
5-40% from step to step), and the defaults (50 steps, 5 samples) were the
setting that kept recall >= 0.9 in every measured run (BUILD_NOTES, "Profile
cache with samples"). Alternative not taken: a rolling cell (the newest K
samples while the newest is young), which lowered the worst run's recall.
Pure Python and numpy, property-tested without devices.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Hashable, Mapping

from capricorn_jax._src.profiling.detector import LayerKey

CACHE_GRANULARITIES = ("tuple", "layer")

CapacityKey = tuple[float, ...]
"""A step's capacity tuple: one capacity factor per MoE layer."""


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
    key: CapacityKey
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

    def _cells(self, key: CapacityKey) -> dict[Hashable, int | None]:
        """The cells a tuple's profile is filed under -> the layer each holds (None: all)."""
        if self.options.granularity == "tuple":
            return {key: None}
        return {(layer, factor): layer for layer, factor in enumerate(key)}

    def record(self, key: CapacityKey, step: int, durations: Mapping[LayerKey, float]) -> None:
        """Stores the durations measured at step ``step`` for tuple ``key``."""
        for cell, layer in self._cells(key).items():
            entry = self.entries.setdefault(cell, [])
            if entry and step <= entry[-1][0]:
                raise ValueError(f"profile of step {step} recorded after one of step "
                                 f"{entry[-1][0]} for {cell!r}")
            entry.append((step, {k: v for k, v in durations.items()
                                 if layer is None or k[0] == layer}))
            del entry[:-self.options.samples]

    def age(self, key: CapacityKey, step: int) -> int | None:
        """Steps from the stalest cell's newest profile to ``step`` (None: a
        cell never measured)."""
        newest = []
        for cell in self._cells(key):
            entry = self.entries.get(cell)
            if not entry:
                return None
            newest.append(entry[-1][0])
        return max(step - s for s in newest)

    def sources(self, key: CapacityKey, step: int) -> dict[Hashable, tuple[int, ...]] | None:
        """Cell -> the steps whose profiles stand for ``step`` (None: the cache does not answer)."""
        out = {}
        for cell in self._cells(key):
            young = tuple(s for s, _ in self.entries.get(cell, ())
                          if 0 <= step - s < self.options.max_age)
            if len(young) < self.options.samples:
                return None
            out[cell] = young
        return out

    def layer_sources(self, key: CapacityKey, step: int) -> dict[int, tuple[int, ...]] | None:
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

    def lookup(self, key: CapacityKey, step: int) -> dict[LayerKey, float] | None:
        """The per-segment medians of ``key``'s cached profiles, if the cache
        answers at ``step``."""
        sources = self.sources(key, step)
        if sources is None:
            return None
        out: dict[LayerKey, float] = {}
        for cell, steps in sources.items():
            profiles = [d for s, d in self.entries[cell] if s in steps]
            out.update({k: statistics.median(d[k] for d in profiles) for k in profiles[-1]})
        return out

    def decide(self, step: int, key: CapacityKey, previous_key: CapacityKey | None,
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
