"""The chunk channel: TCP connections that carry a version's chunks to the peer.

One connection per replication round (this host to its peer, and from its
source), on the address this host reaches the job's coordinator from
(``job_address``: behind shaped links, the link the all-to-alls use; never a
loopback alias such as 127.0.1.1 unless the coordinator itself is on
loopback). The listener accepts only its job's peer: both ends prove they
know the job's secret and state their build in a challenge-response hello
(``threaded.channel_hello``: each pending connection on its own thread
with its own short deadline, so a silent or hostile one delays nobody); a
connection that fails it is closed, counted (``refusals``) and logged with
its address, and the listener goes on waiting; the job's own peer on
another build stops the setup on both ends, naming both builds. Every wait
is bounded by ``timeout_s``:
connecting, each send and each receive. ``measure_channel`` fits the
channel's link model (alpha + bytes/B), host 0's fit on every host.

Every frame follows ``native.integrity``'s rule: its header (version,
offset, length, rows, the frame's CRC32C over the header's fields and the
rows, the header's own CRC32C) is checked before its offset or length is
trusted (a corrupt header ends the receive with ``CorruptHeader``, a
``ConnectionError``: the stream lost its framing), and its rows as placed
in the version's buffer are checked against the CRC32C the sender took
before they left (a mismatch: ``CorruptFrame``, that version dropped). A
header that passes its checksum and still names bytes outside the version's
buffer (rows, a negative offset or length, an end past the buffer:
``integrity.frame_rejection``, the native loop's rule too) is refused before
a byte of it is placed: ``integrity.FrameRejected``, counted by reason
(``integrity.rejected_frames``), and the connection with it.

``close`` shuts both sockets down at once and releases their descriptors
only after the last send or receive under way left (``held_sockets``: the
native loops hold descriptor numbers, which a later socket would reuse).

The sender and receiver threads that use it, and why the bytes leave the XLA
program at all: ``threaded.sender``.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np

try:  # the deadline sender's view of the link (``queued_bytes``): POSIX only
    import fcntl
    import termios
except ImportError:  # pragma: no cover - not POSIX
    fcntl = termios = None  # type: ignore[assignment]

from capricorn_jax._src.multihost.agree import agree_measured
from capricorn_jax._src.multihost.secret import SecretError, from_environment
from capricorn_jax._src.native import frames as native_frames
from capricorn_jax._src.native import integrity
from capricorn_jax._src.scheduling.plan import partitioner
from capricorn_jax._src.scheduling.threaded import channel_hello
from capricorn_jax._src.scheduling.threaded.held_sockets import HeldSockets

log = logging.getLogger(__name__)

_HEADER = integrity.HEADER  # the frame header: ``native.integrity``'s
MISMATCH_GRACE_S = 2.0
"""How long a host that met another build lets the hellos under way finish."""
SEND_BUFFER = 128 << 10
NOTSENT_LOWAT = 16 << 10
"""Unsent bytes the kernel keeps for the chunk channel (``TCP_NOTSENT_LOWAT``)."""
RUN_FRAMES = 4096
"""The most frames one native receive call logs (``receive_frames``)."""
_TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
_KEY = "capricorn/chunk_channel/{job}/{host}"


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


class CorruptFrame(ValueError):
    """A frame whose bytes changed between its sender's checksum and this
    host's (``version``: the version it belongs to, dropped)."""

    def __init__(self, version: int, message: str) -> None:
        super().__init__(message)
        self.version = version


RCVLOWAT_CAP = 1 << 16
"""The most a receive waits to have queued before it wakes (``SO_RCVLOWAT``)."""


