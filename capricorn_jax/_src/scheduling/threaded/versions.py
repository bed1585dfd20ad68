"""The threaded path's version bookkeeping: what is in flight, what is done.

A ``Version`` is one version's record on this host while its chunks move:
its payload, the buffer the peer's frames fill and which ranges of it
arrived (``integrity.Coverage``), the events the caller waits on, the
frames the sender handed over and the parts of a version spread over
several steps. ``Versions`` is the book of them shared by the sender and
the receiver threads (one lock): the versions in flight and those finished,
whose late frames are discarded. ``Version.step_records`` turns what a step
recorded into its windows' spans, last sends and bytes (pure).

Design choice: the book apart from the sender, so the receive loop
(``receiver``) and the sender (``sender``) share it without either reaching
into the other. Alternative not taken: the sender holding the dict, the
finished set and the lock itself (as it did), one class for every concern.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from capricorn_jax._src.native.integrity import Coverage
from capricorn_jax._src.scheduling.plan.partitioner import Schedule
from capricorn_jax._src.scheduling.plan.sites import START, Site
from capricorn_jax._src.scheduling.plan.window_bytes import WindowBytes, window_bytes
from capricorn_jax._src.scheduling.threaded.chunk_channel import CorruptFrame

log = logging.getLogger(__name__)

FINISHED_KEPT = 1024
"""At most this many finished versions remembered (their late frames are
discarded); past it the newest half is kept."""


class StartedTooLate(RuntimeError):
    """A version this host started after its receiver had dropped the peer's
    frames of it (they arrived and this host did not start the version
    within the channel's bound: ``Versions.buffer``). Those frames are gone,
    so the version can never complete here: ``wait`` drops it at once
    (``VersionDropped``) instead of waiting out its bound and counting the
    channel lost."""


class VersionDropped(RuntimeError):
    """``wait``'s answer for a version whose peer payload failed its
    end-to-end check (``chunk_channel.CorruptFrame``; ``corrupt``) or whose
    frames were dropped before this host started it (``StartedTooLate``):
    the caller takes no version at that step (``InMemoryCheckpointer.drop``);
    the channel and the next versions go on."""

    def __init__(self, version: int, message: str, corrupt: bool = True) -> None:
        super().__init__(message)
        self.version, self.corrupt = version, corrupt


class Version:
    """One version in flight on this host (see the module docstring).

    Args:
      version: its number.
      own: its packed payload [local devices, bytes] (a ``jax.Array``).
      received: the buffer the peer's frames fill [local devices, bytes].
      expect: the ranges the peer's frames must cover (the schedule's chunks).
    """

    def __init__(self, version: int, own: Any, received: np.ndarray,
                 expect: list[tuple[int, int]]) -> None:
        self.version, self.own, self.received = version, own, received
        self.coverage = Coverage(expect)  # the ranges received against the schedule's
        self.sent = threading.Event()
        self.complete = threading.Event()
        self.error: BaseException | None = None
        self.times: dict[str, float] = {}  # seconds since start: packed, sent, received
        self.t0 = time.perf_counter()
        # window index -> (the site opening it, the site closing it)
        self.window_sites: dict[int, tuple[Site, Site]] = {}
        self.site_sent: dict[Site, float] = {}  # when a site's last frame was handed over
        # Every frame handed to the kernel: (the site it went in, start, end,
        # bytes, the site that planned it: another when it was carried).
        self.frames: list[tuple[Site, float, float, int, Site]] = []
        # The deadline sender: per site, the planned idle time of the windows
        # it opens (this part's), their bytes planned, and what a part left.
        self.site_idle: dict[Site, float] = {}
        self.planned: dict[int, int] = {}
        self.carry: list[tuple[Site, int, int]] = []
        # A version spread over several steps (``parts``): its schedule, the
        # windows of one step, the next part to send and when the last one began.
        self.schedule: Schedule | None = None
        self.parts, self.per_part, self.next_part = 1, 0, 0
        self.part_t0 = self.t0
        # Holding the tail (``ThreadedSender.hold_tail``): the parts the
        # sender finished (notified on ``done``); ``held`` the bytes the last
        # one kept for the next step (``extend`` makes them a part of their own).
        self.done = threading.Condition()
        self.parts_done = 0
        self.planned_parts = 1
        self.held = 0

    def fail(self, error: BaseException) -> None:
        """Ends the version with ``error`` (the first one kept): its waits return."""
        self.error = self.error or error
        self.complete.set()

    @property
    def arrived(self) -> bool:
        """Whether the peer's bytes of this version all arrived intact."""
        return self.complete.is_set() and self.error is None

    def part_done(self, upto: int) -> None:
        """The sender finished the parts before ``upto``."""
        with self.done:
            self.parts_done = max(self.parts_done, upto)
            self.done.notify_all()

    def step_records(self, opened_at: dict[Site, float],
                     starts: list[tuple[float, int | None]],
                     queued_at: dict[Site, int | None]
                     ) -> tuple[dict[int, float], dict[int, float], dict[int, WindowBytes]]:
        """(spans, sends, bytes) of the step that moved this version's last
        part, from its marks (pure): ``opened_at`` (site -> when its mark
        opened it), ``starts`` (the collectives' starts, in time order, with
        the bytes unacknowledged then) and ``queued_at`` (site -> the bytes
        unacknowledged at its mark). Spans: window index -> seconds from its
        opening to its closing mark; sends: -> when, from its opening, its
        last frame was handed over; bytes: ``window_bytes.window_bytes``."""
        # Window 0 opens when the payload is packed: the pack program runs
        # before the step on the same devices, and its time is no idle link
        # time of the step (window 0's span once included it: 2-28 ms).
        # The sender thread may see the packed payload only after window 0's
        # closing mark (a busy box): that window then gave it no time, 0.
        # A later part of a spread version: its step's start window opens
        # when that part was handed over.
        start = (self.t0 + self.times["packed_s"] if self.parts == 1
                 else max(self.part_t0, self.t0 + self.times["packed_s"]))
        opened = {**opened_at, START: start}
        spans = {i: max(0.0, opened[close] - opened[open_])
                 for i, (open_, close) in self.window_sites.items()
                 if open_ in opened and close in opened}
        sends = {i: self.site_sent[open_] - opened[open_]
                 for i, (open_, _) in self.window_sites.items()
                 if open_ in opened and open_ in self.site_sent}
        # A window closed when the first collective after its opening began
        # (its start edge's mark, where the step marks them): what was still
        # queued then met that collective on a first-in-first-out link.
        closes_at = {}
        for i, (open_, _) in self.window_sites.items():
            if open_ in opened:
                first = next((s for s in starts if s[0] > opened[open_]), None)
                if first is not None:
                    closes_at[i] = first
        # A spread version's earlier parts went in earlier steps: this step's
        # windows hold the frames handed over since its part began.
        moved = window_bytes([f for f in self.frames if f[1] >= self.part_t0],
                             self.window_sites, opened, queued_at, self.planned, closes_at)
        return spans, sends, moved


