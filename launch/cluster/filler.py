"""The busy link (``--link_filler``): a lowest-band stream that keeps every shaper sending.

Why. A tbf shaper sends a frame that finds the link idle at once, on the
credit its bucket (one frame) gathered while idle, and charges the frame's
time on the wire to the frames after it. A real link sends every frame in its
time on the wire, idle or not. So on an idle emulated link each message
crosses a frame's time sooner per shaper than on a real one, while on a link
that carries anything else (the checkpoint's low class) it pays that time:
a checkpoint that only ever yields to the collectives still costs them a
frame per shaper per message, which a real link would have charged anyway.
The collectives here send in many small exchanges (gloo's exchange runs at
half the link's rate), so none's steps gain that frame on most messages
(BUILD_NOTES.md, "round 14": a plain bulk sender's floor with the traffic
class goes with the filler).

What. Each host runs one filler process in its namespace: it sends zeros to
the next host (a ring, so every host's two shapers carry its streams,
``FILLER_FLOWS`` connections) in the last band (``FILLER_TOS``: below the
checkpoint's class, or below the one FIFO of a FIFO link), its frames a
standard Ethernet frame's payload (``FILLER_MSS``: a high frame waits behind
at most one of them, 1514 bytes, against a jumbo checkpoint frame), and
receives its own predecessor's stream, acknowledging it in the same band.
Strict priority gives the stream only what the other classes leave, so every
frame of the collectives and of the checkpoint finds the link sending and
pays its own time on the wire. Its price: the filler's frames cost the hosts'
shared cores their kernel work (per frame: both TCP ends, two veths and two
shapers), measured per run by the bench as a longer step for every row.

Alternatives not taken: netem's ``rate`` (it charges every frame its time,
idle or not, but orders frames by their arrival, so no priority class can sit
under it); a constant netem delay of one frame (right for a full frame, a
frame's time too much for every acknowledgement and small message).
"""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

FILLER_TOS = 0x04
"""The filler's IP TOS byte: its own band, below ``capricorn_jax.LOW_PRIORITY_TOS``."""
FILLER_MSS = 1448
"""The filler's TCP segment: a 1500-byte frame (with TCP's timestamps, 1436 of payload)."""
FILLER_FLOWS = 4
"""Connections per filler: TCP's small queues keep one flow's frames in the
shaper to about two, so one flow leaves the band empty now and then."""
FILLER_PORT = 45999
"""Where each host's filler listens, in the host's own namespace."""
_BLOCK = bytes(1 << 20)


def _drain(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, FILLER_TOS)  # its ACKs in the band
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1 << 18)
    buf = bytearray(1 << 20)
    try:
        while conn.recv_into(buf):
            pass
    except OSError:
        pass


def _serve(listener: socket.socket) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_drain, args=(conn,), daemon=True).start()


def _send(peer: str) -> None:
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, FILLER_TOS)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, FILLER_MSS)
            sock.connect((peer, FILLER_PORT))
            while True:
                sock.sendall(_BLOCK)
        except OSError:
            time.sleep(0.1)  # the peer's filler not listening yet, or its link down
        finally:
            sock.close()


def main(argv: list[str]) -> None:
    """``python -m launch.cluster.filler ADDRESS PEER``, in a host's namespace:
    fills the link towards PEER until its stdin closes (its supervisor ended)."""
    address, peer = argv
    listener = socket.create_server((address, FILLER_PORT))
    threading.Thread(target=_serve, args=(listener,), daemon=True).start()
    for _ in range(FILLER_FLOWS):
        threading.Thread(target=_send, args=(peer,), daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()  # EOF: the supervisor closed the pipe or died


def start(prefixes: list[list[str]], addresses: list[str],
          timeout_s: float = 30.0) -> list[subprocess.Popen]:
    """One filler per host (``prefixes[i]`` runs a command in host i's
    namespace), host i sending to host i + 1 (mod the hosts); returns once
    each listens. Raises RuntimeError naming a host whose filler did not start."""
    procs: list[subprocess.Popen] = []
    try:
        for host, prefix in enumerate(prefixes):
            peer = addresses[(host + 1) % len(addresses)]
            procs.append(subprocess.Popen(
                [*prefix, sys.executable, "-m", "launch.cluster.filler", addresses[host], peer],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, cwd=Path(__file__).resolve().parents[2]))
        deadline = time.monotonic() + timeout_s
        for host, proc in enumerate(procs):
            assert proc.stdout is not None and proc.stderr is not None
            waited = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline() if waited[0] else None
            if line is None or line.strip() != "ready":
                why = ("no answer" if line is None
                       else (proc.stderr.read().strip().splitlines() or ["it exited"])[-1])
                raise RuntimeError(f"--link_filler: host {host}'s filler did not start within "
                                   f"{timeout_s:g}s ({why})")
    except BaseException:
        stop(procs)
        raise
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    """Ends the fillers: their stdin closed, then killed if one lingers."""
    for proc in procs:
        if proc.stdin is not None:
            proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


if __name__ == "__main__":
    main(sys.argv[1:])
