"""The threaded sender's window marks: when each boundary site opened in a step.

``WindowMarks`` records the boundary marks of a step that moves chunks on the
threaded path (``threaded.sender``): a site opens when every local device
stamped it. It is separate from the sender because it is the one piece the
step itself touches (the native FFI stamp or the host callback of
``profiler.ProfileHook``) and the one the mark-cost measurements and the
native tests drive alone, without a channel or a sender thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from capricorn_jax._src.native import PERF_MINUS_MONOTONIC
from capricorn_jax._src.native import frames as native_frames
from capricorn_jax._src.native.marks import MarkTable
from capricorn_jax._src.profiling.layer_profile import is_edge, opens_span
from capricorn_jax._src.scheduling.plan.sites import Site


class WindowMarks:
    """The recorder of the marks: opens a site when every local device passed it.

    The marks stamp a ``MarkTable`` (``native.marks``): in the step, the
    native handler where it could be built (``native_slot`` gives each
    site its slot; no host callback, no GIL), else a host callback that
    calls ``record``. The sender thread waits on ``wait_open`` (the table's
    eventfd, the GIL released) and reads when a site opened (``opened_at``:
    its last local device's stamp) and the chunk bytes still unacknowledged
    then (``queued_at``: sampled by that device's mark).

    Args:
      local_devices: this process's devices (a site opens when as many
        devices stamped it in the current step).
      queued: the channel's unacknowledged bytes (the Python marks' sample).
      devices: the mesh's device count (a mark's tag is its global index).
      sites: the most distinct sites the step marks.
      native: stamp from the native handler where available.
      native_wait: ``wait_opened`` waits in native code (``native.frames.wait_stamped``:
        a mark costs the waiting thread a system call, not a Python pass);
        the caller checked the frame library is available.
    """

    def __init__(self, local_devices: int,
                 queued: Callable[[], int | None] | None = None, devices: int = 64,
                 sites: int = 1024, native: bool = True, native_wait: bool = False) -> None:
        self.local_devices = local_devices
        self.native_wait = native_wait
        self._epoch_cell = np.zeros(1, np.int64)  # the epoch, for the native wait
        self.table = MarkTable(sites, max(devices, local_devices), native=native)
        self._index: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._queued = queued
        self._epoch = 0
        self._epoch_ns = time.monotonic_ns()
        self._to_perf = PERF_MINUS_MONOTONIC  # the native stamps' clock to perf_counter
        self._starts = np.zeros(0, np.int64)  # slots of the collectives' start edges
        self._starts_for = 0  # ... as of this many sites

    def _site(self, name: str, direction: str) -> int:
        with self._lock:
            index = self._index.get((name, direction))
            if index is None:
                if len(self._index) >= self.table.stamps.shape[0]:
                    raise ValueError(f"more than {self.table.stamps.shape[0]} marked sites")
                index = self._index[(name, direction)] = len(self._index)
            return index

    def has_site(self, site: Site) -> bool:
        """Whether a step program marks ``site`` (its slot was given out)."""
        with self._lock:
            return site in self._index

    def native_slot(self, name: str, direction: str) -> tuple[int, int] | None:
        """(table, slot) of a native mark of this site, or None (a host callback)."""
        if not self.table.native:
            return None
        assert self.table.id is not None
        return self.table.id, self._site(name, direction)

    def bind_socket(self, fd: int | None) -> None:
        """The socket whose unacknowledged bytes a native mark samples."""
        self.table.bind_socket(fd)

    def record(self, name: str, direction: str, tag: Any) -> np.ndarray:
        """A mark from a host callback (or a test): stamps the site's slot."""
        device = int(np.asarray(tag)[0])
        self.table.stamp(self._site(name, direction), device,
                         self._queued() if self._queued is not None else None)
        return np.zeros((), np.float32)

    def _stamps(self, site: Site) -> np.ndarray | None:
        """This step's stamps of ``site`` (ns), or None if it is not open."""
        index = self._index.get(site)
        if index is None:
            return None
        row = self.table.stamps[index]
        mine = row[row >= self._epoch_ns]
        return mine if mine.size >= self.local_devices else None

    def _open_sites(self) -> dict[Site, int]:
        """site -> the device column that opened it (the last stamp), this step."""
        out = {}
        for site, index in list(self._index.items()):
            row = self.table.stamps[index]
            if np.count_nonzero(row >= self._epoch_ns) >= self.local_devices:
                out[site] = int(np.argmax(row))
        return out

    def open_time(self, site: Site) -> float | None:
        """When ``site`` opened in this step (perf_counter seconds), or None:
        ``opened_at`` for one site (one row read, not every site's)."""
        mine = self._stamps(site)
        return None if mine is None else float(mine.max()) / 1e9 + self._to_perf

    @property
    def opened_at(self) -> dict[Site, float]:
        """site -> when it opened in this step (perf_counter seconds)."""
        return {site: self.table.stamps[self._index[site], col] / 1e9 + self._to_perf
                for site, col in self._open_sites().items()}

    def step_times(self) -> dict[tuple[str, str, int], float]:
        """Every stamp of this step: {(name, direction, device): perf_counter
        seconds}, the shape ``layer_profile.build_profile`` takes (a step
        whose marks are its profile: ``ScheduledStrategy.run_profiled``)."""
        out = {}
        for (name, direction), index in list(self._index.items()):
            row = self.table.stamps[index]
            for device in np.flatnonzero(row >= self._epoch_ns):
                out[(name, direction, int(device))] = row[device] / 1e9 + self._to_perf
        return out

    def _start_slots(self) -> np.ndarray:
        """The slots of the sites where a collective begins (its edge that
        does not open a span: forward ``.begin``, backward ``.end``)."""
        with self._lock:
            if self._starts_for != len(self._index):
                self._starts = np.array([i for (_, d), i in self._index.items()
                                         if is_edge(d) and not opens_span(d)], np.int64)
                self._starts_for = len(self._index)
            return self._starts

    def collective_started(self, since: float) -> bool:
        """Whether a collective began after ``since`` (perf_counter seconds)
        in this step: every local device stamped its start edge since then
        (as a site opens: the collective's bytes move once the host's
        devices are all in it; one device early waits for the others). The
        window open since then has closed. False where the step marks no
        start edges (Python host callbacks mark only the opening ones)."""
        edges = self.start_edges(since)
        if edges is None:
            return False
        stamps, slots, local, floor = edges
        stamped = np.count_nonzero(stamps[slots] > floor, axis=1)
        return bool((stamped >= local).any())

    def start_edges(self, since: float) -> tuple[np.ndarray, np.ndarray, int, int] | None:
        """What the native sender reads for ``collective_started(since)``:
        (the stamps table, the start slots, the local devices, the floor in
        monotonic ns); None where the step marks no start edges."""
        slots = self._start_slots()
        if slots.size == 0:
            return None
        floor = max(self._epoch_ns, int((since - self._to_perf) * 1e9))
        return self.table.stamps, slots, self.local_devices, floor

    def collective_starts(self) -> list[tuple[float, int | None]]:
        """This step's collective starts in time order, each (when its last
        local device stamped the start edge: perf_counter seconds, the chunk
        bytes unacknowledged then: sampled by that device's mark, None when
        unknown)."""
        out = []
        for slot in self._start_slots():
            row = self.table.stamps[slot]
            if np.count_nonzero(row >= self._epoch_ns) < self.local_devices:
                continue
            device = int(np.argmax(row))
            queued = int(self.table.queued[slot, device])
            out.append((row[device] / 1e9 + self._to_perf, None if queued < 0 else queued))
        return sorted(out, key=lambda x: x[0])

    @property
    def queued_at(self) -> dict[Site, int | None]:
        """site -> the chunk bytes still unacknowledged when it opened (None: unknown)."""
        out: dict[Site, int | None] = {}
        for site, col in self._open_sites().items():
            value = int(self.table.queued[self._index[site], col])
            out[site] = None if value < 0 else value
        return out

    def reset(self) -> int:
        """A new step: no site is open; returns the step's epoch."""
        with self._lock:
            self._epoch += 1
            self._epoch_ns = time.monotonic_ns()
            epoch = self._epoch
            self._epoch_cell[0] = epoch
        self.table.wake()
        return epoch

    def wait_open(self, site: Site, epoch: int, timeout_s: float) -> bool:
        """Whether ``site`` opened in step ``epoch`` within the timeout."""
        return self.wait_opened(site, epoch, timeout_s) is not None

    def wait_opened(self, site: Site, epoch: int, timeout_s: float) -> float | None:
        """When ``site`` opened in step ``epoch`` (its last local device's
        stamp, perf_counter seconds), once it did within the timeout; None
        if it did not, or the step moved on first."""
        index = self._index.get(site)
        if self.native_wait and index is not None:  # the checks and the wait in one call
            stamp = native_frames.wait_stamped(
                self.table.eventfd, self.table.stamps[index], self.local_devices,
                self._epoch_ns - 1, self._epoch_cell, epoch,
                time.monotonic_ns() + int(max(0.0, timeout_s) * 1e9))
            return None if stamp is None else stamp / 1e9 + self._to_perf
        deadline = time.monotonic() + timeout_s
        while True:
            if self._epoch != epoch:
                return None
            at = self.open_time(site)
            if at is not None:
                return at
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self.native_wait and site in self._index:  # its slot was given out meanwhile
                return self.wait_opened(site, epoch, left)
            self.table.wait(left)

    def close(self) -> None:
        self.table.close()
