"""``control``: the emulator's own floor, a run that checkpoints nothing and
still moves a checkpoint's bytes.

It trains as ``none`` does (``launch.baselines.NoCheckpoint``: nothing
saved, nothing to restore) and, beside the training loop, a plain bulk
sender moves the bytes an in-memory strategy replicates each step: this
host's share of the train state, counted as the in-memory tier counts a
version (``version_bytes``: its pack plan's payload per device times this
host's devices, ``capricorn_jax.experimental.make_plan`` over the state's
leaves and shardings), to the peer of each replication round of the tier's
placement (``capricorn_jax.experimental.send_rounds`` for ``replicas``:
one peer at the default of 2), once per step, handed over at ``save`` (the
next step's start, as the tier hands over a version). The bytes go over
a plain TCP connection per round, in the checkpoint's traffic class
(``capricorn_jax.LOW_PRIORITY_TOS`` with ``--traffic_class=priority``),
between the addresses the chunk channel uses: each host listens on the
address it reaches the jax.distributed coordinator from (behind shaped
links, its end of its link) and publishes it in jax.distributed's
key-value store, where its source reads it. Each version goes as a
20-byte header and its bytes; the receiver reads them into one reusable
buffer, drops them, and answers with the bytes it received (a 20-byte
acknowledgement), so the sender's record says what the peer got. In a
table its row is what any checkpoint pays on this emulator for the link
alone: its ratio to ``none`` is the floor under every in-memory strategy's.

What it leaves out, on purpose: the copy out of the device, the packing,
the stores and every agreement between hosts (those are checkpoint code);
the bytes sent are zeros from one buffer. A version handed over while the
previous one is still on the wire waits for it; a newer one replaces a
waiting one, which is recorded as ``skipped`` (nothing piles up behind a
slow link, and ``save`` never waits). ``finish`` and ``close`` wait for the
bytes under way at most ``drain_timeout_s``; what is left then is
abandoned (recorded) and the connections are shut down, so neither hangs.

Where the counts go: ``bytes_per_step`` is the version's bytes (the bench's
"ckpt bytes/step"); the per-version records (bytes planned, sent, received
by the peer, outcome, seconds) are its ``schedule_summary`` (the bench
JSON's ``schedule`` of the row): the bench's per-step records hold windows
and collectives only, no field for bytes moved after the step.

One host has no peer: building it there is an error naming the strategy.
The connection's hello carries a random nonce the receiver published in
the key-value store; a stranger's connection is closed and counted. It
proves less than the chunk channel's hello (the job's secret), enough for
a measurement that reads and drops what it gets.

Design choice: a thread per connection and direction, ``socket`` and
``struct`` only. Alternative not taken: the chunk channel itself (its
frames, checksums, pacing and hello are the checkpoint's own cost, which
the control must not include).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

import capricorn_jax
from capricorn_jax import Strategy

log = logging.getLogger(__name__)

NAME = "control"
TRAFFIC_CLASSES = ("fifo", "priority")
CONNECT_TIMEOUT_S = 120.0
"""Bound on connecting, on every send and on each acknowledgement."""
DRAIN_TIMEOUT_S = 30.0
"""The most ``finish``, ``close`` and ``schedule_summary`` wait for bytes under way."""
POLL_S = 0.5
"""How often an idle receiver looks whether it was told to stop."""
BUFFER_BYTES = 1 << 20
RCVLOWAT_BYTES = 1 << 16
"""The most a receive waits to have queued before it wakes (measured, the
priority point of 0.21.0: waking per packet, the receiver thread took 66 ms
of CPU per step, 4.5 MB; its GIL and cores are the training process's)."""
_HEADER = struct.Struct("!4sqq")  # magic, version, bytes
_ACK = struct.Struct("!4sqq")  # magic, version, bytes received
_HELLO = struct.Struct("!16sii")  # nonce, round, host
_MAGIC, _ACK_MAGIC = b"CTRL", b"CACK"
_KEY = "capricorn/control/{build}/{host}"
_builds = itertools.count()  # every host builds its controls in the same order


def version_bytes(train: Any) -> int:
    """This host's bytes of one version, as the in-memory tier counts them
    (``InMemoryCheckpointer``'s ``SaveReport.bytes``): the payload of each of
    its devices in the pack plan of the state's leaves, times its devices."""
    import jax

    from capricorn_jax.experimental import make_plan

    plan = make_plan(train.abstract_state, train.state_shardings, train.mesh, BUFFER_BYTES)
    return plan.payload_bytes * len(plan.host_positions(jax.process_index()))


def job_address() -> str:
    """The address this host listens on and advertises: the chunk channel's
    rule (``capricorn_jax.experimental.job_address``: the one it reaches the
    jax.distributed coordinator from, never a loopback alias unless the
    coordinator is on loopback)."""
    from jax._src import distributed

    from capricorn_jax.experimental import job_address as advertised

    try:
        return advertised(distributed.global_state.coordinator_address)
    except OSError as e:
        raise OSError(f"strategy {NAME!r}: {e}") from None


@dataclasses.dataclass
class Sent:
    """One version to one peer: bytes planned, sent, and received by the peer
    (its acknowledgement; None before it came); ``outcome``: "queued",
    "sending", "sent", "skipped" (replaced by a newer one before it left),
    "abandoned" (at close) or "failed" (the connection broke)."""

    version: int
    peer: int
    bytes: int
    handed: float
    sent: int = 0
    received: int | None = None
    outcome: str = "queued"
    wait_s: float | None = None
    send_s: float | None = None

    def record(self) -> dict[str, Any]:
        return {"version": self.version, "peer": self.peer, "bytes": self.bytes,
                "sent": self.sent, "received": self.received, "outcome": self.outcome,
                "wait_s": self.wait_s, "send_s": self.send_s}


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    """``size`` bytes from ``sock``; None when the peer closed before the first."""
    view, got = bytearray(size), 0
    while got < size:
        n = sock.recv_into(memoryview(view)[got:])
        if n == 0:
            if got == 0:
                return None
            raise ConnectionError(f"the peer closed after {got} of {size} bytes")
        got += n
    return bytes(view)


class _Sender:
    """One round's outgoing connection and the thread that sends on it."""

    def __init__(self, sock: socket.socket, round_: int, peer: int, timeout_s: float) -> None:
        self.sock, self.peer, self.timeout_s = sock, peer, timeout_s
        self.records: list[Sent] = []
        self.error: str | None = None
        self._cond = threading.Condition()
        self._waiting: Sent | None = None
        self._current: Sent | None = None
        self._stop = False
        self._abandon = threading.Event()
        self._buffer = memoryview(bytes(BUFFER_BYTES))  # zeros, never written
        self.thread = threading.Thread(target=self._run, name=f"chunk-sender-control-{round_}",
                                       daemon=True)
        self.thread.start()

    def offer(self, version: int, nbytes: int) -> None:
        """Hands version ``version`` over (never waits)."""
        item = Sent(version, self.peer, nbytes, time.perf_counter())
        with self._cond:
            self.records.append(item)
            if self.error is not None or self._stop:
                item.outcome = "failed" if self.error is not None else "abandoned"
                return
            if self._waiting is not None:
                self._waiting.outcome = "skipped"
            self._waiting = item
            self._cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Waits until nothing is queued or under way; whether it got there."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._waiting is not None or self._current is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self, abandon: bool) -> None:
        """Ends the thread: after what is under way, or at once (``abandon``:
        the version on the wire and the waiting one recorded abandoned)."""
        with self._cond:
            self._stop = True
            if abandon:
                self._abandon.set()
                if self._waiting is not None:
                    self._waiting.outcome = "abandoned"
                    self._waiting = None
            self._cond.notify_all()
        if abandon:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a send or a wait for its ack
            except OSError:
                pass

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._stop:
                    self._cond.wait()
                if self._waiting is None:
                    return
                item, self._waiting = self._waiting, None
                self._current, item.outcome = item, "sending"
            try:
                self._send(item)
            except OSError as e:  # ConnectionError and timeouts too
                with self._cond:
                    item.outcome = "abandoned" if self._abandon.is_set() else "failed"
                    if not self._abandon.is_set():
                        self.error = f"host {self.peer}: {e}"
                        log.warning("%s: sending version %d to host %d failed: %s; the "
                                    "control sends nothing more", NAME, item.version,
                                    self.peer, e)
                        if self._waiting is not None:
                            self._waiting.outcome = "failed"
                            self._waiting = None
                    self._current = None
                    self._cond.notify_all()
                return
            with self._cond:
                self._current = None
                self._cond.notify_all()

    def _send(self, item: Sent) -> None:
        start = time.perf_counter()
        item.wait_s = start - item.handed
        self.sock.sendall(_HEADER.pack(_MAGIC, item.version, item.bytes))
        left = item.bytes
        while left > 0:
            if self._abandon.is_set():
                raise ConnectionAbortedError("abandoned at close")
            n = min(left, BUFFER_BYTES)
            self.sock.sendall(self._buffer[:n])
            item.sent += n
            left -= n
        ack = _recv_exact(self.sock, _ACK.size)
        if ack is None:
            raise ConnectionError("the peer closed before acknowledging")
        magic, version, received = _ACK.unpack(ack)
        if magic != _ACK_MAGIC or version != item.version:
            raise ConnectionError(f"a bad acknowledgement ({magic!r}, version {version}) "
                                  f"for version {item.version}")
        item.received, item.send_s = received, time.perf_counter() - start
        item.outcome = "sent" if received == item.bytes else "failed"


class _Receiver:
    """One round's incoming connection: reads each version into one reusable
    buffer, drops it, acknowledges the bytes it got."""

    def __init__(self, sock: socket.socket, round_: int, source: int) -> None:
        self.sock, self.source = sock, source
        self.records: list[dict[str, Any]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._buffer = bytearray(BUFFER_BYTES)
        self._lowat = 1  # the socket's SO_RCVLOWAT, last set
        sock.settimeout(POLL_S)
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"chunk-receiver-control-{round_}")
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _read(self, view: memoryview) -> int:
        """Bytes into ``view`` until full, the peer's end, or ``stop``. Each
        wait asks the kernel to wake the thread once the rest of the view (at
        most ``RCVLOWAT_BYTES``) is queued (``SO_RCVLOWAT``, honoured by the
        poll under the socket's timeout): one wake-up per 64 KiB rather than
        one per packet, as the chunk channel's receiver does."""
        got = 0
        while got < len(view) and not self._stop.is_set():
            want = max(1, min(len(view) - got, RCVLOWAT_BYTES))
            if want != self._lowat:
                try:
                    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                except OSError:
                    pass  # a platform without it: one wake-up per arrival
                self._lowat = want
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                continue
            if n == 0:
                break
            got += n
        return got

    def _run(self) -> None:
        header = bytearray(_HEADER.size)
        buffer = memoryview(self._buffer)
        try:
            while not self._stop.is_set():
                got = self._read(memoryview(header))
                if got < _HEADER.size:
                    if got:
                        self.error = f"host {self.source}: cut inside a header"
                    return
                magic, version, nbytes = _HEADER.unpack(header)
                if magic != _MAGIC or nbytes < 0:
                    self.error = f"host {self.source}: a bad header ({magic!r}, {nbytes})"
                    return
                record = {"version": version, "source": self.source, "bytes": nbytes,
                          "received": 0}
                self.records.append(record)
                while record["received"] < nbytes:
                    n = self._read(buffer[:min(nbytes - record["received"], BUFFER_BYTES)])
                    if n == 0:
                        return  # the sender stopped inside the version (abandoned)
                    record["received"] += n
                self.sock.sendall(_ACK.pack(_ACK_MAGIC, version, record["received"]))
        except OSError as e:
            if not self._stop.is_set():
                self.error = f"host {self.source}: {e}"


class Links:
    """This host's control connections: to the peer and from the source of
    each replication round (``send_rounds(hosts, replicas)``).

    Args:
      host, hosts: this process's index and the process count (>= 2).
      replicas: the in-memory tier's replicas m (2..hosts): m - 1 rounds.
      tos: the IP TOS byte of what this host sends (0: the default class).
      client: the jax.distributed key-value client (the addresses).
      address: where to listen (default: ``job_address``).
      timeout_s: bound on connecting, each send and each acknowledgement.
      job: the name of these links in the key-value store, the same on every
        host (default: a count of the ``Links`` this process built; every
        host builds its strategies in the same order).
    """

    def __init__(self, host: int, hosts: int, replicas: int, tos: int, client: Any,
                 address: str | None = None, timeout_s: float = CONNECT_TIMEOUT_S,
                 job: str | None = None) -> None:
        from capricorn_jax.experimental import send_rounds

        if hosts < 2:
            raise ValueError(f"strategy {NAME!r} needs 2 hosts or more: it sends each host's "
                             f"share of the train state to a peer host, and this job has "
                             f"{hosts} host (no peer)")
        if not 2 <= replicas <= hosts:
            raise ValueError(f"strategy {NAME!r} moves what the in-memory tier's peer "
                             f"replicas move: it needs replicas in [2, {hosts}], got {replicas}")
        if client is None:
            raise ValueError(f"strategy {NAME!r} needs jax.distributed's key-value client "
                             f"(jax.distributed.initialize first)")
        rounds = send_rounds(hosts, replicas)
        self.host, self.tos, self.timeout_s = host, tos, timeout_s
        self.peers = [r[host] for r in rounds]
        self.sources = [next(s for s, d in r.items() if d == host) for r in rounds]
        self.refused = 0
        address = address or job_address()
        build = str(next(_builds)) if job is None else job
        nonce = secrets.token_bytes(16)
        deadline = time.monotonic() + timeout_s
        with socket.create_server((address, 0)) as listener:
            client.key_value_set(_KEY.format(build=build, host=host),
                                 f"{address}|{listener.getsockname()[1]}|{nonce.hex()}")
            outgoing = [self._connect(client, build, r, peer, deadline)
                        for r, peer in enumerate(self.peers)]
            try:
                incoming = self._accept(listener, nonce, deadline)
            except BaseException:
                for s in outgoing:
                    s.close()
                raise
        self.senders = [_Sender(s, r, peer, timeout_s)
                        for r, (s, peer) in enumerate(zip(outgoing, self.peers, strict=True))]
        self.receivers = [_Receiver(s, r, source)
                          for r, (s, source) in enumerate(zip(incoming, self.sources,
                                                              strict=True))]

    def _connect(self, client: Any, build: str, round_: int, peer: int,
                 deadline: float) -> socket.socket:
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            value = client.blocking_key_value_get(_KEY.format(build=build, host=peer), left_ms)
        except Exception as e:  # jax's runtime error (deadline exceeded, ...)
            raise TimeoutError(f"strategy {NAME!r}: host {self.host}: host {peer} published no "
                               f"address within {self.timeout_s:g}s ({e})") from None
        address, port, nonce = value.split("|")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if self.tos:  # before connecting: every packet of it in the class
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, self.tos)
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            sock.connect((address, int(port)))
            sock.sendall(_HELLO.pack(bytes.fromhex(nonce), round_, self.host))
            sock.settimeout(self.timeout_s)
        except BaseException:
            sock.close()
            raise
        return sock

    def _accept(self, listener: socket.socket, nonce: bytes,
                deadline: float) -> list[socket.socket]:
        """The sources' connections, one per round; a connection whose hello
        does not match is closed and counted (``refused``)."""
        got: dict[int, socket.socket] = {}
        try:
            while len(got) < len(self.sources):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [s for r, s in enumerate(self.sources) if r not in got]
                    raise TimeoutError(f"strategy {NAME!r}: host {self.host}: hosts {missing} "
                                       f"did not connect within {self.timeout_s:g}s "
                                       f"({self.refused} connections refused)")
                listener.settimeout(left)
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
                try:
                    hello = _recv_exact(conn, _HELLO.size)
                except OSError:
                    hello = None
                if hello is not None:
                    their, round_, source = _HELLO.unpack(hello)
                    if (their == nonce and 0 <= round_ < len(self.sources)
                            and self.sources[round_] == source and round_ not in got):
                        got[round_] = conn
                        continue
                self.refused += 1
                log.warning("%s: host %d refused a connection that is not its source's",
                            NAME, self.host)
                conn.close()
        except BaseException:
            for s in got.values():
                s.close()
            raise
        return [got[r] for r in range(len(self.sources))]

    def offer(self, version: int, nbytes: int) -> None:
        for sender in self.senders:
            sender.offer(version, nbytes)

    def drain(self, timeout_s: float) -> bool:
        """Waits (at most ``timeout_s``) for every version under way; whether all left."""
        deadline = time.monotonic() + timeout_s
        return all(s.drain(max(0.0, deadline - time.monotonic())) for s in self.senders)

    def close(self, timeout_s: float) -> None:
        """Finishes what is under way within ``timeout_s`` or abandons it, then
        ends the connections: this host's end of each first (its peer's
        receiver sees the end), then waits for its sources' ends, each wait
        bounded by ``timeout_s``."""
        done = self.drain(timeout_s)
        for s in self.senders:
            s.stop(abandon=not done)
            s.thread.join(timeout_s)
            try:
                s.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for r in self.receivers:
            r.thread.join(max(0.0, deadline - time.monotonic()))
            r.stop()
            r.thread.join(POLL_S * 4)
        for sock in [s.sock for s in self.senders] + [r.sock for r in self.receivers]:
            sock.close()

    def summary(self) -> dict[str, Any]:
        sent = [x.record() for s in self.senders for x in list(s.records)]
        received = [dict(x) for r in self.receivers for x in list(r.records)]
        outcomes = [x["outcome"] for x in sent]
        return {"kind": NAME, "peers": self.peers, "sources": self.sources, "tos": self.tos,
                "versions": sent, "received": received,
                "bytes_sent": sum(x["sent"] for x in sent),
                "bytes_received": sum(x["received"] for x in received),
                **{k: outcomes.count(k) for k in ("skipped", "abandoned", "failed")},
                "errors": [e for e in [*(s.error for s in self.senders),
                                       *(r.error for r in self.receivers)] if e],
                "refused": self.refused}


