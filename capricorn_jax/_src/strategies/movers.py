"""The scheduled strategies' movers: how a version's chunks go inside its step.

A mover runs the strategy's step programs and moves a version's chunks on
one chunk path, in the windows of the schedule in force (its
``transfers``, a ``scheduling.in_graph.transfers.ScheduledTransfers`` the
strategy's planner re-partitions); the strategy decides which step moves
which version and commits what arrived. Its interface:

* the step programs: ``plain_step`` / ``has_plain_step`` (a step that moves
  nothing, with the path's marks), ``move`` / ``has_move_step`` (the step
  that moves a ``Payload``), ``run_profiled`` (a profiled step on the
  path's own marks, where ``profiles_from_marks``);
* the version in flight: ``collect`` (what arrived, as a ``Moved`` with its
  per-window records when the path timed them, or why none did);
* the save's questions: ``while_lost`` (the chunk channel is lost on some
  host: the versions in flight are abandoned, the save takes none),
  ``carries_on`` / ``carry_on`` (a version spread over the next step's
  windows), ``settle`` (before the last save); ``close``.

The two paths:

* ``InGraphMover`` (``chunk_path="in_graph"``): collective-permutes placed
  inside the jitted step at the boundaries
  (``scheduling.in_graph.executor``), where the backend runs collectives
  asynchronously (GPU). With ``time_windows`` (a planner that acts on the
  records) the step carries the window clock's marks
  (``scheduling.in_graph.window_clock``: when each window's receptions
  arrived against the boundary that closes it); without, it runs no marks
  (gemini would only report them). One window per layer segment: chunks
  are placed at boundaries.
* ``ThreadedMover`` (``chunk_path="threaded"``): a sender thread outside the
  XLA program, started by boundary marks, over a TCP channel to the peer
  (``scheduling.threaded.sender``), on CPU, where an in-graph permute adds
  its link time to the step. Its marks also open span windows at the
  collective edges (``marks_edges``), time every window (the deadline
  sender's records) and, natively, give a profiled step's ``LayerProfile``.
  A lost channel is the ``ChannelKeeper``'s (``strategies.channel_loss``);
  under a budget, a version the windows of one step cannot hold spreads
  over the windows of the next ones (``MAX_SPREAD``, ``carries_on``).

Both commit the same bytes (tested); the link model each schedules with is
measured on its own path (``link``).

Design choice: one object per path holding what only that path has (the
sender, its channel keeper, its packs and its spread version; the in-graph
variants and the window clock), chosen once by ``chunk_path``, so neither
the strategy's lifecycle nor its planner tests which path runs. Alternative
not taken (the previous state): optional ``sender`` / ``keeper`` / ``clock``
attributes on the strategy, tested for None at each step of its lifecycle.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import numpy as np

from capricorn_jax._src.memory.tier.pec_tier import PecVersion
from capricorn_jax._src.memory.tier.reports import SaveReport
from capricorn_jax._src.memory.tier.writer_door import TierWriter
from capricorn_jax._src.memory.wire.transport import Transport
from capricorn_jax._src.multihost.agree import allgather_floats
from capricorn_jax._src.profiling.layer_profile import LayerProfile, build_profile
from capricorn_jax._src.profiling.profiler import step_marks
from capricorn_jax._src.scheduling.in_graph import xla_flags
from capricorn_jax._src.scheduling.in_graph.transfers import ScheduledTransfers, measure_link
from capricorn_jax._src.scheduling.in_graph.window_clock import WindowClock
from capricorn_jax._src.scheduling.plan.partitioner import LinkModel, Schedule
from capricorn_jax._src.scheduling.plan.spills import window_spills
from capricorn_jax._src.scheduling.threaded.chunk_channel import measure_channel
from capricorn_jax._src.scheduling.threaded.sender import ThreadedSender, pack_program
from capricorn_jax._src.scheduling.threaded.versions import VersionDropped
from capricorn_jax._src.strategies.base import CheckpointEvent, Metrics, State, TrainStep
from capricorn_jax._src.strategies.channel_loss import ChannelKeeper
from capricorn_jax._src.strategies.channel_replication import channel_keeper, peer_channel

CHUNK_PATHS = ("auto", "in_graph", "threaded")
MAX_SPREAD = 8
"""Under a cost budget, the most steps one version's chunks may spread over
(``scheduling.plan.partition_search.spread``): a version the windows of one
step cannot hold goes over the windows of the fewest steps that hold it; the
versions of the steps between are not taken."""

log = logging.getLogger(__name__)

EventOf = Callable[[int, SaveReport], CheckpointEvent]
"""The strategy's ``checkpoint`` event of a version's report."""


def resolve_chunk_path(path: str) -> str:
    """``auto``: in_graph where collectives run asynchronously (GPU), threaded elsewhere."""
    if path not in CHUNK_PATHS:
        raise ValueError(f"chunk_path must be one of {CHUNK_PATHS}, got {path!r}")
    if path == "auto":
        path = "in_graph" if jax.default_backend() == "gpu" else "threaded"
    if path == "in_graph" and jax.default_backend() == "gpu":
        xla_flags.set_overlap_flags()  # the backend started: checks, warns what is missing
    return path


@dataclasses.dataclass
class Payload:
    """What a moving step moves: the version's trailer rows (its host
    state), the transport of its payload (a PEC version's own), the PEC
    gather input (empty: none) and the PEC version (None: a whole one)."""

    trailer: jax.Array
    transport: Transport
    gather: tuple[jax.Array, ...] = ()
    pec_version: PecVersion | None = None


@dataclasses.dataclass
class Moved:
    """A version a step moved (or, spread, is moving) and, once ``collect``
    ran, what arrived: ``received`` the peer's payload ([local devices,
    bytes]); ``corrupt`` the in-step CRC32C verdict on it (in-graph only);
    ``windows`` the per-window records (``window_spills``; None: the path
    did not time them); ``fields`` more fields of its ``checkpoint`` event;
    ``dropped`` "corrupt", "late_start" (its frames dropped before this host
    started it) or "channel_lost" when nothing usable arrived (this host
    takes no version)."""

    version: int
    own: jax.Array
    transport: Transport
    pec_version: PecVersion | None = None
    received: jax.Array | np.ndarray | None = None
    corrupt: jax.Array | None = None
    schedule: Schedule | None = None  # threaded: the (spread) schedule it went by
    windows: list[dict[str, Any]] | None = None
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    dropped: str | None = None


class Mover:
    """One chunk path (module docstring); the defaults are a path with no
    channel to lose, no spread version and no profile marks.

    Attributes:
      marks_edges: its steps mark the collective edges, so a plan may use
        span windows.
      link: the link model measured on this path.
      transfers: the schedule in force and its compiled steps.
      held_over: versions whose rest went in a later step's windows.
      keeper: the chunk channel's keeper (None: the path has no channel).
      sends_at_once: each version goes whole at its step's start, not held
        to the plan's windows (``InMemoryOptions.chunk_send="at_once"``).
    """

    marks_edges: ClassVar[bool] = False
    keeper: ChannelKeeper | None = None
    sends_at_once: bool = False

    def __init__(self, ckpt: TierWriter, train: TrainStep, link: LinkModel,
                 transfers: ScheduledTransfers) -> None:
        self.ckpt, self.train, self.link, self.transfers = ckpt, train, link, transfers
        self.held_over: list[int] = []
        self._moved: Moved | None = None  # moved by the last step, not collected yet

    @classmethod
    def build(cls, ckpt: TierWriter, train: TrainStep, chunk_cap: int,
              time_windows: bool) -> Mover:
        """The path's mover with its link measured (``time_windows``: the
        planner acts on the window records, so the path times them)."""
        raise NotImplementedError

    @property
    def profiles_from_marks(self) -> bool:
        """Its step program's marks give a profiled step's ``LayerProfile``."""
        return False

    def plain_step(self, train: TrainStep, factors: tuple[float, ...], hooks: tuple) -> Any:
        """The program of a step that moves nothing."""
        raise NotImplementedError

    def has_plain_step(self, train: TrainStep, factors: tuple[float, ...], hooks: tuple) -> bool:
        raise NotImplementedError

    def has_move_step(self, train: TrainStep, factors: tuple[float, ...], hooks: tuple,
                      transport: Transport) -> bool:
        """Whether the step moving a payload of ``transport`` is compiled."""
        raise NotImplementedError

    def move(self, train: TrainStep, step: int, factors: tuple[float, ...], state: State,
             batch: jax.Array, hooks: tuple, payload: Payload) -> tuple[State, Metrics]:
        """Step ``step``, moving version ``step`` (``payload``) inside it."""
        raise NotImplementedError

    def collect(self, state: State, planned_on: LayerProfile | None) -> Moved | None:
        """What the last step(s) moved, once it arrived (None: nothing moved);
        ``state``: the last step's; ``planned_on``: the profile of the
        schedule in force (the records' busy times)."""
        raise NotImplementedError

    def run_profiled(self, train: TrainStep, step: int, factors: tuple[float, ...],
                     state: State, batch: jax.Array,
                     estimates: tuple[dict[str, float] | None, float],
                     hooks: tuple) -> tuple[State, Metrics, LayerProfile]:
        raise RuntimeError("this chunk path's step carries no profile marks")

    @property
    def carrying_on(self) -> bool:
        """A spread version still has parts for the next step's windows."""
        return False

    def carry_on(self, train: TrainStep, factors: tuple[float, ...], state: State,
                 batch: jax.Array, hooks: tuple) -> tuple[State, Metrics]:
        """A step that sends the next part of the spread version."""
        raise RuntimeError("no version is spread over steps on this chunk path")

    def carries_on(self, next_step_profiled: bool) -> bool:
        """At a save: whether the next step carries on a spread version (then
        the save's version is not taken, on every host alike)."""
        return False

    def while_lost(self, step: int, event: EventOf,
                   tokens_per_expert: np.ndarray | None) -> list[CheckpointEvent] | None:
        """At save ``step``: the events of a save while the hosts agree the
        path's channel is lost (the versions in flight abandoned, ``step``
        not taken); None: the path is up."""
        return None

    def settle(self, step: int) -> None:
        """Before the last save (``step``): what is still to move goes now."""

    def close(self) -> None:
        """Ends the path's threads."""


class InGraphMover(Mover):
    """Chunks moved by collective-permutes inside the step (module docstring).

    Args:
      clock: the window clock whose marks the moving steps carry (None:
        steps without marks, no window records).
    """

    def __init__(self, ckpt: TierWriter, train: TrainStep, link: LinkModel,
                 transfers: ScheduledTransfers, clock: WindowClock | None = None) -> None:
        super().__init__(ckpt, train, link, transfers)
        self.clock = clock

    @classmethod
    def build(cls, ckpt: TierWriter, train: TrainStep, chunk_cap: int,
              time_windows: bool) -> Mover:
        link = measure_link(ckpt.transport)
        clock = WindowClock(train.mesh, train.boundaries) if time_windows else None
        transfers = ScheduledTransfers(ckpt, train, train.boundaries, link, chunk_cap,
                                       clock=clock)
        return cls(ckpt, train, link, transfers, clock)

    def plain_step(self, train: TrainStep, factors: tuple[float, ...], hooks: tuple) -> Any:
        return train.step_fn(factors, hooks, None)

    def has_plain_step(self, train: TrainStep, factors: tuple[float, ...], hooks: tuple) -> bool:
        return train.has_step(factors, hooks)

    def has_move_step(self, train: TrainStep, factors: tuple[float, ...], hooks: tuple,
                      transport: Transport) -> bool:
        return self.transfers.has_step(factors, hooks, transport)

    def move(self, train: TrainStep, step: int, factors: tuple[float, ...], state: State,
             batch: jax.Array, hooks: tuple, payload: Payload) -> tuple[State, Metrics]:
        if self.clock is not None:
            self.clock.clear()
        state, metrics, moved = self.transfers.step_fn(factors, hooks, payload.transport)(
            state, batch, payload.trailer, *payload.gather)
        self._moved = Moved(step, moved["own"], payload.transport, payload.pec_version,
                            received=moved["received"], corrupt=moved["corrupt"])
        return state, metrics

    def collect(self, state: State, planned_on: LayerProfile | None) -> Moved | None:
        moved, self._moved = self._moved, None
        if moved is not None and self.clock is not None:
            moved.windows = self.windows(moved, state, planned_on)
        return moved

    def windows(self, moved: Moved, state: State,
                planned_on: LayerProfile | None) -> list[dict[str, Any]]:
        """The ``window_spills`` records of the step that moved ``moved`` and
        returned ``state``, from the window clock's marks (waits until both
        are ready: every mark is tied into one of them)."""
        assert self.clock is not None, "only steps with the window clock carry the marks"
        jax.block_until_ready((moved.received, state))
        return self.clock.windows(self.transfers.schedule_for(moved.transport), planned_on)


class ThreadedMover(Mover):
    """Chunks sent by a thread over the chunk channel, started by the step's
    marks (module docstring).

    Args:
      sender: the deadline sender (a window's bytes stop at its planned
        close and go on in the next window, issue 38); under a budget it
        holds what a step could not carry (``hold_tail``) for the next
        step's windows instead of sending it after the step
        (``carries_on``).
      keeper: the lost-channel rule of ``sender``.
    """

    marks_edges = True

    def __init__(self, ckpt: TierWriter, train: TrainStep, link: LinkModel,
                 transfers: ScheduledTransfers, sender: ThreadedSender,
                 keeper: ChannelKeeper) -> None:
        super().__init__(ckpt, train, link, transfers)
        self.sender = sender
        self.keeper: ChannelKeeper = keeper
        self.sends_at_once = bool(getattr(sender, "at_once", False))
        self.spread_steps = MAX_SPREAD if ckpt.options.max_wait_s is not None else 1
        self._packs: dict[int, Any] = {}
        self._wrap: Any = None  # the step's start and end marks (``_step_args``)
        self._spread: Moved | None = None  # under a budget: a version with steps to go

    @classmethod
    def build(cls, ckpt: TierWriter, train: TrainStep, chunk_cap: int,
              time_windows: bool) -> Mover:
        channel = peer_channel(ckpt)
        link = measure_channel(channel, jax.local_device_count())
        budget = ckpt.options.max_wait_s is not None
        sender = ThreadedSender(channel, train.boundaries, jax.local_device_count(),
                                train.mesh, channel.timeout_s, deadline=True,
                                hold_tail=MAX_SPREAD if budget else 0,
                                at_once=ckpt.options.chunk_send == "at_once")
        keeper = channel_keeper(ckpt, sender)
        transfers = ScheduledTransfers(ckpt, train, train.boundaries, link, chunk_cap)
        return cls(ckpt, train, link, transfers, sender, keeper)

    @property
    def profiles_from_marks(self) -> bool:
        """With native marks every step runs one program per capacity tuple,
        marked at every boundary and collective edge and at its start and
        end, and a profiled step is that program (``run_profiled``), not a
        separately compiled variant."""
        return self.sender.marks.table.native

    def _step_args(self, train: TrainStep, hooks: tuple) -> tuple[tuple, Any]:
        """(hooks, wrap) of every step program it runs (moving a version or
        not): ``hooks`` and the sender's marks (the same for every schedule)
        and, where ``profiles_from_marks``, the step's start and end marks."""
        hooks = (*hooks, self.sender.hook())
        if not self.profiles_from_marks:
            return hooks, None
        if self._wrap is None:
            self._wrap = step_marks(train, self.sender.marks, ordered=False)
        return hooks, self._wrap

    def plain_step(self, train: TrainStep, factors: tuple[float, ...], hooks: tuple) -> Any:
        return train.step_fn(factors, *self._step_args(train, hooks))

    def has_plain_step(self, train: TrainStep, factors: tuple[float, ...], hooks: tuple) -> bool:
        hooks, wrap = self._step_args(train, hooks)
        # A trainer written before ``has_step`` took ``wrap`` is asked without it.
        return train.has_step(factors, hooks) if wrap is None else \
            train.has_step(factors, hooks, wrap)

    def has_move_step(self, train: TrainStep, factors: tuple[float, ...], hooks: tuple,
                      transport: Transport) -> bool:
        return self.has_plain_step(train, factors, hooks) and id(transport) in self._packs

    def _pack(self, transport: Transport) -> Any:
        """The pack program of ``transport``'s payload (kept with the transport,
        so that its id is not reused by another while the entry lives)."""
        if id(transport) not in self._packs:
            self._packs[id(transport)] = (pack_program(transport, self.train.state_shardings),
                                          transport)
        return self._packs[id(transport)][0]

    def move(self, train: TrainStep, step: int, factors: tuple[float, ...], state: State,
             batch: jax.Array, hooks: tuple, payload: Payload) -> tuple[State, Metrics]:
        """Pack, then the plain step with marks: the sender thread sends each
        window's chunks when the step opens it."""
        transport = payload.transport
        with self.ckpt.clock.phase("pack"):
            own = self._pack(transport)(state, payload.trailer, *payload.gather)
        schedule, parts = self.transfers.spread_for(transport, self.spread_steps)
        with self.ckpt.clock.phase("send_handoff"):
            self.sender.start(step, own, schedule, parts)
        state, metrics = self.plain_step(train, factors, hooks)(state, batch)
        sent = Moved(step, own, transport, payload.pec_version, schedule=schedule)
        if self.sender.parts_left(step):
            self._spread = sent  # collected after its last part's step
        else:
            self._moved = sent
        return state, metrics

    def run_profiled(self, train: TrainStep, step: int, factors: tuple[float, ...],
                     state: State, batch: jax.Array,
                     estimates: tuple[dict[str, float] | None, float],
                     hooks: tuple) -> tuple[State, Metrics, LayerProfile]:
        """The step's marks read after it into a ``LayerProfile``. The
        previous step is waited for first, so the table holds this step's
        stamps only. The native marks' cost (~3 us each) is taken as 0; the
        all-to-alls' times are measured between their edges
        (``measured_collectives``; ``estimates`` gives the gradient
        all-reduce's, and the others' where a segment has no spans)."""
        jax.block_until_ready(state)
        marks = self.sender.marks
        marks.reset()
        program = self.plain_step(train, factors, hooks)
        t0 = time.perf_counter()
        state, metrics = program(state, batch)
        jax.block_until_ready((state, metrics))
        total = time.perf_counter() - t0
        collectives_s, tail_s = estimates
        profile = build_profile(step, total, self.sender.hook().names, marks.step_times(),
                                collectives_s, 0.0, tail_s, measured_collectives=True)
        return state, metrics, profile

    def collect(self, state: State, planned_on: LayerProfile | None) -> Moved | None:
        """The peer's chunks, once all are in, and the window records from
        the sender's marks; a corrupt frame or a lost channel: ``dropped``."""
        moved, self._moved = self._moved, None
        if moved is None:
            return None
        sender = self.sender
        try:
            with self.ckpt.clock.phase("peer_wait"):
                moved.received = self.keeper.wait(moved.version)  # [local devices, bytes]
        except VersionDropped as e:  # no version here, the job goes on
            log.warning("%s; host %d takes no version %d", e, self.ckpt.host, moved.version)
            moved.dropped = "corrupt" if e.corrupt else "late_start"
            return moved
        except Exception as e:
            if not self.keeper.is_loss(e):
                raise
            moved.dropped = "channel_lost"
            return moved
        schedule = moved.schedule or self.transfers.schedule_for(moved.transport)
        moved.windows = window_spills(schedule, sender.last_spans, planned_on,
                                      sender.last_sends, sender.last_bytes)
        # When its chunks went (seconds from start).
        moved.fields = {"chunk_times_s": {k: round(v, 4) for k, v in sender.last_times.items()}}
        return moved

    @property
    def carrying_on(self) -> bool:
        return self._spread is not None

    def carry_on(self, train: TrainStep, factors: tuple[float, ...], state: State,
                 batch: jax.Array, hooks: tuple) -> tuple[State, Metrics]:
        """A step that sends the next part of the spread version (no pack, no
        new version); after the last part the version is collected as a
        moved one."""
        assert self._spread is not None
        version = self._spread.version
        with self.ckpt.clock.phase("send_handoff"):
            self.sender.resume(version)
        state, metrics = self.plain_step(train, factors, hooks)(state, batch)
        if self.sender.parts_left(version) == 0:
            self._moved, self._spread = self._spread, None
        return state, metrics

    def carries_on(self, next_step_profiled: bool) -> bool:
        self._hold_over()
        if self._spread is None:
            return False
        if not next_step_profiled:
            return True  # the spread version still has steps to go
        self._flush_spread()  # a profiled step carries no sender marks
        return False

    def _flush_spread(self) -> None:
        """Sends every part left of the spread version now (before a step that
        carries no sender marks, or at the end); it is collected as moved."""
        if self._spread is not None:
            with self.ckpt.clock.phase("send_handoff"):
                self.sender.resume(self._spread.version, flush=True)
            self._moved, self._spread = self._spread, None

    def _hold_over(self) -> None:
        """Under a budget: when the version the last step moved left bytes on
        any host (its windows' deadlines, or a tail the plan could not
        place), every host gives it the next step's windows (one more part;
        the sender held those bytes instead of sending them after the step,
        where they would meet the next step's collectives) and that step's
        version is not taken. Agreed (one ``allgather_floats`` of the held
        bytes) so every host takes and skips the same versions."""
        sender = self.sender
        if not sender.hold_tail or self._spread is not None or self._moved is None:
            return
        version = self._moved.version
        if sender.parts_left(version):
            return
        held = sender.held_bytes(version)
        rows = allgather_floats([held], what="held_tail")
        if max(row[0] for row in rows) <= 0:
            return
        sender.extend(version)
        self._spread, self._moved = self._moved, None
        self.held_over.append(version)
        log.info("host %d: version %d: %d bytes here (%d on the busiest host) go in the next "
                 "step's windows, not after the step; that step's version is not taken",
                 self.ckpt.host, version, held, max(row[0] for row in rows))

    def while_lost(self, step: int, event: EventOf,
                   tokens_per_expert: np.ndarray | None) -> list[CheckpointEvent] | None:
        """While the hosts agree the chunk channel is lost, the versions in
        flight are abandoned, the channel reconnects when the backoff says so
        (``ChannelKeeper.while_down``), and version ``step`` is not taken (no
        step moves one until the channel is back)."""
        if not self.keeper.down(step):
            self.keeper.note()
            return None
        self._moved = self._spread = None
        return self.keeper.skip_save(step, event, tokens_per_expert)

    def settle(self, step: int) -> None:
        """A spread version still on its way is sent whole (with the chunk
        channel lost on some host: abandoned on every host)."""
        if (self._moved or self._spread) and self.keeper.down(step):
            self.ckpt.note_lost(self.sender.abandon())
            self._moved = self._spread = None
        self._flush_spread()

    def close(self) -> None:
        self.sender.close()


MOVERS: dict[str, type[Mover]] = {"in_graph": InGraphMover, "threaded": ThreadedMover}
"""The mover of each resolved chunk path."""


__all__ = ["CHUNK_PATHS", "MAX_SPREAD", "MOVERS", "InGraphMover", "Moved", "Mover", "Payload",
           "ThreadedMover", "resolve_chunk_path"]
