"""The chunk channel's hello: a challenge-response over the job's secret, both ways.

A connection to a chunk channel's listener is taken as its source host only
once both ends proved they know the job's secret (``multihost.secret``) on
nonces fresh for this connection, and then only when both run the same
build (``identity``). Three messages, the connecting side first:

1. ``hello``: magic ``CJH1``, the connector's host, its nonce (32 random
   bytes), its identity text and the channel's token (the key of the
   channel in the job: which channel of which reconnect attempt);
2. ``reply``: magic, the listener's host, its nonce, its identity, and
   ``HMAC-SHA256(secret, "listener" | hello | reply)``;
3. ``proof``: ``HMAC-SHA256(secret, "connector" | hello | reply)``.

The connector checks the reply's MAC (the listener knows the secret and
answered this hello: its nonce is in it), sends its proof and then compares
the identities; the listener checks the proof (the connector knows the
secret and is live: the listener's nonce is in it), then the identities.
Each side's MAC covers the whole exchange with a label of its own, so a
listener's answer cannot be reflected as a proof, and a recorded exchange
replayed fails at the proof (the listener's nonce is new). A hello whose
nonce this process already saw is refused before any reply (a replay, named
as one). Identities that differ once both proved the secret are the job's
own hosts on different builds: that stops the channel's setup on both
ends with an error naming both identities (``BuildMismatch``). Anything
unproven (a wrong magic, a bad MAC, another token, another host) is only
a refusal: logged with the peer's address, counted, the connection closed,
and the listener goes on waiting; so no stranger can stop or delay a job.

Every pending connection runs its hello on its own thread with its own
deadline (``HELLO_TIMEOUT_S``, at most the channel's bound; at most
``MAX_PENDING`` at once, more are refused at once): a connection that
never speaks holds only its own thread, and the first connection to
complete a valid hello becomes the channel while the others are closed.

What this does not do: hide the frames (no encryption), or, without a
keyed MAC per frame, stop an attacker on the path between the hosts from
changing frames after the hello (the CRC32C stops accidents, not intent).
``docs/design.md``'s threat model says what each check stops.

Design choice: HMAC-SHA256 from the standard library over a shared secret,
a thread per pending connection. Alternatives not taken: TLS with
certificates (a certificate authority per job, and the CPU of encrypting
every checkpoint byte, to gain a confidentiality the threat model does not
ask for); a select loop over the pending sockets (one thread, but each of
the three messages as a state machine; a pending hello is rare and its
thread short-lived).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

from capricorn_jax._src.multihost.agree import PACKAGE_VERSION
from capricorn_jax._src.native.integrity import MAGIC as FRAME_MAGIC

MAGIC = b"CJH1"
"""The hello's format (bumped when a message's layout changes)."""
PROTOCOL = "cjx-channel/4"
"""The channel's protocol: the hello and the frames (named in the identity)."""
HELLO_TIMEOUT_S = 10.0
"""The most one connection may take to complete its hello (each its own)."""
MAX_PENDING = 16
"""Connections whose hello is under way at once; more are refused at once."""
MAX_IDENTITY = 1024
MAX_TOKEN = 4096
NONCE = 32
_DIGEST = 32
_HELLO = struct.Struct("<4sq32sHH")  # magic, host, nonce, identity's length, token's length
_REPLY = struct.Struct("<4sq32sH")  # magic, host, nonce, identity's length; then identity, MAC
_SEEN = 4096  # the nonces of recent hellos this process keeps (replays)


class HelloRefused(ConnectionError):
    """A connection that did not complete a valid hello (not this job's
    source host, or not proven)."""


class BuildMismatch(ConnectionError):
    """This job's own peer, proven, runs another build or configuration."""


def identity(shared: str) -> str:
    """The identity a host states in its hello: the package's version, the
    channel's protocol, the frames' format, and ``shared``, the digest of what both ends must
    share (the pack plan's fingerprint, the rounds, ...)."""
    return (f"capricorn_jax {PACKAGE_VERSION}; {PROTOCOL}; frames {FRAME_MAGIC.decode()}; "
            f"shared {shared or 'none'}")


@dataclasses.dataclass(frozen=True)
class Party:
    """One end's side of the hello: its host, the host expected at the other
    end, the channel's token, the job's secret and its identity text."""

    host: int
    peer: int
    token: bytes
    secret: bytes
    identity: str

    def __post_init__(self) -> None:
        if len(self.token) > MAX_TOKEN:
            raise ValueError(f"channel token of {len(self.token)} bytes; at most {MAX_TOKEN}")
        if len(self.identity.encode()) > MAX_IDENTITY:
            raise ValueError(f"identity of {len(self.identity.encode())} bytes; at most "
                             f"{MAX_IDENTITY}")


