"""persistent.outcomes: every host's outcome of one persistent write, one process.

The key-value store is a dict behind the client's methods (a stand-in for the
``jax.distributed`` client, which the multi-process tests in
tests/test_strategies.py use for real)."""

import threading
import time
from concurrent.futures import Future

import pytest

from capricorn_jax._src.persistent import outcomes
from capricorn_jax._src.persistent.outcomes import (
    PeerFailed,
    PeerOutcomes,
    first_failure,
    poll_until,
    wait_watching,
)


class Store:
    def __init__(self):
        self.kv: dict[str, str] = {}

    def key_value_set(self, key, value):
        self.kv[key] = value

    def key_value_try_get(self, key):
        if key not in self.kv:
            raise KeyError(f"NOT_FOUND: {key}")
        return self.kv[key]

    def blocking_key_value_get(self, key, timeout_ms):
        deadline = time.monotonic() + timeout_ms / 1000
        while key not in self.kv:
            if time.monotonic() > deadline:
                raise TimeoutError(f"DEADLINE_EXCEEDED: {key}")
            time.sleep(0.001)
        return self.kv[key]


def test_first_failure_is_the_lowest_other_host_that_failed():
    assert first_failure({0: None, 1: "ok", 2: None}, me=0) is None
    assert first_failure({0: "OSError: x", 1: None}, me=0) is None  # its own failure
    assert first_failure({0: None, 1: "ok", 2: "E: b", 3: "E: a"}, me=0) == (2, "E: b")
    assert first_failure({3: "E: a", 1: "E: b"}, me=2) == (1, "E: b")


def test_check_stops_on_another_hosts_published_failure_only():
    store = Store()
    h0, h1, h2 = (PeerOutcomes(store, 7, 4, h, 3) for h in range(3))
    h1.check(force=True)  # nothing published: still writing
    h1.publish("")  # "" is success
    h0.check(force=True)
    assert store.kv == {"capricorn/persist/7/4/1": "ok"}
    h2.publish("OSError: [Errno 5] disk")
    with pytest.raises(PeerFailed) as e:
        h0.check(force=True)
    assert str(e.value) == "stopped: host 2 failed (OSError: [Errno 5] disk)"
    h2.check(force=True)  # its own failure is not a peer's
    # Another save's keys are apart: the same hosts at save 8 see nothing yet.
    PeerOutcomes(store, 8, 4, 0, 3).check(force=True)


def test_gather_names_each_failed_or_silent_host():
    store = Store()
    hosts = [PeerOutcomes(store, 1, 8, h, 3) for h in range(3)]
    hosts[0].publish("")
    hosts[1].publish("stopped: host 0 failed (x)")
    assert hosts[0].gather(0.05) == ["host 1: stopped: host 0 failed (x)",
                                     "host 2: no outcome within 0.05s"]
    hosts[2].publish("")
    assert hosts[2].gather(1.0) == ["host 1: stopped: host 0 failed (x)"]


def test_a_wait_inside_the_write_ends_when_a_peer_fails():
    store = Store()
    me, peer = PeerOutcomes(store, 1, 4, 1, 2), PeerOutcomes(store, 1, 4, 0, 2)
    never: Future = Future()  # Orbax's commit future of a primary that failed
    threading.Timer(0.3, peer.publish, ["OSError: injected"]).start()
    with pytest.raises(PeerFailed, match=r"^stopped: host 0 failed \(OSError: injected\)$"):
        wait_watching([never], timeout_s=60.0, peers=me)
    never.set_result(None)  # lets the waiter thread end
    # The same wait returns when the futures finish and raises their error.
    store2 = Store()
    me2 = PeerOutcomes(store2, 1, 4, 1, 2)
    done: Future = Future()
    done.set_result(None)
    wait_watching([done], timeout_s=1.0, peers=me2)
    failed: Future = Future()
    failed.set_exception(OSError("own write"))
    with pytest.raises(OSError, match="own write"):
        wait_watching([failed], timeout_s=1.0, peers=me2)


def test_poll_until_names_what_it_waited_for_and_stops_on_a_peer():
    store = Store()
    me = PeerOutcomes(store, 1, 4, 1, 2)
    with pytest.raises(TimeoutError, match=r"^/ckpt/4/state not created after 0s$"):
        poll_until(lambda: False, 0.05, "/ckpt/4/state not created", me)
    with pytest.raises(RuntimeError, match="^aborted$"):
        poll_until(lambda: False, 60.0, "x", me, lambda: True, lambda: RuntimeError("aborted"))
    store.key_value_set(outcomes.outcome_key(1, 4, 0), "OSError: y")
    with pytest.raises(PeerFailed, match=r"^stopped: host 0 failed \(OSError: y\)$"):
        poll_until(lambda: False, 60.0, "x", me)
    poll_until(lambda: True, 0.0, "x", None)  # ready at once: no wait, no store
