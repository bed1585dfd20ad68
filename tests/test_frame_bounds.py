"""A frame header that passes its checksum and still names bytes outside its
version's buffer is refused by name and counted, on the native and the
Python receive path, with nothing written out of place; the native wrappers
refuse what would let C read or write out of place; an armed corrupt-frame
fault goes through the native sender too.

The receivers here are bare ``ChunkChannel`` receive ends over a socket
pair (``receiver``: no hello, no listener), the peer a raw socket that
writes whatever header it likes (``forged``: fields chosen, both checksums
valid, so the bounds are what is tested)."""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import numpy as np
import pytest

from capricorn_jax._src.native import frames as native_frames
from capricorn_jax._src.native import integrity
from capricorn_jax._src.scheduling.threaded.chunk_channel import (
    RUN_FRAMES,
    ChunkChannel,
    CorruptFrame,
)
from capricorn_jax._src.scheduling.threaded.held_sockets import HeldSockets

native = pytest.mark.skipif(not native_frames.available(),
                            reason="no C++ compiler: the frames go from Python")
INT64_MAX = (1 << 63) - 1
CANARY = 0xA5


def forged(version: int, offset: int, length: int, rows: int, crc: int = 0) -> bytes:
    """A header with these fields (any int64) and valid checksums over them
    (``crc``: the frame's CRC field, not checked before the bounds)."""
    fields = struct.pack("<qqqq", version, offset, length, rows)
    head = fields + struct.pack("<I", crc & 0xFFFFFFFF)
    return head + struct.pack("<I", integrity.crc32c(head))


def receiver(sock: socket.socket, timeout_s: float = 2.0) -> ChunkChannel:
    """A ``ChunkChannel``'s receive end over ``sock`` (host 1, source host 0)."""
    channel = ChunkChannel.__new__(ChunkChannel)
    channel.host, channel.source, channel.timeout_s = 1, 0, timeout_s
    sock.settimeout(timeout_s)
    channel.inc = sock
    channel._sockets = HeldSockets("a receiver", sock)
    channel._mark = np.full(1, -1, np.int64)
    channel._head = np.zeros(native_frames.HEADER_BYTES, np.uint8)
    channel._have_head = False
    channel._log = np.zeros((RUN_FRAMES, 2), np.int64)
    channel._corrupt = None
    return channel


@contextlib.contextmanager
def peer_and_receiver(timeout_s: float = 2.0) -> Iterator[tuple[socket.socket, ChunkChannel]]:
    a, b = socket.socketpair()
    try:
        yield a, receiver(b, timeout_s)
    finally:
        a.close()
        b.close()


