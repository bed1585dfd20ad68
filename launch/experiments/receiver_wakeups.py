"""What the chunk receiver's CPU costs with and without SO_RCVLOWAT, on a shaped link.

    python -m launch.experiments.receiver_wakeups [--mbit=118] [--frames=80] [--repeats=2]

In a network namespace of its own whose loopback is shaped like a simulated
host's link (tc tbf at ``--mbit``, a 20 KB bucket, Ethernet frames), one
thread sends ``--frames`` frames of 2 x 32 KiB (the threaded sender's 64 KiB
frame over two rows) and another reads them the way the chunk channel does
(one ``recv_into`` loop per row, on a socket with a timeout), with the
receive low-water mark set to the rest of each row (``SO_RCVLOWAT``, the
channel's way since 23ae153) or left at 1 byte (before); prints the reading
thread's CPU time (``time.thread_time``) per run. Needs root (namespaces and
tc). Found with it: a *blocking* receive (no timeout) with a raised mark
waits forever behind the shaped link, so the channel raises the mark only on
sockets with a timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

FLAGS = flags.FLAGS
ROW = 32 << 10


def _read_exact(sock: socket.socket, view: memoryview, lowat: bool) -> None:
    while view:
        if lowat:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, min(len(view), 1 << 16))
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("closed")
        view = view[n:]


def run_once(frames: int, lowat: bool) -> tuple[float, float]:
    """(seconds, reader CPU seconds) of ``frames`` frames over loopback here."""
    server = socket.create_server(("127.0.0.1", 0))
    out = socket.create_connection(server.getsockname())
    inc, _ = server.accept()
    inc.settimeout(30.0)  # as the channel's frame bodies: Python waits in poll
    rows = [bytearray(ROW), bytearray(ROW)]
    cpu = {}

    def read() -> None:
        t0 = time.thread_time()
        for _ in range(frames):
            for row in rows:
                _read_exact(inc, memoryview(row), lowat)
        cpu["s"] = time.thread_time() - t0

    reader = threading.Thread(target=read)
    reader.start()
    start = time.perf_counter()
    payload = bytes(2 * ROW)
    for _ in range(frames):
        out.sendall(payload)
    reader.join()
    took = time.perf_counter() - start
    for s in (out, inc, server):
        s.close()
    return took, cpu["s"]


def main(argv: list[str]) -> None:
    if len(argv) == 4 and argv[1] == "inside":
        took, cpu = run_once(int(argv[2]), argv[3] == "on")
        print(f"SO_RCVLOWAT {argv[3]:3s}: {int(argv[2]) * 2 * ROW / 1e6:.1f} MB in {took:.2f} s, "
              f"reader CPU {cpu * 1e3:.1f} ms", flush=True)
        return
    if os.geteuid() != 0:
        sys.exit("receiver_wakeups: needs root (a network namespace and tc)")
    ns = f"cjxrw{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "mtu", "1500", "up"], check=True)
        subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                        f"{FLAGS.mbit:g}mbit", "burst", "20000", "latency", "100ms"], check=True)
        for _ in range(FLAGS.repeats):
            for mode in ("off", "on"):
                subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m",
                                "launch.experiments.receiver_wakeups", "inside",
                                str(FLAGS.frames), mode], check=True)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


if __name__ == "__main__":
    flags.DEFINE_float("mbit", 118.0, "Shaped rate (Mbit/s).")
    flags.DEFINE_integer("frames", 80, "Frames of 2 x 32 KiB per run.")
    flags.DEFINE_integer("repeats", 2, "Runs of each mode.")
    app.run(main)
