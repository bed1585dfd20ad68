"""Cross-host agreement on small values: every host takes the same decision.

The library's multi-host decisions (which version to recover, whether the
persistent root is writable, which experts a persisted step carries, the
durations a schedule is built from) are taken by every host from the same
inputs, so that the collectives each host then runs match. The primitives:

* ``allgather_json``: every host's JSON document, in process order (each host
  sees all the answers, e.g. to refuse together when one host has a problem);
* ``broadcast_json`` / ``agree_floats``: host 0's document or numbers on every
  host (one host decides, e.g. the primary host's view of the persistent steps,
  or the measured durations a schedule is partitioned from);
* ``allgather_floats``: every host's numbers (measurements to report, or a
  barrier).

A document travels as a JSON string through the ``jax.distributed`` key-value
store: every host sets its key of the agreement (agreements are numbered in
call order, the same on every host) and reads every host's key with one
deadline, so a host that never answers ends the wait with an
``AgreementTimeout`` naming that host, the agreement and what the caller
waited for (``what``), after ``timeout_s`` (default: ``set_timeout``'s value
for the process, ``DEFAULT_TIMEOUT_S`` until then). A host deletes its key of
the previous agreement once it has read every key of the current one (every
host has then finished reading the previous one). On one process nothing is
exchanged.

Every key carries the agreement's identity with the document: the protocol
(``PROTOCOL``), the package's version (``PACKAGE_VERSION``), ``what`` the
caller agrees on, and the digest of what the hosts must share (``shared``:
the pack plan's fingerprint, the replication rounds, the strategy and its
PEC options, agreed once at a strategy's start by ``agree_shared``; empty
before). A host whose key differs in any of them at the same number (hosts
running different builds, or out of step) ends the agreement with an
``AgreementMismatch`` naming both hosts and both identities, instead of
reading the other's document as its own. ``agree_shared`` itself compares
the parts of the digest and names each part that differs with both hosts'
values. Alternative not taken: the digest only in the agreements that
concern the plan (recovery's, the persistent tier's): every agreement
carrying it costs ~20 bytes a key, and a caller that forgets to pass it
(recovery's agreements once used the default subject) is still covered.

A timed-out agreement is neither retried nor skipped: the hosts' agreements
are matched by their order, which a host that gave up can no longer keep, so
the error propagates and ends the job (the launcher restarts it and recovery
resumes from the memory tier). The default bound is longer than the
persistent tier's (``CapricornHandler.commit_timeout_s``, also Orbax's
barrier timeout): a host that failed a persistent write alone waits at the next
agreement while the others time out at Orbax's barrier, and the job goes on.

Design choice: the key-value store, read with a deadline. Alternatives not
taken: collectives over the processes (``multihost_utils``, used here
before): a collective that one host never joins hangs inside XLA, cannot be
interrupted from Python and cannot say which host is missing; a watchdog
thread around such a collective could only end the process, still without
naming the host. The store's client is a private JAX API
(``capricorn_jax.experimental.distributed_client``), already used by the
chunk channel to exchange addresses.

Agreements are numbered per ``stream``: the training thread's share the
default stream; a thread of its own that agrees while the training thread
runs on (capricorn's background re-plans, ``strategies.planners``) passes its
stream, whose agreements are numbered apart (their keys are
``capricorn/agree/<stream>/<n>/<host>``), so the two threads' call orders
never interleave into one numbering. Every host must make a stream's
agreements in the same order, as for the default one.

Every function takes ``hosts``, the number of processes taking part (default
``jax.process_count()``); with ``hosts == 1`` nothing is exchanged, which is
how a single-process caller that simulates several hosts stays local.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

DEFAULT_TIMEOUT_S = 1800.0
PROTOCOL = "cjx-agree/2"
"""The agreement's wire format (bumped when a key's layout changes)."""
_KEY = "capricorn/agree/{stream}{seq}/{host}"


def _package_version() -> str:
    try:
        return importlib.metadata.version("capricorn_jax")
    except importlib.metadata.PackageNotFoundError:  # a checkout used without installing it
        return "unknown"


PACKAGE_VERSION = _package_version()
"""This build's version, carried by every agreement and every chunk channel hello."""


class AgreementTimeout(TimeoutError):
    """A host did not answer a cross-host agreement within its bound."""


class AgreementMismatch(RuntimeError):
    """Two hosts took part in the same agreement on different things (or with
    different protocols): their code or their call order differs."""


def _envelope(what: str, doc: str, shared: str) -> str:
    return json.dumps([PROTOCOL, what, doc, PACKAGE_VERSION, shared])


def _identity(protocol: str, package: str, shared: str) -> str:
    return f"{protocol}, capricorn_jax {package}, shared {shared or 'none yet'}"


