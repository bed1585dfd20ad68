"""The chunk channel's frames in native code (``frames.cc``), off the GIL.

``send_window`` hands a window's byte range to the chunk channel's socket in
frames of the channel's format, with ``ThreadedSender._send_until``'s stop
rule (the next collective began, the planned close, the bound on bytes ahead
on the link), in one ctypes call that releases the GIL. Why: the rule wants
small frames (a window that closes early meets at most one frame and the
bound), and each frame cost ~0.14 ms of the sender thread's Python (24 KiB
frames: +24 ms of CPU per step over two hosts against 64 KiB ones, on the
cores the step's collectives use).

``receive_frames`` is the receiving end's: a run of one version's frames
read straight into its buffer and checked, one call per run rather
than Python per frame (the receiver of 24 KiB frames cost 24-32 ms of CPU per
step over two hosts against inmem's 9 with large frames).

Design choice: the frame loops and the sender's stop rule in C; the choice of
ranges, the carrying, the versions' buffers and the records in Python (the
frame logs come back). The same decisions as the Python loops, which stay
for platforms without a compiler and for the channel's fault injection (a
flipped byte, a stall).

The frame header and its checksum (CRC32C) are ``native.integrity``'s: the
source compiled is its ``native_prelude`` (the header's C layout generated
from ``HEADER_FIELDS``, and the CRC32C) followed by ``frames.cc``, written to
the build cache under a name of its digest (``native.build`` names the
library by the source's bytes, so a change to either half rebuilds it).
Alternative not taken: a C++ header shared by file, which the build's hash
(of ``frames.cc`` alone) would not see change.

``available()`` builds it once per process (``native.build``); any
failure to build or load it makes it False (said once in the log), or an
error with ``CAPRICORN_REQUIRE_NATIVE=1``. ``CAPRICORN_FRAMES_LIBRARY``
names a library to load instead (the sanitizer build of the tests).

What goes over to C is checked here first: arrays by dtype, contiguity,
writability and size, ranges against the rows they index, so the C side
trusts only what this module vouched for (and re-checks what a peer sends:
``frame_rejection``). Alternative not taken: the checks in C alone, which
cannot see a numpy array's dtype or extent behind its pointer.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from capricorn_jax._src.native import PERF_MINUS_MONOTONIC, Library, cache_dir
from capricorn_jax._src.native.integrity import (
    HEADER_BYTES,
    REJECTIONS,
    CorruptHeader,
    FrameRejected,
    count_rejection,
    native_prelude,
)

_LOOPS = Path(__file__).with_name("frames.cc")
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def _configure(lib: ctypes.CDLL) -> None:
    lib.CapricornSendWindow.restype = _I64
    lib.CapricornSendWindow.argtypes = [
        ctypes.c_int, _P, ctypes.c_int, _I64, ctypes.POINTER(_I64), _I64, _I64, _I64,
        ctypes.c_double, _I64, _P, _P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int, _I64,
        ctypes.c_int, _P, _I64, ctypes.c_int, ctypes.c_int]
    lib.CapricornWaitStamped.restype = ctypes.c_int
    lib.CapricornWaitStamped.argtypes = [ctypes.c_int, _P, ctypes.c_int, ctypes.c_int, _I64, _P,
                                         _I64, _I64, ctypes.POINTER(_I64)]
    lib.CapricornStopRule.restype = ctypes.c_int
    lib.CapricornStopRule.argtypes = [
        ctypes.c_int, _I64, ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_double,
        ctypes.c_double, _I64, ctypes.c_double, ctypes.POINTER(ctypes.c_double)]
    lib.CapricornReceiveFrames.restype = _I64
    lib.CapricornReceiveFrames.argtypes = [
        ctypes.c_int, _I64, _P, ctypes.c_int, _I64, _I64, _I64, _P, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, _P, _P, _I64, _P]
    lib.CapricornCrc32c.restype = ctypes.c_uint32
    lib.CapricornCrc32c.argtypes = [ctypes.c_uint32, _P, _I64]
    lib.CapricornCrc32cTables.restype = ctypes.c_uint32
    lib.CapricornCrc32cTables.argtypes = [ctypes.c_uint32, _P, _I64]


def _source() -> Path:
    """The source compiled: the integrity prelude, then the frame loops
    (written once per content, atomically, into the build cache)."""
    text = native_prelude() + _LOOPS.read_text()
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = cache_dir() / f"chunk_frames_source_{digest}.cc"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".cc", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return path


@functools.cache
def _library() -> Library:
    return Library(_source, "chunk_frames", "the chunk channel's native frame loops",
                   "the chunk channel's frames go through Python", _configure,
                   override_env="CAPRICORN_FRAMES_LIBRARY")


def load() -> ctypes.CDLL:
    """The built library (``Library.load``)."""
    return _library().load()


def available() -> bool:
    """Whether the native frame loops could be built (``Library.available``)."""
    return _library().available()


def crc32c(data: np.ndarray, crc: int = 0, tables: bool = False) -> int:
    """The native CRC32C of a contiguous uint8 array, continuing ``crc``
    (tests hold it to ``native.integrity.crc32c``); ``tables``: by the
    slicing-by-8 tables even where the CPU has the instruction."""
    data = np.ascontiguousarray(data, np.uint8).reshape(-1)
    fn = load().CapricornCrc32cTables if tables else load().CapricornCrc32c
    return int(fn(crc, data.ctypes.data, data.size))


def _check_array(name: str, a: np.ndarray, dtype: type, ndim: int,
                 writeable: bool = False) -> None:
    """Raises ValueError unless ``a`` is a C-contiguous ``ndim``-D ``dtype``
    array (writeable if asked): what a raw pointer to it may assume."""
    if (not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != ndim
            or not a.flags.c_contiguous or (writeable and not a.flags.writeable)):
        raise ValueError(f"{name} must be a C-contiguous {ndim}-D {np.dtype(dtype).name} array"
                         f"{' (writeable)' if writeable else ''}, got "
                         f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")


class SendRows:
    """Rows checked once for ``send_window`` (1 to 64 1-D contiguous uint8
    arrays, one per local device) and their pointers, for the many windows
    of a part: a window's call then checks only its range. The arrays are
    kept referenced (the pointers stay valid while this lives).

    Raises:
      ValueError: rows the native loop would read out of place.
    """

    def __init__(self, rows: Sequence[np.ndarray]) -> None:
        if not 1 <= len(rows) <= 64:
            raise ValueError(f"send_window takes 1 to 64 rows, got {len(rows)}")
        for r in rows:
            _check_array("a row", r, np.uint8, 1)
        self.rows = list(rows)
        self.size = min(r.size for r in rows)
        self.pointers = (_P * len(rows))(*[r.ctypes.data for r in rows])
        self._edges: tuple[np.ndarray, np.ndarray] | None = None  # the last mark table checked

    def check_edges(self, stamps: np.ndarray, slots: np.ndarray) -> None:
        """Raises ValueError unless ``slots`` are rows of the mark table
        ``stamps`` (int64 [sites, devices >= 1]); the pair last checked is
        not checked again (the marks keep one table, and replace, never
        rewrite, their slots array)."""
        if self._edges is not None and self._edges[0] is stamps and self._edges[1] is slots:
            return
        _check_array("the mark table's stamps", stamps, np.int64, 2)
        _check_array("the start slots", slots, np.int64, 1)
        if stamps.shape[1] < 1 or not np.all((slots >= 0) & (slots < stamps.shape[0])):
            raise ValueError(f"start slots {slots.tolist()} are not rows of a mark table of "
                             f"{stamps.shape}")
        self._edges = (stamps, slots)


def send_window(fd: int, rows: Sequence[np.ndarray] | SendRows, version: int, lo: int, hi: int,
                per_row: int,
                closes: float, rate: float, queue_bound: int, link: tuple[float, float],
                start_edges: tuple[np.ndarray, np.ndarray, int, float] | None,
                timeout_s: float, flip: bool = False, wake_fd: int = -1
                ) -> tuple[int, list[tuple[float, float, int]], tuple[float, float],
                           BaseException | None]:
    """Sends bytes [lo, hi) of every row (1-D contiguous uint8, one per local
    device; or a ``SendRows`` of them, checked once for many calls) as
    frames of at most ``per_row`` bytes per row, while the stop rule allows
    (``frames.cc``).

    Args:
      fd: the chunk channel's sending socket.
      closes: the window's planned close (perf_counter seconds).
      rate: the link's rate for all rows (bytes per second, > 0).
      queue_bound: the most bytes ahead on the link before a frame.
      link: (bytes modelled ahead on the link, when: perf_counter seconds).
      start_edges: (the mark table's stamps [sites, devices] int64, the
        collectives' start slots int64 (sites), local devices, the floor:
        monotonic ns); None: no collective stops the window.
      timeout_s: bound on each wait for the socket.
      flip: fault injection: the first frame leaves with a byte of its row 0
        flipped after its checksum (``ChunkChannel.flip_version``).
      wake_fd: the mark table's eventfd: a frame waiting for the link to
        drain sleeps on it (a mark wakes it at once) rather than looking at
        the marks every millisecond; -1: none (one not open ends the call
        with a ConnectionError naming it).

    Returns:
      (where it stopped, the frames (handed from, to: perf_counter seconds;
      bytes), the link model after them, the error that ended it or None).

    Raises:
      ValueError: an argument the native loop would read out of place: rows
        that are not 1-D contiguous uint8 (1 to 64 of them), ``lo < 0``, ``hi``
        past a row, a bad mark table or a slot outside it, ``wake_fd`` < -1.
    """
    lib = load()
    prepared = rows if isinstance(rows, SendRows) else SendRows(rows)
    if not 0 <= lo <= hi <= prepared.size:
        raise ValueError(f"bytes [{lo}, {hi}) are not inside rows of {prepared.size} bytes")
    if per_row < 1 or not rate > 0:
        raise ValueError(f"per_row={per_row} and rate={rate} must be positive")
    if wake_fd < -1:
        raise ValueError(f"wake_fd={wake_fd}: a descriptor, or -1 for none")
    offset = PERF_MINUS_MONOTONIC
    cursor = _I64(lo)
    state = (ctypes.c_double * 2)(link[0], (link[1] - offset) * 1e9)
    most = (hi - lo) // per_row + 2
    frames_log = np.zeros((most, 3), np.int64)
    if start_edges is None:
        stamps_p = slots_p = None
        nslots = columns = local = 0
        floor = 0
    else:
        stamps, slots, local, floor_ns = start_edges
        prepared.check_edges(stamps, slots)
        stamps_p, slots_p = stamps.ctypes.data, slots.ctypes.data
        nslots, columns, floor = len(slots), stamps.shape[1], int(floor_ns)
    done = lib.CapricornSendWindow(
        fd, prepared.pointers, len(prepared.rows), version, ctypes.byref(cursor), hi, per_row,
        int((closes - offset) * 1e9), float(rate), queue_bound, state, stamps_p,
        slots_p, nslots, columns, local, floor, int(wake_fd), frames_log.ctypes.data, most,
        max(1, int(timeout_s * 1000)), int(flip))
    error: BaseException | None = None
    count = int(done)
    if done < 0:
        count = int(np.count_nonzero(frames_log[:, 2]))
        if -done == errno.ETIMEDOUT:
            error = TimeoutError(f"a frame's send waited over {timeout_s:g}s for the socket")
        elif -done == errno.EBADF and wake_fd >= 0 and not _is_open(wake_fd):
            error = ConnectionError(f"the marks' wake descriptor {wake_fd} is not open")
        else:
            error = ConnectionError(f"sending a frame failed: {os.strerror(int(-done))}")
    frames = [(t0 / 1e9 + offset, t1 / 1e9 + offset, n)
              for t0, t1, n in frames_log[:count].tolist()]
    return int(cursor.value), frames, (state[0], state[1] / 1e9 + offset), error


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def wait_stamped(wake_fd: int, row: np.ndarray, local: int, floor_ns: int,
                 epoch_cell: np.ndarray, epoch: int, deadline_ns: int) -> int | None:
    """Waits, the GIL released, until ``local`` entries of ``row`` (a mark
    table's stamps of one site, int64 ns) are above ``floor_ns``: returns the
    last of them (monotonic ns). None: the step moved on first
    (``epoch_cell[0]`` is no longer ``epoch``) or the monotonic clock reached
    ``deadline_ns``. Wakes on ``wake_fd`` (the table's eventfd, which every
    mark writes), nothing else.

    Raises:
      ValueError: ``row`` or ``epoch_cell`` not a C-contiguous int64 vector,
        or ``local`` < 1 or ``wake_fd`` < 0.
      OSError: ``wake_fd`` is not open (EBADF).
    """
    _check_array("the site's stamps", row, np.int64, 1)
    _check_array("the epoch cell", epoch_cell, np.int64, 1)
    if row.size < 1 or epoch_cell.size < 1 or local < 1 or wake_fd < 0:
        raise ValueError(f"wait_stamped needs stamps, an epoch cell, local >= 1 and an "
                         f"eventfd (got {row.size} stamps, local={local}, fd {wake_fd})")
    opened = _I64(0)
    got = load().CapricornWaitStamped(wake_fd, row.ctypes.data, row.size, local, floor_ns,
                                      epoch_cell.ctypes.data, epoch, deadline_ns,
                                      ctypes.byref(opened))
    if got < 0:
        raise OSError(-got, f"waiting for a mark on descriptor {wake_fd}: {os.strerror(-got)}")
    return opened.value if got == 1 else None


# The stop rule's decisions (frames.cc's Decision; ``scheduling.threaded.stop_rule``'s).
SEND, STARTED, CLOSE, WAIT = range(4)


def stop_rule(started: bool, now_ns: int, link: tuple[float, float], kernel: int | None,
              nbytes: int, rate: float, close_ns: int, queue_bound: int) -> tuple[int, float]:
    """The native loop's decision before a frame, alone (for tests held to
    ``scheduling.threaded.stop_rule.decide``): (SEND, STARTED, CLOSE or WAIT, the
    bytes modelled ahead on the link). ``link``: (bytes, when: ns)."""
    ahead = ctypes.c_double(0.0)
    decision = load().CapricornStopRule(int(started), now_ns, link[0], link[1],
                                        -1.0 if kernel is None else float(kernel),
                                        float(nbytes), float(rate), close_ns, float(queue_bound),
                                        ctypes.byref(ahead))
    return int(decision), float(ahead.value)


# How a ``receive_frames`` call ended (frames.cc's Status).
COVERED, HEADER, IDLE, CORRUPT, DISCARDED, FULL = range(6)
__all__ = ["HEADER_BYTES", "SendRows", "available", "crc32c", "load", "receive_frames",
           "send_window", "stop_rule", "wait_stamped"]


def receive_frames(fd: int, version: int, target: np.ndarray | None, remaining: int,
                   header: np.ndarray, have_header: bool, discard: bool, idle_s: float,
                   timeout_s: float, mark: np.ndarray, log: np.ndarray
                   ) -> tuple[int, np.ndarray, BaseException | None]:
    """Receives frames of ``version`` into ``target`` ([rows, bytes] uint8,
    rows contiguous) until they cover ``remaining`` bytes of a row, a header
    of another version came, or no frame within ``idle_s`` (``frames.cc``).

    Args:
      fd: the chunk channel's receiving socket.
      target: the version's buffer; None: end at the first header.
      header: ``HEADER_BYTES`` uint8: a header already read (``have_header``), and on
        return the header the call ended on.
      discard: read and drop the frame of ``header``.
      timeout_s: bound on each wait once a frame began.
      mark: [1] int64, SO_RCVLOWAT last set on ``fd`` (the channel's record).
      log: [n, 2] int64 scratch for the frames' (offset, length).

    Returns:
      (how it ended: COVERED, HEADER, IDLE, CORRUPT, DISCARDED or FULL; the
      frames read and checked: [k, 2] (offset, length per row), a copy; the
      error that ended it or None: TimeoutError for a frame stalled past the
      bound, ConnectionError for a closed peer, ``CorruptHeader`` for a header
      that fails its own checksum, ``FrameRejected`` for a frame refused by
      ``integrity.frame_rejection`` (nothing of it written; counted)).

    Raises:
      ValueError: an array the native loop would read or write out of place
        (``header``, ``mark``, ``log`` or ``target`` of the wrong dtype,
        shape, layout or size, or not writeable).
    """
    lib = load()
    _check_array("header", header, np.uint8, 1, writeable=True)
    _check_array("mark", mark, np.int64, 1, writeable=True)
    _check_array("log", log, np.int64, 2, writeable=True)
    if header.size != HEADER_BYTES or mark.size < 1 or log.shape[0] < 1 or log.shape[1] != 2:
        raise ValueError(f"header of {header.size} bytes (not {HEADER_BYTES}), mark of "
                         f"{mark.size}, or log of {log.shape} (not [n >= 1, 2])")
    if target is not None and (not isinstance(target, np.ndarray) or target.dtype != np.uint8
                               or target.ndim != 2 or target.shape[0] < 1
                               or target.strides[1] != 1 or not target.flags.writeable
                               or (target.shape[0] > 1
                                   and target.strides[0] < target.shape[1])):
        raise ValueError("target must be a writeable [rows >= 1, bytes] uint8 array with "
                         "contiguous rows that do not overlap")
    status = np.zeros(2, np.int64)
    rows, stride, cols = ((0, 0, 0) if target is None
                          else (target.shape[0], target.strides[0], target.shape[1]))
    done = lib.CapricornReceiveFrames(
        fd, version, None if target is None else target.ctypes.data, rows, stride, cols,
        remaining, header.ctypes.data, int(have_header), int(discard),
        max(0, int(idle_s * 1000)), max(1, int(timeout_s * 1000)), mark.ctypes.data,
        log.ctypes.data, log.shape[0], status.ctypes.data)
    if done >= 0:
        return int(status[0]), log[:done].copy(), None
    code = int(-done)
    if code == errno.ETIMEDOUT:
        error: BaseException = TimeoutError(f"a frame stalled for over {timeout_s:g}s")
    elif code == errno.EPIPE:
        error = ConnectionError("the peer closed the connection")
    elif code == errno.EPROTO:
        count_rejection("header_checksum")
        error = CorruptHeader("a frame header fails its checksum")
    elif code == errno.EBADMSG:
        reason = REJECTIONS[int(status[1]) - 1] if 1 <= status[1] <= len(REJECTIONS) else "?"
        count_rejection(reason)
        error = FrameRejected(reason, "a frame does not fit its version's buffer")
    else:
        error = ConnectionError(f"receiving a frame failed: {os.strerror(code)}")
    return -1, np.zeros((0, 2), np.int64), error
