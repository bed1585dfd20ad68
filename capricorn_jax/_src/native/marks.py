"""Window marks without Python: a native FFI mark that stamps a shared table.

A ``MarkTable`` is a process-wide table of (site, device) slots, numpy arrays
whose addresses the native handler (``marks.cc``) is given: a mark
(``emit``: an FFI custom call inside the jitted step, placed by its data
dependency like the host-callback marks) writes CLOCK_MONOTONIC into its slot,
samples the chunk channel's unacknowledged bytes (SIOCOUTQ on the bound
socket) and writes the table's eventfd; the sender thread waits on the
eventfd (``select``, GIL released) and reads the slots. ``stamp`` is the same
write from Python (tests, and the fallback when no compiler is there).

Design choice: the handler only stamps; every decision (is the site open on
every local device, when, how much was queued) stays in Python, read from
the table. Alternative not taken: the whole window bookkeeping in C++, which
would move the sender's logic out of reach of its unit tests. Why: a host
callback costs ~0.5 ms of CPU per device and mark inside the step (GIL,
operand transfer, a numpy result), 48 marks per step on two devices per host
here, where this costs two system calls.

``load()`` builds and registers the handler once per process; a
``NativeBuildError`` (no compiler) makes ``available()`` False and the
callers keep Python callbacks (said once in the log).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from capricorn_jax._src.native import Library

log = logging.getLogger(__name__)

TARGET = "capricorn_window_mark"
TABLES = 64
"""Tables bound at once in one process (``marks.cc``'s kTables)."""
_SOURCE = Path(__file__).with_name("marks.cc")
_LOCK = threading.Lock()
_FREE = list(range(TABLES))  # tables not bound (under _LOCK)


def _configure(lib: ctypes.CDLL) -> None:
    lib.CapricornMarksBind.restype = ctypes.c_int
    lib.CapricornMarksBind.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.CapricornMarksSocket.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.CapricornMarksUnbind.argtypes = [ctypes.c_int]
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.CapricornWindowMark),
                                platform="cpu")


_LIBRARY = Library(_SOURCE, "window_marks", "the native window marks",
                   "window marks run as Python host callbacks", _configure)


def load() -> ctypes.CDLL:
    """Builds (if needed), loads and registers the handler, once per process.

    Raises:
      NativeBuildError: it could not be built (the first error, every call).
    """
    return _LIBRARY.load()


def available() -> bool:
    """Whether the native handler is loaded (building it on first call)."""
    return _LIBRARY.available()


class MarkTable:
    """Slots stamped by marks: ``sites`` x ``devices`` (global device indices).

    Args:
      sites: how many distinct sites the table holds.
      devices: the mesh's device count (a mark's tag carries its global index).
      native: bind the table to the native handler (False: Python stamps only).
    """

    def __init__(self, sites: int, devices: int, native: bool = True) -> None:
        if sites < 1 or devices < 1:
            raise ValueError(f"MarkTable needs sites >= 1 and devices >= 1, got {sites}, "
                             f"{devices}")
        self.stamps = np.zeros((sites, devices), np.int64)
        self.queued = np.full((sites, devices), -1, np.int64)
        self.eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.id: int | None = None
        self._lib: ctypes.CDLL | None = None
        if native and available():
            with _LOCK:
                if _FREE:
                    self.id = _FREE.pop(0)
            if self.id is None:
                log.warning("more than %d native mark tables in one process; this one's marks "
                            "run as Python host callbacks", TABLES)
            else:
                self._lib = load()
                for a in (self.stamps, self.queued):  # what the handler's pointers assume
                    if (a.dtype != np.int64 or a.shape != (sites, devices)
                            or not a.flags.c_contiguous):
                        raise ValueError(f"a mark table of {a.dtype} {a.shape}")
                if self._lib.CapricornMarksBind(self.id, self.stamps.ctypes.data,
                                                self.queued.ctypes.data, sites, devices,
                                                self.eventfd) != 0:
                    raise ValueError(f"the native marks refused a table of {sites} x {devices}")

    @property
    def native(self) -> bool:
        return self.id is not None

    def bind_socket(self, fd: int | None) -> None:
        """The socket whose unacknowledged bytes each native mark samples (None: none)."""
        if self._lib is not None and self.id is not None:
            self._lib.CapricornMarksSocket(self.id, -1 if fd is None else fd)

    def stamp(self, site: int, device: int, queued: int | None) -> None:
        """A mark from Python: the same slot write as the native handler's."""
        self.queued[site, device] = -1 if queued is None else queued
        self.stamps[site, device] = time.monotonic_ns()
        self.wake()

    def wake(self) -> None:
        os.eventfd_write(self.eventfd, 1)

    def wait(self, timeout_s: float) -> None:
        """Until a mark (or ``wake``) or the timeout; the GIL is released meanwhile."""
        import select

        ready, _, _ = select.select([self.eventfd], [], [], max(0.0, timeout_s))
        if ready:
            try:
                os.eventfd_read(self.eventfd)
            except BlockingIOError:
                pass

    def close(self) -> None:
        """Unbinds the table (its slot is free again) and closes its eventfd; idempotent."""
        if self._lib is not None and self.id is not None:
            self._lib.CapricornMarksUnbind(self.id)
            with _LOCK:
                _FREE.append(self.id)
            self.id, self._lib = None, None
        if self.eventfd >= 0:
            os.close(self.eventfd)
            self.eventfd = -1

    def __del__(self) -> None:  # a table its owner did not close frees its slot
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def emit(tag: jax.Array, table: int, site: int) -> jax.Array:
    """The native mark of ``(table, site)`` on this device (inside a
    ``shard_map``; ``tag``: float32[2], the device's global index and a probe
    of the data it is tied to); a float32 scalar to tie the data to."""
    load()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((), jnp.float32), has_side_effect=True)
    out = call(tag, table=np.int64(table), site=np.int64(site))
    # Inside shard_map a custom call's result carries no manual axis type:
    # give it the axes the tag varies over (a type-only cast).
    varying = tuple(sorted(jax.typeof(tag).manual_axis_type.varying
                           - jax.typeof(out).manual_axis_type.varying))
    return jax.lax.pcast(out, varying, to="varying") if varying else out
