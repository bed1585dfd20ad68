"""The host path for checkpoint chunks: a sender thread started by the boundary marks.

On XLA:CPU an in-graph collective-permute does not overlap the compute around
it when the link is the bottleneck (BUILD_NOTES, "Shaped links"): the step
costs compute + link time. This path moves a window's chunks *outside* the
XLA program while the step computes:

* before the step, a jitted program (no collective) packs version t into
  the payload; the step itself is the plain step plus a mark at every layer
  boundary (``profiler.ProfileHook``: an unordered host callback per device,
  tied to the boundary's data, so placed by that dependency alone; the same
  marks for every schedule, so a re-partition compiles nothing);
* a mark on every local device of a boundary, or of a collective edge that
  opens an idle span (a span window, ``Window.edge``), opens the windows
  whose site it is (``sites.site_of``; recorded by
  ``window_marks.WindowMarks``); the sender thread sends each window's ranges,
  in step order, as soon as its window is open, and the schedule's tail
  after the last window, so each window carries what the partitioner sized
  to its capacity; the marks' times give each filled window's real length
  (``last_spans``), which the strategy compares with its plan
  (``spills.window_spills``), and the frames' times where each window's
  bytes went (``last_bytes``: ``window_bytes.window_bytes``);
* the bytes go over the chunk channel (``threaded.chunk_channel``: a TCP
  connection per replication round, on the job's address, accepting only its
  job's peer); a receiver thread (``receiver``) writes the peer's frames into
  the version's buffer, and ``wait`` hands the complete buffer to the commit.

What each part of a version sends where is laid out before its step
(``pacing.part_plan``, pure); the deadline sender's decision before each
frame is ``stop_rule.decide`` (pure; the native loop's the same); the
versions in flight are ``versions.Versions``.

Why not XLA programs issued from a second thread (a chunk's ppermute program
while the step runs): measured on this box (jax 0.10.2, gloo), two programs
with collectives in flight at once on the same devices deadlocked: 2 hosts x 2
devices 2 of 2 runs, 4 hosts x 1 device 1 of 2 runs (XLA's CPU collectives
share one communicator per device set, with tag 0 for every op). A separate
device set (one device per host) ran, but 4 hosts x 1 device has none. Why
not ``jax.experimental.transfer``: a pull hung about once in 6 runs
(launch.experiments.overlap, tag experiments-2026-12-05). On GPUs the
in-graph permutes run on their own streams and overlap: there
``executor.InStepSender`` is the path.

Every host sends and receives the same frames in the same order; a peer
that stops answering ends ``wait`` with an error naming it after the
timeout, never a hang. Every wait is bounded by ``timeout_s``: connecting,
each send and receive, a window's mark (a mark that never fires sends the
window's chunks at the bound rather than never), a frame of a version this
host has not started yet, and ``wait``. A version whose ``wait`` failed or
timed out is dropped whole (its late frames are read and discarded), a
frame that arrives twice counts once, and the next version goes on.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from capricorn_jax._src.memory.wire.transport import local_rows, pack_payload
from capricorn_jax._src.native import frames as native_frames
from capricorn_jax._src.profiling.layer_profile import END, STEP
from capricorn_jax._src.profiling.profiler import ProfileHook
from capricorn_jax._src.scheduling.plan.partitioner import Schedule
from capricorn_jax._src.scheduling.plan.sites import AFTER, START, Site, sites_in_order
from capricorn_jax._src.scheduling.plan.window_bytes import WindowBytes
from capricorn_jax._src.scheduling.threaded import stop_rule
from capricorn_jax._src.scheduling.threaded.chunk_channel import ChunkChannel, CorruptFrame
from capricorn_jax._src.scheduling.threaded.pacing import PartPlan, part_plan
from capricorn_jax._src.scheduling.threaded.receiver import receive_loop
from capricorn_jax._src.scheduling.threaded.versions import (
    StartedTooLate,
    Version,
    VersionDropped,
    Versions,
)
from capricorn_jax._src.scheduling.threaded.window_marks import WindowMarks

STEP_END = (STEP, END)
"""The step's end mark (``profiler.step_marks``), where the step program carries it."""

