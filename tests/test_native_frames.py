"""The chunk channel's native frame loops (capricorn_jax._src.native.frames)
over real loopback sockets. The deadline sender's: its frames are the chunk
channel's (the Python receiver decodes and checks them), and it stops where
the Python loop does: a collective's start edge stamped by every local
device, the planned close, a socket that takes nothing within the bound. The
receiver's (``ChunkChannel.receive_frames``): Python's frames land bit for
bit, a run ends where its version is covered or another version begins, a
dropped version's frames are read and discarded, a corrupt frame is named
after the frames before it, a stalled frame ends within the bound."""

import contextlib
import os
import socket
import threading
import time

import numpy as np
import pytest

from capricorn_jax._src.native import frames as native_frames
from capricorn_jax._src.native import integrity
from capricorn_jax._src.scheduling.threaded.chunk_channel import _HEADER, CorruptFrame
from tests.test_threaded import _pair

pytestmark = pytest.mark.skipif(not native_frames.available(),
                                reason="no C++ compiler: the frames go from Python")

FAR = 1e9  # a planned close that never comes


@contextlib.contextmanager
def _channels(timeout_s):
    """Hosts 0 and 1's chunk channels (``_pair``), closed after the block."""
    a, b = _pair(timeout_s)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _rows(n, rows=2, seed=0):
    return [np.random.default_rng(seed + r).integers(0, 256, n, np.uint8) for r in range(rows)]


def test_the_checksum_is_integritys_crc32c_by_the_instruction_and_by_the_tables():
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 8, 9, 63, 4096, 100_003):
        data = rng.integers(0, 256, n, np.uint8)
        for tables in (False, True):
            assert native_frames.crc32c(data, tables=tables) == integrity.crc32c(data.tobytes())
            assert (native_frames.crc32c(data, 12345, tables=tables)
                    == integrity.crc32c(data.tobytes(), 12345))


