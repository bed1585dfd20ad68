"""The deadline sender's native window loop (capricorn_jax._src.native.send)
over real loopback sockets: its frames are the chunk channel's (the Python
receiver decodes and checks them), and it stops where the Python loop does:
a collective's start edge stamped by every local device, the planned close,
a socket that takes nothing within the bound."""

import time
import zlib

import numpy as np
import pytest

from capricorn_jax._src.native import send as native_send
from capricorn_jax._src.scheduling.chunk_channel import _HEADER
from tests.test_threaded import _pair

pytestmark = pytest.mark.skipif(not native_send.available(),
                                reason="no C++ compiler: the frames go from Python")

FAR = 1e9  # a planned close that never comes


def _rows(n, rows=2, seed=0):
    return [np.random.default_rng(seed + r).integers(0, 256, n, np.uint8) for r in range(rows)]


def test_the_checksum_is_zlibs():
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 8, 9, 63, 4096, 100_003):
        data = rng.integers(0, 256, n, np.uint8)
        assert native_send.crc32(data) == zlib.crc32(data.tobytes())
        assert native_send.crc32(data, 12345) == zlib.crc32(data.tobytes(), 12345)


def test_every_frame_arrives_whole_and_checked_by_the_python_receiver():
    a, b = _pair(10.0)
    try:
        rows = _rows(50_000)
        stop, frames, link, error = native_send.send_window(
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
    finally:
        a.close()
        b.close()


def test_it_stops_at_a_collective_every_local_device_began_and_at_the_close():
    a, b = _pair(10.0)
    try:
        rows = _rows(10_000)
        stamps = np.zeros((4, 3), np.int64)  # sites x devices (two local, one not)
        slots = np.array([2], np.int64)
        now_ns = time.monotonic_ns()
        stamps[2, 0] = now_ns  # one local device at the start edge: the window stays open
        args = (a.out.fileno(), rows, 1, 0, 10_000, 4096)
        stop, frames, _, error = native_send.send_window(
            *args, time.perf_counter() + FAR, 1e9, 1 << 20, (0.0, 0.0),
            (stamps, slots, 2, now_ns - 1), 10.0)
        assert error is None and stop == 10_000 and len(frames) == 3
        stamps[2, 1] = now_ns  # both: the collective began, nothing more goes
        stop, frames, _, error = native_send.send_window(
            *args, time.perf_counter() + FAR, 1e9, 1 << 20, (0.0, 0.0),
            (stamps, slots, 2, now_ns - 1), 10.0)
        assert (stop, frames, error) == (0, [], None)
        # Stamps before the window opened (the floor) do not count.
        stop, _, _, _ = native_send.send_window(
            *args, time.perf_counter() + FAR, 1e9, 1 << 20, (0.0, 0.0),
            (stamps, slots, 2, now_ns), 10.0)
        assert stop == 10_000
        # A frame the link cannot carry by the planned close is not sent.
        stop, frames, _, error = native_send.send_window(
            *args, time.perf_counter() + 0.001, 1e5, 1 << 20, (0.0, 0.0), None, 10.0)
        assert (stop, frames, error) == (0, [], None)
    finally:
        a.close()
        b.close()


def test_a_socket_that_takes_nothing_ends_the_window_within_the_bound():
    """The peer reads nothing: once the buffers are full a send waits at
    most the bound, then the call returns a TimeoutError with the frames
    handed over whole before it (the channel is then lost, as in Python)."""
    a, b = _pair(10.0)
    try:
        rows = _rows(64 << 20, rows=1)
        t0 = time.perf_counter()
        stop, frames, _, error = native_send.send_window(
            a.out.fileno(), rows, 1, 0, rows[0].size, 1 << 16, time.perf_counter() + FAR, 1e12,
            1 << 40, (0.0, 0.0), None, 0.3)
        assert isinstance(error, TimeoutError)
        assert 0.3 <= time.perf_counter() - t0 < 5.0
        assert 0 < stop < rows[0].size and stop == sum(n for *_, n in frames)
    finally:
        a.close()
        b.close()


def test_the_header_is_the_channels():
    assert _HEADER.size == 36  # send.cc's packed Header
