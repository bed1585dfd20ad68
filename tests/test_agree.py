"""Cross-host agreement on one process (the multi-process paths run in the
recovery, Orbax and training tests, whose hosts agree through them)."""

import contextlib
import re

import numpy as np

from capricorn_jax._src.multihost import agree


def test_one_process_exchanges_nothing_and_keeps_the_documents():
    doc = {"inv": {"0": [1, 2]}, "big": "x" * 100_000}  # no size limit
    assert agree.allgather_json(doc) == [doc]
    assert agree.allgather_json(doc, hosts=1) == [doc]
    assert agree.broadcast_json(doc) == doc
    assert agree.allgather_floats([1.5, 2]) == [[1.5, 2.0]]


def test_agreed_floats_are_float32_everywhere_and_none_travels():
    got = agree.agree_floats([0.1, None, 3.0])
    assert got == [float(np.float32(0.1)), None, 3.0]
    assert got[0] != 0.1  # host 0 rounds too, so one process decides like many


@contextlib.contextmanager
def _store(hosts: int):
    """A real jax.distributed key-value service and one connected client per host."""
    import socket
    import threading

    from jax._src.lib import _jax

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service = _jax.get_distributed_runtime_service(f"127.0.0.1:{port}", hosts)
    clients = [_jax.get_distributed_runtime_client(f"127.0.0.1:{port}", h, init_timeout=60)
               for h in range(hosts)]
    threads = [threading.Thread(target=c.connect) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        yield clients
    finally:  # every client leaves together (a shutdown barrier), then the service
        stops = [threading.Thread(target=c.shutdown) for c in clients]
        for t in stops:
            t.start()
        for t in stops:
            t.join()
        service.shutdown()


def _on_hosts(clients, calls):
    """Runs calls[h](client h) on a thread per host; host -> result or exception."""
    import threading

    out = {}

    def run(h):
        try:
            out[h] = calls[h](clients[h], h)
        except BaseException as e:  # noqa: BLE001
            out[h] = e

    threads = [threading.Thread(target=run, args=(h,)) for h in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_every_host_gets_every_document_in_host_order_agreement_after_agreement():
    docs = {h: f"doc of {h}" for h in range(3)}
    with _store(3) as clients:
        for round_ in range(3):  # numbered agreements: round 2 does not read round 1's keys
            got = _on_hosts(clients, {h: (lambda c, h, r=round_: agree.exchange(
                f"{docs[h]} #{r}", 3, "a test", 30, c, h)) for h in range(3)})
            assert got == {h: [f"doc of {x} #{round_}" for x in range(3)] for h in range(3)}


def test_a_host_that_never_answers_is_named_in_a_timeout_and_nobody_hangs():
    with _store(2) as clients:
        got = _on_hosts(clients, {0: lambda c, h: agree.exchange("x", 2, "persistent step 7",
                                                                 0.5, c, h)})
    error = got[0]
    assert isinstance(error, agree.AgreementTimeout)
    # (the agreement's number counts per client object: another test's client
    # may have had the same id, so it is not checked here)
    assert re.match(r"host 0: agreement #\d+ \(persistent step 7\): host 1 did not answer "
                    r"within 0.5s", str(error)), str(error)


def test_timeout_must_be_positive():
    import pytest

    with pytest.raises(ValueError, match="must be positive, got 0"):
        agree.set_timeout(0)


def test_hosts_agreeing_on_different_things_stop_naming_both():
    with _store(2) as clients:
        got = _on_hosts(clients, {
            0: lambda c, h: agree.exchange("a", 2, "persistent step 7", 30, c, h),
            1: lambda c, h: agree.exchange("b", 2, "the restore's version", 30, c, h)})
    assert isinstance(got[0], agree.AgreementMismatch)
    build = rf"cjx-agree/2, capricorn_jax {re.escape(agree.PACKAGE_VERSION)}, shared none yet"
    assert re.fullmatch(
        rf"host 0: agreement #\d+: this host agrees on 'persistent step 7' \({build}\) but "
        rf"host 1 on 'the restore's version' \({build}\); the hosts run different code or "
        r"are out of step, so the job stops", str(got[0])), str(got[0])
    assert isinstance(got[1], agree.AgreementMismatch)
    assert re.match(r"host 1: agreement #\d+: this host agrees on 'the restore's version'",
                    str(got[1])), str(got[1])


def test_a_key_in_another_protocol_is_refused():
    with _store(2) as clients:
        # Host 1 runs older code: its key is the bare document.
        clients[1].key_value_set("capricorn/agree/1/1", '{"step": 7}')
        got = _on_hosts(clients, {0: lambda c, h: agree.exchange("a", 2, "step 7", 30, c, h)})
    assert isinstance(got[0], agree.AgreementMismatch)
    assert "host 1 on a key in an unknown protocol" in str(got[0])


def test_a_stream_numbers_its_agreements_apart_from_the_training_threads():
    """Two threads per host agree at once, the training thread on the default
    stream and a planner's thread on its own: each stream's agreements match
    across the hosts whatever order the two threads' calls interleave in (one
    numbering for both would pair host 0's plan agreement with host 1's
    training one: a mismatch)."""
    import threading

    def host(client, h):
        results = {}

        def run(stream, what):
            results[stream] = [agree.exchange(f"{what} {i} of {h}", 2, f"{what} {i}", 30,
                                              client, h, stream=stream) for i in range(3)]

        # Host 0 starts its plan thread first, host 1 its training thread first.
        order = [("plan", "plan"), ("", "train")] if h == 0 else [("", "train"), ("plan", "plan")]
        threads = [threading.Thread(target=run, args=args) for args in order]
        for t in threads:
            t.start()
            t.join(0.05)
        for t in threads:
            t.join()
        return results

    with _store(2) as clients:
        got = _on_hosts(clients, {0: host, 1: host})
    for h in (0, 1):
        assert got[h] == {"plan": [[f"plan {i} of 0", f"plan {i} of 1"] for i in range(3)],
                          "": [[f"train {i} of 0", f"train {i} of 1"] for i in range(3)]}, got[h]


def test_a_client_at_a_freed_clients_address_starts_its_own_count():
    """Counts are keyed by the client's id; one that takes a freed client's id
    (tests make a store per test) starts at #1, not at the freed one's count
    (the two-stream test failed so when the tests ran in another order)."""
    state = agree._State()
    old, new = object(), object()
    ident = state.key(new)
    state.seq[(ident, 0, "")] = 5
    state.shared[(ident, 0)] = "digest"
    assert state.key(new) == ident and state.seq == {(ident, 0, ""): 5}  # the same client
    state.clients[ident] = old  # as if ``old`` had been counted under this id
    assert state.key(new) == ident and state.seq == {} and state.shared == {}
