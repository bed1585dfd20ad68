"""Why a shaped link's exchange rate is half its one-way rate (issue 38's last question).

    python -m launch.experiments.link_exchange --gbps=0.12 --mib=8 --repeats=3 \
        --json=results/emulated/link_exchange.json

Two network namespaces joined by one veth pair, each end shaped on egress the
way ``launch.cluster.netns`` shapes a host (``tbf`` at ``--gbps``, the bench's
20 KB bucket, 100 ms queue). Plain TCP between them, ``--mib`` MiB per
direction, in three patterns:

- ``one_way``: A sends, B receives (the link probe's one-way figure);
- ``two_sockets``: A sends to B and B to A at once, on two connections;
- ``one_socket``: both send and receive at once on one connection, as a gloo
  pair does (gloo keeps one TCP connection per pair of ranks).

and under four queue disciplines:

- ``tbf``: the project's shaped link;
- ``tbf_10ms``: the same with a 10 ms queue (less standing queue ahead of an ACK);
- ``htb``: an htb class at the same rate (a control for ``htb_ack``);
- ``htb_ack``: the same htb with pure ACKs (IP packets under 128 bytes) in a
  higher-priority class, so an ACK never waits behind the other direction's data.

Each figure is a direction's goodput (bytes over the receiver's time from first
to last byte), the median over ``--repeats``. If the ACK hypothesis holds, the
two-way patterns fall to about half the one-way rate under ``tbf`` and recover
under ``htb_ack`` but not under ``htb``.

The namespaces are named ``cjxlx<pid>a|b`` (the cluster's stale-namespace
sweep does not match them) and removed on exit.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS
PATTERNS = ("one_way", "two_sockets", "one_socket")
QDISCS = ("tbf", "tbf_10ms", "htb", "htb_ack")
PORT = 47310
ADDRESS = {"a": "10.94.0.1", "b": "10.94.0.2"}


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")


def qdisc_commands(ns: str, dev: str, qdisc: str, gbps: float, burst_kb: float) -> list[list[str]]:
    """The tc commands that shape ``dev`` in ``ns`` (pure: what ``shape`` runs)."""
    rate = f"{gbps * 1000:g}mbit"
    burst = str(int(burst_kb * 1000))
    tc = ["tc", "-n", ns]
    if qdisc in ("tbf", "tbf_10ms"):
        latency = "100ms" if qdisc == "tbf" else "10ms"
        return [tc + ["qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", rate,
                      "burst", burst, "latency", latency]]
    if qdisc in ("htb", "htb_ack"):
        out = [tc + ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"],
               tc + ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
                     "rate", rate, "burst", burst, "cburst", burst],
               tc + ["class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb",
                     "rate", rate, "ceil", rate, "prio", "0", "burst", burst, "cburst", burst],
               tc + ["class", "add", "dev", dev, "parent", "1:1", "classid", "1:20", "htb",
                     "rate", rate, "ceil", rate, "prio", "1", "burst", burst, "cburst", burst],
               tc + ["qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "pfifo",
                     "limit", str(max(16, int(gbps * 1e9 / 8 * 0.1 / 1500))) ]]
        if qdisc == "htb_ack":
            # TCP packets whose IP total length is under 128 bytes: pure ACKs.
            out.append(tc + ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
                             "prio", "1", "u32", "match", "ip", "protocol", "6", "0xff",
                             "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", "1:10"])
        return out
    raise ValueError(f"qdisc {qdisc!r}: expected one of {', '.join(QDISCS)}")


class Pair:
    """Two namespaces ``a`` and ``b`` joined by a veth pair (a context manager);
    with ``cluster=True`` the cluster's own two-host network instead
    (``launch.cluster.netns.ShapedNetwork``: a bridge, a tbf on each host's
    egress and on the switch port towards it; ``qdisc`` must be tbf)."""

    def __init__(self, qdisc: str, gbps: float, burst_kb: float, cluster: bool = False):
        self.ns = {side: f"cjxlx{os.getpid()}{side}" for side in "ab"}
        self.address = dict(ADDRESS)
        self.qdisc, self.gbps, self.burst_kb = qdisc, gbps, burst_kb
        self.network = None
        if cluster:
            if qdisc != "tbf":
                raise ValueError(f"--topology=cluster shapes with tbf only, not {qdisc!r}")
            from launch.cluster.netns import LinkOptions, ShapedNetwork

            self.network = ShapedNetwork(2, LinkOptions(gbps=gbps, burst_kb=burst_kb))
            self.ns = {s: self.network.host_namespace(i) for i, s in enumerate("ab")}
            self.address = {s: self.network.address(i) for i, s in enumerate("ab")}

    def __enter__(self) -> Pair:
        if self.network is not None:
            self.network.open()
            return self
        try:
            for ns in self.ns.values():
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "add", "lxa", "netns", self.ns["a"], "type", "veth", "peer",
                 "name", "lxb", "netns", self.ns["b"])
            for side in "ab":
                ns, dev = self.ns[side], f"lx{side}"
                _run("ip", "-n", ns, "addr", "add", f"{ADDRESS[side]}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                for cmd in qdisc_commands(ns, dev, self.qdisc, self.gbps, self.burst_kb):
                    _run(*cmd)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.network is not None:
            self.network.close()
            return
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def endpoint(side: str, pattern: str, nbytes: int, address: dict[str, str]) -> dict:
    """One namespace's half of a pattern (run inside it): listens, connects to
    the peer, sends and receives what the pattern says; returns the receive's
    first-to-last-byte seconds (None where this side receives nothing)."""
    peer = "b" if side == "a" else "a"
    server = socket.create_server((address[side], PORT))
    accepted: list[socket.socket] = []
    acceptor = threading.Thread(target=lambda: accepted.append(server.accept()[0]))
    acceptor.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            client = socket.create_connection((address[peer], PORT), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    acceptor.join(30)
    inbound = accepted[0]
    # Which socket this side sends on and which it reads from.
    send_sock = {"one_way": client if side == "a" else None, "two_sockets": client,
                 "one_socket": client if side == "a" else inbound}[pattern]
    recv_sock = {"one_way": inbound if side == "b" else None, "two_sockets": inbound,
                 "one_socket": client if side == "a" else inbound}[pattern]
    result: dict = {}

    def receive(sock: socket.socket) -> None:
        got, buf = 0, bytearray(1 << 20)
        first: float | None = None
        while got < nbytes:
            n = sock.recv_into(buf)
            if n == 0:
                raise ConnectionError("peer closed early")
            if first is None:
                first, first_n = time.perf_counter(), n
            got += n
        if first is None:
            raise ValueError(f"nothing to receive: nbytes={nbytes}, must be > 0")
        result["recv_s"] = time.perf_counter() - first
        result["recv_bytes"] = nbytes - first_n

    reader = (threading.Thread(target=receive, args=(recv_sock,))
              if recv_sock is not None else None)
    if reader:
        reader.start()
    if send_sock is not None:
        send_sock.sendall(bytes(nbytes))
    if reader:
        reader.join(300)
    for s in (client, inbound, server):
        s.close()
    return result


def measure(qdisc: str, pattern: str, gbps: float, burst_kb: float, mib: float,
            cluster: bool = False) -> float:
    """The slower direction's goodput in Gbit/s."""
    nbytes = int(mib * (1 << 20))
    with Pair(qdisc, gbps, burst_kb, cluster) as pair:
        procs = {side: subprocess.Popen(
            ["ip", "netns", "exec", pair.ns[side], sys.executable, "-m",
             "launch.experiments.link_exchange", "endpoint", side, pattern, str(nbytes),
             pair.address["a"], pair.address["b"]],
            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
            for side in "ab"}
        out = {side: p.communicate(timeout=300)[0] for side, p in procs.items()}
        for side, p in procs.items():
            if p.returncode != 0:
                raise RuntimeError(f"{qdisc} {pattern}: endpoint {side} exited {p.returncode}")
    got = [json.loads(out[s]) for s in "ab"]
    rates = [g["recv_bytes"] * 8 / g["recv_s"] / 1e9 for g in got if "recv_s" in g]
    return min(rates)


def main(argv: list[str]) -> None:
    if len(argv) == 7 and argv[1] == "endpoint":
        print(json.dumps(endpoint(argv[2], argv[3], int(argv[4]), {"a": argv[5], "b": argv[6]})))
        return
    if os.geteuid() != 0:
        sys.exit("link_exchange: needs root (network namespaces and tc)")
    results: dict = {"gbps": FLAGS.gbps, "burst_kb": FLAGS.burst_kb, "mib": FLAGS.mib,
                     "repeats": FLAGS.repeats, "goodput_gbps": {}}
    cases = [(q, False) for q in FLAGS.qdiscs] + ([("tbf", True)] if FLAGS.cluster else [])
    for qdisc, cluster in cases:
        for pattern in PATTERNS:
            runs = [measure(qdisc, pattern, FLAGS.gbps, FLAGS.burst_kb, FLAGS.mib, cluster)
                    for _ in range(FLAGS.repeats)]
            med = statistics.median(runs)
            name = "cluster_tbf" if cluster else qdisc
            results["goodput_gbps"][f"{name}/{pattern}"] = {
                "median": round(med, 4), "runs": [round(r, 4) for r in runs]}
            print(f"{name:11s} {pattern:12s} {med:.3f} Gbit/s per direction "
                  f"({med / FLAGS.gbps:.2f} of the rate)", flush=True)
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    flags.DEFINE_float("gbps", 0.12, "Shaped rate per direction (Gbit/s).")
    flags.DEFINE_float("burst_kb", 20.0, "Token bucket (KB), the bench's --link_burst_kb.")
    flags.DEFINE_float("mib", 8.0, "MiB per direction per transfer.")
    flags.DEFINE_integer("repeats", 3, "Transfers per pattern and queue discipline.")
    flags.DEFINE_list("qdiscs", list(QDISCS), "Queue disciplines to compare (veth pair).")
    flags.DEFINE_bool("cluster", True, "Also the cluster's own shaped network (bridge, tbf "
                      "on both ends of each host's link).")
    flags.DEFINE_string("json", None, "Write the figures here.")
    app.run(main)
