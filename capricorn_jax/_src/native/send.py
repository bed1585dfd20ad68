"""The deadline sender's window loop in native code (``send.cc``), off the GIL.

``send_window`` hands a window's byte range to the chunk channel's socket in
frames of the channel's format, with ``ThreadedSender._send_until``'s stop
rule (the next collective began, the planned close, the bound on bytes ahead
on the link), in one ctypes call that releases the GIL. Why: the rule wants
small frames (a window that closes early meets at most one frame and the
bound), and each frame cost ~0.14 ms of the sender thread's Python (24 KiB
frames: +24 ms of CPU per step over two hosts against 64 KiB ones, on the
cores the step's collectives use).

Design choice: the frame loop and its stop rule in C, the choice of ranges,
the carrying and the records in Python (the frame log comes back). The same
decisions as the Python loop, which stays for platforms without a compiler
and for the channel's fault injection (a flipped byte, a stall).

``available()`` builds it once per process (``native.build``); a
``NativeBuildError`` makes it False (said once in the log).
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from pathlib import Path

import numpy as np

from capricorn_jax._src.native import Library

_SOURCE = Path(__file__).with_name("send.cc")
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def _configure(lib: ctypes.CDLL) -> None:
    lib.CapricornSendWindow.restype = _I64
    lib.CapricornSendWindow.argtypes = [
        ctypes.c_int, _P, ctypes.c_int, _I64, ctypes.POINTER(_I64), _I64, _I64, _I64,
        ctypes.c_double, _I64, _P, _P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int, _I64,
        _P, _I64, ctypes.c_int]
    lib.CapricornCrc32.restype = ctypes.c_uint32
    lib.CapricornCrc32.argtypes = [ctypes.c_uint32, _P, _I64]


_LIBRARY = Library(_SOURCE, "window_send", "the native window sender",
                   "the deadline sender's frames go from Python", _configure)
load = _LIBRARY.load
available = _LIBRARY.available


def crc32(data: np.ndarray, crc: int = 0) -> int:
    """zlib's CRC-32 of a contiguous uint8 array, continuing ``crc`` (the
    frames' checksum; tests hold it to ``zlib.crc32``)."""
    data = np.ascontiguousarray(data, np.uint8)
    return int(load().CapricornCrc32(crc, data.ctypes.data, data.size))


def _perf_minus_monotonic() -> float:
    return time.perf_counter() - time.monotonic_ns() / 1e9


def send_window(fd: int, rows: list[np.ndarray], version: int, lo: int, hi: int, per_row: int,
                closes: float, rate: float, queue_bound: int, link: tuple[float, float],
                start_edges: tuple[np.ndarray, np.ndarray, int, float] | None,
                timeout_s: float) -> tuple[int, list[tuple[float, float, int]],
                                           tuple[float, float], BaseException | None]:
    """Sends bytes [lo, hi) of every row (1-D contiguous uint8, one per local
    device) as frames of at most ``per_row`` bytes per row, while the stop
    rule allows (``send.cc``).

    Args:
      fd: the chunk channel's sending socket.
      closes: the window's planned close (perf_counter seconds).
      rate: the link's rate for all rows (bytes per second).
      queue_bound: the most bytes ahead on the link before a frame.
      link: (bytes modelled ahead on the link, when: perf_counter seconds).
      start_edges: (the mark table's stamps [sites, devices] int64, the
        collectives' start slots int64, local devices, the floor: monotonic
        ns); None: no collective stops the window.
      timeout_s: bound on each wait for the socket.

    Returns:
      (where it stopped, the frames (handed from, to: perf_counter seconds;
      bytes), the link model after them, the error that ended it or None).
    """
    lib = load()
    if not rows or any(r.dtype != np.uint8 or r.ndim != 1 or not r.flags.c_contiguous
                       for r in rows):
        raise ValueError("rows must be 1-D contiguous uint8 arrays")
    offset = _perf_minus_monotonic()
    pointers = (_P * len(rows))(*[r.ctypes.data for r in rows])
    cursor = _I64(lo)
    state = np.array([link[0], (link[1] - offset) * 1e9], np.float64)
    most = (hi - lo) // max(1, per_row) + 2
    frames_log = np.zeros((most, 3), np.int64)
    if start_edges is None:
        stamps_p = slots_p = None
        nslots = columns = local = 0
        floor = 0
    else:
        stamps, slots, local, floor_ns = start_edges
        stamps_p, slots_p = stamps.ctypes.data, slots.ctypes.data
        nslots, columns, floor = len(slots), stamps.shape[1], int(floor_ns)
    done = lib.CapricornSendWindow(
        fd, pointers, len(rows), version, ctypes.byref(cursor), hi, per_row,
        int((closes - offset) * 1e9), float(rate), queue_bound, state.ctypes.data, stamps_p,
        slots_p, nslots, columns, local, floor, frames_log.ctypes.data, most,
        max(1, int(timeout_s * 1000)))
    error: BaseException | None = None
    count = int(done)
    if done < 0:
        count = int(np.count_nonzero(frames_log[:, 2]))
        if -done == errno.ETIMEDOUT:
            error = TimeoutError(f"a frame's send waited over {timeout_s:g}s for the socket")
        else:
            error = ConnectionError(f"sending a frame failed: {os.strerror(int(-done))}")
    frames = [(t0 / 1e9 + offset, t1 / 1e9 + offset, int(n))
              for t0, t1, n in frames_log[:count]]
    return int(cursor.value), frames, (float(state[0]), state[1] / 1e9 + offset), error
