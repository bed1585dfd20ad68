"""The in-step transfer schedule in force, and its compiled steps.

A scheduled strategy (``strategies.scheduled``: gemini, capricorn) moves
version t's chunks *inside* step t with ``executor.InStepSender``, according
to a ``partitioner.Schedule`` built from profiled windows and a link model
measured on the real transport (``measure_link``). ``ScheduledTransfers``
keeps the schedule in force (one per payload size: a PEC version's payload is
smaller and is partitioned again over the same windows) and the scheduled
step variants compiled for it; ``schedule_at_risk`` is capricorn's gate on
speculative profiles.

Every host must build the same schedule, or their compiled steps (which hold
the collectives) would differ: the link fit and the windows are host 0's
numbers (``multihost.agree.agree_measured``).

Design choice: compiled variants are keyed by where the bytes go, not by the
window durations, so a re-partition that moves nothing reuses its variant.
Alternative not taken: one variant per re-partition, a compile each time the
detector fires.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from capricorn_jax._src.multihost.agree import agree_measured
from capricorn_jax._src.profiling.layer_profile import LayerProfile, moe_segments
from capricorn_jax._src.scheduling.executor import InStepSender, SiteClock, scheduled_step
from capricorn_jax._src.scheduling.load_windows import windows_at
from capricorn_jax._src.scheduling.partition_search import even_partition, spread
from capricorn_jax._src.scheduling.partitioner import (
    MEASURE_ATTEMPTS,
    LinkModel,
    Schedule,
    Window,
    fit_link_model,
    partition,
    scale_windows,
)

if TYPE_CHECKING:
    from capricorn_jax._src.memory.tier.writer_door import TierWriter
    from capricorn_jax._src.memory.wire.transport import Transport
    from capricorn_jax._src.profiling.detector import DynamicityDetector
    from capricorn_jax._src.profiling.train_step import TrainStep


def measure_link(transport: Transport, sizes: Sequence[int] = (1 << 16, 1 << 20, 1 << 22),
                 repeats: int = 5) -> LinkModel:
    """Fits alpha + bytes/B from timed collective-permutes on the replication link.

    The fastest of ``repeats`` runs per size is used (the others carry the
    machine's noise), and host 0's fit is taken by every host. A fit that
    fails (times that do not grow with size, seen on a busy box) is measured
    again, up to ``MEASURE_ATTEMPTS`` times, as the chunk channel's is (every
    host decides alike: host 0's times).
    """
    perm = transport.perms[0]
    spec = P(transport.axes)
    mapped = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, transport.axes, perm),
                                   mesh=transport.mesh, in_specs=spec, out_specs=spec))
    for attempt in range(MEASURE_ATTEMPTS):
        xs, ts = [], []
        for size in sizes:
            rows = transport.rows_of(np.zeros(size, np.uint8), np.uint8)
            jax.block_until_ready(mapped(rows))  # compile
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(mapped(rows))
                xs.append(size)
                ts.append(time.perf_counter() - t0)
        best = [min(t for x, t in zip(xs, ts, strict=True) if x == s) for s in sizes]
        try:
            return fit_link_model(list(sizes), agree_measured(best))
        except ValueError:
            if attempt == MEASURE_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


WindowKey = tuple[str, str, str]  # name, direction, edge


def _per_window(profiles: Sequence[LayerProfile], windows_of: Callable[[LayerProfile], list[Window]]
                ) -> tuple[list[WindowKey], dict[WindowKey, list[float]]]:
    """The windows' keys in step order, and each key's durations over ``profiles``."""
    per_key: dict[WindowKey, list[float]] = {}
    order: list[WindowKey] = []
    for profile in profiles:
        for w in windows_of(profile):
            key = (w.name, w.direction, w.edge)
            if key not in per_key:
                per_key[key] = []
                order.append(key)
            per_key[key].append(w.duration_s)
    return order, per_key


def average_windows(profiles: Sequence[LayerProfile],
                    windows_of: Callable[[LayerProfile], list[Window]]) -> list[Window]:
    """Mean window per (name, direction, edge) over several profiles, in step order."""
    order, per_key = _per_window(profiles, windows_of)
    return [Window(n, d, float(np.mean(per_key[(n, d, e)])), e) for n, d, e in order]


def shortest_windows(profiles: Sequence[LayerProfile],
                     windows_of: Callable[[LayerProfile], list[Window]]) -> list[Window]:
    """Shortest window per (name, direction, edge) over several profiles, in
    step order: a plan that holds if the step is as fast as the fastest of
    them (a profile that caught a slow step only lengthens windows, so it
    cannot overfill one)."""
    order, per_key = _per_window(profiles, windows_of)
    return [Window(n, d, float(min(per_key[(n, d, e)])), e) for n, d, e in order]


class ScheduledTransfers:
    """Keeps the current schedule and the compiled scheduled steps.

    Args:
      ckpt: the host's memory tier (its transport).
      trainer: the caller's TrainStep (builds the steps).
      boundaries: the model's boundary names, forward order.
      link: the measured link model.
      chunk_cap: largest chunk in bytes.
      margin: windows are scaled by this before partitioning (safety).
      even: fill every window to the same least share of its (margin-scaled)
        time that holds the version (``partition_search.even_partition``), not
        greedily in order to the margin.
      clock: the in-graph path's window clock (``window_clock.WindowClock``),
        whose marks the compiled steps carry; None: steps without marks.
    """

    def __init__(self, ckpt: TierWriter, trainer: TrainStep, boundaries: list[str],
                 link: LinkModel, chunk_cap: int, margin: float = 0.8,
                 clock: SiteClock | None = None, even: bool = True) -> None:
        self.ckpt, self.trainer, self.boundaries = ckpt, trainer, boundaries
        self.clock = clock
        self.link, self.chunk_cap, self.margin, self.even = link, chunk_cap, margin, even
        self._shares: dict[int, float] = {}  # payload bytes -> the even fill's share
        self.schedule: Schedule | None = None  # of the full payload (ckpt.plan)
        self.partitions = 0
        self._steps: dict[tuple, Any] = {}
        self._windows: list[Window] | None = None
        # payload bytes -> (schedule in force, where its bytes go: the variants' key)
        self._schedules: dict[int, tuple[Schedule, tuple]] = {}
        self._spreads: dict[tuple[int, int], tuple[Schedule, int]] = {}

    def repartition(self, windows: Sequence[Window]) -> Schedule:
        """A new schedule from ``windows`` (host 0's durations, on every host)."""
        durations = agree_measured([w.duration_s for w in windows])
        windows = [dataclasses.replace(w, duration_s=d)
                   for w, d in zip(windows, durations, strict=True)]
        self._windows = scale_windows(windows, self.margin)
        self._schedules = {}
        self._spreads = {}
        self.schedule = self.schedule_for(self.ckpt.transport)
        self.partitions += 1
        return self.schedule

    def schedule_for(self, transport: Transport) -> Schedule:
        """The schedule in force for a payload of ``transport``'s plan (a PEC
        version's payload is smaller: the same windows, partitioned again)."""
        return self._planned(transport)[0]

    def spread_for(self, transport: Transport, max_steps: int) -> tuple[Schedule, int]:
        """(schedule, k): ``transport``'s payload over the windows of the
        fewest steps k <= ``max_steps`` that hold it (``partition_search.spread``;
        k = 1 is ``schedule_for``'s)."""
        schedule = self.schedule_for(transport)
        if not schedule.tail or max_steps == 1:
            return schedule, 1
        key = (transport.plan.payload_bytes, max_steps)
        if key not in self._spreads:
            assert self._windows is not None  # schedule_for raised otherwise
            self._spreads[key] = spread(transport.plan.payload_bytes, self._windows, self.link,
                                        self.chunk_cap, max_steps)
        return self._spreads[key]

    def _planned(self, transport: Transport) -> tuple[Schedule, tuple]:
        """(schedule, where its bytes go) for ``transport``'s payload size."""
        if self._windows is None:
            raise RuntimeError("no schedule yet: repartition first")
        size = transport.plan.payload_bytes
        if size not in self._schedules:
            if self.even:
                s, self._shares[size] = even_partition(size, self._windows, self.link,
                                                       self.chunk_cap)
            else:
                s = partition(size, self._windows, self.link, self.chunk_cap)
            where = (tuple((w.name, w.direction, w.edge, tuple((c.start, c.stop) for c in cs))
                           for w, cs in zip(s.windows, s.chunks, strict=True)),
                     tuple((c.start, c.stop) for c in s.tail))
            self._schedules[size] = (s, where)
        return self._schedules[size]

    def _key(self, factors: tuple[float, ...], hooks: tuple, transport: Transport) -> tuple:
        # Compiled variants are keyed by where the bytes go, not by the window
        # durations, so a re-partition that moves nothing reuses its variant.
        return self._planned(transport)[1], id(transport), tuple(factors), tuple(hooks)

    def has_step(self, factors: tuple[float, ...], hooks: tuple = (),
                 transport: Transport | None = None) -> bool:
        """Whether the scheduled step for the current schedule is compiled."""
        return self._key(factors, hooks, transport or self.ckpt.transport) in self._steps

    def step_fn(self, factors: tuple[float, ...], hooks: tuple = (),
                transport: Transport | None = None) -> Callable[..., Any]:
        """The scheduled step of the schedule in force (compiled once per
        factors, ``hooks`` (extra boundary hooks, e.g. a CollectiveProbe) and
        payload: ``transport`` of a PEC version, default the full one)."""
        transport = transport or self.ckpt.transport
        key = self._key(factors, hooks, transport)
        if key not in self._steps:
            sender = InStepSender(transport, self.trainer.state_shardings,
                                  self.schedule_for(transport), self.boundaries,
                                  clock=self.clock)
            self._steps[key] = scheduled_step(self.trainer, sender, factors, hooks)
        return self._steps[key]

    def summary(self) -> dict[str, Any]:
        s = self.schedule
        if s is None:
            return {"scheduled": False}
        return {"scheduled": True, "partitions": self.partitions,
                "window_bytes": [s.bytes_in_window(i) for i in range(len(s.windows))],
                "tail_bytes": s.tail_bytes,
                "fill_share": (round(self._shares[s.payload_bytes], 4)
                               if s.payload_bytes in self._shares else None)}


def schedule_at_risk(schedule: Schedule | None, detector: DynamicityDetector,
                     tokens_per_expert: Any, profile: LayerProfile | None,
                     moe_layers: Sequence[int]) -> bool:
    """Whether ``schedule`` may overflow a window at this expert load.

    Capricorn's gate on speculative profiling: a drift of the load only
    matters to the checkpoint if a window the schedule fills shrinks below its
    chunks. Each MoE window is predicted from the detector's cost model of
    its segment at this load (``load_windows.windows_at`` on ``profile``, the
    one the schedule was planned on, span windows when the schedule has
    them); other windows do not depend on the load. At risk when some
    window's chunks cost more than its predicted length (the partitioner
    filled only a share of each window, so a small shrink is absorbed), when
    the schedule has a tail that grown windows might take, or when a model
    has fewer than two profiles to fit (exploration: the model must see the
    load move).

    Args:
      schedule: the schedule in force (None: at risk, there is none).
      detector: the DynamicityDetector whose cost models are keyed
        (MoE layer, direction).
      tokens_per_expert: [moe_layers, experts] load now.
      profile: the LayerProfile the schedule was planned on.
      moe_layers: the model's MoE layer indices.
    """
    if schedule is None or profile is None or schedule.tail_bytes > 0:
        return True
    layer_of = moe_segments(profile, moe_layers)
    for i, window in enumerate(schedule.windows):
        if not schedule.chunks[i] or (window.name, window.direction) not in layer_of:
            continue
        model = detector.cost_models.get((layer_of[(window.name, window.direction)],
                                          window.direction))
        if model is None or model.count < 2:
            return True
    durations = detector.predict(tokens_per_expert)
    for (name, direction), layer in layer_of.items():  # no model: as profiled (none filled)
        durations.setdefault((layer, direction), next(
            s.duration_s for s in profile.segments if (s.name, s.direction) == (name, direction)))
    spans = any(w.edge for w in schedule.windows)
    room = {(w.name, w.direction, w.edge): w.duration_s
            for w in windows_at(profile, lambda layer, d: durations[(layer, d)], moe_layers,
                                spans) or ()}
    return any(schedule.chunks[i] and (w.name, w.direction) in layer_of
               and schedule.window_cost_s(i) > room.get((w.name, w.direction, w.edge), 0.0)
               for i, w in enumerate(schedule.windows))


def window_spills(schedule: Schedule, spans_s: dict[int, float],
                  profile: LayerProfile | None,
                  sends_s: dict[int, float] | None = None,
                  window_bytes: dict[int, Any] | None = None) -> list[dict[str, Any]]:
    """What each filled window of a step that moved ``schedule`` really held.

    A window's idle time in the step is the span between the marks of the
    boundaries that open and close it, less the all-to-all estimate of its
    segment in ``profile`` (the one the schedule was planned on; 0 without
    one). Two measures of its overflow: ``spill_s``, the link time of its
    chunks (the link model's) beyond that idle time, i.e. what the cost model
    promised and the step did not give; and, with ``sends_s``, ``late_s``,
    how long after the window's closing mark its last byte was handed to the
    kernel (measured, no model: the link's real rate and its sharing with
    the step's own traffic included).

    Args:
      schedule: the schedule the step moved.
      spans_s: window index -> seconds between its opening and closing marks
        (windows without both marks left out).
      profile: the LayerProfile the schedule was planned on.
      sends_s: window index -> seconds from its opening mark until its last
        frame was sent (None: not measured).
      window_bytes: window index -> its bytes planned, sent inside it and
        late (``window_bytes.WindowBytes``: measured on the threaded path; None:
        not measured: the in-graph path).

    Returns:
      One record per window in ``spans_s`` with chunks, in step order:
      window ("name/direction"), planned_s (the window the schedule was
      partitioned into: measured x the safety margin), observed_s (idle time
      measured), chunks_s (its chunks' link time, modelled), spill_s, and
      with ``sends_s`` sent_s and late_s; bytes_planned, bytes_sent,
      bytes_late, bytes_carried (to later windows) and bytes_carried_in
      from ``window_bytes`` (None without).
    """
    busy = {} if profile is None else _busy_after(profile, any(w.edge for w in schedule.windows))
    out = []
    for i in sorted(spans_s):
        if not schedule.chunks[i]:
            continue
        window = schedule.windows[i]
        idle = max(0.0, spans_s[i] - busy.get((window.name, window.direction, window.edge), 0.0))
        cost = schedule.window_cost_s(i)
        name = f"{window.name}/{window.direction}" + (f"@{window.edge}" if window.edge else "")
        record = {"window": name,
                  "planned_s": round(window.duration_s, 6), "observed_s": round(idle, 6),
                  "chunks_s": round(cost, 6), "spill_s": round(max(0.0, cost - idle), 6)}
        measured = (window_bytes or {}).get(i)
        record["bytes_planned"] = None if measured is None else measured.planned
        record["bytes_sent"] = None if measured is None else measured.sent
        record["bytes_late"] = None if measured is None else measured.late
        record["bytes_carried"] = None if measured is None else measured.carried_out
        record["bytes_carried_in"] = None if measured is None else measured.carried_in
        if sends_s is not None and i in sends_s:
            record["sent_s"] = round(sends_s[i], 6)
            record["late_s"] = round(max(0.0, sends_s[i] - spans_s[i]), 6)
        out.append(record)
    return out


def _busy_after(profile: LayerProfile, spans: bool) -> dict[WindowKey, float]:
    """Per window key, the link-busy time between its opening mark and the
    next window's (the marks a step's span measures): a segment window's
    all-to-all estimate; with ``spans``, a span window's closing collective
    (``windows_from_profile``'s windows)."""
    out: dict[WindowKey, float] = {}
    for seg in profile.segments:
        if spans and seg.spans:
            out.update({(seg.name, seg.direction, s.edge): s.busy_s for s in seg.spans})
        else:
            out[(seg.name, seg.direction, "")] = seg.collective_s or 0.0
    return out
