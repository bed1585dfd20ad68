"""Each host's outcome of one persistent write, shared through the job's key-value store.

A persistent step is whole on every host or dropped by every host: after its
write each host publishes its outcome ("ok" or its error) under the save's
key and reads every other host's (``PeerOutcomes.gather``). A host still
waiting inside its own write also *watches* the others' outcomes
(``PeerOutcomes.check``, every ``POLL_S``): when another host has already
failed, this host stops waiting at once and its write fails with
``PeerFailed`` naming that host. Without the watch a failure on the primary
host left the others waiting inside Orbax, whose non-primary hosts poll for
the primary's files until the write's own timeout (a chaos trial with an
injected I/O error on host 0: 324 s, BUILD_NOTES "Bounded waits on other
hosts").

Design choice: polling with non-blocking reads (``key_value_try_get``), not
a blocking get per host on a thread of its own: one loop on the write's own
thread, bounded by the wait it watches, and nothing left behind when the
write ends. Alternative not taken: a cancel broadcast through the store; the
outcome a failed host publishes anyway is that signal.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

OK = "ok"
POLL_S = 0.25
"""How often a host waiting inside its write reads the others' outcomes."""


class PeerFailed(RuntimeError):
    """Another host's persistent write of the same step failed first."""


def outcome_key(seq: int, step: int, host: int) -> str:
    """The store key of ``host``'s outcome of the handler's ``seq``-th save (step ``step``)."""
    return f"capricorn/persist/{seq}/{step}/{host}"


def first_failure(outcomes: Mapping[int, str | None], me: int) -> tuple[int, str] | None:
    """The lowest other host whose published outcome is a failure, with it;
    None while every other host is still writing (None) or succeeded."""
    for host in sorted(outcomes):
        outcome = outcomes[host]
        if host != me and outcome is not None and outcome != OK:
            return host, outcome
    return None


def stopped_message(host: int, outcome: str) -> str:
    return f"stopped: host {host} failed ({outcome})"


class PeerOutcomes:
    """The outcomes of one persistent save on every host (``client``: the
    ``jax.distributed`` client, or any object with its key-value methods)."""

    def __init__(self, client: Any, seq: int, step: int, host: int, hosts: int) -> None:
        self.client, self.seq, self.step, self.host, self.hosts = client, seq, step, host, hosts
        self._last_poll = float("-inf")

    def _key(self, host: int) -> str:
        return outcome_key(self.seq, self.step, host)

    def publish(self, outcome: str) -> None:
        self.client.key_value_set(self._key(self.host), outcome or OK)

    def _try_get(self, host: int) -> str | None:
        try:
            return self.client.key_value_try_get(self._key(host))
        except Exception:  # noqa: BLE001 - the store's not-found error: no outcome yet
            return None

    def check(self, force: bool = False) -> None:
        """Raises ``PeerFailed`` when another host already failed (reads the
        store at most once per ``POLL_S`` unless ``force``)."""
        now = time.monotonic()
        if not force and now - self._last_poll < POLL_S:
            return
        self._last_poll = now
        failed = first_failure({h: self._try_get(h) for h in range(self.hosts)
                                if h != self.host}, self.host)
        if failed is not None:
            raise PeerFailed(stopped_message(*failed))

    def gather(self, timeout_s: float) -> list[str]:
        """Every host's outcome (this one's included), each "ok" or its error;
        a host that published none within ``timeout_s`` reads as such."""
        deadline = time.monotonic() + timeout_s
        failed = []
        for host in range(self.hosts):
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                outcome = self.client.blocking_key_value_get(self._key(host), left_ms)
            except Exception:  # noqa: BLE001 - the store's deadline error
                outcome = f"no outcome within {timeout_s:g}s"
            if outcome != OK:
                failed.append(f"host {host}: {outcome}")
        return failed


def wait_watching(futures: Sequence[Any], timeout_s: float, peers: PeerOutcomes | None) -> None:
    """``f.result(timeout=timeout_s)`` for each of ``futures`` (Orbax's commit
    futures of this host's write), while ``peers`` is watched: another host's
    failure raises ``PeerFailed`` at once. The futures are waited on by a
    daemon thread, which ends within ``timeout_s`` per future whatever
    happens here."""
    if peers is None or not futures:
        for f in futures:
            f.result(timeout=timeout_s)
        return
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            for f in futures:
                f.result(timeout=timeout_s)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            outcome.append(e)

    waiter = threading.Thread(target=run, daemon=True, name="capricorn-persist-commit")
    waiter.start()
    while waiter.is_alive():
        waiter.join(POLL_S)
        if waiter.is_alive():
            peers.check(force=True)
    if outcome and outcome[0] is not None:
        raise outcome[0]


def poll_until(ready: Callable[[], bool], timeout_s: float, what: str,
               peers: PeerOutcomes | None, cancelled: Callable[[], bool] = lambda: False,
               on_cancel: Callable[[], BaseException] | None = None) -> None:
    """Waits (10 ms polls) until ``ready()``; raises TimeoutError naming
    ``what`` after ``timeout_s``, ``on_cancel()`` when ``cancelled()``, and
    ``PeerFailed`` when another host failed meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if cancelled():
            raise on_cancel() if on_cancel is not None else RuntimeError(f"{what}: cancelled")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s:.0f}s")
        if peers is not None:
            peers.check()
        time.sleep(0.01)
