"""``InMemoryOptions.chunk_pacing_gbps``: the chunk channel's socket paced by
the kernel (``channel_replication.pace``), on a real loopback TCP connection."""

import math
import socket
import sys
import threading
import time

import pytest

import capricorn_jax
from capricorn_jax._src.strategies.channel_replication import SO_MAX_PACING_RATE, pace


@pytest.mark.parametrize("gbps", [0.0, -1.0, math.nan, math.inf])
def test_a_pacing_rate_that_is_not_a_positive_rate_is_refused(tmp_path, gbps):
    with pytest.raises(ValueError, match="chunk_pacing_gbps must be a rate > 0"):
        capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="j", chunk_pacing_gbps=gbps)


def _pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    """A loopback connection whose segments are an Ethernet frame's (TCP
    paces a connection only after its first 10 segments; loopback's are
    64 kB otherwise)."""
    listener = socket.create_server(("127.0.0.1", 0))
    out = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    out.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1448)
    out.connect(listener.getsockname())
    inc, _ = listener.accept()
    return listener, out, inc


def test_a_paced_socket_sends_no_faster_than_its_rate():
    """0.0008 Gbit/s (100 kB/s): 300 kB take at least 2 s whatever the box's
    load (a lower bound: load only slows a send), where the same bytes
    unpaced cross loopback at once; the kernel reads the rate back."""
    listener, out, inc = _pair()
    got = bytearray()

    def drain():
        while chunk := inc.recv(1 << 16):
            got.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        pace(out, 0.0008)
        assert out.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) == 100_000
        payload = bytes(range(256)) * 1200  # 307,200 bytes
        t0 = time.perf_counter()
        out.sendall(payload)
        out.shutdown(socket.SHUT_WR)
        reader.join(timeout=60)
        assert not reader.is_alive() and bytes(got) == payload
        assert time.perf_counter() - t0 >= 2.0
    finally:
        for s in (out, inc, listener):
            s.close()


def test_a_rate_past_32_bits_is_taken_whole():
    """100 Gbit/s is 12.5e9 B/s, past a 32-bit int option: set and read back
    as the kernel's unsigned long (passed as a Python int, it raised TypeError)."""
    listener, out, inc = _pair()
    try:
        pace(out, 100.0)
        taken = out.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8)
        assert int.from_bytes(taken, sys.byteorder) == 12_500_000_000
    finally:
        for s in (out, inc, listener):
            s.close()
