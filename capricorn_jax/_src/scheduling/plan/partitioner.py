"""Partitioner: which bytes of a device payload travel in which idle window.

What it decides. A host's checkpoint is a set of equal-layout device payloads
(``packing.PackPlan``: leaf i occupies ``[offset, offset + segment)`` of every
payload, a trailer follows). The partitioner cuts *one* payload's byte range
``[0, payload_bytes)`` into contiguous chunks and assigns each chunk to an idle
window of the training step (a span in which the inter-host link carries no
training traffic, e.g. a layer's compute between its all-to-alls, see
``windows_from_profile``) or, when it fits nowhere, to the *tail*: the chunks
sent after the step. The transfer executor then issues each window's chunks as
collective-permutes tied to that window's layer boundary. Since every payload
has one layout, one schedule serves all devices of all hosts.

Cost model. Sending one chunk of ``s`` bytes costs ``alpha + s / B`` seconds
(``LinkModel``; ``fit_link_model`` fits it to measured transfers), so ``n``
chunks holding ``S`` bytes in total cost ``n * alpha + S / B``. A window of
duration ``D`` may hold any chunks whose costs add up to at most ``D``. Chunks
are at most ``chunk_cap`` bytes (the executor's buffer) and at least
``min_chunk`` bytes, except the payload's very last chunk, which is whatever
is left.

Why greedy contiguous filling. The payload is cut in order: window 0 takes a
prefix, window 1 the next range, ..., the tail the rest. Each window is filled
to its capacity: as many full ``chunk_cap`` chunks as fit, then one partial
chunk with what is left of the window (when ``min_chunk`` > 1 and that partial
chunk would be too short, the last full chunks give it bytes); if the rest of
the payload fits in the window, it all goes there and the schedule ends. This
minimizes the tail (the bytes that miss the step), see ``partition`` for the
argument, in O(1) arithmetic per window plus one object per chunk. The
schedule is a pure, deterministic function of plain numbers: every host
computes the same one without talking to the others.

Alternative not taken: bin-packing whole leaves (or whole shard blocks) into
windows. It keeps a leaf in one piece, but it is NP-hard in general, leaves
windows partly empty when leaves are large or uneven (an MoE layer's expert
weights are one large leaf), and forces each window's transfer into as many
chunks as it holds leaves, each paying ``alpha``. Cutting the flat payload by
byte range fills every window to the byte and pays ``alpha`` only per
``chunk_cap`` bytes; ``Schedule.slices`` maps a chunk back to the leaf byte
ranges it carries, which is all a receiver needs.

Pure Python and numpy, no JAX: property-tested without devices.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from capricorn_jax._src.profiling.layer_profile import TAIL

if TYPE_CHECKING:
    from capricorn_jax._src.profiling.layer_profile import LayerProfile

TRAILER = "<trailer>"
PADDING = "<padding>"
_JSON_VERSION = 1


def _finite(name: str, value: float, *, positive: bool = False) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value}")
    return value


def _index(name: str, value: Any, low: int) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """Cost of sending bytes over the inter-host link.

    Attributes:
      alpha_s: fixed cost of one chunk (launch, latency), seconds, >= 0.
      bytes_per_s: bandwidth B, > 0.
    """

    alpha_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha_s", _finite("alpha_s", self.alpha_s))
        object.__setattr__(
            self, "bytes_per_s", _finite("bytes_per_s", self.bytes_per_s, positive=True))

    def cost_s(self, chunks: int, nbytes: int) -> float:
        """Seconds to send ``chunks`` chunks holding ``nbytes`` bytes in total.

        The one formula every fit decision uses: monotone in both arguments.
        """
        return chunks * self.alpha_s + nbytes / self.bytes_per_s


MEASURE_ATTEMPTS = 3
"""Measurements of a link before its fit's error is raised: on a busy host the
smallest size's fastest time can exceed the largest's (measured on this box
beside a CPU-bound process: a fit with a negative slope)."""


def fit_link_model(sizes: Sequence[int], seconds: Sequence[float]) -> LinkModel:
    """Least-squares fit of seconds ~ alpha + size / B to measured transfers.

    When the unconstrained intercept is negative, the fit is redone with
    alpha = 0 (the least-squares optimum under alpha >= 0).

    Args:
      sizes: bytes of each measured transfer (>= 0).
      seconds: the measured time of each.

    Raises:
      ValueError: mismatched lengths, fewer than 2 distinct sizes, non-finite
        or negative values, or a non-positive fitted bandwidth (times that do
        not grow with size).
    """
    x = np.asarray(sizes, np.float64).ravel()
    y = np.asarray(seconds, np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"sizes and seconds differ in length: {x.size} vs {y.size}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("sizes and seconds must be finite")
    if np.any(x < 0):
        raise ValueError("sizes must be >= 0")
    if np.unique(x).size < 2:
        raise ValueError(f"sizes: need at least 2 distinct sizes to fit alpha and B, "
                         f"got {np.unique(x).tolist()}")
    dx = x - x.mean()
    beta = float(np.dot(dx, y - y.mean()) / np.dot(dx, dx))
    alpha = float(y.mean() - beta * x.mean())
    if alpha < 0:
        alpha, beta = 0.0, float(np.dot(x, y) / np.dot(x, x))
    if not beta > 0 or not math.isfinite(1.0 / beta):
        raise ValueError(f"fitted bandwidth is not positive (seconds per byte {beta}): "
                         "the measured times do not grow with size")
    return LinkModel(alpha, 1.0 / beta)


@dataclasses.dataclass(frozen=True)
class Window:
    """An idle span of the step in which the link carries no training traffic.

    Attributes:
      name: the layer boundary that opens it (``profiler.Segment.name``).
      direction: "fwd" or "bwd" (the segment's direction).
      duration_s: its length, seconds, >= 0.
      edge: the collective edge that opens it inside its segment
        (``layer_profile.Span.edge``, e.g. "bwd:combine.begin"), or "" when
        the segment's opening boundary does (a whole segment's window, or its
        first span).
    """

    name: str
    direction: str
    duration_s: float
    edge: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "duration_s", _finite("duration_s", self.duration_s))


def windows_from_profile(profile: LayerProfile, spans: bool = False) -> list[Window]:
    """The idle windows of a profiled step, in step order.

    One window per segment: its compute time (duration minus the all-to-all
    estimate) when the profile knows its collective time, else its whole
    duration. With ``spans``, a segment whose idle spans were measured
    (``Segment.spans``) gives one window per span instead (opened by its
    edge; its idle time), so no window's bytes are sent while the segment's
    collectives run. Segments are taken in the order they happen in the step
    (forward, then backward; sorted by start time, ties kept in profile
    order). A negative measured duration (clock noise) becomes 0. With
    ``spans``, the TAIL segment's last span (the one that holds the step's
    gradient all-reduce) is a window of 0 s: no bytes are planned where the
    all-reduce may run.
    """
    segments = sorted(profile.segments, key=lambda s: s.start_s)
    out: list[Window] = []
    for seg in segments:
        if spans and seg.spans:
            # The TAIL's last span holds the gradient all-reduce (XLA runs it
            # after the backward, where it will): never planned (idle 0).
            last = len(seg.spans) - 1 if seg.name == TAIL else -1
            out.extend(Window(seg.name, seg.direction,
                              0.0 if k == last else max(0.0, float(span.idle_s)), span.edge)
                       for k, span in enumerate(seg.spans))
            continue
        compute = seg.compute_s  # None exactly when the collective time is unknown
        idle = seg.duration_s if compute is None else compute
        out.append(Window(seg.name, seg.direction, max(0.0, float(idle))))
    return out


def scale_windows(windows: Sequence[Window], factor: float) -> list[Window]:
    """The windows with each duration multiplied by ``factor`` (a safety margin:
    ``partition_search.SCHEDULE_MARGIN``)."""
    factor = _finite("factor", factor)
    return [dataclasses.replace(w, duration_s=w.duration_s * factor) for w in windows]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Bytes [start, stop) of a device payload, sent in ``window`` (None: the tail)."""

    window: int | None
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of a chunk that belongs to one leaf.

    Attributes:
      path: the leaf's path, or TRAILER (bytes after the last leaf) / PADDING
        (a gap between leaves).
      start, stop: byte range within the leaf's segment (for TRAILER and
        PADDING: within that region).
      payload_start: where ``start`` lies in the payload.
    """

    path: str
    start: int
    stop: int
    payload_start: int


def _leaf_regions(leaves: Sequence[Any], payload_bytes: int) -> list[tuple[str, int, int]]:
    """(path, payload start, payload stop) of every leaf, gap and the trailer, in order."""
    spans = []
    for leaf in leaves:
        if hasattr(leaf, "path"):
            path, offset, segment = leaf.path, leaf.offset, leaf.segment
        else:
            path, offset, segment = leaf
        offset, segment = _index("leaf offset", offset, 0), _index("leaf segment", segment, 0)
        if offset + segment > payload_bytes:
            raise ValueError(f"leaves: {path} ends at {offset + segment}, past the payload "
                             f"({payload_bytes} bytes)")
        if segment:
            spans.append((offset, offset + segment, str(path)))
    spans.sort()
    regions, cursor = [], 0
    for start, stop, path in spans:
        if start < cursor:
            raise ValueError(f"leaves: {path} at [{start}, {stop}) overlaps the leaf before it")
        if start > cursor:
            regions.append((PADDING, cursor, start))
        regions.append((path, start, stop))
        cursor = stop
    if cursor < payload_bytes:
        regions.append((TRAILER, cursor, payload_bytes))
    return regions


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Where each byte of one device payload travels.

    Attributes:
      windows: the windows scheduled into, in step order.
      chunks: chunks[i]: window i's chunks, in payload order.
      tail: chunks sent after the step (the overflow), in payload order.
      payload_bytes: bytes of one device payload.
      chunk_cap: the most bytes of one chunk.
      link: the cost model the schedule was planned with.
      min_chunk: the fewest bytes of a chunk (but the payload's last one).
    """

    windows: tuple[Window, ...]
    chunks: tuple[tuple[Chunk, ...], ...]
    tail: tuple[Chunk, ...]
    payload_bytes: int
    chunk_cap: int
    link: LinkModel
    min_chunk: int = 1

    def bytes_in_window(self, i: int) -> int:
        return sum(c.size for c in self.chunks[i])

    @property
    def tail_bytes(self) -> int:
        """Bytes that fit in no window (sent after the step)."""
        return sum(c.size for c in self.tail)

    def window_cost_s(self, i: int) -> float:
        """Link seconds of window i's chunks (<= its duration)."""
        return self.link.cost_s(len(self.chunks[i]), self.bytes_in_window(i))

    def all_chunks(self) -> list[Chunk]:
        """Every chunk in payload order: the windows' in order, then the tail."""
        return [c for window in self.chunks for c in window] + list(self.tail)

    def slices(self, plan_leaves: Sequence[Any]) -> list[tuple[Chunk, tuple[Piece, ...]]]:
        """The leaf byte ranges each chunk carries.

        Args:
          plan_leaves: the payload layout: ``PackPlan.leaves`` or (path,
            offset, segment) triples; non-overlapping, inside the payload.

        Returns:
          (chunk, pieces) for every chunk in payload order; the pieces tile
          the chunk in order. Bytes outside every leaf map to TRAILER (after
          the last leaf) or PADDING (before or between leaves).
        """
        regions = _leaf_regions(plan_leaves, self.payload_bytes)
        out, r = [], 0
        for chunk in self.all_chunks():
            pieces, pos = [], chunk.start
            while pos < chunk.stop:
                while regions[r][2] <= pos:
                    r += 1
                path, start, stop = regions[r]
                end = min(stop, chunk.stop)
                pieces.append(Piece(path, pos - start, end - start, pos))
                pos = end
            out.append((chunk, tuple(pieces)))
        return out

    def validate(self) -> None:
        """Raises ValueError unless the schedule covers the payload and respects its windows."""
        if len(self.chunks) != len(self.windows):
            raise ValueError(f"schedule: {len(self.chunks)} chunk lists for "
                             f"{len(self.windows)} windows")
        pos = 0
        for i, group in enumerate([*self.chunks, self.tail]):
            expect = None if i == len(self.chunks) else i
            for c in group:
                if c.window != expect or c.start != pos or not 0 < c.size <= self.chunk_cap:
                    raise ValueError(f"schedule: bad chunk {c} at byte {pos}")
                if c.size < self.min_chunk and c.stop != self.payload_bytes:
                    raise ValueError(f"schedule: {c} is shorter than min_chunk {self.min_chunk}")
                pos = c.stop
            if expect is not None and self.window_cost_s(i) > self.windows[i].duration_s:
                raise ValueError(f"schedule: window {i} needs {self.window_cost_s(i)} s, "
                                 f"has {self.windows[i].duration_s} s")
        if pos != self.payload_bytes:
            raise ValueError(f"schedule covers {pos} of {self.payload_bytes} bytes")

    def to_json(self) -> str:
        doc = {
            "version": _JSON_VERSION,
            "payload_bytes": self.payload_bytes,
            "chunk_cap": self.chunk_cap,
            "min_chunk": self.min_chunk,
            "link": dataclasses.asdict(self.link),
            "windows": [dataclasses.asdict(w) for w in self.windows],
            "chunks": [[[c.start, c.stop] for c in group] for group in self.chunks],
            "tail": [[c.start, c.stop] for c in self.tail],
        }
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """The schedule ``to_json`` wrote; raises ValueError if it is not a valid one."""
        doc = json.loads(text)
        if doc.get("version") != _JSON_VERSION:
            raise ValueError(f"schedule JSON version {doc.get('version')}, "
                             f"expected {_JSON_VERSION}")
        schedule = cls(
            windows=tuple(Window(**w) for w in doc["windows"]),
            chunks=tuple(tuple(Chunk(i, a, b) for a, b in group)
                         for i, group in enumerate(doc["chunks"])),
            tail=tuple(Chunk(None, a, b) for a, b in doc["tail"]),
            payload_bytes=int(doc["payload_bytes"]),
            chunk_cap=int(doc["chunk_cap"]),
            link=LinkModel(**doc["link"]),
            min_chunk=int(doc["min_chunk"]),
        )
        schedule.validate()
        return schedule


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The largest x in [lo, hi] with ok(x), for ok true then false; lo - 1 if none."""
    if hi < lo or not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _largest_near(lo: int, hi: int, ok: Callable[[int], bool], guess: float) -> int:
    """``_largest(lo, hi, ok)``, searched from ``guess`` (the closed-form
    answer, which float rounding may put a step off): galloping from the
    guess, then bisecting the bracket found, so a guess one off costs a few
    calls of ``ok`` instead of a bisection of the whole range. The same
    answer for any guess (ok true then false)."""
    if hi < lo or not ok(lo):
        return lo - 1
    x = min(max(int(guess), lo), hi) if math.isfinite(guess) else hi
    if ok(x):  # the answer is in [x, hi]: gallop up to a failing bound
        step = 1
        while x < hi and ok(min(x + step, hi)):
            x, step = min(x + step, hi), step * 2
        if x == hi:
            return hi
        return _largest(x, min(x + step, hi) - 1, ok)
    top, step = x - 1, 1  # ok(x) false: the answer is in [lo, x - 1]; ok(lo) holds
    y = max(lo, x - step)
    while not ok(y):
        top, step = y - 1, step * 2
        y = max(lo, x - step)
    return _largest(y, top, ok)


def _split(total: int, count: int, cap: int, low: int) -> list[int]:
    """``total`` bytes as ``count`` chunk sizes in [low, cap], largest first.

    Requires count * low <= total <= count * cap.
    """
    sizes = []
    for left_after in range(count - 1, -1, -1):
        size = min(cap, total - left_after * low)
        sizes.append(size)
        total -= size
    return sizes


def _take(remaining: int, duration_s: float, link: LinkModel, cap: int,
          low: int) -> tuple[int, int, int]:
    """(bytes, chunks, smallest chunk) one window takes of the bytes still
    unscheduled: the greedy fill's decision (``partition``'s docstring)."""
    if remaining == 0:
        return 0, 0, 1

    def fits(n: int, nbytes: int) -> bool:
        return link.cost_s(n, nbytes) <= duration_s

    # The rest of the payload fits: take it all (its last chunk may be short).
    n_rest = -(-remaining // cap)
    if fits(n_rest, remaining):
        return remaining, n_rest, 1
    # Else the most bytes: n_full full chunks, or one more chunk, partial.
    # Both searches start from their closed forms (a step off at most, by
    # float rounding): a re-plan partitions for every share it tries
    # (``partition_search.even_partition``), on the training thread.
    per_chunk = link.alpha_s + cap / link.bytes_per_s
    n_full = _largest_near(0, n_rest, lambda n: fits(n, n * cap),
                           duration_s / per_chunk if per_chunk > 0 else math.inf)
    best, count = n_full * cap, n_full
    n = n_full + 1
    most = _largest_near(0, min(n * cap, remaining), lambda s: fits(n, s),
                         (duration_s - n * link.alpha_s) * link.bytes_per_s)
    if most >= n * low and most > best:
        best, count = most, n
    return best, count, low


def _fill(remaining: int, duration_s: float, link: LinkModel, cap: int, low: int) -> list[int]:
    """Chunk sizes for one window, given the bytes still unscheduled."""
    best, count, smallest = _take(remaining, duration_s, link, cap, low)
    return _split(best, count, cap, smallest) if count else []


def placed_bytes(payload_bytes: int, durations: Sequence[float], link: LinkModel,
                 chunk_cap: int, min_chunk: int = 1) -> int:
    """The bytes ``partition`` would place in windows of these durations (the
    payload less its tail), without building the schedule: what a search
    over window scales asks of each scale it tries."""
    pos = 0
    for d in durations:
        if pos == payload_bytes:
            break
        pos += _take(payload_bytes - pos, d, link, chunk_cap, min_chunk)[0]
    return pos


def partition(payload_bytes: int, windows: Sequence[Window], link: LinkModel,
              chunk_cap: int, min_chunk: int = 1) -> Schedule:
    """Schedules one device payload into the step's idle windows, the rest into the tail.

    Windows are filled in order with contiguous chunks of at most
    ``chunk_cap`` bytes, each window with chunks whose costs
    (``alpha + size / B`` each) add up to at most its duration; a window
    shorter than ``alpha`` gets nothing; what fits nowhere goes to the tail
    as ``chunk_cap`` chunks (the last one shorter).

    Why greedy minimizes the tail. A window's cost depends only on its chunk
    count n and byte total S (n * alpha + S / B), so the most it can hold is
    max_n min(n * cap, (D - n * alpha) * B): the first term grows and the
    second falls with n, so the maximum is at n_full (the full chunks that
    fit) or n_full + 1 (those plus one partial chunk), the two counts tried
    here. The payload is one ordered byte stream and a window's capacity does
    not depend on which bytes it holds, so filling windows in order to their
    capacity places min(payload, sum of capacities) bytes, which no schedule
    exceeds. With ``min_chunk`` > 1 the totals a window can hold have gaps,
    but only the payload's last chunk may be short: every window before the
    one holding the last byte holds at most its capacity (greedy takes it),
    and whether the rest fits in a window is monotone in the rest, which
    greedy only makes smaller; so greedy still leaves the least in the tail.

    Args:
      payload_bytes: bytes of one device payload (``PackPlan.payload_bytes``).
      windows: the idle windows, in step order.
      link: the link cost model.
      chunk_cap: the most bytes of one chunk (>= 1).
      min_chunk: the fewest bytes of a chunk, except the payload's last chunk
        (1 <= min_chunk <= chunk_cap).

    Returns:
      The schedule; ``tail_bytes`` is the overflow.

    Raises:
      ValueError: naming the bad argument.
    """
    payload_bytes = _index("payload_bytes", payload_bytes, 0)
    chunk_cap = _index("chunk_cap", chunk_cap, 1)
    min_chunk = _index("min_chunk", min_chunk, 1)
    if min_chunk > chunk_cap:
        raise ValueError(f"min_chunk ({min_chunk}) must be <= chunk_cap ({chunk_cap})")
    if not isinstance(link, LinkModel):
        raise ValueError(f"link must be a LinkModel, got {type(link).__name__}")
    windows = tuple(windows)
    for i, w in enumerate(windows):
        if not isinstance(w, Window):
            raise ValueError(f"windows[{i}] must be a Window, got {type(w).__name__}")

    per_window, pos = [], 0
    for i, w in enumerate(windows):
        group = []
        for size in _fill(payload_bytes - pos, w.duration_s, link, chunk_cap, min_chunk):
            group.append(Chunk(i, pos, pos + size))
            pos += size
        per_window.append(tuple(group))
    tail = []
    while pos < payload_bytes:
        stop = min(pos + chunk_cap, payload_bytes)
        tail.append(Chunk(None, pos, stop))
        pos = stop
    return Schedule(windows, tuple(per_window), tuple(tail), payload_bytes, chunk_cap, link,
                    min_chunk)
