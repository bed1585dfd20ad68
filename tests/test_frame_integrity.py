"""End-to-end checks on the chunk channel: a frame carries the CRC32 its
sender computed before it left; a byte flipped in transit (here: in the
sending socket's bytes, below the sender's checksum) fails the receiver's
check, drops that version on that host, and the channel goes on. Real TCP
connections on loopback; the fault is injected at the socket."""

import socket
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capricorn_jax._src.native import integrity
from capricorn_jax._src.scheduling.threaded import chunk_channel
from capricorn_jax._src.scheduling.threaded.chunk_channel import ChunkChannel, CorruptFrame
from capricorn_jax._src.scheduling.threaded.versions import VersionDropped
from tests.test_deadline_sender import _close, _schedule, _senders, _step
from tests.test_threaded import SECRET, _DictStore, _pair


class _Flipper:
    """A socket whose ``sendmsg`` flips one byte of the ``nth`` payload buffer
    (headers are buffers of exactly the header's size) and sends every byte."""

    def __init__(self, sock, nth):
        self.sock, self.nth, self.count = sock, nth, 0

    def sendmsg(self, buffers):
        sent = 0
        for data in buffers:
            view = memoryview(data).cast("B")
            if len(view) != chunk_channel._HEADER.size:
                self.count += 1
                if self.count == self.nth:
                    view = memoryview(bytearray(view))
                    view[len(view) // 2] ^= 0xFF
            self.sock.sendall(view)
            sent += len(view)
        return sent

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _buffers(rows, size):
    out = {}

    def get(version):
        return out.setdefault(version, np.zeros((rows, size), np.uint8))

    return out, get


def test_a_flipped_byte_fails_the_frame_and_the_next_frame_is_received():
    a, b = _pair(10.0)
    try:
        a.out = _Flipper(a.out, nth=3)  # the second frame's first row (2 rows a frame)
        rng = np.random.default_rng(0)
        frames = [rng.integers(0, 256, (2, 1000), np.uint8) for _ in range(3)]
        for i, rows in enumerate(frames):
            a.send(7, i * 1000, rows)
        got, get = _buffers(2, 3000)
        assert b.receive_into(get) == (7, 0, 1000)
        with pytest.raises(CorruptFrame, match="version 7: a frame of 2 x 1000 bytes at 1000 "
                                               "from host 0 fails its checksum") as e:
            b.receive_into(get)
        assert e.value.version == 7
        assert b.receive_into(get) == (7, 2000, 1000)  # the stream stays in step
        assert (got[7][:, 2000:] == frames[2]).all() and (got[7][:, :1000] == frames[0]).all()
    finally:
        a.close()
        b.close()


def test_a_corrupt_frame_drops_that_version_on_the_receiver_and_the_next_goes():
    mesh, senders = _senders()
    try:
        senders[0].channel.out = _Flipper(senders[0].channel.out, nth=3)
        senders[0].native_send = False  # the flipper corrupts what Python's socket sends
        with pytest.raises(VersionDropped, match="fails its checksum") as e:
            _step(mesh, senders, 1, _schedule(10.0, 10.0))
        assert e.value.version == 1 and senders[1].failure is None
        for s in senders:  # the other direction completed: drain host 0's side
            if 1 in s._versions:
                s.wait(1, 20.0)
        _step(mesh, senders, 2, _schedule(10.0, 10.0))  # bit for bit, the channel goes on
    finally:
        _close(senders)


def test_a_peer_running_another_format_is_refused_at_the_hello_naming_both(caplog):
    """An older build's hello (CJX1) is refused and logged naming both
    formats; unproven, it cannot stop the job: the setup ends at its bound,
    its error naming the refusal."""
    store = _DictStore()
    errors = {}

    def host0():
        try:
            ChunkChannel(0, 1, 1, "fmt", store, 2.0, address="127.0.0.1", secret=SECRET)
        except Exception as e:  # noqa: BLE001
            errors[0] = e

    t = threading.Thread(target=host0)
    with caplog.at_level("WARNING", logger=chunk_channel.log.name):
        t.start()
        # Host 1 of an older build: its hello says CJX1.
        address = store.blocking_key_value_get("capricorn/chunk_channel/fmt/0", 10_000)
        peer_listener = socket.create_server(("127.0.0.1", 0))
        store.key_value_set("capricorn/chunk_channel/fmt/1",
                            f"127.0.0.1:{peer_listener.getsockname()[1]}")
        old = socket.create_connection(tuple([address.rsplit(":", 1)[0],
                                              int(address.rsplit(":", 1)[1])]))
        old.sendall(b"CJX1" + bytes(12) + b"fmt")
        t.join(20)
    old.close()
    peer_listener.close()
    assert isinstance(errors.get(0), TimeoutError), errors
    named = "another format (b'CJX1'; this host speaks b'CJH1')"
    assert named in str(errors[0])
    assert any(named in r.getMessage() and "refused a connection from 127.0.0.1:" in
               r.getMessage() for r in caplog.records)


def test_a_peer_that_stalls_mid_frame_ends_the_receive_within_the_bound_naming_it():
    import time

    a, b = _pair(10.0)
    try:
        b.timeout_s = 0.5
        b.inc.settimeout(None)  # idle between frames: no bound
        rows = np.zeros((1, 1000), np.uint8)
        header = integrity.pack_header(3, 0, 1000, [rows.tobytes()])
        a.out.sendall(header + rows.tobytes()[:400])
        _, get = _buffers(1, 1000)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="host 1: host 0 stopped mid-frame for over 0.5s"):
            b.receive_into(get)
        assert time.monotonic() - t0 < 5.0
        assert b.inc.gettimeout() is None  # the idle wait is unbounded again
    finally:
        a.close()
        b.close()