def guarded(rows: int, cols: int, pad: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """(a [rows, cols] target, the block it lies in: ``pad`` canary bytes on
    each side of every row, so a write out of place shows)."""
    block = np.full((rows, pad + cols + pad), CANARY, np.uint8)
    return block[:, pad:pad + cols], block


def canaries_intact(block: np.ndarray, cols: int, pad: int = 4096) -> bool:
    return bool((block[:, :pad] == CANARY).all() and (block[:, pad + cols:] == CANARY).all())


def receive(channel: ChunkChannel, path: str, target: np.ndarray | None, version: int = 5,
            remaining: int = 1) -> list[tuple[int, int, int]] | None:
    buffers = lambda v: target if v == version else None  # noqa: E731
    if path == "native":
        return channel.receive_frames(buffers, lambda v: remaining)
    one = channel.receive_into(buffers)
    return None if one is None else [one]


def test_the_overflowing_frame_is_refused_by_the_native_loop_without_a_crash():
    """The issue's frame: offset = cols - 8 and a length near INT64_MAX, so
    offset + length wraps negative in int64 and passed the old check; 64 KiB
    behind it. Before, ``recv`` wrote past the row (heap corruption, abort:
    exit 134). Run in a child so a regression fails this test, not the run."""
    if not native_frames.available():
        pytest.skip("no C++ compiler")
    script = textwrap.dedent("""
        import socket, numpy as np
        from capricorn_jax._src.native import frames, integrity
        from tests.test_frame_bounds import canaries_intact, forged, guarded, receiver
        cols = 1000
        for way in ("loop", "channel"):
            a, b = socket.socketpair()
            a.sendall(forged(5, cols - 8, (1 << 63) - 1 - 4, 1) + bytes(64 << 10))
            a.shutdown(socket.SHUT_WR)
            target, block = guarded(1, cols)
            if way == "loop":  # the native loop with the buffer, reading the header itself
                head, mark, log = (np.zeros(integrity.HEADER_BYTES, np.uint8),
                                   np.full(1, -1, np.int64), np.zeros((8, 2), np.int64))
                _, got, e = frames.receive_frames(b.fileno(), 5, target, cols, head, False,
                                                  False, 1.0, 1.0, mark, log)
                assert len(got) == 0 and isinstance(e, integrity.FrameRejected), e
            else:  # the chunk channel's receive loop
                try:
                    receiver(b).receive_frames(lambda v: target, lambda v: cols)
                except integrity.FrameRejected as caught:
                    e = caught
            assert canaries_intact(block, cols) and (target == 0xA5).all()
            print(way, "refused:", e.reason, e)
        assert integrity.rejected_frames() == {"too_long": 2}
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loop refused: too_long" in done.stdout
    assert ("channel refused: too_long host 1: a frame of 1 x 9223372036854775803 bytes at 992 "
            "from host 0 does not fit") in done.stdout


@pytest.mark.parametrize("path", ["python", pytest.param("native", marks=native)])
@pytest.mark.parametrize("offset, length, rows, reason", [
    (-100, 50, 1, "negative_offset"),  # Python used to place it at [-100, -50): the row's end
    (-(1 << 62), 64, 1, "negative_offset"),
    (10, -5, 1, "negative_length"),
    (992, INT64_MAX - 4, 1, "too_long"),
    (992, 9, 1, "past_end"),
    (1000, 1, 1, "past_end"),
    (0, 10, 2, "rows"),
    (0, 10, 0, "rows"),
    (0, 10, -1, "rows"),
])
def test_a_frame_outside_its_buffer_is_refused_by_name_and_counted(path, offset, length, rows,
                                                                   reason):
    before = integrity.rejected_frames().get(reason, 0)
    with peer_and_receiver() as (peer, channel):
        peer.sendall(forged(5, offset, length, rows) + bytes(4096))
        target, block = guarded(1, 1000)
        with pytest.raises(integrity.FrameRejected, match=f"refused: {reason}") as caught:
            receive(channel, path, target)
        assert caught.value.reason == reason
        assert "from host 0" in str(caught.value)
        assert (target == CANARY).all() and canaries_intact(block, 1000)
    assert integrity.rejected_frames()[reason] == before + 1


@pytest.mark.parametrize("path", ["python", pytest.param("native", marks=native)])
def test_a_frame_to_discard_with_unbounded_rows_times_length_is_refused(path):
    """A frame of a version with no buffer is read and dropped: rows * length
    bytes. Rows or a length out of bounds (a product past int64, or negative)
    used to read nothing and lose the stream's framing in silence."""
    with peer_and_receiver() as (peer, channel):
        peer.sendall(forged(9, 0, 1 << 60, 1 << 10) + bytes(100))
        with pytest.raises(integrity.FrameRejected, match="refused: (rows|too_long)"):
            receive(channel, path, None)
    with peer_and_receiver() as (peer, channel):
        peer.sendall(forged(9, 0, 100, -3) + bytes(100))
        with pytest.raises(integrity.FrameRejected, match="refused: rows"):
            receive(channel, path, None)


@pytest.mark.parametrize("path", ["python", pytest.param("native", marks=native)])
def test_the_frames_at_the_bounds_are_placed(path):
    """The edges are inside: a frame ending at the buffer's last byte, one of
    no bytes at its end."""
    with peer_and_receiver() as (peer, channel):
        body = bytes(range(8))
        crc = integrity.frame_crc(struct.pack("<qqqq", 5, 992, 8, 1), [body])
        peer.sendall(forged(5, 992, 8, 1, crc) + body)
        target, block = guarded(1, 1000)
        assert receive(channel, path, target, remaining=8) == [(5, 992, 8)]
        assert bytes(target[0, 992:]) == body and canaries_intact(block, 1000)


@native
def test_the_native_wrappers_refuse_what_would_be_read_or_written_out_of_place():
    rows = [np.zeros(100, np.uint8)] * 2
    args = (1e9, 1e9, 1 << 20, (0.0, 0.0), None, 1.0)
    for lo, hi in ((-1, 50), (0, 101), (60, 50)):
        with pytest.raises(ValueError, match="not inside rows of 100 bytes"):
            native_frames.send_window(-1, rows, 1, lo, hi, 10, *args)
    with pytest.raises(ValueError, match="C-contiguous 1-D uint8"):
        native_frames.send_window(-1, [np.zeros(100, np.int16)], 1, 0, 10, 10, *args)
    with pytest.raises(ValueError, match="C-contiguous 1-D uint8"):
        native_frames.send_window(-1, [np.zeros(200, np.uint8)[::2]], 1, 0, 10, 10, *args)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        native_frames.send_window(-1, [np.zeros(10, np.uint8)] * 65, 1, 0, 10, 10, *args)
    stamps = np.zeros((4, 2), np.int64)
    with pytest.raises(ValueError, match="not rows of a mark table"):
        native_frames.send_window(-1, rows, 1, 0, 10, 10, 1e9, 1e9, 1 << 20, (0.0, 0.0),
                                  (stamps, np.array([4], np.int64), 2, 0), 1.0)
    with pytest.raises(ValueError, match="stamps must be a C-contiguous 2-D int64"):
        native_frames.send_window(-1, rows, 1, 0, 10, 10, 1e9, 1e9, 1 << 20, (0.0, 0.0),
                                  (stamps.astype(np.int32), np.array([0], np.int64), 2, 0), 1.0)
    head, mark, log = (np.zeros(integrity.HEADER_BYTES, np.uint8), np.zeros(1, np.int64),
                       np.zeros((4, 2), np.int64))
    bad = {"header": (np.zeros(integrity.HEADER_BYTES - 4, np.uint8), mark, log),
           "header's dtype": (np.zeros(integrity.HEADER_BYTES, np.int8), mark, log),
           "mark": (head, np.zeros(1, np.int32), log),
           "log": (head, mark, np.zeros((4, 3), np.int64)),
           "log's layout": (head, mark, np.zeros((4, 4), np.int64)[:, :2])}
    for what, (h, m, g) in bad.items():
        with pytest.raises(ValueError):
            native_frames.receive_frames(-1, 1, None, 0, h, False, False, 0.0, 1.0, m, g)
        assert what  # every case refused before C
    frozen = np.zeros((2, 10), np.uint8)
    frozen.flags.writeable = False
    for target in (frozen, np.zeros((2, 10), np.int32), np.zeros((2, 20), np.uint8)[:, ::2],
                   np.zeros((0, 10), np.uint8)):
        with pytest.raises(ValueError, match="target must be"):
            native_frames.receive_frames(-1, 1, target, 0, head, False, False, 0.0, 1.0, mark,
                                         log)


@native
def test_an_armed_corrupt_frame_goes_through_the_native_sender():
    """``flip_version`` armed, the native deadline loop (not the Python
    sender) sends the first frame with a byte flipped after its checksum:
    the receiver names it, the next frame arrives whole, the caller's rows
    are untouched and the fault is disarmed once used."""
    a, b = socket.socketpair()
    try:
        sender = ChunkChannel.__new__(ChunkChannel)
        sender.out, sender.timeout_s = a, 2.0
        sender._sockets = HeldSockets("a sender", a)
        flipped: list[int] = []
        sender.flip_version, sender.on_flip = 3, flipped.append
        rows = [np.arange(3000, dtype=np.uint8), np.arange(3000, dtype=np.uint8)[::-1].copy()]
        copies = [r.copy() for r in rows]
        stop, frames, _, error = sender.send_window(rows, 4, 0, 3000, 1000,
                                                    time.perf_counter() + 1e9, 1e9, 1 << 20,
                                                    (0.0, 0.0), None)
        assert (stop, len(frames), error) == (3000, 3, None)
        assert flipped == [4] and sender.flip_version is None
        assert all((r == c).all() for r, c in zip(rows, copies, strict=True))
        channel = receiver(b)
        sink = np.zeros((2, 3000), np.uint8)
        with pytest.raises(CorruptFrame, match="version 4: a frame of 2 x 1000 bytes at 0"):
            channel.receive_into(lambda v: sink)
        assert channel.receive_into(lambda v: sink) == (4, 1000, 1000)
        assert channel.receive_into(lambda v: sink) == (4, 2000, 1000)
        assert (sink[:, 1000:] == np.stack(rows)[:, 1000:]).all()
    finally:
        a.close()
        b.close()