def test_every_frame_arrives_whole_and_checked_by_the_python_receiver():
    with _channels(10.0) as (a, b):
        rows = _rows(50_000)
        stop, frames, link, error = native_frames.send_window(
            a.out.fileno(), rows, 7, 1000, 50_000, 4096, time.perf_counter() + FAR, 1e9, 1 << 20,
            (0.0, 0.0), None, 10.0)
        assert error is None and stop == 50_000
        assert len(frames) == -(-49_000 // 4096) and sum(n for *_, n in frames) == 2 * 49_000
        assert all(t0 <= t1 for t0, t1, _ in frames) and link[0] > 0
        sink = np.zeros((2, 50_000), np.uint8)
        got = 0
        while got < 49_000:
            version, offset, length = b.receive_into(lambda v: sink)  # CRC checked there
            assert version == 7 and offset == 1000 + got
            got += length
        assert (sink[:, 1000:] == np.stack(rows)[:, 1000:]).all()


def test_it_stops_at_a_collective_every_local_device_began_and_at_the_close():
    with _channels(10.0) as (a, b):
        rows = _rows(10_000)
        stamps = np.zeros((4, 3), np.int64)  # sites x devices (two local, one not)
        slots = np.array([2], np.int64)
        now_ns = time.monotonic_ns()
        stamps[2, 0] = now_ns  # one local device at the start edge: the window stays open
        args = (a.out.fileno(), rows, 1, 0, 10_000, 4096)
        stop, frames, _, error = native_frames.send_window(
            *args, time.perf_counter() + FAR, 1e9, 1 << 20, (0.0, 0.0),
            (stamps, slots, 2, now_ns - 1), 10.0)
        assert error is None and stop == 10_000 and len(frames) == 3
        stamps[2, 1] = now_ns  # both: the collective began, nothing more goes
        stop, frames, _, error = native_frames.send_window(
            *args, time.perf_counter() + FAR, 1e9, 1 << 20, (0.0, 0.0),
            (stamps, slots, 2, now_ns - 1), 10.0)
        assert (stop, frames, error) == (0, [], None)
        # Stamps before the window opened (the floor) do not count.
        stop, _, _, _ = native_frames.send_window(
            *args, time.perf_counter() + FAR, 1e9, 1 << 20, (0.0, 0.0),
            (stamps, slots, 2, now_ns), 10.0)
        assert stop == 10_000
        # A frame the link cannot carry by the planned close is not sent.
        stop, frames, _, error = native_frames.send_window(
            *args, time.perf_counter() + 0.001, 1e5, 1 << 20, (0.0, 0.0), None, 10.0)
        assert (stop, frames, error) == (0, [], None)


def test_a_socket_that_takes_nothing_ends_the_window_within_the_bound():
    """The peer reads nothing: once the buffers are full a send waits at
    most the bound, then the call returns a TimeoutError with the frames
    handed over whole before it (the channel is then lost, as in Python)."""
    with _channels(10.0) as (a, b):
        rows = _rows(64 << 20, rows=1)
        t0 = time.perf_counter()
        stop, frames, _, error = native_frames.send_window(
            a.out.fileno(), rows, 1, 0, rows[0].size, 1 << 16, time.perf_counter() + FAR, 1e12,
            1 << 40, (0.0, 0.0), None, 0.3)
        assert isinstance(error, TimeoutError)
        assert 0.3 <= time.perf_counter() - t0 < 5.0
        assert 0 < stop < rows[0].size and stop == sum(n for *_, n in frames)


def test_the_header_is_the_channels():
    assert _HEADER is integrity.HEADER and native_frames.HEADER_BYTES == _HEADER.size == 40
    assert "struct Header" in integrity.native_prelude()  # frames.cc's, generated


def _receive_all(channel, buffers, remaining, until):
    """(version, offset, length) of every frame until ``until(frames)``."""
    got = []
    while not until(got):
        run = channel.receive_frames(buffers, remaining, idle_ok=True)
        assert run is not None, got  # no idle wait: the frames are on their way
        got += run
    return got


def test_the_native_receiver_lands_pythons_frames_in_runs_per_version():
    with _channels(10.0) as (a, b):
        data = {v: np.random.default_rng(v).integers(0, 256, (2, 30_000), np.uint8)
                for v in (3, 4)}
        for v in (3, 4):  # Python frames, 5000 bytes per row each, version 3 then 4
            for lo in range(0, 30_000, 5000):
                a.send(v, lo, [row[lo:lo + 5000] for row in data[v]])
        sinks = {v: np.zeros((2, 30_000), np.uint8) for v in (3, 4)}
        calls = []

        def remaining(v):
            calls.append(v)
            return 30_000 - sum(n for w, _, n in got if w == v)

        got: list = []
        got += _receive_all(b, sinks.get, remaining, lambda g: len(g) >= 12)
        assert got == [(v, lo, 5000) for v in (3, 4) for lo in range(0, 30_000, 5000)]
        for v in (3, 4):
            assert (sinks[v] == data[v]).all()
        # Runs: at most one call per version's first frame and one more per
        # run that its remaining bytes or the next version ended.
        assert calls.count(3) <= 2 and calls.count(4) <= 2, calls
        # A run returns as soon as its version is covered: nothing else was sent.
        a.send(5, 0, [np.ones(10, np.uint8)] * 2)
        sink5 = np.zeros((2, 10), np.uint8)
        t0 = time.perf_counter()
        assert b.receive_frames(lambda v: sink5, lambda v: 10) == [(5, 0, 10)]
        assert time.perf_counter() - t0 < 5.0 and (sink5 == 1).all()  # not the 10 s idle wait


def test_the_native_receiver_discards_a_dropped_versions_frames_and_idles():
    with _channels(10.0) as (a, b):
        a.send(1, 0, [np.full(40_000, 9, np.uint8)] * 2)  # version 1: dropped here
        a.send(2, 0, [np.full(100, 2, np.uint8)] * 2)
        sink = np.zeros((2, 100), np.uint8)
        buffers = {1: None, 2: sink}.get
        got = _receive_all(b, buffers, lambda v: 100, lambda g: len(g) >= 2)
        assert got == [(1, 0, 40_000), (2, 0, 100)] and (sink == 2).all()
        b.inc.settimeout(0.2)  # the loop's idle wait: nothing more, no error
        assert b.receive_frames(buffers, lambda v: 100, idle_ok=True) is None
        with pytest.raises(TimeoutError, match="no frame from host 0"):
            b.receive_frames(buffers, lambda v: 100)


def test_the_native_receiver_names_a_corrupt_frame_after_the_frames_before_it():
    with _channels(10.0) as (a, b):
        rows = [np.arange(3000, dtype=np.uint8)] * 2
        a.send(7, 0, [r[:1000] for r in rows])
        a.flip_version = 7  # the next frame's byte flips after its checksum
        a.send(7, 1000, [r[1000:2000] for r in rows])
        a.send(7, 2000, [r[2000:] for r in rows])
        sink = np.zeros((2, 3000), np.uint8)
        time.sleep(0.2)  # all three queued: one run meets the corrupt frame
        first = b.receive_frames(lambda v: sink, lambda v: 3000)
        assert first[0] == (7, 0, 1000)
        got = list(first)
        with pytest.raises(CorruptFrame, match="version 7: a frame of 2 x 1000 bytes at 1000 "
                                                   "from host 0 fails its checksum"):
            while True:
                got += b.receive_frames(lambda v: sink, lambda v: 3000)
        assert got == [(7, 0, 1000)]
        # Read whole: the stream stays in step.
        assert b.receive_frames(lambda v: sink, lambda v: 1000) == [(7, 2000, 1000)]
        assert (sink[:, 2000:] == rows[0][2000:]).all()


def test_the_native_receiver_ends_a_stalled_frame_within_the_bound_and_a_closed_peer():
    with _channels(1.0) as (a, b):
        header = integrity.pack_header(4, 0, 1000, [bytes(1000)] * 2)
        a.out.sendall(header + bytes(500))  # a frame that stops mid-row
        sink = np.zeros((2, 1000), np.uint8)
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError, match="host 1: host 0 stopped mid-frame for over 1s"):
            b.receive_frames(lambda v: sink, lambda v: 1000, idle_ok=True)
        assert time.perf_counter() - t0 < 5.0
    with _channels(5.0) as (a, b):
        waiting = threading.Timer(0.3, a.close)
        waiting.start()
        with pytest.raises(ConnectionError, match="peer closed"):
            b.receive_frames(lambda v: None, lambda v: 1, idle_ok=True)
        waiting.join()


