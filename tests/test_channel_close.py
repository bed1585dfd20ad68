"""Closing a chunk channel while a send or receive is under way on it
(scheduling.threaded.held_sockets): the sockets' descriptor numbers stay theirs until
the last one left, so no later socket of the process takes a number a
native loop still holds (the stale loop would read a new channel's hello).
"""

import socket
import threading

import numpy as np
import pytest

from capricorn_jax._src.native import frames as native_frames
from capricorn_jax._src.scheduling.threaded import channel_hello
from capricorn_jax._src.scheduling.threaded.chunk_channel import ChunkChannel
from tests.test_threaded import _DictStore

SECRET = b"a secret for the close tests"


def _pair(job):
    store, out = _DictStore(), {}

    def make(h):
        out[h] = ChunkChannel(h, 1 - h, 1 - h, job, store, 10.0, "127.0.0.1", secret=SECRET)

    threads = [threading.Thread(target=make, args=(h,)) for h in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out[0], out[1]


def _next_sockets(stop_at):
    """Socket pairs opened until one takes descriptor ``stop_at`` or every
    number up to it is taken (the kernel gives the lowest free number):
    [(pair, the end on ``stop_at`` or None)]."""
    opened = []
    while True:
        x, y = socket.socketpair()
        on = x if x.fileno() == stop_at else y if y.fileno() == stop_at else None
        opened.append(((x, y), on))
        if on is not None or min(x.fileno(), y.fileno()) > stop_at:
            return opened


@pytest.mark.skipif(not native_frames.available(), reason="the native receive")
def test_a_receive_under_way_at_close_keeps_its_descriptor_from_the_next_socket():
    """A native receive waits for its version's buffer (``Versions.buffer``)
    when the channel closes, then discards the frame's body: it must not
    read it from a socket opened meanwhile (a new channel's connection)."""
    a, b = _pair("close")
    entered, go, result = threading.Event(), threading.Event(), []

    def buffers(version):
        entered.set()
        go.wait(10)
        return None  # the version was dropped: the body is read and discarded

    def receive():
        try:
            result.append(b.receive_frames(buffers, lambda v: 1 << 40))
        except BaseException as e:  # noqa: BLE001
            result.append(e)

    receiver = threading.Thread(target=receive)
    receiver.start()
    opened = []
    try:
        a.send(5, 0, np.zeros((1, 64), np.uint8))
        assert entered.wait(10)
        stale = b.inc.fileno()
        b.close()
        opened = _next_sockets(stale)
        (x, y), on = opened[-1]
        if on is y:
            x, y = y, x  # x: the end on the stale number, if one took it
        hello = channel_hello.MAGIC + bytes(100)
        y.sendall(hello)  # a new channel's hello arrives at x
        go.set()
        receiver.join(10)
        x.settimeout(1)
        got = b""
        while len(got) < len(hello):
            try:
                more = x.recv(len(hello))
            except TimeoutError:
                break
            got, more = got + more, b""
        assert got == hello  # every byte, the magic first
        assert on is None  # no socket took the number while the receive held it
        # Its own socket's bytes (queued before the close) or its close's error.
        assert result[0] == [(5, 0, 64)] or isinstance(result[0], ConnectionError)
        with pytest.raises(ConnectionError, match="host 1's chunk channel is closed"):
            b.receive_frames(buffers, lambda v: 1)
        assert b.inc.fileno() == -1  # released once the receive left
    finally:
        go.set()
        receiver.join(10)
        a.close()
        b.close()
        for pair, _ in opened:
            for s in pair:
                s.close()


def test_a_channel_closed_with_nothing_under_way_releases_its_descriptors_at_once():
    a, b = _pair("idle")
    a.close()
    b.close()
    assert a.out.fileno() == a.inc.fileno() == b.out.fileno() == b.inc.fileno() == -1
    with pytest.raises(ConnectionError, match="host 0's chunk channel is closed"):
        a.send(1, 0, np.zeros((1, 8), np.uint8))
    a.close()  # again: nothing happens