def _recv_exact(sock: socket.socket, view: memoryview, mark: np.ndarray | None = None,
                once: bool = False) -> int:
    """Fills ``view`` from ``sock``. Each wait asks the kernel to wake the
    reader only once the rest of the view (at most ``RCVLOWAT_CAP``) is
    queued (``SO_RCVLOWAT``, honoured by poll for TCP): on a link slower
    than the reader, one wake-up per 64 KiB rather than one per packet (the
    receiver thread's Python runs per wake-up). Only on a socket with a
    timeout (Python waits in poll): a blocking receive with a raised mark
    was seen to wait forever behind a shaped link (tbf), so a blocking one
    keeps the mark at 1. ``mark``: the caller's one-item record of the mark
    last set on ``sock`` (an int64 array the native receive shares); a mark
    it already has is not set again (one system call less per wake-up).
    ``once``: returns after the first wake-up, with what it read (possibly
    less than the view). Returns the bytes read."""
    blocking = sock.gettimeout() is None
    total = 0
    while view:
        want = 1 if blocking else max(1, min(len(view), RCVLOWAT_CAP))
        if mark is None or mark[0] != want:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            except OSError:
                pass  # a platform without it: one wake-up per arrival, as before
            if mark is not None:
                mark[0] = want
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        view = view[n:]
        total += n
        if once:
            break
    return total