def test_the_native_receiver_refuses_a_frame_that_does_not_fit():
    with _channels(10.0) as (a, b):
        a.send(7, 900, [np.zeros(200, np.uint8)] * 2)
        with pytest.raises(ValueError, match="a frame of 2 x 200 bytes at 900 from host 0 does "
                                             "not fit version 7's"):
            b.receive_frames(lambda v: np.zeros((2, 1000), np.uint8), lambda v: 200)


def _switches():
    """The calling thread's voluntary context switches (each sleep is one)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        line = next(x for x in f if x.startswith("voluntary_ctxt_switches"))
    return int(line.split()[1])


def test_a_frame_waiting_for_the_link_sleeps_on_the_marks_until_one_comes():
    """A frame held back by the queue bound waits on the mark table's
    eventfd: one sleep until the collective's start edge is stamped, where
    without it the loop looks at the marks every millisecond (~200 sleeps
    here). Both stop at the mark with the one frame the link took. (A unix
    socket pair, whose unread bytes are its queue: loopback TCP acknowledges
    at once and would let every frame go.)"""
    rows = _rows(200_000)
    counts = {}
    for wake in (True, False):
        a, b = socket.socketpair()
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        a.setblocking(False)
        stamps = np.zeros((3, 2), np.int64)
        slots = np.array([1], np.int64)
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        floor = time.monotonic_ns()

        def mark(stamps=stamps, efd=efd):
            time.sleep(0.2)
            stamps[1, :] = time.monotonic_ns()
            os.eventfd_write(efd, 1)

        marker = threading.Thread(target=mark)
        try:
            marker.start()
            before = _switches()
            # 100 KB frames on a 100 KB/s link, nothing ahead allowed: the
            # second frame would wait a second for the first to drain.
            stop, frames, _, error = native_frames.send_window(
                a.fileno(), rows, 1, 0, 200_000, 50_000, time.perf_counter() + FAR, 1e5, 0,
                (0.0, 0.0), (stamps, slots, 2, floor), 10.0, wake_fd=efd if wake else -1)
            counts[wake] = _switches() - before
            assert (stop, len(frames), error) == (50_000, 1, None)
        finally:
            marker.join()
            os.close(efd)
            a.close()
            b.close()
    assert counts[True] <= 5 < 50 <= counts[False], counts


def test_the_wait_for_a_mark_ends_at_the_stamps_at_a_new_step_and_at_its_deadline():
    row = np.zeros(3, np.int64)
    epoch = np.array([4], np.int64)
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        floor = time.monotonic_ns()

        def later(action):
            def run():
                time.sleep(0.1)
                action()
                os.eventfd_write(efd, 1)
            t = threading.Thread(target=run)
            t.start()
            return t

        row[0] = floor + 1  # one of two local devices: not yet open
        t = later(lambda: row.__setitem__(2, time.monotonic_ns()))
        before = _switches()
        opened = native_frames.wait_stamped(efd, row, 2, floor, epoch, 4,
                                            time.monotonic_ns() + 10 * 10**9)
        assert _switches() - before <= 3  # one sleep, woken by the mark
        t.join()
        assert opened == row[2] > row[0]  # the last local stamp
        # Stamps at or under the floor are an earlier step's: the deadline ends it.
        deadline = time.monotonic_ns() + 5 * 10**7
        assert native_frames.wait_stamped(efd, row, 2, row.max(), epoch, 4, deadline) is None
        assert time.monotonic_ns() >= deadline
        t = later(lambda: epoch.__setitem__(0, 5))
        assert native_frames.wait_stamped(efd, row, 3, floor, epoch, 4,
                                          time.monotonic_ns() + 10 * 10**9) is None
        t.join()
        # Open, but the step moved on: none of its own.
        assert native_frames.wait_stamped(efd, row, 2, floor, epoch, 4, 0) is None
        assert native_frames.wait_stamped(efd, row, 2, floor, epoch, 5, 0) == row[2]
        with pytest.raises(ValueError, match="epoch cell"):
            native_frames.wait_stamped(efd, row, 2, floor, epoch.astype(np.int32), 5, 0)
        with pytest.raises(ValueError, match="local >= 1"):
            native_frames.wait_stamped(efd, row, 0, floor, epoch, 5, 0)
    finally:
        os.close(efd)


def test_rows_checked_once_send_what_the_rows_send_and_refuse_what_they_refuse():
    rows = _rows(30_000)
    prepared = native_frames.SendRows(rows)
    stamps, slots = np.zeros((4, 2), np.int64), np.array([1, 3], np.int64)
    sent = []
    for given in (rows, prepared, prepared):  # the second call skips the table's check
        a, b = socket.socketpair()
        try:
            stop, frames, link, error = native_frames.send_window(
                a.fileno(), given, 3, 100, 30_000, 7000, time.perf_counter() + FAR, 1e12,
                1 << 30, (0.0, 0.0), (stamps, slots, 2, 0), 10.0)
            got = b.recv(1 << 20, socket.MSG_DONTWAIT)
            while len(got) < 2 * 29_900 + 5 * integrity.HEADER_BYTES:
                got += b.recv(1 << 20)
            sent.append((stop, [n for *_, n in frames], error, got))
        finally:
            a.close()
            b.close()
    assert sent[0] == sent[1] == sent[2] and sent[0][0] == 30_000 and sent[0][1][0] == 14_000
    with pytest.raises(ValueError, match="inside rows of 30000"):
        native_frames.send_window(-1, prepared, 1, 0, 30_001, 10, FAR, 1e9, 1, (0.0, 0.0), None,
                                  1.0)
    with pytest.raises(ValueError, match="not rows of a mark table"):
        native_frames.send_window(-1, prepared, 1, 0, 10, 10, FAR, 1e9, 1, (0.0, 0.0),
                                  (stamps, np.array([4], np.int64), 2, 0), 1.0)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        native_frames.SendRows([])
    with pytest.raises(ValueError, match="uint8"):
        native_frames.SendRows([np.zeros(8, np.int16)])


def test_a_wake_descriptor_that_is_not_open_is_refused_naming_it_not_spun_on():
    """A wake descriptor that is not open would make every poll return at
    once (a spin for the whole wait): both waits refuse it, naming it."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    a.setblocking(False)
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    os.close(efd)  # its number is not open now (nothing opens one before the calls)
    try:
        stamps, slots = np.zeros((3, 2), np.int64), np.array([1], np.int64)
        stop, frames, _, error = native_frames.send_window(
            a.fileno(), _rows(200_000), 1, 0, 200_000, 50_000, time.perf_counter() + FAR, 1e5,
            0, (0.0, 0.0), (stamps, slots, 2, time.monotonic_ns()), 10.0, wake_fd=efd)
        assert (stop, len(frames)) == (50_000, 1)  # the frame before the wait went
        assert isinstance(error, ConnectionError) and f"descriptor {efd} is not open" in str(error)
        with pytest.raises(OSError, match=f"descriptor {efd}: Bad file descriptor"):
            native_frames.wait_stamped(efd, np.zeros(2, np.int64), 1, 0, np.zeros(1, np.int64),
                                       0, time.monotonic_ns() + 10**9)
        with pytest.raises(ValueError, match="wake_fd=-2"):
            native_frames.send_window(a.fileno(), _rows(10), 1, 0, 10, 10, FAR, 1e9, 1,
                                      (0.0, 0.0), None, 1.0, wake_fd=-2)
    finally:
        a.close()
        b.close()