def _open(raw: str, host: int, other: int, seq: int, what: str, shared: str) -> str:
    """The document of ``other``'s key; raises AgreementMismatch naming both
    hosts and both identities when its protocol, package version, shared
    digest or subject is not this host's."""
    try:
        got = json.loads(raw)
    except ValueError:
        got = None
    if isinstance(got, list) and len(got) == 5 and all(isinstance(x, str) for x in got):
        protocol, theirs, doc, package, their_shared = got
    else:
        protocol, theirs, doc, package, their_shared = "an unknown protocol", None, "", "?", "?"
    mine = (PROTOCOL, PACKAGE_VERSION, shared)
    if (protocol, package, their_shared) != mine or theirs != what:
        their = (f"'{theirs}' ({_identity(protocol, package, their_shared)})"
                 if protocol == PROTOCOL or theirs is not None else f"a key in {protocol}")
        raise AgreementMismatch(
            f"host {host}: agreement #{seq}: this host agrees on '{what}' "
            f"({_identity(*mine)}) but host {other} on {their}; the hosts run different "
            f"code or are out of step, so the job stops")
    return doc


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        # (client, host, stream) -> agreements so far
        self.seq: dict[tuple[int, int, str], int] = {}
        self.shared: dict[tuple[int, int], str] = {}  # (client, host) -> agreed shared digest
        # id -> the client counted under it, held so that no other client takes
        # its id while its counts stand (the store's client takes no weak
        # reference): a new client at a freed one's address started at that
        # one's count (two hosts in one test process, one at #2 and one at #1).
        self.clients: dict[int, Any] = {}
        self.timeout_s = DEFAULT_TIMEOUT_S

    def key(self, client: Any) -> int:
        """``id(client)``, its counts dropped if they were another client's (under the lock)."""
        ident = id(client)
        if self.clients.get(ident) is not client:
            self.clients[ident] = client
            self.seq = {k: v for k, v in self.seq.items() if k[0] != ident}
            self.shared = {k: v for k, v in self.shared.items() if k[0] != ident}
        return ident


_state = _State()


def set_timeout(seconds: float) -> None:
    """The bound of every later agreement of this process (all hosts should set
    the same); it must exceed the persistent tier's ``commit_timeout_s`` (module
    docstring)."""
    if not seconds > 0:
        raise ValueError(f"agreement timeout must be positive, got {seconds}")
    _state.timeout_s = float(seconds)


def current_timeout() -> float:
    """The bound of this process's agreements (``set_timeout``'s value)."""
    return _state.timeout_s


def _jax() -> Any:
    """JAX, imported at the first agreement rather than with this module: a
    process that only reads the options built on it (a launcher's
    supervisor) never starts JAX."""
    import jax

    return jax


def _hosts(hosts: int | None) -> int:
    return _jax().process_count() if hosts is None else hosts


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("cross-host agreement needs jax.distributed.initialize() on every "
                           "host (no key-value store client in this process)")
    return client


def exchange(doc: str, hosts: int, what: str, timeout_s: float | None = None,
             client: Any = None, host: int | None = None, stream: str = "") -> list[str]:
    """Every host's string ``doc`` in process order, through the key-value store.

    Args:
      doc: this host's string.
      hosts: the processes taking part (process indices 0..hosts-1).
      what: what the caller waits for, for the error (e.g. "the pre-check of
        persistent step 12").
      timeout_s: the bound (default: ``set_timeout``'s).
      client, host: the store's client and this host's index (default: this
        process's ``jax.distributed`` client and ``jax.process_index()``).
      stream: the numbering this agreement takes part in ("": the default
        one; module docstring).

    Raises:
      AgreementTimeout: a host did not set its key within the bound; the
        message names it, the agreement's number and ``what``.
      AgreementMismatch: a host's key names another protocol, package
        version, shared digest or ``what`` (module docstring).
    """
    client = _client() if client is None else client
    host = _jax().process_index() if host is None else host
    timeout_s = _state.timeout_s if timeout_s is None else timeout_s
    prefix = f"{stream}/" if stream else ""
    with _state.lock:
        ident = _state.key(client)
        key = (ident, host, stream)
        seq = _state.seq[key] = _state.seq.get(key, 0) + 1
        shared = _state.shared.get((ident, host), "")
    client.key_value_set(_KEY.format(stream=prefix, seq=seq, host=host),
                         _envelope(what, doc, shared))
    deadline = time.monotonic() + timeout_s
    out = []
    for other in range(hosts):
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            raw = client.blocking_key_value_get(_KEY.format(stream=prefix, seq=seq, host=other),
                                                left_ms)
        except Exception as e:  # noqa: BLE001 - the store's deadline error (JaxRuntimeError)
            raise AgreementTimeout(
                f"host {host}: agreement #{seq} ({what}): host {other} did not answer within "
                f"{timeout_s:g}s ({type(e).__name__}: {str(e)[:200]}); the job stops, as its "
                f"hosts can no longer match their agreements") from e
        out.append(_open(raw, host, other, seq, what, shared))
    if seq > 1:
        try:
            client.key_value_delete(_KEY.format(stream=prefix, seq=seq - 1, host=host))
        except Exception:  # noqa: BLE001 - a key left behind costs a few bytes
            pass
    return out