class _Seen:
    """Nonces of the hellos this process heard (bounded, oldest dropped)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.order: collections.deque[bytes] = collections.deque()
        self.set: set[bytes] = set()

    def first_time(self, nonce: bytes) -> bool:
        with self.lock:
            if nonce in self.set:
                return False
            self.order.append(nonce)
            self.set.add(nonce)
            if len(self.order) > _SEEN:
                self.set.discard(self.order.popleft())
            return True


_seen = _Seen()


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"\0".join([b"capricorn chunk channel " + label, *parts]),
                    hashlib.sha256).digest()


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes from ``sock``, all of them by ``deadline`` (a peer that
    sends a byte at a time gains nothing)."""
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(out)} of {n} bytes by the hello's deadline")
        sock.settimeout(left)
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError("the peer closed the connection")
        out += got
    return bytes(out)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(data)


def _format(magic: bytes) -> str:
    if magic.startswith(MAGIC[:2]):
        return (f"a chunk channel of another format ({magic!r}; this host speaks {MAGIC!r}): "
                f"an older or newer build")
    return f"not a chunk channel hello ({magic!r})"


def say_hello(sock: socket.socket, me: Party, timeout_s: float) -> None:
    """The connecting side's hello on ``sock`` (``me.peer``: the listener's host).

    Raises:
      HelloRefused: the listener did not prove the secret, or closed the
        connection (it refused this host: its log says why).
      TimeoutError: it did not answer within ``timeout_s``.
      BuildMismatch: the listener, proven, runs another build (both named).
    """
    deadline = time.monotonic() + timeout_s
    identity_bytes = me.identity.encode()
    hello = _HELLO.pack(MAGIC, me.host, secrets.token_bytes(NONCE), len(identity_bytes),
                        len(me.token)) + identity_bytes + me.token
    try:
        _send(sock, hello, deadline)
        head = _read(sock, _REPLY.size, deadline)
        magic, host, _, size = _REPLY.unpack(head)
        if magic != MAGIC:
            raise HelloRefused(f"host {me.peer}'s listener answered with {_format(magic)}")
        if size > MAX_IDENTITY:
            raise HelloRefused(f"host {me.peer}'s listener stated an identity of {size} bytes")
        their_identity = _read(sock, size, deadline)
        mac = _read(sock, _DIGEST, deadline)
    except (OSError, ConnectionError) as e:
        if isinstance(e, HelloRefused):
            raise
        if isinstance(e, TimeoutError):
            raise TimeoutError(f"no answer to this host's hello within {timeout_s:g}s") from None
        raise HelloRefused(f"host {me.peer} did not answer this host's hello ({type(e).__name__}"
                           f": {e}); it refused the connection (its log says why) or is "
                           f"not there") from None
    reply = head + their_identity
    if not hmac.compare_digest(mac, _mac(me.secret, b"listener", hello, reply)):
        raise HelloRefused(f"the listener of host {me.peer} did not prove the job's secret: "
                           f"the hosts hold different secrets (give every host the same "
                           f"file or environment variable), or another process listens there")
    if host != me.peer:
        raise HelloRefused(f"the listener answered as host {host}, not host {me.peer}")
    _send(sock, _mac(me.secret, b"connector", hello, reply + mac), deadline)
    theirs = their_identity.decode(errors="replace")
    if theirs != me.identity:
        raise BuildMismatch(f"host {me.peer} runs another build: {theirs!r}; this host "
                            f"{me.identity!r}")


