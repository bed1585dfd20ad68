"""``gemini`` and ``capricorn``: version t's chunks move inside step t.

Version t is the state step t starts from; the scheduled variant of step t
packs it and moves its chunks at the layer boundaries the schedule names
(``scheduling.executor``), and ``save`` after step t commits it
(``InMemoryCheckpointer.save_transferred``). The schedule comes from layer
profiles (``partitioner.windows_from_profile``): gemini builds it once from
the warm profiles of its first ``first_n`` profiled steps (Gemini profiles
the first iterations and assumes the timeline stays constant) and keeps it;
capricorn re-partitions from every new warm profile (each window the shortest
it had in its last ``PLAN_PROFILES`` warm profiles), so the chunks follow the
experts' load. Under PEC (``gemini_pec``/``capricorn_pec``: the checkpointer
has PEC options) each version is decided when its step starts, and only its
K experts per layer move, on a schedule of their own payload.

Two paths move the chunks (``chunk_path``): ``in_graph``, collective-permutes
placed inside the jitted step at the boundaries (``scheduling.executor``), where
the backend runs collectives asynchronously (GPU); ``threaded``, a sender
thread outside the XLA program, started by boundary marks, over a TCP channel
to the peer (``scheduling.threaded``), on CPU, where an in-graph permute adds
its link time to the step. ``auto`` takes in_graph on GPU, threaded otherwise.
Both commit the same bytes (tested); the link model each schedules with is
measured on its own path. On the threaded path the windows are the idle
spans between a layer's all-to-alls (``spans``: the profile's
``Segment.spans``, opened at the collective edges the step marks), so a
window's bytes do not meet the all-to-all that begins its layer's backward;
the in-graph path keeps one window per layer segment.

A step that is profiled, or runs before a schedule exists, moves no chunks:
its version moves unscheduled after the step (as ``inmem``). A version is
never moved twice: ``save`` defers version t when step t will move it, and
saves it now otherwise. ``finish`` saves the last state, which no later step
moves.

Each moved version's event reports, per filled window, the idle time the
step gave it against the plan (``transfers.window_spills``): on the threaded
path from the sender's marks; on the in-graph path, capricorn's only, from
the window clock's marks inside the step (``scheduling.window_clock``: when
each window's receptions arrived against the boundary that closes it; gemini,
which would only report them, runs its steps without those marks).
capricorn asks for a profile when its windows spilled in most of host 0's
last ``SPILL_WINDOW`` moved versions (agreed through the checkpointer's
status round), so a schedule planned on slower or faster steps than today's
is re-planned; gemini keeps its schedule and only reports the spills (the
spill count and the expert windows' model: ``strategies.window_feedback``).

Design choice: the strategy does not decide which steps are profiled; the
profiling driver (``strategies.driver.ProfilingDriver``) does, for every
strategy alike, and hands this one its profiles (``on_profile``), asks its
gate (``allow_profile``: capricorn profiles on the detector's word only when
the schedule in force may overflow at the new load) and its own request
(``profile_requested``: the spills above). Alternative not taken
(the previous state): a second profiling loop inside this class for the
benchmark, with its own defaults.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, NotRequired, TypedDict

import jax
import numpy as np

from capricorn_jax._src.memory.tier.writer_door import TierWriter
from capricorn_jax._src.memory.wire.transport import Transport
from capricorn_jax._src.multihost.agree import allgather_floats
from capricorn_jax._src.profiling.detector import DynamicityDetector
from capricorn_jax._src.profiling.layer_profile import LayerProfile, build_profile
from capricorn_jax._src.profiling.policy import DEFAULT_FIRST_N
from capricorn_jax._src.profiling.profiler import step_marks
from capricorn_jax._src.scheduling.in_graph import xla_flags
from capricorn_jax._src.scheduling.in_graph.transfers import ScheduledTransfers, measure_link
from capricorn_jax._src.scheduling.in_graph.window_clock import WindowClock
from capricorn_jax._src.scheduling.plan.load_windows import windows_at_load
from capricorn_jax._src.scheduling.plan.partitioner import Schedule, Window, windows_from_profile
from capricorn_jax._src.scheduling.plan.policies import (
    average_windows,
    schedule_at_risk,
    shortest_windows,
)
from capricorn_jax._src.scheduling.plan.spills import window_spills
from capricorn_jax._src.scheduling.plan.window_model import WindowModel
from capricorn_jax._src.scheduling.threaded.chunk_channel import measure_channel
from capricorn_jax._src.scheduling.threaded.sender import ThreadedSender, pack_program
from capricorn_jax._src.scheduling.threaded.versions import VersionDropped
from capricorn_jax._src.strategies.base import (
    CheckpointEvent,
    HostState,
    Metrics,
    State,
    TrainStep,
)
from capricorn_jax._src.strategies.channel_loss import ChannelKeeper
from capricorn_jax._src.strategies.channel_replication import channel_keeper, peer_channel
from capricorn_jax._src.strategies.inmemory import InMemoryStrategy
from capricorn_jax._src.strategies.window_feedback import SPILL_WINDOW, WindowFeedback

KINDS = ("gemini", "capricorn")
CHUNK_PATHS = ("auto", "in_graph", "threaded")
PLAN_PROFILES = 3
"""capricorn plans on the shortest of each window over its last this many warm
profiles: one profile is one noisy sample, and on this box a profile that
caught a slow step (1.3-1.7x the others) planned the whole version into one
window that the next steps did not give (BUILD_NOTES, "Where the CPU goes")."""
MAX_SPREAD = 8
"""Under a cost budget, the most steps one version's chunks may spread over
(``partition_search.spread``): a version the windows of one step cannot hold goes over
the windows of the fewest steps that hold it; the versions of the steps between are not taken."""

log = logging.getLogger(__name__)


class MovedPayloads(TypedDict):
    """What a step moved: this host's packed payload, the peer's (None until
    the threaded sender's chunks are all in), the transport they went by, and
    in-step the CRC32C verdict on the peer's (``executor``: ``corrupt``)."""

    own: jax.Array
    received: jax.Array | np.ndarray | None
    transport: NotRequired[Transport]
    schedule: NotRequired[Schedule]
    corrupt: NotRequired[jax.Array]


def resolve_chunk_path(path: str) -> str:
    """``auto``: in_graph where collectives run asynchronously (GPU), threaded elsewhere."""
    if path not in CHUNK_PATHS:
        raise ValueError(f"chunk_path must be one of {CHUNK_PATHS}, got {path!r}")
    if path == "auto":
        path = "in_graph" if jax.default_backend() == "gpu" else "threaded"
    if path == "in_graph" and jax.default_backend() == "gpu":
        xla_flags.set_overlap_flags()  # the backend started: checks, warns what is missing
    return path


class ScheduledStrategy(WindowFeedback, InMemoryStrategy):
    """``gemini`` / ``capricorn`` (see the module docstring).

    Args:
      name: "gemini" or "capricorn", optionally with a "_pec" suffix (the
        checkpointer's PEC options decide what a version carries).
      checkpointer: the host's memory tier (``TierWriter``); one peer replica.
      train: the caller's TrainStep (the scheduled steps are built on it).
      first_n: gemini: the profiled steps its fixed schedule is built from.
      chunk_cap: the partitioner's largest chunk, in bytes.
      chunk_path: "auto", "in_graph" or "threaded" (module docstring).
      spans: plan on span windows (``partitioner.windows_from_profile``:
        the idle spans between a layer's all-to-alls, opened at their edges)
        rather than one window per layer segment; threaded path only (the
        in-graph path places chunks at boundaries). None: on the threaded
        path.
    """

    plans_on_profiles = True

    def __init__(self, name: str, checkpointer: TierWriter, train: TrainStep,
                 first_n: int = DEFAULT_FIRST_N, chunk_cap: int = 1 << 20,
                 chunk_path: str = "auto", spans: bool | None = None) -> None:
        kind = name.removesuffix("_pec")
        if kind not in KINDS:
            raise ValueError(f"unknown scheduled strategy {name!r}")
        if len(checkpointer.sources) != 1:
            raise ValueError(f"{name} sends one replica per step inside the step; it needs "
                             f"--replicas=2, got {len(checkpointer.sources) + 1}")
        super().__init__(checkpointer, name)
        self.kind, self.train, self.first_n = kind, train, first_n
        self.chunk_path = resolve_chunk_path(chunk_path)
        if spans and self.chunk_path != "threaded":
            raise ValueError(f"{name}: span windows open at collective edges, which only the "
                             f"threaded chunk path marks; chunk_path={self.chunk_path!r}")
        self.spans = self.chunk_path == "threaded" if spans is None else spans
        self.sender: ThreadedSender | None = None
        # capricorn, in-graph: the marks that time each window inside the step.
        self.clock: WindowClock | None = None
        if self.chunk_path == "threaded":
            channel = peer_channel(checkpointer)
            self.link = measure_channel(channel, jax.local_device_count())
            # The deadline sender: a window's bytes stop at its planned close
            # and go on in the next window (issue 38); under a budget what a
            # step could not carry goes in the next step's windows, not after
            # the step (``_hold_over``).
            budget = checkpointer.options.max_wait_s is not None
            self.sender = ThreadedSender(channel, train.boundaries, jax.local_device_count(),
                                         train.mesh, channel.timeout_s, deadline=True,
                                         hold_tail=MAX_SPREAD if budget else 0)
            self.keeper: ChannelKeeper | None = channel_keeper(checkpointer, self.sender)
        else:
            self.keeper = None
            self.link = measure_link(checkpointer.transport)
            if kind == "capricorn":
                self.clock = WindowClock(train.mesh, train.boundaries)
        self._packs: dict[int, Any] = {}
        self._step_wrap: Any = None  # the step's start and end marks (``_step_args``)
        self.transfers = ScheduledTransfers(checkpointer, train, train.boundaries, self.link,
                                            chunk_cap, clock=self.clock)
        self._profiles: list[LayerProfile] = []  # gemini: its warm profiles, until it schedules
        self._profiles_seen = 0  # gemini: profiles seen (cold ones too)
        self._moved: tuple[int, MovedPayloads, Any] | None = None
        # Under a budget, threaded: a version whose chunks still have steps to go.
        self._spread: tuple[int, MovedPayloads, Any] | None = None
        self._host_states: dict[int, tuple[HostState, np.ndarray | None]] = {}
        self._last_saved = -1
        self._planned_on: LayerProfile | None = None  # the profile of the schedule in force
        self._pec_transport: Transport | None = None  # PEC: the program of the last version moved
        self.repartitions: list[int] = []
        # What each re-partition was planned on: "profile" (a measured one,
        # newly taken or cached) or "cost_model" (``replan_at_load``).
        self.repartition_sources: list[str] = []
        self._modelled_windows: list | None = None  # the model's windows in force, if any
        # capricorn: the expert windows' model, fitted on every moved step's
        # marks (scheduling.window_model), and the windows of the plan in force.
        self.window_model = WindowModel()
        self._plan_windows: list[Window] = []
        self.window_model_replans: list[int] = []
        # capricorn: whether a window spilled in each of this host's
        # last moved versions under the schedule in force, and whether the
        # hosts agreed to profile.
        self._spills: collections.deque[bool] = collections.deque(maxlen=SPILL_WINDOW)
        self.held_over: list[int] = []  # versions whose rest went in a later step's windows
        self._recent: collections.deque[LayerProfile] = collections.deque(maxlen=PLAN_PROFILES)
        self._wants_profile = False
        self.spill_requests: list[int] = []  # versions after which it asked for a profile

    def _hooks(self, hooks: tuple) -> tuple:
        """The boundary hooks of a step that moves chunks on the threaded path:
        ``hooks`` and the sender's marks (the same for every schedule)."""
        assert self.sender is not None
        return (*hooks, self.sender.hook())

    @property
    def profiles_from_marks(self) -> bool:  # type: ignore[override]
        """On the threaded path with native marks: every step runs one
        program per capacity tuple, marked at every boundary and collective
        edge and at its start and end, and a profiled step is that program
        (``run_profiled``), not a separately compiled variant."""
        return self.sender is not None and self.sender.marks.table.native

    def _step_args(self, train: TrainStep, hooks: tuple) -> tuple[tuple, Any]:
        """(hooks, wrap) of this strategy's step program for every step it
        runs (moving a version or not): the plain step without a sender; the
        sender's marks (and, where ``profiles_from_marks``, the step's start
        and end marks) with one."""
        if self.sender is None:
            return hooks, None
        if not self.profiles_from_marks:
            return self._hooks(hooks), None
        if self._step_wrap is None:
            self._step_wrap = step_marks(train, self.sender.marks, ordered=False)
        return self._hooks(hooks), self._step_wrap

    def _step(self, train: TrainStep, factors: tuple[float, ...], hooks: tuple) -> Any:
        return train.step_fn(factors, *self._step_args(train, hooks))

    def _has_step(self, train: TrainStep, factors: tuple[float, ...], hooks: tuple) -> bool:
        hooks, wrap = self._step_args(train, hooks)
        # A trainer written before ``has_step`` took ``wrap`` is asked without it.
        return train.has_step(factors, hooks) if wrap is None else \
            train.has_step(factors, hooks, wrap)

    def run_profiled(self, train: TrainStep, step: int, factors: tuple[float, ...],
                     state: State, batch: jax.Array, estimates: tuple[dict[str, float] | None,
                                                                     float],
                     hooks: tuple = ()) -> tuple[State, Metrics, LayerProfile]:
        """Profiled step ``step`` on this strategy's own program: no version
        moves in it (``save`` saved version ``step`` unscheduled and flushed
        a spread one), its marks are read after it into a ``LayerProfile``.
        The previous step is waited for first, so the table holds this
        step's stamps only. The native marks' cost (~3 us each) is taken as 0;
        the all-to-alls' times are measured between their edges
        (``measured_collectives``; ``estimates`` gives the gradient
        all-reduce's, and the others' where a segment has no spans)."""
        if not self.profiles_from_marks:
            raise RuntimeError(f"{self.name}: run_profiled needs the threaded path's native "
                               f"marks; the driver profiles with an instrumented variant")
        assert self.sender is not None and not self._moves(step)
        jax.block_until_ready(state)
        marks = self.sender.marks
        marks.reset()
        program = self._step(train, factors, hooks)
        t0 = time.perf_counter()
        state, metrics = program(state, batch)
        jax.block_until_ready((state, metrics))
        total = time.perf_counter() - t0
        collectives_s, tail_s = estimates
        profile = build_profile(step, total, self.sender.hook().names, marks.step_times(),
                                collectives_s, 0.0, tail_s, measured_collectives=True)
        return state, metrics, profile

    def _pack(self, transport: Transport) -> Any:
        """The pack program of ``transport``'s payload (kept with the transport,
        so that its id is not reused by another while the entry lives)."""
        if id(transport) not in self._packs:
            self._packs[id(transport)] = (pack_program(transport, self.train.state_shardings),
                                          transport)
        return self._packs[id(transport)][0]

    def _moves(self, step: int) -> bool:
        """Whether step ``step`` moves version ``step`` inside it."""
        return self.transfers.schedule is not None and step in self._host_states

    def has_step(self, train: TrainStep, step: int, factors: tuple[float, ...],
                 hooks: tuple = ()) -> bool:
        """Under PEC it assumes the payload of the last version moved (K is
        fixed in the bench; a new K compiles a variant)."""
        if self._spread is not None:
            return self._has_step(train, factors, hooks)
        if self._moves(step):
            if self.ckpt.pec is not None and self._pec_transport is None:
                return False
            if self.sender is not None:
                return (self._has_step(train, factors, hooks)
                        and id(self._pec_transport or self.ckpt.transport) in self._packs)
            return self.transfers.has_step(factors, hooks, self._pec_transport)
        return self._has_step(train, factors, hooks)

    def run_step(self, train: TrainStep, step: int, factors: tuple[float, ...], state: State,
                 batch: jax.Array, hooks: tuple = ()) -> tuple[State, Metrics]:
        """Step ``step``, moving version ``step`` in it when a schedule exists;
        ``hooks``: extra boundary hooks (the bench's CollectiveProbe). While a
        spread version has parts left, the step sends its next part instead."""
        if self._spread is not None:
            return self._continue_spread(train, factors, state, batch, hooks)
        if not self._moves(step):
            return self._step(train, factors, hooks)(state, batch)
        host_state, tokens_per_expert = self._host_states[step]
        trailer = self.ckpt.trailer_rows(host_state)
        version, transport = None, None
        gather: tuple[jax.Array, ...] = ()
        if self.ckpt.pec is not None:
            # PEC: decide version ``step`` now (K experts per layer), pack and
            # move only it; its payload has its own schedule.
            version = self.ckpt.plan_pec_version(step, tokens_per_expert)
            transport = self._pec_transport = version.transport
            if version.gather is not None:
                gather = (transport.gather_input(version.gather),)
        if self.sender is not None:
            # Pack, then the plain step with marks: the sender thread sends each
            # window's chunks when the step opens it.
            transport = transport or self.ckpt.transport
            with self.ckpt.clock.phase("pack"):
                own = self._pack(transport)(state, trailer, *gather)
            schedule, parts = self.transfers.spread_for(
                transport, MAX_SPREAD if self.ckpt.options.max_wait_s is not None else 1)
            with self.ckpt.clock.phase("send_handoff"):
                self.sender.start(step, own, schedule, parts)
            state, metrics = self._step(train, factors, hooks)(state, batch)
            sent: tuple[int, MovedPayloads, Any] = (
                step, {"own": own, "received": None, "transport": transport,
                       "schedule": schedule}, version)
            if self.sender.parts_left(step):
                self._spread = sent  # committed after its last part's step
            else:
                self._moved = sent
            return state, metrics
        if self.clock is not None:
            self.clock.clear()
        state, metrics, moved = self.transfers.step_fn(factors, hooks, transport)(
            state, batch, trailer, *gather)
        self._moved = (step, {"own": moved["own"], "received": moved["received"],
                              "corrupt": moved["corrupt"],
                              "transport": transport or self.ckpt.transport}, version)
        return state, metrics

    def _continue_spread(self, train: TrainStep, factors: tuple[float, ...], state: State,
                         batch: jax.Array, hooks: tuple) -> tuple[State, Metrics]:
        """A step that sends the next part of the spread version (no pack, no
        new version); after the last part the version is committed as a
        moved one."""
        assert self._spread is not None and self.sender is not None
        version = self._spread[0]
        with self.ckpt.clock.phase("send_handoff"):
            self.sender.resume(version)
        state, metrics = self._step(train, factors, hooks)(state, batch)
        if self.sender.parts_left(version) == 0:
            self._moved, self._spread = self._spread, None
        return state, metrics

    def _flush_spread(self) -> None:
        """Sends every part left of the spread version now (before a step that
        carries no sender marks, or at the end); it is committed as moved."""
        if self._spread is not None:
            assert self.sender is not None
            with self.ckpt.clock.phase("send_handoff"):
                self.sender.resume(self._spread[0], flush=True)
            self._moved, self._spread = self._spread, None

    def on_profile(self, step: int, profile: LayerProfile, cold: bool) -> dict[str, Any] | None:
        """Re-partitions from the profile when the strategy does (gemini: once,
        after its first ``first_n`` profiles; capricorn: every warm profile)."""
        if self.kind == "gemini":
            if self.transfers.schedule is not None:
                return None
            self._profiles_seen += 1
            if not cold:
                self._profiles.append(profile)
            if self._profiles_seen < self.first_n:
                return None
            # Gemini: the iteration timeline of the first n steps, kept for good.
            windows = average_windows(self._profiles or [profile], self._windows_of)
            self._profiles.clear()
        else:
            if cold:
                return None
            self._recent.append(profile)
            windows = shortest_windows(list(self._recent), self._windows_of)
            self._wants_profile = False  # a warm profile answers a spill's request
            self._spills.clear()
        self._planned_on, self._modelled_windows = profile, None
        return self._repartition(step, windows, "profile")

    def _windows_of(self, profile: LayerProfile) -> list[Window]:
        """The windows a profile gives this strategy (span windows or not)."""
        return windows_from_profile(profile, spans=self.spans)

    def _repartition(self, step: int, windows: list, source: str) -> dict[str, Any]:
        """Re-partitions the payload into ``windows`` (planned on ``source``);
        the fields of its ``repartition`` event."""
        self.transfers.repartition(windows)
        self._plan_windows = list(windows)
        self.repartitions.append(step)
        self.repartition_sources.append(source)
        return {**self.transfers.summary(), "link_alpha_s": self.link.alpha_s,
                "link_bytes_per_s": self.link.bytes_per_s, "source": source,
                "windows_s": [round(w.duration_s, 6) for w in windows]}

    def replan_at_load(self, step: int, detector: DynamicityDetector,
                       tokens_per_expert: np.ndarray) -> dict[str, Any] | None:
        """capricorn: when the load shifted enough to put its schedule at risk,
        re-partitions on the windows its cost models predict at this load
        (``scheduling.load_windows``), with no profiled step, where every
        filled MoE window's model covers the load; None (profile instead)
        elsewhere, and always for gemini. The same answer on every host: the
        models are fitted on host 0's agreed profiles and the load is
        replicated (as for ``allow_profile``, the detector reads every
        expert's load: ``DetectorOptions.host_experts`` None, the driver's
        default).

        Returns:
          The ``repartition`` event's fields; ``{}`` when the schedule in
          force already is the model's at this load (no profile either);
          None to profile."""
        if self.kind != "capricorn" or self._planned_on is None:
            return None
        by_model = self._replan_by_window_model(step, tokens_per_expert)
        if by_model is not None:
            return by_model
        windows = windows_at_load(self._planned_on, detector, tokens_per_expert,
                                  self.train.moe_layers, spans=self.spans)
        if windows is None:
            return None
        if windows == self._modelled_windows:
            return {}  # the plan in force already is the model's at this load
        self._modelled_windows = windows
        self._spills.clear()  # a new schedule in force: its spills count afresh
        return self._repartition(step, windows, "cost_model")

    def in_graph_windows(self, payloads: MovedPayloads, state: State) -> list[dict[str, Any]]:
        """The ``window_spills`` records of the in-graph step that moved
        ``payloads`` and returned ``state``, from the window clock's marks
        (waits until both are ready: every mark is tied into one of them)."""
        assert self.clock is not None, "only capricorn's in-graph steps carry the marks"
        jax.block_until_ready((payloads["received"], state))
        transport = payloads.get("transport", self.ckpt.transport)
        return self.clock.windows(self.transfers.schedule_for(transport), self._planned_on)

    def allow_profile(self, detector: DynamicityDetector, tokens_per_expert: np.ndarray) -> bool:
        """capricorn: whether the schedule in force may overflow at this load
        (``scheduling.transfers.schedule_at_risk``); gemini: always."""
        if self.kind != "capricorn":
            return True
        # The same answer on every host with no collective: a profiled step
        # (other collectives) must run on every host or on none, and every
        # input is the same everywhere: the expert load is replicated, and the
        # schedule, the profile it was planned on and the cost models' points
        # are host 0's (the driver hands this strategy agreed profiles only).
        return schedule_at_risk(self.transfers.schedule, detector, tokens_per_expert,
                                self._planned_on, self.train.moe_layers)

    def save(self, step: int, state: State, host_state: HostState, *,
             tokens_per_expert: np.ndarray | None = None,
             next_step_profiled: bool = False) -> list[CheckpointEvent]:
        """After step ``step - 1``: commits the version moved inside it.

        Version ``step`` (``state``) is then either deferred, when step ``step``
        will move it (a schedule exists and that step is not profiled), or
        saved now, unscheduled. A version is never moved twice.

        Returns:
          The ``checkpoint`` events of the versions committed now: the one
          moved in the step, and ``step`` when it is saved now.
        """
        if self.keeper is not None:
            if self.keeper.down(step):
                return self._save_while_down(step, tokens_per_expert)
            self.keeper.note()
        self._hold_over()
        if self._spread is not None:
            if not next_step_profiled:
                # The spread version still has steps to go: version ``step``
                # is not taken (every host alike: the same schedule).
                self._host_states = {}
                report = self.ckpt.skip(
                    step, tokens_per_expert if self.ckpt.pec is not None else None)
                return [self._event(step, report)]
            self._flush_spread()  # a profiled step carries no sender marks
        will_move = self.transfers.schedule is not None and not next_step_profiled
        self._host_states = {step: (host_state, tokens_per_expert)} if will_move else {}
        events = self._commit_moved(state, tokens_per_expert)
        if not will_move:
            self._last_saved = step
            events += super().save(step, state, host_state, tokens_per_expert=tokens_per_expert)
        return events

    def _hold_over(self) -> None:
        """Under a budget, threaded: when the version the last step moved left
        bytes on any host (its windows' deadlines, or a tail the plan could
        not place), every host gives it the next step's windows (one more
        part; the sender held those bytes instead of sending them after the
        step, where they would meet the next step's collectives) and that
        step's version is not taken. Agreed (one ``allgather_floats`` of the
        held bytes) so every host takes and skips the same versions."""
        sender = self.sender
        if (sender is None or not sender.hold_tail or self._spread is not None
                or self._moved is None or self._moved[1]["received"] is not None):
            return
        version = self._moved[0]
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

    def _commit_moved(self, state: State, load: np.ndarray | None = None) -> list[CheckpointEvent]:
        """Commits the version the last step(s) moved, if any: its event
        (``state``: the last step's, whose marks the in-graph path reads;
        ``load``: its tokens per expert, which the window model reads)."""
        moved, self._moved = self._moved, None
        if moved is None:
            return []
        version, payloads, pec_version = moved
        windows = None
        if payloads["received"] is None:  # threaded: the peer's chunks, once all are in
            sender = self.sender
            assert sender is not None, "only the threaded path leaves the peer's payload out"
            try:
                with self.ckpt.clock.phase("peer_wait"):
                    waiter = sender.wait if self.keeper is None else self.keeper.wait
                    payloads["received"] = waiter(version)  # [local devices, bytes]
            except VersionDropped as e:  # a corrupt frame: no version here, the job goes on
                log.warning("%s; host %d takes no version %d", e, self.ckpt.host, version)
                self._last_saved = version
                return [{**self._event(version, self.ckpt.drop(version)), "corrupt": True}]
            except Exception as e:
                assert self.keeper is not None
                if not self.keeper.is_loss(e):
                    raise
                self._last_saved = version
                report = self.ckpt.drop(version, corrupt=False)
                return [{**self._event(version, report), "channel_lost": True}]
            schedule = payloads.get("schedule") or self.transfers.schedule_for(
                payloads["transport"])  # a spread version's: its last step's windows timed
            windows = window_spills(schedule, sender.last_spans, self._planned_on,
                                    sender.last_sends, sender.last_bytes)
            self._observe_windows(windows, load)
            self._note_spills(windows)
        elif self.clock is not None:  # in-graph: the step's marks, once it is done
            windows = self.in_graph_windows(payloads, state)
            self._note_spills(windows)
        report = self.ckpt.save_transferred(  # in-step: its CRC32C verdict, for the writer
            version, payloads["own"], [payloads["received"]], version=pec_version,
            corrupt=[payloads["corrupt"]] if "corrupt" in payloads else None)
        self._last_saved = version
        event = {**self._event(version, report), "moved_in_step": version}
        if self.sender is not None:  # threaded: when its chunks went (seconds from start)
            event["chunk_times_s"] = {k: round(v, 4) for k, v in self.sender.last_times.items()}
        if windows is not None:
            event["windows"] = windows
            self._check_spills(version)
        return [event]

    def _save_while_down(self, step: int, tokens_per_expert: np.ndarray | None
                         ) -> list[CheckpointEvent]:
        """A save while the hosts agree the chunk channel is lost: the
        versions in flight are abandoned, the channel reconnects when the
        backoff says so (``ChannelKeeper.while_down``), and version ``step``
        is not taken (no step moves one until the channel is back)."""
        assert self.keeper is not None
        self._moved = self._spread = None
        self._host_states = {}
        self._last_saved = step
        return self.keeper.skip_save(step, self._event, tokens_per_expert)

    def finish(self, step: int, state: State, host_state: HostState) -> list[CheckpointEvent]:
        """Saves the final state (version ``step``), which no later step moves;
        a spread version still on its way is sent whole and committed first
        (with the chunk channel lost on some host: abandoned on every host)."""
        if self.keeper is not None and (self._moved or self._spread) and self.keeper.down(step):
            self.ckpt.note_lost(self.sender.abandon())  # type: ignore[union-attr]
            self._moved = self._spread = None
        self._flush_spread()
        events = self._commit_moved(state)
        if self._last_saved == step:
            return events
        self._last_saved = step
        _, tokens_per_expert = self._host_states.get(step, (None, None))
        return events + super().save(step, state, host_state,
                                     tokens_per_expert=tokens_per_expert)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        super().close()

    def schedule(self) -> Schedule | None:
        return self.transfers.schedule

    def schedule_summary(self) -> dict[str, Any] | None:
        return {**self.transfers.summary(), "repartition_steps": self.repartitions,
                "repartition_sources": self.repartition_sources,
                "spill_request_versions": self.spill_requests,
                "held_over_versions": self.held_over,
                "window_model_replan_steps": self.window_model_replans}