def _send_all(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Sends every byte of ``buffers``, in order, gathered into as few system
    calls as the kernel takes (``sendmsg``; a partial send goes on from
    where it stopped). Alternative not taken: ``sendall`` per buffer (a
    frame of a header and two rows was three calls)."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if len(v)]
    while views:
        n = sock.sendmsg(views)
        while n:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0], n = views[0][n:], 0


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _holding(method: Callable[Concatenate[ChunkChannel, _P], _R]
             ) -> Callable[Concatenate[ChunkChannel, _P], _R]:
    """A send or receive of the channel, run holding its sockets'
    descriptors (``held_sockets``: ``close`` releases them after it)."""
    def held(self: ChunkChannel, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._sockets.hold():
            return method(self, *args, **kwargs)
    return functools.wraps(method)(held)


class ChunkChannel:
    """TCP connections to this host's replication peer (round 0) and from its source.

    Args:
      host: this process's index.
      destination, source: the hosts this one sends to and receives from.
      job: a name unique to the channel in the job (the key-value store's
        keys, and the token its hello names).
      client: the jax.distributed key-value client (exchanges the addresses).
      timeout_s: bound on connecting and on every send and receive.
      address: the address to listen on and advertise (default:
        ``job_address`` of the jax.distributed coordinator).
      tos: the IP TOS byte of what this host sends (0: the default class).
      secret: the job's secret, the same on both ends (default: the
        environment's, ``multihost.secret``; none there: ``SecretError``).
      shared: the digest of what both ends must share (the pack plan's
        fingerprint, ...), stated in the hello with the build
        (``channel_hello.identity``); ends that differ stop at the hello.
      hello_timeout_s: the most each incoming connection may take to
        complete its hello (at most ``timeout_s``).

    ``refusals``: (address, reason) of each connection the listener refused.

    Fault injection (tests and the chaos harness): ``flip_version`` set, the
    first frame sent of a version at or after it has a byte flipped after its
    checksum (a byte corrupted in transit; ``memory.hooks.FaultHooks.flip_frame_at``),
    then ``on_flip(version)``. ``stall_at`` (version, seconds) set, the
    channel sends nothing for that long before the first frame of a version
    at or after it (a connection that hangs; ``FaultHooks.stall_channel_at``),
    after ``on_stall(version)``.
    """

    def __init__(self, host: int, destination: int, source: int, job: str, client: Any,
                 timeout_s: float = 120.0, address: str | None = None, tos: int = 0, *,
                 secret: bytes | None = None, shared: str = "",
                 hello_timeout_s: float = channel_hello.HELLO_TIMEOUT_S) -> None:
        self.host, self.destination, self.source = host, destination, source
        self.timeout_s = timeout_s
        self.tos = tos
        self.flip_version: int | None = None
        self.on_flip: Callable[[int], None] | None = None
        self.stall_at: tuple[int, float] | None = None
        self.on_stall: Callable[[int], None] | None = None
        self._closed = threading.Event()
        # SO_RCVLOWAT last set on the incoming socket (``_recv_exact``, the native loop)
        self._mark = np.full(1, -1, np.int64)
        # The native receive's state: a header read whose body is next on the
        # socket, the frame log, and a corrupt frame to raise after the frames
        # received before it were returned.
        self._head = np.zeros(native_frames.HEADER_BYTES, np.uint8)
        self._have_head = False
        self._log = np.zeros((RUN_FRAMES, 2), np.int64)
        self._corrupt: CorruptFrame | None = None
        self.job = job
        self.token = job.encode()
        self.refusals: list[tuple[str, str]] = []
        if secret is None:
            secret = from_environment()
        if secret is None:
            raise SecretError("the chunk channel needs the job's secret (secret=..., or "
                              "CAPRICORN_CHANNEL_SECRET / CAPRICORN_CHANNEL_SECRET_FILE)")
        identity = channel_hello.identity(shared)
        if address is None:
            from jax._src import distributed

            address = job_address(distributed.global_state.coordinator_address)
        listener = socket.create_server((address, 0))
        acceptor = channel_hello.Acceptor(
            listener, channel_hello.Party(host, source, self.token, secret, identity),
            time.monotonic() + timeout_s, min(hello_timeout_s, timeout_s), self._refused)
        acceptor.start()
        try:
            client.key_value_set(_KEY.format(job=job, host=host),
                                 f"{address}:{listener.getsockname()[1]}")
            peer_address, port = client.blocking_key_value_get(
                _KEY.format(job=job, host=destination), int(timeout_s * 1000)).rsplit(":", 1)
            self.out = socket.create_connection((peer_address, int(port)), timeout=timeout_s)
            try:
                channel_hello.say_hello(self.out, channel_hello.Party(
                    host, destination, self.token, secret, identity), timeout_s)
            except BaseException:
                self.out.close()
                raise
        except TimeoutError as e:
            acceptor.stop()
            listener.close()
            refused = "" if not self.refusals else f"; last refusal: {self.refusals[-1][1]}"
            raise TimeoutError(f"host {host}: host {destination} did not connect its chunk "
                               f"channel within {timeout_s:g}s ({e}{refused})") from None
        except channel_hello.BuildMismatch as e:
            acceptor.settle(MISMATCH_GRACE_S)  # the peer's hello to us hears our build too
            acceptor.stop()
            listener.close()
            raise channel_hello.BuildMismatch(f"host {host}: chunk channel to host "
                                              f"{destination}: {e}") from None
        except channel_hello.HelloRefused:
            # The peer may have stopped at a mismatch it saw first and closed
            # on us: our acceptor then hears its hello; name the mismatch.
            acceptor.wait(MISMATCH_GRACE_S)
            acceptor.stop()
            listener.close()
            if acceptor.mismatch is not None:
                raise channel_hello.BuildMismatch(f"host {host}: host {source}'s chunk "
                                                  f"channel: {acceptor.mismatch}") from None
            raise
        except BaseException:
            acceptor.stop()
            listener.close()
            raise
        acceptor.wait(max(0.0, timeout_s + 1.0))
        acceptor.stop()
        listener.close()
        if acceptor.mismatch is not None:
            self.out.close()
            raise channel_hello.BuildMismatch(f"host {host}: host {source}'s chunk channel: "
                                              f"{acceptor.mismatch}")
        if acceptor.conn is None:
            self.out.close()
            why = f"last refusal: {self.refusals[-1][1]}" if self.refusals else acceptor.error
            raise TimeoutError(f"host {host}: host {source} did not connect its chunk channel "
                               f"within {timeout_s:g}s ({why})")
        self.inc: socket.socket = acceptor.conn
        self._sockets = HeldSockets(f"host {host}'s chunk channel", self.out, self.inc)
        for s in (self.out, self.inc):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(timeout_s)
        # A small send buffer: ``send`` returns when a window's bytes are
        # nearly on the link, not parked in the kernel to leave during the
        # next all-to-all (pacing to the window).
        self.out.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        # And little of it unsent in the kernel (Linux: a send blocks while
        # more than this is unsent), so what the deadline sender hands over
        # leaves now, and its view of the link (``queued_bytes``) is the link's.
        try:
            self.out.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, NOTSENT_LOWAT)
        except OSError:  # not Linux: the send buffer alone bounds it
            pass
        if tos:  # the checkpoint's traffic class (InMemoryOptions.chunk_tos)
            self.out.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)

    def _refused(self, address: str, reason: str) -> None:
        """A connection the listener refused: counted and logged with its address."""
        self.refusals.append((address, reason))
        log.warning("host %d: chunk channel refused a connection from %s: %s (%d refused)",
                    self.host, address, reason, len(self.refusals))

    @_holding
    def send(self, version: int, offset: int, rows: np.ndarray | Sequence[np.ndarray]) -> None:
        """Sends ``rows`` (one uint8 row of n bytes per local device: a
        [devices, n] array or views of each device's buffer) as bytes
        [offset, offset + n) of ``version``; each row goes from its own memory,
        without a copy when it is contiguous."""
        lengths = {len(r) for r in rows}
        if len(lengths) != 1:
            raise ValueError(f"rows of different lengths {sorted(lengths)}")
        views = [np.ascontiguousarray(row).data.cast("B") for row in rows]
        # Before the bytes leave: end to end (CRC32C releases the GIL).
        header = integrity.pack_header(version, offset, lengths.pop(), views)
        if self.flip_version is not None and version >= self.flip_version:  # fault injection
            self.flip_version = None
            flipped = bytearray(views[0])
            flipped[len(flipped) // 2] ^= 0xFF
            views[0] = memoryview(flipped)
            if self.on_flip is not None:
                self.on_flip(version)
        if self.stall_at is not None and version >= self.stall_at[0]:  # fault injection
            seconds, self.stall_at = self.stall_at[1], None
            if self.on_stall is not None:
                self.on_stall(version)
            self._closed.wait(seconds)  # a hung connection: nothing leaves (until closed)
        _send_all(self.out, [header, *views])

    @_holding
    def send_window(self, rows: list[np.ndarray] | native_frames.SendRows, version: int, lo: int,
                    hi: int, per_row: int,
                    closes: float, rate: float, queue_bound: int, link: tuple[float, float],
                    edges: tuple[np.ndarray, np.ndarray, int, float] | None,
                    wake_fd: int = -1
                    ) -> tuple[int, list[tuple[float, float, int]], tuple[float, float],
                               BaseException | None]:
        """``native.frames.send_window`` on the sending socket (the deadline
        sender's native loop), with the channel's corrupt-frame fault
        (``flip_version``) applied there as in ``send``, after its checksum."""
        flip = self.flip_version is not None and version >= self.flip_version
        out = native_frames.send_window(self.out.fileno(), rows, version, lo, hi, per_row,
                                        closes, rate, queue_bound, link, edges, self.timeout_s,
                                        flip=flip, wake_fd=wake_fd)
        if flip and out[1]:  # a frame left flipped
            self.flip_version = None
            if self.on_flip is not None:
                self.on_flip(version)
        return out

    def out_fileno(self) -> int | None:
        """The sending socket's descriptor (the native marks sample its queue), or None."""
        try:
            fd = self.out.fileno()
        except (AttributeError, OSError):
            return None
        return fd if fd >= 0 else None

    def queued_bytes(self) -> int | None:
        """Bytes this host handed to the kernel for the peer that the peer has
        not acknowledged yet (Linux ``SIOCOUTQ``: in the socket's queue, in a
        shaped link's queue or on the wire); None where the kernel does not
        say. One ioctl, cheap enough for a window's closing mark."""
        if fcntl is None or termios is None:
            return None
        try:
            out = fcntl.ioctl(self.out.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
            return int.from_bytes(out, "little", signed=True)
        except (OSError, AttributeError, ValueError):
            return None

    @_holding
    def receive_into(self, buffers: Callable[[int], np.ndarray | None], idle_ok: bool = False
                     ) -> tuple[int, int, int] | None:
        """Receives one frame into ``buffers(version)``; (version, offset, length).
        When ``buffers`` gives None the frame is read and discarded.
        ``idle_ok``: when no byte of a frame came within the socket's timeout,
        returns None (the receive loop's wait between steps, which is not a
        failure); otherwise the timeout raises.

        Raises:
          CorruptFrame: the frame's bytes do not match the checksum its sender
            computed (read whole: the next frame can be received).
          CorruptHeader: the frame's header fails its own checksum (the
            stream cannot be read on).
        """
        header = bytearray(_HEADER.size)
        view = memoryview(header)
        if idle_ok:
            try:  # one wake-up once a header is queued, or the socket's timeout
                view = view[_recv_exact(self.inc, view, self._mark, once=True):]
            except TimeoutError:
                return None
        # Once a frame began, the rest of it is due within the bound: a peer
        # that stalls mid-frame ends the receive with an error naming it.
        idle = self.inc.gettimeout()
        if idle != self.timeout_s:  # (the receive loop's socket keeps the bound: no call)
            if view.nbytes == len(header):
                _recv_exact(self.inc, view[:1], self._mark)  # the first byte: as the socket says
                view = view[1:]
            self.inc.settimeout(self.timeout_s)
        try:
            _recv_exact(self.inc, view, self._mark)
            return self._receive_body(header, buffers)
        except TimeoutError:
            raise TimeoutError(f"host {self.host}: host {self.source} stopped mid-frame for "
                               f"over {self.timeout_s:g}s") from None
        finally:
            if idle != self.timeout_s:
                self.inc.settimeout(idle)

    @_holding
    def receive_frames(self, buffers: Callable[[int], np.ndarray | None],
                       remaining: Callable[[int], int], idle_ok: bool = False
                       ) -> list[tuple[int, int, int]] | None:
        """``receive_into`` for a run of frames, in native code with the GIL
        released (``native.frames``; call only where it is available): the
        frames of one version go straight into ``buffers(version)`` until
        they cover ``remaining(version)`` bytes of a row, another version's
        frame comes, or none within the socket's timeout. Returns the frames
        received, [(version, offset, length)] (a discarded frame's too), or
        None (``idle_ok``) when no frame came.

        Raises:
          CorruptFrame: as ``receive_into`` (after the frames before it were
            returned: on the next call).
          TimeoutError: a frame began and stopped for over ``timeout_s``.
        """
        if self._corrupt is not None:
            corrupt, self._corrupt = self._corrupt, None
            raise corrupt
        fd, idle = self.inc.fileno(), self.inc.gettimeout()
        idle_s = self.timeout_s if idle is None else idle
        if not self._have_head:  # wait for a frame's header
            status, _, error = native_frames.receive_frames(
                fd, -1, None, 0, self._head, False, False, idle_s, self.timeout_s, self._mark,
                self._log)
            self._raise(error)
            if status == native_frames.IDLE:
                if idle_ok:
                    return None
                raise TimeoutError(f"host {self.host}: no frame from host {self.source} "
                                   f"within {idle_s:g}s")
            self._have_head = True
        version, offset, length, _, _, _ = _HEADER.unpack(self._head.tobytes())
        target = buffers(version)
        status, frames, error = native_frames.receive_frames(
            fd, version, target, remaining(version) if target is not None else 0, self._head,
            True, target is None, idle_s, self.timeout_s, self._mark, self._log)
        self._have_head = status == native_frames.HEADER
        self._raise(error, None if target is None else target.shape)
        if status == native_frames.DISCARDED:
            return [(version, offset, length)]
        got = [(version, int(o), int(n)) for o, n in frames]
        if status == native_frames.CORRUPT:
            v, offset, length, rows, crc, _ = _HEADER.unpack(self._head.tobytes())
            corrupt = CorruptFrame(v, f"host {self.host}: version {v}: a frame of {rows} x "
                                      f"{length} bytes at {offset} from host {self.source} fails "
                                      f"its checksum (sent {crc:#010x})")
            if not got:
                raise corrupt
            self._corrupt = corrupt
        return got

    def _raise(self, error: BaseException | None, shape: tuple[int, ...] | None = None) -> None:
        """A native receive's error, named after this channel's ends (a
        refused frame's after its header, in ``_head``, and ``shape``)."""
        if isinstance(error, integrity.FrameRejected):
            version, offset, length, rows, _, _ = _HEADER.unpack(self._head.tobytes())
            raise integrity.FrameRejected(error.reason, self._misfit(version, offset, length,
                                                                     rows, shape))
        if isinstance(error, TimeoutError):
            raise TimeoutError(f"host {self.host}: host {self.source} stopped mid-frame for "
                               f"over {self.timeout_s:g}s") from None
        if isinstance(error, integrity.CorruptHeader):
            raise integrity.CorruptHeader(f"host {self.host}: from host {self.source}: {error}; "
                                          f"the channel cannot be read on") from None
        if error is not None:
            raise type(error)(f"host {self.host}: from host {self.source}: {error}")

    def _receive_body(self, header: bytearray, buffers: Callable[[int], np.ndarray | None]
                      ) -> tuple[int, int, int]:
        try:
            version, offset, length, rows, crc = integrity.read_header(header)
        except integrity.CorruptHeader as e:
            raise integrity.CorruptHeader(f"host {self.host}: from host {self.source}: {e}; "
                                          f"the channel cannot be read on") from None
        # Bounds every frame keeps, before anything waits on its version.
        why = integrity.frame_rejection(rows, offset, length)
        target = None if why is not None else buffers(version)
        if target is not None:
            why = integrity.frame_rejection(rows, offset, length, *target.shape)
        if why is not None:
            integrity.count_rejection(why)
            raise integrity.FrameRejected(why, self._misfit(
                version, offset, length, rows, None if target is None else target.shape))
        if target is None:
            scratch = memoryview(bytearray(min(max(length, 1), 1 << 20)))
            left = rows * length  # both bounded (frame_rejection)
            while left > 0:
                n = min(left, len(scratch))
                _recv_exact(self.inc, scratch[:n], self._mark)
                left -= n
            return version, offset, length
        got = integrity.crc32c(header[:integrity.FIELD_BYTES])
        for r in range(rows):  # checked as placed
            _recv_exact(self.inc, target[r, offset:offset + length].data, self._mark)
            got = integrity.crc32c(target[r, offset:offset + length].data, got)
        if got != crc:
            raise CorruptFrame(version, f"host {self.host}: version {version}: a frame of "
                                        f"{rows} x {length} bytes at {offset} from host "
                                        f"{self.source} fails its checksum (CRC32C "
                                        f"{got:#010x}, sent {crc:#010x})")
        return version, offset, length

    def _misfit(self, version: int, offset: int, length: int, rows: int,
                shape: tuple[int, ...] | None) -> str:
        """What a refused frame's error says."""
        where = f"version {version}'s {shape}" if shape is not None else "any buffer"
        return (f"host {self.host}: a frame of {rows} x {length} bytes at {offset} from host "
                f"{self.source} does not fit {where}")

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
        """Closes both connections; a thread blocked in a send or receive on
        them wakes with an error (``shutdown`` first: ``close`` alone would
        leave it blocked until its timeout), and their descriptors are
        released once no send or receive holds them (``held_sockets``)."""
        self._closed.set()
        self._sockets.close()


def measure_channel(channel: ChunkChannel, rows: int) -> partitioner.LinkModel:
    """alpha + bytes/B of the chunk channel, host 0's fit on every host; a fit
    that fails (times that do not grow with size) is measured again, up to
    ``MEASURE_ATTEMPTS`` times (every host decides alike: host 0's times)."""
    for attempt in range(partitioner.MEASURE_ATTEMPTS):
        sizes, times = channel.measure(rows=rows)
        # Per-row bytes (the schedule's unit): every local row of a range goes at once.
        agreed = agree_measured(times, what="the chunk channel's measured times")
        try:
            return partitioner.fit_link_model(sizes, agreed)
        except ValueError as e:
            if attempt == partitioner.MEASURE_ATTEMPTS - 1:
                raise
            log.info("host %d: chunk channel measured again (%s)", channel.host, e)
    raise AssertionError("unreachable")