class Versions:
    """The versions in flight on one host and those finished (one lock).

    A finished version (waited for, dropped or abandoned) is forgotten and
    its later frames are discarded; ``closed`` (the sender closed) ends the
    wait for a version not started yet."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, Version] = {}
        self._finished: set[int] = set()
        self._unstarted: set[int] = set()  # dropped by ``buffer`` before this host started them
        self.closed = False

    def add(self, entry: Version) -> None:
        """A version this host starts; one whose peer frames ``buffer`` dropped
        before it started fails at once (``StartedTooLate``)."""
        with self._lock:
            self._entries[entry.version] = entry
            late = entry.version in self._unstarted
            self._unstarted.discard(entry.version)
        if late:
            entry.fail(StartedTooLate(
                f"version {entry.version}: the peer's frames arrived before this host started "
                f"it and were dropped"))

    def get(self, version: int) -> Version | None:
        with self._lock:
            return self._entries.get(version)

    def __getitem__(self, version: int) -> Version:
        with self._lock:
            return self._entries[version]

    def __contains__(self, version: object) -> bool:
        with self._lock:
            return version in self._entries

    def pending(self) -> list[tuple[int, Version]]:
        """The versions in flight, oldest first."""
        with self._lock:
            return sorted(self._entries.items())

    def fail_incomplete(self, error: BaseException) -> None:
        """The channel failed: the versions in flight whose peer bytes have
        not all arrived end with ``error``; one that arrived whole keeps them
        (a peer closes its channel once it holds its copy: at a job's end,
        before this host's training thread waited for the last version, soak
        seed 66 trial 15)."""
        with self._lock:  # ``received`` completes a version under it
            for entry in self._entries.values():
                if not entry.complete.is_set():
                    entry.fail(error)

    def finish(self, version: int) -> None:
        """Forgets ``version``: its later frames are discarded."""
        with self._lock:
            self._entries.pop(version, None)
            self._finished.add(version)
            if len(self._finished) > FINISHED_KEPT:
                self._finished = set(sorted(self._finished)[-(FINISHED_KEPT // 2):])
                self._unstarted &= self._finished

    def buffer(self, version: int, timeout_s: float, host: int, source: int
               ) -> np.ndarray | None:
        """The buffer of a frame of ``version``; None (discard the frame) for a
        version already finished or dropped, or one this host did not start
        within ``timeout_s`` (then dropped). ``host``, ``source``: this host
        and the peer sending, for the warning."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                entry = self._entries.get(version)
                if entry is None and version in self._finished:
                    return None
            if entry is not None:
                return entry.received
            if time.monotonic() > deadline or self.closed:
                log.warning("host %d: a frame of version %d from host %d arrived and this host "
                            "did not start that version within %gs; version %d dropped",
                            host, version, source, timeout_s, version)
                self.finish(version)
                with self._lock:
                    self._unstarted.add(version)
                return None
            time.sleep(0.001)

    def remaining(self, version: int) -> int:
        """The bytes of a row still due for ``version`` (the native receive
        returns once a run covers them, so its last frame is seen at once)."""
        with self._lock:
            entry = self._entries.get(version)
            return 1 << 62 if entry is None else max(1, entry.coverage.missing)

    def received(self, frames: list[tuple[int, int, int]], host: int) -> None:
        """Counts the frames (version, offset, length) written into their
        buffers: a version is complete when its ranges are the schedule's
        (not a byte count); a range outside them fails the version as a
        corrupt frame would; a frame of a version discarded or done is
        ignored."""
        with self._lock:
            for version, offset, length in frames:
                entry = self._entries.get(version)
                if entry is None or entry.complete.is_set():  # discarded, or done
                    continue
                try:
                    entry.coverage.add(offset, offset + length)
                except ValueError as e:  # refused: dropped as a corrupt one
                    entry.error = CorruptFrame(version, f"host {host}: version "
                                                        f"{version}: {e}")
                if entry.error is not None or entry.coverage.complete:
                    entry.times["received_s"] = time.perf_counter() - entry.t0
                    entry.complete.set()