def allgather_json(doc: Any, hosts: int | None = None, what: str = "allgather_json") -> list[Any]:
    """Every host's JSON-able ``doc``, in process order (every host calls it).

    Args:
      doc: this host's document (anything ``json.dumps`` takes).
      hosts: the processes taking part (default: all); 1 exchanges nothing.
      what: what the caller waits for (named by a timeout's error).

    Returns:
      [host 0's doc, host 1's doc, ...] as ``json.loads`` gives them back (the
      local doc itself when ``hosts`` is 1).
    """
    n = _hosts(hosts)
    if n == 1:
        return [doc]
    return [json.loads(x) for x in exchange(json.dumps(doc), n, what)]


def broadcast_json(doc: Any, hosts: int | None = None, what: str = "broadcast_json",
                   stream: str = "") -> Any:
    """Host 0's JSON-able ``doc`` on every host (every host calls it and passes
    its own, only host 0's is used; ``stream``: ``exchange``'s)."""
    n = _hosts(hosts)
    if n == 1:
        return doc
    mine = json.dumps(doc) if _jax().process_index() == 0 else "null"
    return json.loads(exchange(mine, n, what, stream=stream)[0])


def agree_floats(values: Sequence[float | None], hosts: int | None = None,
                 what: str = "agree_floats", stream: str = "") -> list[float | None]:
    """Host 0's ``values`` on every host, as float32 (every host calls it).

    Every host passes as many values. Each value is rounded to float32 on
    every host, host 0 included and on one process too, so that a decision
    taken from the agreed values is the same whatever the process count. None
    stays None (e.g. a duration not measured).
    """
    arr = np.array([np.nan if v is None else v for v in values], np.float32)
    if _hosts(hosts) > 1:
        got = broadcast_json([None if math.isnan(v) else float(v) for v in arr], hosts, what,
                             stream)
        arr = np.array([np.nan if v is None else v for v in got], np.float32)
    return [None if math.isnan(v) else float(v) for v in arr]


def agree_measured(values: Sequence[float], hosts: int | None = None,
                   what: str = "agree_floats", stream: str = "") -> list[float]:
    """``agree_floats`` of measured values (times, durations: never None nor
    NaN), typed as floats; raises ValueError naming a value that came back
    unmeasured (NaN on host 0)."""
    got = agree_floats(values, hosts, what, stream)
    out = [v for v in got if v is not None]
    if len(out) != len(got):
        raise ValueError(f"{what}: host 0's values {[i for i, v in enumerate(got) if v is None]} "
                         f"are NaN, not measured values")
    return out


def allgather_floats(values: Sequence[float], hosts: int | None = None,
                     what: str = "allgather_floats") -> list[list[float]]:
    """Every host's ``values`` (float64, as many on every host), in process
    order; also a barrier: it returns once every host called it."""
    mine = [float(v) for v in values]
    if _hosts(hosts) == 1:
        return [mine]
    return [[float(v) for v in row] for row in allgather_json(mine, hosts, what)]


def shared_digest(parts: Mapping[str, Any]) -> str:
    """The digest of what the hosts must share (16 hex digits of the SHA-256
    of ``parts`` as canonical JSON): the same parts give the same digest on
    every host and in every process."""
    text = json.dumps(dict(parts), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 120 else text[:117] + "..."


def agree_shared(parts: Mapping[str, Any], hosts: int | None = None,
                 what: str = "the shared identity", client: Any = None,
                 host: int | None = None) -> str:
    """Every host checks that the others share ``parts`` (the pack plan's
    fingerprint, the rounds, the strategy, ...); their digest
    (``shared_digest``) is then carried by every later agreement of this
    host. Every host calls it at the same point (a strategy's start).

    Returns:
      The digest.

    Raises:
      AgreementMismatch: a host's parts differ; the message names each part
        that differs with this host's and that host's value, and both digests.
    """
    digest = shared_digest(parts)
    n = _hosts(hosts)
    if n > 1:
        mine = {k: json.loads(json.dumps(v, default=str)) for k, v in parts.items()}
        client = _client() if client is None else client
        host = _jax().process_index() if host is None else host
        docs = exchange(json.dumps(mine, sort_keys=True), n, what, client=client, host=host)
        for other, raw in enumerate(docs):
            theirs = json.loads(raw)
            if theirs == mine:
                continue
            theirs = theirs if isinstance(theirs, dict) else {"(document)": theirs}
            differ = sorted(k for k in {*mine, *theirs} if mine.get(k) != theirs.get(k))
            named = "; ".join(f"{k}: this host {_short(mine.get(k))}, host {other} "
                              f"{_short(theirs.get(k))}" for k in differ)
            raise AgreementMismatch(
                f"host {host}: {what}: host {other} runs another build or configuration "
                f"(digest {shared_digest(theirs)}, this host's {digest}): {named}; the "
                f"hosts' collectives would not match, so the job stops")
        with _state.lock:
            _state.shared[(_state.key(client), host)] = digest
    return digest
