"""The in-step transfer schedule in force, and its compiled steps.

A scheduled strategy (``strategies.scheduled``: gemini, capricorn) moves
version t's chunks *inside* step t with ``executor.InStepSender``, according
to a ``partitioner.Schedule`` built from profiled windows and a link model
measured on the real transport (``measure_link``). ``ScheduledTransfers``
keeps the schedule in force (one per payload size: a PEC version's payload is
smaller and is partitioned again over the same windows) and the scheduled
step variants compiled for it. The pure decisions about windows (capricorn's
gate on speculative profiles, the window rules the planner replays, the spill
records) are ``plan.policies`` and ``plan.spills``: no JAX.

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
from capricorn_jax._src.scheduling.in_graph.executor import (
    InStepSender,
    SiteClock,
    scheduled_step,
)
from capricorn_jax._src.scheduling.plan.partition_search import (
    SCHEDULE_MARGIN,
    even_partition,
    spread,
)
from capricorn_jax._src.scheduling.plan.partitioner import (
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
    from capricorn_jax._src.profiling.train_step import TrainStep


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A schedule built off the training thread, not yet in force
    (``ScheduledTransfers.prepare`` / ``install``): the margin-scaled
    windows, the payload size, the schedule, where its bytes go and the
    even fill's share."""

    windows: list[Window]
    size: int
    schedule: Schedule
    where: tuple
    share: float | None


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


class ScheduledTransfers:
    """Keeps the current schedule and the compiled scheduled steps.

    Args:
      ckpt: the host's memory tier (its transport).
      trainer: the caller's TrainStep (builds the steps).
      boundaries: the model's boundary names, forward order.
      link: the measured link model.
      chunk_cap: largest chunk in bytes.
      margin: windows are scaled by this before partitioning (safety;
        ``partition_search.SCHEDULE_MARGIN``).
      even: fill every window to the same least share of its (margin-scaled)
        time that holds the version (``partition_search.even_partition``), not
        greedily in order to the margin.
      clock: the in-graph path's window clock (``window_clock.WindowClock``),
        whose marks the compiled steps carry; None: steps without marks.
    """

    def __init__(self, ckpt: TierWriter, trainer: TrainStep, boundaries: list[str],
                 link: LinkModel, chunk_cap: int, margin: float = SCHEDULE_MARGIN,
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
        return self.install(self.prepare(windows))

    def prepare(self, windows: Sequence[Window], agreed: bool = False) -> Prepared:
        """The schedule of ``windows`` for the full payload, not yet in force
        (``install``); it reads no state ``install`` changes, so a thread
        other than the training thread may prepare it. ``agreed``: the
        durations are every host's already (host 0's, or computed alike from
        agreed inputs), else host 0's are agreed here (an agreement on the
        default stream: the training thread's)."""
        if not agreed:
            durations = agree_measured([w.duration_s for w in windows])
            windows = [dataclasses.replace(w, duration_s=d)
                       for w, d in zip(windows, durations, strict=True)]
        scaled = scale_windows(list(windows), self.margin)
        size = self.ckpt.transport.plan.payload_bytes
        return Prepared(scaled, size, *self._partition(size, scaled))

    def install(self, prepared: Prepared) -> Schedule:
        """Puts a ``prepare``d schedule in force (the training thread, at the
        same step on every host)."""
        self._windows = prepared.windows
        self._schedules = {prepared.size: (prepared.schedule, prepared.where)}
        if prepared.share is not None:
            self._shares[prepared.size] = prepared.share
        self._spreads = {}
        self.schedule = prepared.schedule
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
            s, where, share = self._partition(size, self._windows)
            if share is not None:
                self._shares[size] = share
            self._schedules[size] = (s, where)
        return self._schedules[size]

    def _partition(self, size: int, windows: list[Window]
                   ) -> tuple[Schedule, tuple, float | None]:
        """(schedule of ``size`` bytes over ``windows``, where its bytes go,
        the even fill's share or None)."""
        share = None
        if self.even:
            s, share = even_partition(size, windows, self.link, self.chunk_cap)
        else:
            s = partition(size, windows, self.link, self.chunk_cap)
        where = (tuple((w.name, w.direction, w.edge, tuple((c.start, c.stop) for c in cs))
                       for w, cs in zip(s.windows, s.chunks, strict=True)),
                 tuple((c.start, c.stop) for c in s.tail))
        return s, where, share

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