@given(st.binary(min_size=1, max_size=257), st.data())
@settings(max_examples=60, deadline=None)
def test_the_in_graph_check_changes_with_any_one_changed_byte(chunk, data):
    """The in-graph exchange's check (``integrity.crc32c_chunks``): any one
    byte changed, at any position of a chunk of any length, changes it."""
    import jax.numpy as jnp

    at = data.draw(st.integers(0, len(chunk) - 1))
    delta = data.draw(st.integers(1, 255))
    changed = bytearray(chunk)
    changed[at] ^= delta
    both = jnp.frombuffer(chunk + bytes(changed), jnp.uint8)
    before, after = np.asarray(integrity.crc32c_chunks(both, len(chunk)))
    assert before != after


def test_an_idle_wait_returns_nothing_and_the_next_frame_costs_no_timeout_change():
    """The receive loop's wait between steps (``idle_ok``): no frame within
    the socket's bound gives None, not an error; a frame after it is read,
    and the socket's timeout is the channel's bound throughout."""
    import time

    a, b = _pair(10.0)
    try:
        b.inc.settimeout(0.3)
        b.timeout_s = 0.3
        _, get = _buffers(2, 1000)
        t0 = time.monotonic()
        assert b.receive_into(get, idle_ok=True) is None
        assert 0.2 < time.monotonic() - t0 < 5.0
        rows = np.arange(2000, dtype=np.uint32).astype(np.uint8).reshape(2, 1000)
        a.send(4, 0, rows)
        assert b.receive_into(get, idle_ok=True) == (4, 0, 1000)
        assert b.inc.gettimeout() == 0.3
    finally:
        a.close()
        b.close()


def test_a_gathered_send_delivers_every_byte_in_order_past_the_socket_buffer():
    """``_send_all``: a header and rows far larger than the socket's buffers go
    out in order whatever each ``sendmsg`` took."""
    import socket
    import threading

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    parts = [b"head", np.arange(300_000, dtype=np.uint32).view(np.uint8), b"", b"tail"]
    want = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    got = bytearray()

    def read():
        while len(got) < len(want):
            got.extend(b.recv(65536))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        chunk_channel._send_all(a, parts)
        reader.join(20)
        assert bytes(got) == want
    finally:
        a.close()
        b.close()