PIECE_BYTES = 24 << 10
"""The deadline sender's frame size over all of a host's rows: a window that
closes early (its collective begins before the plan said) meets at most one
frame and ``QUEUE_BYTES`` (24 KiB at 0.118 Gbit/s: 1.7 ms). Measured (2x2
dynamic, R 0.55, 2026-12-05): 64 KiB frames with a 16 KiB bound, capricorn's
all-to-alls 61 ms per step above none's, steady 1.135x; 24 KiB with 8 KiB,
24 ms and 1.098x, for 24 ms more sender CPU per step (the frames' Python)."""
QUEUE_BYTES = 8 << 10
"""The most chunk bytes the deadline sender leaves on its link before it
hands over the next frame (``stop_rule.ahead``): on a first-in-first-out link what
is queued when a collective begins goes before it. TCP alone keeps a
congestion window of the link's queue there (156-191 KB measured at a
collective's start on the 0.0787 Gbit/s links, 16-20 ms)."""


class ThreadedSender:
    """Moves each version's chunks while its step computes (see the module docstring).

    Args:
      channel: the connections to the peer.
      boundaries: the model's boundary names, forward order.
      local_devices: this process's devices (rows of the payload).
      mesh: the training mesh (the marks run once per device).
      timeout_s: bound on a window's wait for its mark and on ``wait``.
      deadline: a window's bytes stop at its planned close (``_send_until``)
        and go on in the next window.
      piece_bytes: the deadline sender's frame size over all rows.
      queue_bytes: the most unacknowledged bytes the deadline sender leaves
        on the link before its next frame (``QUEUE_BYTES``).
      native_send: a window's frames go from the native loop
        (``native.frames``, the GIL released) where it could be built, and
        the wait for a window's mark is native too (``WindowMarks``); the
        Python loop otherwise, and for frames with a fault armed.
      native_receive: the receive loop takes runs of frames in native code
        (``ChunkChannel.receive_frames``) where it could be built; a frame
        at a time in Python otherwise.
      at_once: every part of a version goes at its step's start, in large
        frames, without waiting for any mark (``InMemoryOptions.chunk_send``
        "at_once": the network's classes let the collectives pass the
        checkpoint's bytes); False: held to the planned windows.
      hold_tail: the most parts a version may take in all (its planned ones
        and the held ones); 0: none held. What a version's last part
        leaves (the bytes its windows could not carry before their
        deadlines, and the schedule's tail) is then not sent after the step
        (where it meets the next step's collectives on a first-in-first-out
        link) but held (``held_bytes``); the caller either gives it the next
        step's windows (``extend``, then ``resume``) or sends it now
        (``resume(flush=True)``). A version at the bound sends its rest
        after the step, so it always completes.
    """

    def __init__(self, channel: ChunkChannel, boundaries: list[str], local_devices: int,
                 mesh: Any, timeout_s: float = 120.0, deadline: bool = False,
                 piece_bytes: int = PIECE_BYTES, hold_tail: int = 0,
                 queue_bytes: int = QUEUE_BYTES, native_send: bool = True,
                 native_receive: bool = True, at_once: bool = False) -> None:
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes={piece_bytes} must be positive")
        if queue_bytes < 0:
            raise ValueError(f"queue_bytes={queue_bytes} must be >= 0")
        self.queue_bytes = queue_bytes
        self.at_once = at_once
        self._link = (0.0, 0.0)  # (bytes modelled on the link, when): ``stop_rule``
        self.native_send = native_send and deadline and native_frames.available()
        self.native_receive = native_receive and native_frames.available()
        if hold_tail < 0:
            raise ValueError(f"hold_tail={hold_tail} must be >= 0")
        self.channel, self.boundaries, self.timeout_s = channel, boundaries, timeout_s
        self.deadline, self.piece_bytes, self.hold_tail = deadline, piece_bytes, hold_tail
        self.marks = WindowMarks(local_devices, lambda: self.channel.queued_bytes(),
                                 devices=mesh.size,
                                 native_wait=native_send and native_frames.available())
        self.marks.bind_socket(channel.out_fileno())
        self.mesh = mesh
        self._hook: ProfileHook | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._sender: threading.Thread | None = None
        self._receiver: threading.Thread | None = None
        self._versions = Versions()  # in flight, and finished (late frames discarded)
        self._closed = False
        self.failure: BaseException | None = None
        self._start_threads()
        self.last_times: dict[str, float] = {}
        self.last_spans: dict[int, float] = {}
        self.last_sends: dict[int, float] = {}
        self.last_bytes: dict[int, WindowBytes] = {}

    def hook(self) -> ProfileHook:
        """The boundary hook of a step moving chunks: an unordered mark (placed
        by its data dependency alone) at every boundary a window can open or
        close at, whatever the schedule fills (the closing ones time the
        windows: ``last_spans``). One hook for every schedule, so a
        re-partition never compiles a new step program (each cost 5.7 s
        against a 0.5 s step in the emulated 2x2 runs); a mark at a boundary
        no filled window uses costs one host callback per device. The
        collective edges that open an idle span (``layer_profile.opens_span``,
        2 per MoE layer and direction) are marked too: span windows
        (``Window.edge``) open there; with native marks every collective
        edge is, so a step's marks give its ``LayerProfile``
        (``WindowMarks.step_times``)."""
        if self._hook is None:
            sites = frozenset(sites_in_order(self.boundaries)) - {START, AFTER}
            # Native marks cost ~3 us: every edge, so the step's marks are
            # its profile (``profiles_from_marks``); host callbacks ~0.5 ms:
            # only the edges a window opens at.
            self._hook = ProfileHook(self.mesh, self.marks, sites=sites, ordered=False,
                                     edges="all" if self.marks.table.native else "opening")
        return self._hook

    def start(self, version: int, own: jax.Array, schedule: Schedule, parts: int = 1) -> None:
        """Version ``version``'s chunks go as the step about to be dispatched
        opens its windows. ``own``: its packed payload [devices, bytes].
        ``parts`` > 1: the schedule's windows are ``parts`` steps' windows
        (``partition_search.spread``); this step sends the first step's, and each
        ``resume`` the next's. With ``at_once`` every part goes at once,
        without waiting for any mark (``parts_left`` is 0)."""
        if parts < 1 or len(schedule.windows) % parts:
            raise ValueError(f"{len(schedule.windows)} windows are not {parts} steps' windows")
        rows = self.marks.local_devices
        entry = Version(version, own, np.empty((rows, schedule.payload_bytes), np.uint8),
                         [(c.start, c.stop) for c in schedule.all_chunks()])
        entry.schedule, entry.parts, entry.planned_parts = schedule, parts, parts
        entry.per_part = len(schedule.windows) // parts
        self._versions.add(entry)
        if self.failure is not None:  # the channel failed earlier: this version is lost
            entry.error = RuntimeError(f"host {self.channel.host}: the chunk channel failed "
                                       f"before version {version}")
            entry.error.__cause__ = self.failure
            entry.sent.set()
            entry.complete.set()
            entry.part_done(parts)
            entry.next_part = entry.parts
            return
        # ``at_once`` (a network whose classes let a collective pass the
        # chunk bytes): no window holds them back, every part goes now, in
        # large frames. Measured (R 0.77, priority): held to the windows, 6-7%
        # of the version was still on its way at the step's end and the
        # training thread waited 73 ms per step for it (capricorn 1.10x,
        # inmem 1.04x).
        self._queue_part(entry, flush=self.at_once)

    def resume(self, version: int, flush: bool = False) -> None:
        """The next step's part of spread version ``version`` goes as the step
        about to be dispatched opens its windows; ``flush``: every part left
        goes now, without waiting for any mark (before a step that carries no
        marks, e.g. a profiled one)."""
        entry = self._versions[version]
        if entry.error is not None and entry.next_part >= entry.parts:
            return  # a version lost with the channel: nothing to send
        if entry.next_part >= entry.parts:
            raise ValueError(f"version {version}: all {entry.parts} parts were sent")
        self._queue_part(entry, flush)

    def parts_left(self, version: int) -> int:
        """Parts of ``version`` not yet handed to the sender thread."""
        entry = self._versions[version]
        return entry.parts - entry.next_part

    def held_bytes(self, version: int, timeout_s: float | None = None) -> int:
        """The bytes of ``version`` its last part held for a later step
        (``hold_tail``), once the sender finished that part's windows (0:
        none; it ended the step with every byte handed over). Bounded: a
        sender that did not finish the part within the timeout raises."""
        entry = self._versions[version]
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with entry.done:
            finished = entry.done.wait_for(lambda: entry.parts_done >= entry.next_part,
                                           timeout_s)
        if not finished:
            raise TimeoutError(f"host {self.channel.host}: version {version}: the sender did "
                               f"not finish its step's windows within {timeout_s:g}s")
        if entry.error is not None and not isinstance(entry.error, CorruptFrame):
            return 0  # the channel failed: ``wait`` raises it
        # A peer's corrupt frame fails this host's copy of the peer's version,
        # not what this host sends: its held bytes still go (the peer needs
        # them), or the peer's wait runs into its timeout (found by the soak).
        return entry.held

    def extend(self, version: int) -> None:
        """One more part for ``version``: the bytes it held go in the next
        step's windows (those of its schedule's first step, with their
        deadlines) when ``resume`` hands that part over."""
        entry = self._versions[version]
        if entry.next_part < entry.parts:
            raise ValueError(f"version {version}: {entry.parts - entry.next_part} parts are "
                             f"still to send")
        entry.parts += 1

    def _queue_part(self, entry: Version, flush: bool = False) -> None:
        assert entry.schedule is not None
        part = entry.next_part
        plan = part_plan(entry.schedule, self.boundaries, part, entry.parts,
                         entry.planned_parts, entry.per_part, self.marks.local_devices,
                         flush=flush, deadline=self.deadline, hold_tail=self.hold_tail)
        entry.next_part = plan.upto
        entry.window_sites, entry.site_idle = plan.window_sites, plan.site_idle
        entry.planned = plan.planned
        entry.part_t0 = time.perf_counter()
        entry.held = 0
        epoch = self.marks.reset()
        self._jobs.put((entry, epoch, plan))

    def _start_threads(self) -> None:
        """A sender and a receiver thread on the current channel (each keeps
        its channel: after ``reconnect`` the old ones end on the old one)."""
        self._jobs = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop,
                                        args=(self._jobs, self.channel),
                                        name="chunk-sender", daemon=True)
        channel = self.channel
        self._receiver = threading.Thread(
            target=receive_loop, name="chunk-receiver", daemon=True,
            args=(channel, self._versions, self.timeout_s, self.native_receive,
                  lambda: not self._closed and channel is self.channel, self._failed))
        self._sender.start()
        self._receiver.start()

    def _send_loop(self, jobs: queue.Queue, channel: ChunkChannel) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            entry, epoch, plan = job
            try:
                self._send_part(channel, entry, epoch, plan)
            except BaseException as e:  # noqa: BLE001
                entry.error = e
                if channel is self.channel:  # not an old channel's (``reconnect``)
                    self._failed(e)
                entry.complete.set()
                entry.sent.set()
                entry.part_done(plan.upto)
            else:
                if plan.last and not entry.held:
                    entry.sent.set()
                entry.part_done(plan.upto)

    def _failed(self, error: BaseException) -> None:
        """The channel failed (the first error is kept until ``reconnect``)."""
        self.failure = self.failure or error

    def _send_part(self, channel: ChunkChannel, entry: Version, epoch: int,
                   plan: PartPlan) -> None:
        """Sends ``plan``'s part of ``entry``, each window's at its mark."""
        by_site, last, hold = plan.by_site, plan.last, plan.hold
        t0 = entry.t0
        local = local_rows(entry.own, copy=False)  # views of the packed payload
        # The native loop's rows, checked once for the part's windows.
        prepared = (native_frames.SendRows([np.asarray(r) for r in local])
                    if self.native_send else None)
        t_packed = time.perf_counter()
        entry.times.setdefault("packed_s", t_packed - t0)
        # Bytes a window could not send before its deadline go in the
        # next window (a part's leftovers in the next part's first).
        carry, entry.carry = entry.carry, []
        # The link model is per row (the schedule's unit: every local
        # row of a range goes at once); the frames and the queue are
        # all rows' bytes.
        rate = entry.schedule.link.bytes_per_s * len(local) if entry.schedule else 0.0
        for site in plan.order:
            if site == AFTER and (hold or not last):
                # A part's leftovers go in the next part's first
                # window; a held version's (and its tail) in the
                # next step's, if the caller gives it one.
                carry += [(AFTER, lo, hi) for lo, hi in by_site.get(AFTER, ())]
                break
            idle = entry.site_idle.get(site)
            own = [(site, lo, hi) for lo, hi in by_site.get(site, ())]
            if not own and (not carry or (idle is None and site != AFTER)):
                continue  # no window here to take the carried bytes
            at = None
            if site not in (START, AFTER):
                # A window opens at its mark; a missed mark (a step that
                # ended another way) sends at once rather than never.
                at = self.marks.wait_opened(site, epoch, self.timeout_s)
            elif site == AFTER and entry.site_idle and self.marks.has_site(STEP_END):
                # What the windows could not carry goes after the step
                # (its end mark), not into the gradient all-reduce's
                # span that follows the last window.
                self.marks.wait_open(STEP_END, epoch, self.timeout_s)
            ranges, carry = carry + own, []
            closes = opened = None
            if idle is not None and site != AFTER:
                opened = (max(entry.part_t0, t_packed) if site == START
                          else at or time.perf_counter())
                closes = opened + idle
            carry = self._send_until(channel, entry, local, site, ranges, closes,
                                     rate, opened, prepared)
            entry.site_sent[site] = time.perf_counter()
        if carry and hold:  # held for a later step: its windows carry them in
            entry.carry = [(AFTER, lo, hi) for _, lo, hi in carry]
            entry.held = sum(hi - lo for _, lo, hi in carry) * len(local)
        elif carry:  # the part's last window left some: the next part's
            entry.carry = carry
        if last and not entry.held:
            entry.times["sent_s"] = time.perf_counter() - t0

    def _send_until(self, channel: ChunkChannel, entry: Version, local: list, site: Site,
                    ranges: list[tuple[Site, int, int]], closes: float | None, rate: float,
                    opened: float | None = None, prepared: native_frames.SendRows | None = None
                    ) -> list[tuple[Site, int, int]]:
        """Sends ``ranges`` ((planning site, lo, hi), in order) in window
        ``site`` as frames of at most ``piece_bytes`` over all rows; with a
        deadline (``closes``), stops before a frame that the link could not
        carry before it: now + (bytes still queued on the link + the frame)
        / the link's rate (all rows' bytes: the per-row model's rate times
        the rows), the queue being the channel's unacknowledged
        bytes (the drain time of what is already in flight: the guard).
        It also stops as soon as a collective began after the window
        ``opened`` (its start edge's mark: the step's compute was shorter
        than the plan), and hands a frame over only while at most
        ``queue_bytes`` are unacknowledged (waiting on the marks meanwhile),
        so an early close meets at most that and one frame (a low-priority
        channel has no deadline: ``start``). ``prepared``: ``local`` checked
        for the native loop (``_send_part`` gives it where ``native_send``);
        None: the Python loop. Returns the ranges left (to carry)."""
        per_row = max(1, self.piece_bytes // max(1, len(local)))
        if closes is not None and rate > 0 and prepared is not None and channel.stall_at is None:
            return self._send_native(channel, entry, prepared, site, ranges, closes, rate, opened,
                                     per_row)
        left = list(ranges)
        while left:
            origin, lo, hi = left[0]
            stop = min(hi, lo + per_row) if closes is not None else hi
            nbytes = (stop - lo) * len(local)
            if closes is not None and rate > 0:
                while True:  # the rule: ``stop_rule`` (native: ``frames.cc``, the same)
                    now = time.perf_counter()
                    rule, queued = stop_rule.decide(
                        opened is not None and self.marks.collective_started(opened), now,
                        self._link, channel.queued_bytes(), nbytes, rate, closes,
                        self.queue_bytes)
                    if rule == stop_rule.SEND:
                        break
                    if rule != stop_rule.WAIT:
                        return left
                    # Until the link drained to the bound, or a mark (a
                    # collective's start among them) wakes the thread.
                    self.marks.table.wait(min((queued - self.queue_bytes) / rate, closes - now))
            t_frame = time.perf_counter()
            if rate > 0:
                self._link = (stop_rule.ahead(t_frame, self._link, None, rate) + nbytes, t_frame)
            channel.send(entry.version, lo, [row[lo:stop] for row in local])
            entry.frames.append((site, t_frame, time.perf_counter(), nbytes, origin))
            if stop < hi:
                left[0] = (origin, stop, hi)
            else:
                left.pop(0)
        return []

    def _send_native(self, channel: ChunkChannel, entry: Version, rows: native_frames.SendRows,
                     site: Site, ranges: list[tuple[Site, int, int]], closes: float, rate: float,
                     opened: float | None, per_row: int
                     ) -> list[tuple[Site, int, int]]:
        """``_send_until``'s loop in native code (``native.frames``): one call
        per range, the GIL released; the same stop rule and records."""
        left = list(ranges)
        while left:
            origin, lo, hi = left[0]
            edges = None if opened is None else self.marks.start_edges(opened)
            stop, frames, self._link, error = channel.send_window(
                rows, entry.version, lo, hi, per_row, closes, rate, self.queue_bytes, self._link,
                edges, wake_fd=-1 if edges is None else self.marks.table.eventfd)
            entry.frames.extend((site, t0, t1, n, origin) for t0, t1, n in frames)
            if error is not None:
                raise error
            if stop < hi:  # the rule stopped it: the rest is carried
                left[0] = (origin, stop, hi)
                return left
            left.pop(0)
        return []

    def wait(self, version: int, timeout_s: float | None = None) -> np.ndarray:
        """The peer's payload of ``version`` [local devices, bytes] once every
        chunk arrived and this host's chunks are sent; raises on a failure or
        after the timeout, naming the peer. ``last_times`` then holds the
        version's seconds from ``start``: packed, sent, received, and waited
        (this call); ``last_spans`` the seconds each window with chunks lasted
        in the step (window index -> from its opening mark, or for window 0
        from when the payload was packed, to its closing mark) and
        ``last_sends`` when, from its opening, its last frame was handed to
        the kernel (call it after the step, before the next ``start``)."""
        t_wait = time.perf_counter()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        entry = self._versions.get(version)
        if entry is None:  # ``abandon`` finished it (or it never started)
            raise ConnectionError(f"host {self.channel.host}: version {version} is not in "
                                  f"flight on the chunk channel (abandoned with it)")
        deadline = time.monotonic() + timeout_s
        if self.hold_tail and entry.next_part == entry.parts:
            # A held rest that the caller gave no later step goes now.
            if self.held_bytes(version, timeout_s):
                self.extend(version)
                self._queue_part(entry, flush=True)
        for event, what in ((entry.sent, f"sending to host {self.channel.destination}"),
                            (entry.complete, f"receiving from host {self.channel.source}")):
            if not event.wait(max(0.0, deadline - time.monotonic())):
                self._versions.finish(version)  # dropped whole: its late frames are discarded
                raise TimeoutError(f"host {self.channel.host}: version {version}: {what} did "
                                   f"not finish within {timeout_s:g}s")
            if isinstance(entry.error, (CorruptFrame, StartedTooLate)):  # this version only
                self._versions.finish(version)
                raise VersionDropped(version, str(entry.error),
                                     corrupt=isinstance(entry.error, CorruptFrame)) from entry.error
            if entry.error is not None:
                self._versions.finish(version)
                raise RuntimeError(f"host {self.channel.host}: version {version}: {what} "
                                   f"failed") from entry.error
        self._versions.finish(version)
        self.last_times = {**entry.times, "waited_s": time.perf_counter() - t_wait}
        self.last_spans, self.last_sends, self.last_bytes = entry.step_records(
            self.marks.opened_at, self.marks.collective_starts(), self.marks.queued_at)
        return entry.received

    def abandon(self, keep_arrived: bool = False) -> list[int]:
        """Gives up every version not waited for yet (the hosts declared the
        channel lost: none of them will wait for these): each is finished
        (its late frames discarded) and its ``wait`` would raise. Returns
        their numbers, oldest first. ``keep_arrived``: a version whose peer
        bytes all arrived intact stays (this host alone knows the channel
        lost: what arrived is still good, its wait returns it)."""
        pending = [(v, e) for v, e in self._versions.pending()
                   if not (keep_arrived and e.arrived)]
        for version, entry in pending:
            entry.error = entry.error or ConnectionError(
                f"host {self.channel.host}: version {version} abandoned with its chunk channel")
            entry.sent.set()
            entry.complete.set()
            entry.part_done(entry.parts)
            self._versions.finish(version)
        return [v for v, _ in pending]

    def reconnect(self, channel: ChunkChannel) -> None:
        """Moves to ``channel`` (new connections to the same peers, after the
        hosts agreed the old ones were lost): versions in flight are
        abandoned, the old channel is closed (its threads wake and end
        without touching this sender's state) and new threads start on the
        new one, with no failure recorded. The marks (and so the compiled
        steps) stay."""
        self.abandon()
        old = self.channel
        self._jobs.put(None)
        self.channel = channel
        self.marks.bind_socket(channel.out_fileno())
        old.close()
        self.failure = None
        self._start_threads()

    def close(self) -> None:
        self._closed = self._versions.closed = True
        self._jobs.put(None)
        self.marks.bind_socket(None)
        self.channel.close()
        if self._sender is not None:
            self._sender.join(5.0)
        self.marks.close()


def pack_program(transport: Any, state_shardings: Any) -> Callable[..., jax.Array]:
    """The jitted pack of a version into its payload [devices, bytes] (no
    collective; ``transport.pack_payload``, as the in-graph path packs it)."""
    specs = [s.spec for s in jax.tree.leaves(state_shardings)]
    return jax.jit(functools.partial(pack_payload, transport, specs))
