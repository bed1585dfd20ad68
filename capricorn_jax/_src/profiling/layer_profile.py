"""A profiled step's data: timestamps in, ``LayerProfile`` out, and its MoE view.

The instrumented step (``profiling.profiler``) stamps the host clock at every
layer boundary, per device, into a ``Recorder``; ``build_profile`` turns one
step's stamps into a ``LayerProfile``: per layer and direction, the wall time
between consecutive boundaries (``Segment``). ``moe_segments`` /
``moe_durations`` read the MoE layers' segments out of a profile, keyed the
way the detector's cost models and the schedule's windows are.

Design choice: the recorder only stamps the time and keeps its operand; it is
read after the step (``drain``), off the step's timeline. Alternative not
taken: reading the operand (the device index) inside the callback, which cost
~50 us per device and mark on CPU. Pure Python and numpy: no JAX here, so a
profile can be built, stored and read without devices.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from capricorn_jax._src.profiling.detector import LayerKey

FWD, BWD = "fwd", "bwd"
STEP = "step"
START, END = "start", "end"
HEAD, TAIL = "head", "tail"

EventKey = tuple[str, str]  # (boundary name or STEP, FWD | BWD | START | END)


def is_edge(direction: str) -> bool:
    """Whether a mark's direction is a collective edge's (``"fwd:dispatch.end"``)
    rather than a boundary's (FWD, BWD) or the step's (START, END)."""
    return ":" in direction


def opens_span(edge: str) -> bool:
    """Whether a collective edge ends its collective in the step's order, so
    that an idle span of the link begins there: in the forward pass a
    collective runs from its ``.begin`` edge to its ``.end`` edge; in the
    backward pass its transpose runs from ``.end`` to ``.begin``."""
    direction, phase = edge.split(":", 1)
    return phase.endswith(".end" if direction == FWD else ".begin")


@dataclasses.dataclass(frozen=True)
class Span:
    """An idle span of the link inside a segment, between its collectives.

    Attributes:
      edge: the collective edge that opens it (``"fwd:dispatch.end"``), or ""
        for the segment's opening mark.
      idle_s: seconds until the next collective begins (or the segment ends).
      busy_s: seconds of the collective that closes it (0 for the last span,
        closed by the segment's end; the TAIL's last span holds the gradient
        all-reduce estimate).
    """

    edge: str
    idle_s: float
    busy_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Segment:
    """The wall time between two consecutive marks of one step.

    Attributes:
      name: the boundary closing the layer (``"block3"``), or HEAD / TAIL.
      direction: FWD or BWD (see the module docstring for HEAD and TAIL).
      start_s: when the segment began, seconds after the step's start mark
        (the sum of the segments before it).
      duration_s: its length in seconds (the gap between its two marks less
        one mark's cost, ``LayerProfile.mark_cost_s``).
      collective_s: estimated all-to-all time inside it, or None if unknown.
      spans: its idle spans between collectives, in step order, when the
        step marked its collectives' edges (``collective_boundary``): they
        tile the segment with their collectives (sum of idle and busy is its
        duration); None when it was not measured.
    """

    name: str
    direction: str
    start_s: float
    duration_s: float
    collective_s: float | None = None
    spans: tuple[Span, ...] | None = None

    def __post_init__(self) -> None:
        if self.spans is not None:  # from JSON: lists or dicts
            spans = tuple(s if isinstance(s, Span) else
                          Span(**s) if isinstance(s, Mapping) else Span(*s)
                          for s in self.spans)
            object.__setattr__(self, "spans", spans)

    @property
    def compute_s(self) -> float | None:
        """duration_s minus the collective estimate (None without one)."""
        if self.collective_s is None:
            return None
        return max(0.0, self.duration_s - self.collective_s)


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """One profiled step of one process.

    Attributes:
      step: the train step (``state["step"]`` before the update).
      total_s: host wall time of the call, dispatch to outputs ready.
      segments: in execution order; they tile [start mark, end mark], each
        less ``mark_cost_s``.
      devices: local devices whose marks were merged.
      mark_cost_s: what one mark adds to a step, taken off every segment
        (``build_profile``): the profile is of the step without its marks.
    """

    step: int
    total_s: float
    segments: tuple[Segment, ...]
    devices: int = 1
    mark_cost_s: float = 0.0

    @property
    def span_s(self) -> float:
        """The sum of the segments: the time from the start mark to the end
        mark less one mark's cost per segment."""
        return sum(s.duration_s for s in self.segments)

    def durations(self) -> dict[EventKey, float]:
        """{(name, direction): duration_s} of every segment."""
        return {(s.name, s.direction): s.duration_s for s in self.segments}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerProfile:
        segments = tuple(Segment(**s) for s in d["segments"])
        return cls(int(d["step"]), float(d["total_s"]), segments, int(d.get("devices", 1)),
                   float(d.get("mark_cost_s", 0.0)))

    @classmethod
    def from_json(cls, text: str) -> LayerProfile:
        return cls.from_dict(json.loads(text))


class Recorder:
    """Host-side sink of the marks' timestamps (thread-safe).

    Callbacks of different devices run on different threads. The callback
    only stamps the time and keeps its operand; reading the operand (the
    device index) waits for ``drain``, off the step's timeline (reading it
    in the callback cost ~50 us per device and mark on CPU). Each mark is kept
    once, at its first timestamp, per (name, direction, device).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._raw: list[tuple[str, str, Any, float]] = []

    def record(self, name: str, direction: str, tag: Any) -> np.ndarray:
        """The callback body: stamps the time; returns the dummy scalar.

        Args:
          name, direction: the mark's key (bound when the step is traced).
          tag: float32[2] (device index, probe of the marked data).
        """
        now = time.perf_counter()
        with self._lock:
            self._raw.append((name, direction, tag, now))
        return _ZERO

    def clear(self) -> None:
        with self._lock:
            self._raw.clear()

    def drain(self) -> dict[tuple[str, str, int], float]:
        """{(name, direction, device): first timestamp} recorded so far; forgets them."""
        with self._lock:
            raw, self._raw = self._raw, []
        times: dict[tuple[str, str, int], float] = {}
        for name, direction, tag, t in raw:
            key = (name, direction, int(np.asarray(tag)[0]))
            times[key] = min(t, times.get(key, t))
        return times


_ZERO = np.zeros((), np.float32)


def event_order(names: Sequence[str]) -> list[EventKey]:
    """The marks of one step in the order they must fire."""
    return (
        [(STEP, START)]
        + [(n, FWD) for n in names]
        + [(n, BWD) for n in reversed(names)]
        + [(STEP, END)]
    )


def _segment_keys(names: Sequence[str]) -> list[EventKey]:
    """The (name, direction) of the segment that each mark after START closes."""
    fwd = [(n, FWD) for n in names]
    bwd = [(n, BWD) for n in reversed(names[1:])]
    return fwd + [(HEAD, FWD)] + bwd + [(TAIL, BWD)]


def merge_devices(times: Mapping[tuple[str, str, int], float]) -> dict[EventKey, float]:
    """Per mark, the time its last device passed it; for START, its first.

    The step begins on this host when its first device begins (devices are
    launched one after the other: ~2 ms apart on 4 CPU devices), and every
    later mark is passed when all local devices passed it.
    """
    merged: dict[EventKey, float] = {}
    for (name, direction, _), t in times.items():
        pick = min if direction == START else max
        merged[(name, direction)] = pick(t, merged.get((name, direction), t))
    return merged


def build_profile(
    step: int,
    total_s: float,
    names: Sequence[str],
    times: Mapping[tuple[str, str, int], float],
    collectives_s: Mapping[str, float] | None = None,
    mark_cost_s: float = 0.0,
    tail_collective_s: float = 0.0,
    measured_collectives: bool = False,
) -> LayerProfile:
    """Turns one step's timestamps into a LayerProfile.

    Args:
      step: the step's index.
      total_s: host wall time of the call.
      names: the boundaries in forward order (at least one).
      times: {(name, direction, device): perf_counter seconds} from a Recorder.
      collectives_s: estimated collective seconds per boundary name, applied to
        both directions of that layer; others get None.
      mark_cost_s: what one mark adds to a step (``profiler.time_marks``):
        the time between two marks holds the rest of the first mark's
        callback and the start of the second's, about one mark's cost, so
        each segment's duration is its marks' gap less this (at least 0).
      tail_collective_s: estimated seconds of the collectives after the last
        boundary (the gradient all-reduce of the parameters every device
        holds, which XLA runs after the backward), added to the TAIL
        segment's collective estimate.
      measured_collectives: a segment whose collectives' edges were all
        marked (its ``spans``) takes as ``collective_s`` their measured time
        in the step (the sum of its spans' busy time, the tail's estimate
        included) instead of ``collectives_s``' estimate: no all-to-all timed
        in isolation, so no probe program compiled per buffer shape.

    Raises:
      RuntimeError: a mark is missing or the marks are out of order.
    """
    if not names:
        raise RuntimeError("profiler: no layer boundary was traced in the step")
    merged = merge_devices(times)
    order = event_order(names)
    missing = [k for k in order if k not in merged]
    if missing:
        raise RuntimeError(f"profiler: marks missing for {missing}")
    stamps = [merged[k] for k in order]
    if any(b < a for a, b in zip(stamps, stamps[1:], strict=False)):
        raise RuntimeError(f"profiler: marks out of order: {list(zip(order, stamps, strict=True))}")
    if not mark_cost_s >= 0:
        raise ValueError(f"mark_cost_s must be >= 0, got {mark_cost_s}")
    layer_of = {(n, d): n for n in names for d in (FWD, BWD)}
    layer_of[(TAIL, BWD)] = names[0]
    edges = _edges_by_layer(merged)
    segments, start = [], 0.0
    for key, t0, t1 in zip(_segment_keys(names), stamps[:-1], stamps[1:], strict=True):
        layer = layer_of.get(key)
        coll = None if collectives_s is None or layer is None else collectives_s.get(layer)
        tail = tail_collective_s if key == (TAIL, BWD) else 0.0
        if tail:
            coll = (coll or 0.0) + tail
        inside = {} if layer is None else {
            e: t for e, t in edges.get((layer, key[1]), {}).items() if t0 <= t <= t1}
        # Every gap between two marks holds about one mark's cost.
        duration = max(0.0, t1 - t0 - (len(inside) + 1) * mark_cost_s)
        spans = _spans(t0, t1, inside, mark_cost_s, tail) if inside else None
        if measured_collectives and spans is not None:
            coll = sum(span.busy_s for span in spans)
        segments.append(Segment(key[0], key[1], start, duration, coll, spans))
        start += duration
    devices = len({d for (_, _, d) in times})
    return LayerProfile(step, total_s, tuple(segments), devices, float(mark_cost_s))


def _edges_by_layer(merged: Mapping[EventKey, float]) -> dict[tuple[str, str], dict[str, float]]:
    """{(layer, FWD | BWD): {edge: time}} of the collective edges among the marks."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for (name, direction), t in merged.items():
        if is_edge(direction):
            out.setdefault((name, direction.split(":", 1)[0]), {})[direction] = t
    return out


def _spans(t0: float, t1: float, edges: Mapping[str, float], mark_cost_s: float,
           tail_s: float) -> tuple[Span, ...] | None:
    """The idle spans of a segment [t0, t1] whose collectives' edges are
    ``edges`` ({"fwd:dispatch.begin": time, ...}, both edges of each); None
    when some collective misses an edge or two collectives overlap. ``tail_s``
    (the gradient all-reduce, which runs in the segment's last span) moves
    from the last span's idle time to its busy time."""
    by_collective: dict[str, list[tuple[float, str]]] = {}
    for edge, t in edges.items():
        by_collective.setdefault(edge.rsplit(".", 1)[0], []).append((t, edge))
    busy = []
    for marks in by_collective.values():
        if len(marks) != 2:
            return None
        (begin, _), (end, closing) = sorted(marks)
        if not opens_span(closing):
            return None
        busy.append((begin, end, closing))
    busy.sort()
    spans, cursor, opening = [], t0, ""
    for begin, end, closing in busy:
        if begin < cursor:
            return None
        spans.append(Span(opening, max(0.0, begin - cursor - mark_cost_s),
                          max(0.0, end - begin - mark_cost_s)))
        cursor, opening = end, closing
    last = max(0.0, t1 - cursor - mark_cost_s)
    spans.append(Span(opening, max(0.0, last - tail_s), min(last, tail_s)))
    return tuple(spans)


def moe_segments(profile: LayerProfile, moe_layers: Sequence[int]) -> dict[EventKey, int]:
    """{(segment name, direction): MoE layer index} of a profile's MoE segments.

    A segment named ``block{i}`` holds layer i (forward: the segment closing
    at boundary i; backward: the segment opening there); the backward
    ``tail`` segment holds the first boundary's layer.

    Args:
      profile: a LayerProfile.
      moe_layers: the model's MoE layer indices (``TrainStep.moe_layers``).
    """
    moe = list(moe_layers)
    first_boundary = profile.segments[0].name  # its fwd segment opens the step
    out = {}
    for seg in profile.segments:
        name = first_boundary if seg.name == TAIL else seg.name
        if name.startswith("block") and int(name[5:]) in moe:
            out[(seg.name, seg.direction)] = moe.index(int(name[5:]))
    return out


def moe_durations(profile: LayerProfile, moe_layers: Sequence[int]) -> dict[LayerKey, float]:
    """{(MoE layer index, direction): seconds} of a profile's MoE segments: what
    the detector's cost models (``DynamicityDetector.record_profile``) take."""
    layer_of = moe_segments(profile, moe_layers)
    return {(layer_of[(s.name, s.direction)], s.direction): s.duration_s
            for s in profile.segments if (s.name, s.direction) in layer_of}