def hear_hello(sock: socket.socket, me: Party, deadline: float) -> None:
    """The listening side's hello on ``sock`` (``me.peer``: the source host
    expected), completed by ``deadline``.

    Raises:
      HelloRefused: not this job's source host, or not proven (the reason).
      BuildMismatch: the source host, proven, runs another build (both named).
    """
    try:
        magic = _read(sock, len(MAGIC), deadline)  # another format is named at once
        if magic != MAGIC:
            raise HelloRefused(_format(magic))
        head = magic + _read(sock, _HELLO.size - len(MAGIC), deadline)
        _, host, nonce, size, token_size = _HELLO.unpack(head)
        if size > MAX_IDENTITY or token_size > MAX_TOKEN:
            raise HelloRefused(f"a hello of {size} identity and {token_size} token bytes")
        their_identity = _read(sock, size, deadline)
        token = _read(sock, token_size, deadline)
        if not _seen.first_time(nonce):
            raise HelloRefused("a replayed hello (its nonce was heard before)")
        if token != me.token:
            raise HelloRefused(f"another channel's token ({token[:64]!r})")
        if host != me.peer:
            raise HelloRefused(f"host {host}, not this host's source host {me.peer}")
        hello = head + their_identity + token
        identity_bytes = me.identity.encode()
        reply = _REPLY.pack(MAGIC, me.host, secrets.token_bytes(NONCE),
                            len(identity_bytes)) + identity_bytes
        mac = _mac(me.secret, b"listener", hello, reply)
        _send(sock, reply + mac, deadline)
        proof = _read(sock, _DIGEST, deadline)
    except HelloRefused:
        raise
    except (OSError, ConnectionError) as e:
        raise HelloRefused(f"no hello ({type(e).__name__}: {e})") from None
    if not hmac.compare_digest(proof, _mac(me.secret, b"connector", hello, reply + mac)):
        raise HelloRefused("it did not prove the job's secret (a hello without the secret, "
                           "or a replayed one)")
    theirs = their_identity.decode(errors="replace")
    if theirs != me.identity:
        raise BuildMismatch(f"host {me.peer} runs another build: {theirs!r}; this host "
                            f"{me.identity!r}")


class Acceptor:
    """Accepts connections on ``listener`` until one completes its hello
    (``hear_hello``) or ``deadline``; each pending connection on its own
    thread, bounded by ``hello_timeout_s``. ``on_refusal(address, reason)``:
    called for each refusal (the channel counts and logs them)."""

    def __init__(self, listener: socket.socket, me: Party, deadline: float,
                 hello_timeout_s: float, on_refusal: Callable[[str, str], None]) -> None:
        self.listener, self.me, self.deadline = listener, me, deadline
        self.hello_timeout_s = hello_timeout_s
        self.on_refusal = on_refusal
        self.done = threading.Event()
        self.conn: socket.socket | None = None
        self.mismatch: BuildMismatch | None = None
        self.error = "no connection"
        self._lock = threading.Lock()
        self._pending: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"chunk-channel-accept-{me.host}")

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self.done.is_set():
                left = self.deadline - time.monotonic()
                if left <= 0:
                    return
                self.listener.settimeout(min(left, 0.25))
                try:
                    conn, address = self.listener.accept()
                except TimeoutError:
                    continue
                except OSError as e:  # the listener closed (the setup ended)
                    self.error = f"{type(e).__name__}: {e}"
                    return
                with self._lock:
                    crowded = len(self._pending) >= MAX_PENDING
                    if not crowded:
                        self._pending.add(conn)
                if crowded:
                    self._refuse(conn, address, f"{MAX_PENDING} hellos already under way")
                    continue
                threading.Thread(target=self._hello, args=(conn, address), daemon=True,
                                 name=f"chunk-channel-hello-{self.me.host}").start()
        finally:
            self.done.set()
            self._close_pending()

    def _hello(self, conn: socket.socket, address: tuple) -> None:
        deadline = min(self.deadline, time.monotonic() + self.hello_timeout_s)
        try:
            hear_hello(conn, self.me, deadline)
        except HelloRefused as e:
            with self._lock:
                self._pending.discard(conn)
            if not self.done.is_set():
                self._refuse(conn, address, str(e))
            else:
                conn.close()
            return
        except BuildMismatch as e:
            with self._lock:
                self._pending.discard(conn)
                self.mismatch = self.mismatch or e
            conn.close()
            self.done.set()
            return
        with self._lock:
            self._pending.discard(conn)
            won = self.conn is None and self.mismatch is None and not self.done.is_set()
            if won:
                self.conn = conn
        if won:
            self.done.set()
        else:
            conn.close()

    def _refuse(self, conn: socket.socket, address: tuple, reason: str) -> None:
        self.error = reason
        self.on_refusal(f"{address[0]}:{address[1]}", reason)
        try:
            conn.close()
        except OSError:
            pass

    def _close_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, set()
        for conn in pending:  # their threads wake with an error and end
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def wait(self, timeout_s: float) -> None:
        """Until a connection was taken, the setup must stop, or ``timeout_s``."""
        self.done.wait(timeout_s)

    def settle(self, timeout_s: float) -> None:
        """Until no hello is under way, or ``timeout_s``: a peer's hello in
        progress then hears this host's identity before the listener closes."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                if not self._pending:
                    return
            time.sleep(0.02)

    def stop(self) -> None:
        self.done.set()
        self._thread.join(1.0)
        self._close_pending()
