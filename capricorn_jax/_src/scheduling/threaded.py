"""The host path for checkpoint chunks: a sender thread started by the boundary marks.

On XLA:CPU an in-graph collective-permute does not overlap the compute around
it when the link is the bottleneck (BUILD_NOTES, "Shaped links"): the step
costs compute + link time. This path moves a window's chunks *outside* the
XLA program while the step computes:

* before the step, a jitted program (no collective) packs version t into
  the payload; the step itself is the plain step plus a mark at each layer
  boundary that opens or closes a window holding chunks
  (``profiler.ProfileHook``: an unordered host callback per device, tied to
  the boundary's data, so placed by that dependency alone);
* a mark on every local device of a boundary opens the windows whose site it
  is (``executor.site_of``); the sender thread sends each window's ranges,
  in step order, as soon as its window is open, and the schedule's tail
  after the last window, so each window carries what the partitioner sized
  to its capacity; the marks' times give each filled window's real length
  (``last_spans``), which the strategy compares with its plan
  (``transfers.window_spills``);
* the bytes go over a TCP connection per replication round (this host to its
  peer), on the address this host reaches the job's coordinator from
  (``job_address``: behind shaped links, the link the all-to-alls use; never
  a loopback alias such as 127.0.1.1 unless the coordinator itself is on
  loopback); a receiver thread writes the peer's frames into the version's
  buffer, and ``wait`` hands the complete buffer to the commit.
* the listener accepts only its job's peer: the connecting side first sends a
  hello (a magic, its host index, the job's token); a connection with
  another token or host index is closed with a logged reason and the
  listener goes on waiting (an identity check against stray or stale
  connections, not an authentication).

Why not XLA programs issued from a second thread (a chunk's ppermute program
while the step runs): measured on this box (jax 0.10.2, gloo), two programs
with collectives in flight at once on the same devices deadlocked: 2 hosts x 2
devices 2 of 2 runs, 4 hosts x 1 device 1 of 2 runs (XLA's CPU collectives
share one communicator per device set, with tag 0 for every op). A separate
device set (one device per host) ran, but 4 hosts x 1 device has none. Why
not ``jax.experimental.transfer``: a pull hung about once in 6 runs
(launch.experiments.overlap). On GPUs the in-graph permutes run on their own
streams and overlap: there ``executor.InStepSender`` is the path.

Every host sends and receives the same frames in the same order; a peer
that stops answering ends ``wait`` with an error naming it after the
timeout, never a hang. Every wait is bounded by ``timeout_s``: connecting,
each send and receive, a window's mark (a mark that never fires sends the
window's chunks at the bound rather than never), a frame of a version this
host has not started yet, and ``wait``. A version whose ``wait`` failed or
timed out is dropped whole (its late frames are read and discarded), a
frame that arrives twice counts once, and the next version goes on.
"""

from __future__ import annotations

import functools
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from capricorn_jax._src.memory.transport import local_rows
from capricorn_jax._src.multihost.agree import agree_measured
from capricorn_jax._src.profiling.profiler import ProfileHook
from capricorn_jax._src.scheduling.executor import AFTER, START, Site, pack_payload, site_of
from capricorn_jax._src.scheduling.partitioner import LinkModel, Schedule, fit_link_model
from capricorn_jax._src.scheduling.window_clock import sites_in_order, window_sites

log = logging.getLogger(__name__)

# version, offset, length (bytes per row), rows
_HEADER = struct.Struct("<qqqq")
SEND_BUFFER = 128 << 10
_KEY = "capricorn/chunk_channel/{job}/{host}"
# The connecting side's hello: magic, its host index, the token's length; then the token.
_HELLO = struct.Struct("<4sqi")
_MAGIC = b"CJX1"
_MAX_TOKEN = 4096