class BulkControl(Strategy):
    """``control`` (module docstring): no checkpoint, a version's bytes on the link.

    Args:
      train: the trainer (its state's leaves, shardings and mesh size a version).
      traffic_class: "fifo" or "priority" (``--traffic_class``).
      replicas: the in-memory tier's m (``--replicas``).
      drain_timeout_s: the most ``finish``/``close`` wait for bytes under way.
      timeout_s: bound on connecting, each send and each acknowledgement.
      links: test-only: ready ``Links`` (default: built from jax.distributed).
    """

    name = NAME

    def __init__(self, train: Any, *, traffic_class: str = "fifo", replicas: int = 2,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S, timeout_s: float = CONNECT_TIMEOUT_S,
                 links: Links | None = None) -> None:
        import jax

        from capricorn_jax.experimental import distributed_client

        if traffic_class not in TRAFFIC_CLASSES:
            raise ValueError(f"strategy {NAME!r}: traffic_class must be one of "
                             f"{TRAFFIC_CLASSES}, got {traffic_class!r}")
        self.drain_timeout_s = drain_timeout_s
        self.traffic_class = traffic_class
        hosts = jax.process_count()
        if links is None and hosts < 2:  # before anything else: the reason, not a missing client
            raise ValueError(f"strategy {NAME!r} needs 2 hosts or more: it sends each host's "
                             f"share of the train state to a peer host, and this job has 1 "
                             f"host (no peer)")
        self.version_bytes = version_bytes(train)  # before any connection: a bad state fails here
        if links is None:
            tos = capricorn_jax.LOW_PRIORITY_TOS if traffic_class == "priority" else 0
            links = Links(jax.process_index(), hosts, replicas, tos, distributed_client(),
                          timeout_s=timeout_s)
        self.links = links
        self.bytes_per_step = 0
        self._closed = False

    def save(self, step: int, state: Any, host_state: dict[str, Any], *,
             tokens_per_expert: np.ndarray | None = None,
             next_step_profiled: bool = False) -> list[dict[str, Any]]:
        """Hands version ``step``'s bytes to the senders; saves nothing (no events)."""
        self.links.offer(step, self.version_bytes)
        self.bytes_per_step = self.version_bytes
        return []

    def finish(self, step: int, state: Any, host_state: dict[str, Any]) -> list[dict[str, Any]]:
        """Waits (bounded) for the last versions' bytes; ``close`` abandons any left."""
        if not self.links.drain(self.drain_timeout_s):
            log.warning("%s: bytes still under way after %gs at finish; close abandons them",
                        NAME, self.drain_timeout_s)
        return []

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.links.close(self.drain_timeout_s)

    def resume_at(self, step: int) -> None:
        return None

    def schedule_summary(self) -> dict[str, Any]:
        """Every version's record, this host's (after a bounded wait for the
        bytes under way, so that their counts are final)."""
        if not self._closed:
            self.links.drain(self.drain_timeout_s)
        return {**self.links.summary(), "version_bytes": self.version_bytes,
                "traffic_class": self.traffic_class}


def build(args: Any) -> BulkControl:
    """The registry's builder (``launch.strategies``): ``args.extra``'s
    ``traffic_class`` (default fifo), ``replicas`` (default 2) and
    ``time_scale`` (default 1): its bounds follow the link, so a time scale
    of k makes them k times longer. The launchers pass all three from their
    parsed configs (a strategy reads no flag: ``tests/test_launch_flags.py``)."""
    extra = args.extra
    traffic = extra.get("traffic_class") or "fifo"
    replicas = extra.get("replicas") or 2
    scale = max(1.0, float(extra.get("time_scale") or 1.0))
    return BulkControl(args.train, traffic_class=traffic, replicas=int(replicas),
                       drain_timeout_s=DRAIN_TIMEOUT_S * scale,
                       timeout_s=CONNECT_TIMEOUT_S * scale)