def job_address(coordinator: str | None) -> str:
    """The address this host advertises to its peers: the one it reaches the
    job's coordinator (``host:port``) from, so a peer that reaches the
    coordinator reaches it too (behind shaped links: this host's end of its
    link). Without a coordinator (one process), the address this host's name
    resolves to.

    Raises:
      OSError: the coordinator is on another machine and this host would
        advertise a loopback address (e.g. 127.0.1.1), which peers cannot reach.
    """
    if coordinator is None:
        return socket.gethostbyname(socket.gethostname())
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: this only picks the route
        address = probe.getsockname()[0]
    coordinator_local = socket.gethostbyname(host).startswith("127.")
    if address.startswith("127.") and not coordinator_local:
        raise OSError(f"this host would advertise the loopback address {address} to reach the "
                      f"coordinator {coordinator}; its peers cannot connect there")
    return address


class WindowMarks:
    """The recorder of the marks: opens a site when every local device passed it.

    The callback only counts (device index from the mark's tag); the sender
    thread waits on ``wait_open``.
    """

    def __init__(self, local_devices: int) -> None:
        self.local_devices = local_devices
        self._cond = threading.Condition()
        self._seen: dict[tuple[str, str], set[int]] = {}
        self._open: set[tuple[str, str]] = set()
        self.opened_at: dict[tuple[str, str], float] = {}  # site -> when it opened
        self._epoch = 0

    def record(self, name: str, direction: str, tag: Any) -> np.ndarray:
        device = int(np.asarray(tag)[0])
        with self._cond:
            seen = self._seen.setdefault((name, direction), set())
            seen.add(device)
            if len(seen) >= self.local_devices and (name, direction) not in self._open:
                self._open.add((name, direction))
                self.opened_at[(name, direction)] = time.perf_counter()
                self._cond.notify_all()
        return np.zeros((), np.float32)

    def reset(self) -> int:
        """A new step: no site is open; returns the step's epoch."""
        with self._cond:
            self._seen.clear()
            self._open.clear()
            self.opened_at = {}
            self._epoch += 1
            self._cond.notify_all()
            return self._epoch

    def wait_open(self, site: Site, epoch: int, timeout_s: float) -> bool:
        """Whether ``site`` opened in step ``epoch`` within the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while site not in self._open or self._epoch != epoch:
                if self._epoch != epoch:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        view = view[n:]


class ChunkChannel:
    """TCP connections to this host's replication peer (round 0) and from its source.

    Args:
      host: this process's index.
      destination, source: the hosts this one sends to and receives from.
      job: a name unique to the job (the key-value store's keys, and the
        token of the hello a peer's connection must start with).
      client: the jax.distributed key-value client (exchanges the addresses).
      timeout_s: bound on connecting and on every send and receive.
      address: the address to listen on and advertise (default:
        ``job_address`` of the jax.distributed coordinator).
    """

    def __init__(self, host: int, destination: int, source: int, job: str, client: Any,
                 timeout_s: float = 120.0, address: str | None = None) -> None:
        self.host, self.destination, self.source = host, destination, source
        self.timeout_s = timeout_s
        self.token = job.encode()
        if len(self.token) > _MAX_TOKEN:
            raise ValueError(f"job name of {len(self.token)} bytes; at most {_MAX_TOKEN}")
        if address is None:
            from jax._src import distributed

            address = job_address(distributed.global_state.coordinator_address)
        listener = socket.create_server((address, 0))
        client.key_value_set(_KEY.format(job=job, host=host),
                             f"{address}:{listener.getsockname()[1]}")
        peer = client.blocking_key_value_get(_KEY.format(job=job, host=destination),
                                             int(timeout_s * 1000))
        peer_address, port = peer.rsplit(":", 1)
        result: dict[str, Any] = {}
        deadline = time.monotonic() + timeout_s
        acceptor = threading.Thread(target=self._accept, args=(listener, deadline, result),
                                    daemon=True)
        acceptor.start()
        try:
            self.out = socket.create_connection((peer_address, int(port)), timeout=timeout_s)
            self.out.sendall(_HELLO.pack(_MAGIC, host, len(self.token)) + self.token)
        except OSError:
            listener.close()
            raise
        acceptor.join(timeout_s + 1.0)
        listener.close()
        if "in" not in result:
            self.out.close()
            raise TimeoutError(f"host {host}: host {source} did not connect its chunk channel "
                               f"within {timeout_s:g}s ({result.get('error', 'no connection')})")
        self.inc: socket.socket = result["in"]
        for s in (self.out, self.inc):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(timeout_s)
        # A small send buffer: ``send`` returns when a window's bytes are
        # nearly on the link, not parked in the kernel to leave during the
        # next all-to-all (pacing to the window).
        self.out.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)

    def _accept(self, listener: socket.socket, deadline: float, result: dict[str, Any]) -> None:
        """Accepts connections until one from this job's source host, with this
        job's token, says hello; any other is closed with a logged reason."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                result.setdefault("error", "no connection")
                return
            try:
                listener.settimeout(left)
                conn, peer = listener.accept()
            except OSError as e:  # timed out, or the listener closed (the connect failed)
                result["error"] = e
                return
            why = self._refusal(conn, min(left, self.timeout_s))
            if why is None:
                result["in"] = conn
                return
            log.warning("host %d: chunk channel refused a connection from %s: %s", self.host,
                        peer, why)
            result["error"] = why
            conn.close()

    def _refusal(self, conn: socket.socket, timeout_s: float) -> str | None:
        """Why ``conn`` is not this job's source host (None: it is)."""
        conn.settimeout(timeout_s)
        try:
            hello = bytearray(_HELLO.size)
            _recv_exact(conn, memoryview(hello))
            magic, host, size = _HELLO.unpack(hello)
            if magic != _MAGIC or not 0 <= size <= _MAX_TOKEN:
                return f"not a chunk channel hello ({bytes(hello[:4])!r})"
            token = bytearray(size)
            _recv_exact(conn, memoryview(token))
        except (OSError, ConnectionError) as e:
            return f"no hello ({type(e).__name__}: {e})"
        if bytes(token) != self.token:
            return f"another job's token ({bytes(token)[:64]!r})"
        if host != self.source:
            return f"host {host}, not this host's source host {self.source}"
        return None

    def send(self, version: int, offset: int, rows: np.ndarray | Sequence[np.ndarray]) -> None:
        """Sends ``rows`` (one uint8 row of n bytes per local device: a
        [devices, n] array or views of each device's buffer) as bytes
        [offset, offset + n) of ``version``; each row goes from its own memory,
        without a copy when it is contiguous."""
        lengths = {len(r) for r in rows}
        if len(lengths) != 1:
            raise ValueError(f"rows of different lengths {sorted(lengths)}")
        self.out.sendall(_HEADER.pack(version, offset, lengths.pop(), len(rows)))
        for row in rows:
            self.out.sendall(np.ascontiguousarray(row).data.cast("B"))

    def receive_into(self, buffers: Callable[[int], np.ndarray | None]
                     ) -> tuple[int, int, int]:
        """Receives one frame into ``buffers(version)``; (version, offset, length).
        When ``buffers`` gives None the frame is read and discarded."""
        header = bytearray(_HEADER.size)
        _recv_exact(self.inc, memoryview(header))
        version, offset, length, rows = _HEADER.unpack(header)
        target = buffers(version)
        if target is None:
            scratch = memoryview(bytearray(min(max(length, 1), 1 << 20)))
            left = rows * length
            while left:
                n = min(left, len(scratch))
                _recv_exact(self.inc, scratch[:n])
                left -= n
            return version, offset, length
        if rows != target.shape[0] or offset + length > target.shape[1]:
            raise ValueError(f"host {self.host}: a frame of {rows} x {length} bytes at "
                             f"{offset} from host {self.source} does not fit version "
                             f"{version}'s {target.shape}")
        for r in range(rows):
            _recv_exact(self.inc, target[r, offset:offset + length].data)
        return version, offset, length

    def measure(self, sizes: Sequence[int] = (1 << 16, 1 << 20, 1 << 22), repeats: int = 3,
                rows: int = 1) -> tuple[list[int], list[float]]:
        """Fastest time per size of every host sending ``rows`` x size bytes to
        its peer at once (the replication's pattern), receiving its source's;
        every host calls it at the same point."""
        times = []
        for size in sizes:
            data = np.zeros((rows, size), np.uint8)
            sink = np.empty((rows, size), np.uint8)
            best = float("inf")
            for i in range(repeats):
                errors: list[BaseException] = []

                def receive(sink: np.ndarray = sink, errors: list = errors) -> None:
                    try:
                        self.receive_into(lambda _: sink)
                    except BaseException as e:  # noqa: BLE001
                        errors.append(e)

                t0 = time.perf_counter()
                receiver = threading.Thread(target=receive, daemon=True)
                receiver.start()
                self.send(-1 - i, 0, data)
                receiver.join(self.timeout_s)
                if errors or receiver.is_alive():
                    raise ConnectionError(f"host {self.host}: measuring the chunk channel "
                                          f"failed") from (errors[0] if errors else None)
                best = min(best, time.perf_counter() - t0)
            times.append(best)
        return list(sizes), times

    def close(self) -> None:
        for s in (self.out, self.inc):
            try:
                s.close()
            except OSError:
                pass


class _Version:
    def __init__(self, version: int, own: jax.Array, received: np.ndarray,
                 expect: list[tuple[int, int]]) -> None:
        self.version, self.own, self.received = version, own, received
        self.expect = sorted(expect)
        self.got: set[tuple[int, int]] = set()  # a frame that arrives twice counts once
        self.sent = threading.Event()
        self.complete = threading.Event()
        self.error: BaseException | None = None
        self.times: dict[str, float] = {}  # seconds since start: packed, sent, received
        self.t0 = time.perf_counter()
        # window index -> (the site opening it, the site closing it)
        self.window_sites: dict[int, tuple[Site, Site]] = {}
        self.site_sent: dict[Site, float] = {}  # when a site's last frame was handed over


class ThreadedSender:
    """Moves each version's chunks while its step computes (see the module docstring).

    Args:
      channel: the connections to the peer.
      boundaries: the model's boundary names, forward order.
      local_devices: this process's devices (rows of the payload).
      mesh: the training mesh (the marks run once per device).
      timeout_s: bound on a window's wait for its mark and on ``wait``.
    """

    def __init__(self, channel: ChunkChannel, boundaries: list[str], local_devices: int,
                 mesh: Any, timeout_s: float = 120.0) -> None:
        self.channel, self.boundaries, self.timeout_s = channel, boundaries, timeout_s
        self.marks = WindowMarks(local_devices)
        self.mesh = mesh
        self._hooks: dict[frozenset, ProfileHook] = {}
        self._jobs: queue.Queue = queue.Queue()
        self._versions: dict[int, _Version] = {}
        self._finished: set[int] = set()  # versions waited for or dropped: late frames discarded
        self._lock = threading.Lock()
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, name="chunk-sender",
                                        daemon=True)
        self._receiver = threading.Thread(target=self._receive_loop, name="chunk-receiver",
                                          daemon=True)
        self._sender.start()
        self._receiver.start()
        self.failure: BaseException | None = None
        self.last_times: dict[str, float] = {}
        self.last_spans: dict[int, float] = {}
        self.last_sends: dict[int, float] = {}

    def sites_in_order(self) -> list[Site]:
        """The sites at which windows open, in the order a step passes them."""
        return sites_in_order(self.boundaries)

    def _window_sites(self, schedule: Schedule) -> dict[int, tuple[Site, Site]]:
        """Window index -> (opening site, closing site: the next one a step
        passes) of each window with chunks."""
        return window_sites(schedule, self.boundaries)

    def hook(self, schedule: Schedule) -> ProfileHook:
        """The boundary hook of a step moving ``schedule``: an unordered mark
        (placed by its data dependency alone) at each boundary that opens or
        closes a window with chunks (the closing ones time the window:
        ``last_spans``), none elsewhere; one per set of such sites, so a
        re-partition that marks the same sites reuses its compiled step."""
        sites = frozenset(site for pair in self._window_sites(schedule).values()
                          for site in pair) - {START, AFTER}
        if sites not in self._hooks:
            self._hooks[sites] = ProfileHook(self.mesh, self.marks, sites=sites, ordered=False)
        return self._hooks[sites]

    def start(self, version: int, own: jax.Array, schedule: Schedule) -> None:
        """Version ``version``'s chunks go as the step about to be dispatched
        opens its windows. ``own``: its packed payload [devices, bytes]."""
        if self.failure is not None:
            raise RuntimeError("the chunk channel failed earlier") from self.failure
        by_site: dict[Site, list[tuple[int, int]]] = {}
        for window, chunks in zip(schedule.windows, schedule.chunks, strict=True):
            by_site.setdefault(site_of(window, self.boundaries), []).extend(
                (c.start, c.stop) for c in chunks)
        by_site.setdefault(AFTER, []).extend((c.start, c.stop) for c in schedule.tail)
        rows = self.marks.local_devices
        entry = _Version(version, own, np.empty((rows, schedule.payload_bytes), np.uint8),
                         [r for rs in by_site.values() for r in rs])
        entry.window_sites = self._window_sites(schedule)
        with self._lock:
            self._versions[version] = entry
        epoch = self.marks.reset()
        self._jobs.put((entry, epoch, by_site))

    def _send_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            entry, epoch, by_site = job
            try:
                t0 = entry.t0
                local = local_rows(entry.own, copy=False)  # views of the packed payload
                entry.times["packed_s"] = time.perf_counter() - t0
                for site in self.sites_in_order():
                    ranges = by_site.get(site)
                    if not ranges:
                        continue
                    if site not in (START, AFTER):
                        # A window opens at its mark; a missed mark (a step that
                        # ended another way) sends at once rather than never.
                        self.marks.wait_open(site, epoch, self.timeout_s)
                    for lo, hi in ranges:
                        self.channel.send(entry.version, lo, [row[lo:hi] for row in local])
                    entry.site_sent[site] = time.perf_counter()
                entry.times["sent_s"] = time.perf_counter() - t0
            except BaseException as e:  # noqa: BLE001
                entry.error = e
                self.failure = e
                entry.complete.set()
            finally:
                entry.sent.set()

    def _buffer(self, version: int) -> np.ndarray | None:
        """The buffer of a frame of ``version``; None (discard the frame) for a
        version already finished or dropped, or one this host did not start
        within the bound (then dropped)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            with self._lock:
                entry = self._versions.get(version)
                if entry is None and version in self._finished:
                    return None
            if entry is not None:
                return entry.received
            if time.monotonic() > deadline or self._closed:
                log.warning("host %d: a frame of version %d from host %d arrived and this host "
                            "did not start that version within %gs; version %d dropped",
                            self.channel.host, version, self.channel.source, self.timeout_s,
                            version)
                self._finish(version)
                return None
            time.sleep(0.001)

    def _finish(self, version: int) -> None:
        """Forgets ``version``: its later frames are discarded."""
        with self._lock:
            self._versions.pop(version, None)
            self._finished.add(version)
            if len(self._finished) > 1024:
                self._finished = set(sorted(self._finished)[-512:])

    def _receive_loop(self) -> None:
        while not self._closed:
            try:
                self.channel.inc.settimeout(None)  # idle between steps is not a failure
                version, offset, length = self.channel.receive_into(self._buffer)
            except BaseException as e:  # noqa: BLE001
                if self._closed:
                    return
                self.failure = e
                with self._lock:
                    pending = list(self._versions.values())
                for waiting in pending:
                    waiting.error = waiting.error or e
                    waiting.complete.set()
                return
            with self._lock:
                entry = self._versions.get(version)
                if entry is None:  # discarded (a finished or dropped version)
                    continue
                entry.got.add((offset, offset + length))
                if sorted(entry.got) == entry.expect:
                    entry.times["received_s"] = time.perf_counter() - entry.t0
                    entry.complete.set()

    def wait(self, version: int, timeout_s: float | None = None) -> np.ndarray:
        """The peer's payload of ``version`` [local devices, bytes] once every
        chunk arrived and this host's chunks are sent; raises on a failure or
        after the timeout, naming the peer. ``last_times`` then holds the
        version's seconds from ``start``: packed, sent, received, and waited
        (this call); ``last_spans`` the seconds each window with chunks lasted
        in the step (window index -> from its opening mark, or the step's
        issue, to its closing mark) and ``last_sends`` when, from its opening,
        its last frame was handed to the kernel (call it after the step,
        before the next ``start``)."""
        t_wait = time.perf_counter()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            entry = self._versions[version]
        deadline = time.monotonic() + timeout_s
        for event, what in ((entry.sent, f"sending to host {self.channel.destination}"),
                            (entry.complete, f"receiving from host {self.channel.source}")):
            if not event.wait(max(0.0, deadline - time.monotonic())):
                self._finish(version)  # dropped whole: its late frames are discarded
                raise TimeoutError(f"host {self.channel.host}: version {version}: {what} did "
                                   f"not finish within {timeout_s:g}s")
            if entry.error is not None:
                self._finish(version)
                raise RuntimeError(f"host {self.channel.host}: version {version}: {what} "
                                   f"failed") from entry.error
        self._finish(version)
        self.last_times = {**entry.times, "waited_s": time.perf_counter() - t_wait}
        opened = {**self.marks.opened_at, START: entry.t0}  # START: when the step was issued
        self.last_spans = {i: opened[close] - opened[open_]
                           for i, (open_, close) in entry.window_sites.items()
                           if open_ in opened and close in opened}
        self.last_sends = {i: entry.site_sent[open_] - opened[open_]
                           for i, (open_, _) in entry.window_sites.items()
                           if open_ in opened and open_ in entry.site_sent}
        return entry.received

    def close(self) -> None:
        self._closed = True
        self._jobs.put(None)
        self.channel.close()
        self._sender.join(5.0)


MEASURE_ATTEMPTS = 3
"""Measurements of the channel before its fit's error is raised: on a busy
host the smallest size's fastest time can exceed the largest's (measured on
this box beside a CPU-bound process: a fit with a negative slope)."""


def measure_channel(channel: ChunkChannel, rows: int) -> LinkModel:
    """alpha + bytes/B of the chunk channel, host 0's fit on every host; a fit
    that fails (times that do not grow with size) is measured again, up to
    ``MEASURE_ATTEMPTS`` times (every host decides alike: host 0's times)."""
    for attempt in range(MEASURE_ATTEMPTS):
        sizes, times = channel.measure(rows=rows)
        # Per-row bytes (the schedule's unit): every local row of a range goes at once.
        agreed = agree_measured(times, what="the chunk channel's measured times")
        try:
            return fit_link_model(sizes, agreed)
        except ValueError as e:
            if attempt == MEASURE_ATTEMPTS - 1:
                raise
            log.info("host %d: chunk channel measured again (%s)", channel.host, e)
    raise AssertionError("unreachable")


def pack_program(transport: Any, state_shardings: Any) -> Callable[..., jax.Array]:
    """The jitted pack of a version into its payload [devices, bytes] (no
    collective; ``executor.pack_payload``, as the in-graph path packs it)."""
    specs = [s.spec for s in jax.tree.leaves(state_shardings)]
    return jax.jit(functools.partial(pack_payload, transport, specs))
