"""The chunk channel only the job can talk to, and identity that means something.

The hello (``scheduling.threaded.channel_hello``) over socket pairs and loopback: a
hello without the job's secret and a replayed one are refused, a silent
connection delays nobody, and two builds that differ in what they must
share stop at the first exchange naming both. The agreements carry the same
identity (``multihost.agree``), and the secret file is the user's alone
(``multihost.secret``).
"""

import os
import secrets
import socket
import stat
import threading
import time

import numpy as np
import pytest

from capricorn_jax._src.multihost import agree, secret
from capricorn_jax._src.scheduling.threaded import channel_hello, chunk_channel
from capricorn_jax._src.scheduling.threaded.channel_hello import BuildMismatch, HelloRefused, Party
from capricorn_jax._src.scheduling.threaded.chunk_channel import ChunkChannel
from tests.test_agree import _on_hosts, _store
from tests.test_threaded import SECRET, _DictStore, raw_hello

IDENTITY = channel_hello.identity("plan aaaa")


def _party(host, peer, key=SECRET, identity=IDENTITY, token=b"job-a"):
    return Party(host, peer, token, key, identity)


def _both(listener_party, connector_party, connector_sock=None):
    """hear_hello and say_hello on the two ends of a socket pair: (listener's
    outcome, connector's outcome), each None or the exception."""
    a, b = socket.socketpair()
    out = {}

    def listen():
        try:
            channel_hello.hear_hello(a, listener_party, time.monotonic() + 5)
            out["listener"] = None
        except Exception as e:  # noqa: BLE001
            out["listener"] = e
        finally:
            a.close()

    t = threading.Thread(target=listen)
    t.start()
    try:
        channel_hello.say_hello(connector_sock(b) if connector_sock else b, connector_party, 5)
        out["connector"] = None
    except Exception as e:  # noqa: BLE001
        out["connector"] = e
    finally:
        b.close()
    t.join(10)
    return out["listener"], out["connector"]


def test_a_hello_with_the_secret_passes_both_ways():
    assert _both(_party(0, 1), _party(1, 0)) == (None, None)


def test_a_hello_without_the_secret_is_refused_both_ways():
    # The connector holds another secret: the listener's answer fails its check
    # (it names the likely cause), and the listener gets no proof.
    listener, connector = _both(_party(0, 1), _party(1, 0, key=b"another secret, 32 bytes long!"))
    assert isinstance(connector, HelloRefused)
    assert "did not prove the job's secret: the hosts hold different secrets" in str(connector)
    assert isinstance(listener, HelloRefused)
    # A stranger that knows the token and the host but not the secret: its proof fails.
    a, b = socket.socketpair()
    with a, b:
        b.sendall(raw_hello(1, b"job-a", IDENTITY.encode()))
        b.sendall(secrets.token_bytes(32))  # a guessed proof
        with pytest.raises(HelloRefused, match=r"did not prove the job's secret \(a hello "
                                               r"without the secret, or a replayed one\)"):
            channel_hello.hear_hello(a, _party(0, 1), time.monotonic() + 5)


class _Recorder:
    """A socket whose sends are kept (a recorded exchange, to replay)."""

    def __init__(self, sock):
        self.sock, self.sent = sock, []

    def sendall(self, data):
        self.sent.append(bytes(data))
        self.sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _replay(sent):
    """Replays a recorded connector's messages to a new listener; its refusal."""
    a, b = socket.socketpair()
    with a, b:
        b.sendall(sent[0])

        def answer():  # the listener's reply arrives, the recorded proof goes back
            try:
                b.recv(4096)
                b.sendall(sent[1])
            except OSError:
                pass

        t = threading.Thread(target=answer)
        t.start()
        with pytest.raises(HelloRefused) as refused:
            channel_hello.hear_hello(a, _party(0, 1), time.monotonic() + 5)
        b.shutdown(socket.SHUT_RDWR)
        t.join(5)
    return str(refused.value)


def test_a_replayed_hello_is_refused(monkeypatch):
    recorders = []

    def record(sock):
        recorders.append(_Recorder(sock))
        return recorders[0]

    assert _both(_party(0, 1), _party(1, 0), connector_sock=record) == (None, None)
    sent = recorders[0].sent
    assert len(sent) == 2  # the hello and the proof
    # Replayed as recorded: its nonce was heard before.
    assert "a replayed hello (its nonce was heard before)" in _replay(sent)
    # In a process that never heard it (another host, or the nonce forgotten):
    # the listener's new nonce makes the recorded proof wrong.
    monkeypatch.setattr(channel_hello, "_seen", channel_hello._Seen())
    assert "did not prove the job's secret" in _replay(sent)


def test_another_build_is_refused_at_the_first_exchange_naming_both():
    theirs = channel_hello.identity("plan bbbb")
    listener, connector = _both(_party(0, 1), _party(1, 0, identity=theirs))
    for error in (listener, connector):
        assert isinstance(error, BuildMismatch), error
        assert theirs in str(error) and IDENTITY in str(error)
    assert "plan aaaa" in IDENTITY and "capricorn_jax " in IDENTITY and "cjx-channel/" in IDENTITY


def _channels(shared, timeout_s=20.0, before_host_1=None):
    """Hosts 0 and 1's channels on loopback (host 1 built after
    ``before_host_1(host 0's address)``); host -> channel or exception, seconds."""
    store, out = _DictStore(), {}

    def make(h):
        try:
            out[h] = ChunkChannel(h, 1 - h, 1 - h, "job-a", store, timeout_s,
                                  address="127.0.0.1", secret=SECRET, shared=shared[h])
        except Exception as e:  # noqa: BLE001
            out[h] = e

    start = time.monotonic()
    zero = threading.Thread(target=make, args=(0,))
    zero.start()
    host, port = store.blocking_key_value_get("capricorn/chunk_channel/job-a/0", 10_000
                                              ).rsplit(":", 1)
    if before_host_1 is not None:
        before_host_1((host, int(port)))
    make(1)
    zero.join(timeout_s + 5)
    return out, time.monotonic() - start


def test_a_silent_connection_does_not_delay_the_channel():
    """A connection to host 0's port that never says a word (and one that
    sends half a hello) while host 1 connects: the channel comes up at once,
    not at the hello's deadline (10 s) nor at the channel's (20 s)."""
    silent = []

    def strangers(address):
        silent.append(socket.create_connection(address))
        silent.append(socket.create_connection(address))
        silent[1].sendall(raw_hello(1, b"job-a")[:20])
        time.sleep(0.2)  # both wait in the listener's hello threads

    try:
        out, seconds = _channels({0: "same", 1: "same"}, before_host_1=strangers)
        assert isinstance(out[0], ChunkChannel) and isinstance(out[1], ChunkChannel), out
        assert seconds < 5, seconds
        out[1].send(3, 0, np.arange(16, dtype=np.uint8).reshape(1, 16))
        got = np.zeros((1, 16), np.uint8)
        assert out[0].receive_into(lambda v: got) == (3, 0, 16) and got[0, 15] == 15
    finally:
        for s in silent:
            s.close()
        for c in out.values():
            if isinstance(c, ChunkChannel):
                c.close()


def test_channels_of_mismatched_builds_stop_at_the_hello_naming_both():
    """The two hosts' plan digests differ: both stop at the first exchange,
    long before the channel's bound, each naming both identities."""
    out, seconds = _channels({0: "plan 1111", 1: "plan 2222"})
    assert seconds < 10, seconds
    for h in (0, 1):
        assert isinstance(out[h], BuildMismatch), out
        assert "shared plan 1111" in str(out[h]) and "shared plan 2222" in str(out[h])
    assert str(out[0]).startswith("host 0: ") and str(out[1]).startswith("host 1: ")


def test_refusals_are_counted_and_logged_with_the_address(caplog):
    def stranger(address):
        s = socket.create_connection(address)
        s.sendall(raw_hello(1, b"job-a", IDENTITY.encode()))
        s.recv(4096)
        s.sendall(bytes(32))  # a wrong proof
        assert s.recv(4096) == b""  # closed once refused (and logged)
        s.close()

    with caplog.at_level("WARNING", logger=chunk_channel.log.name):
        out, _ = _channels({0: "x", 1: "x"}, before_host_1=stranger)
    try:
        assert [reason for _, reason in out[0].refusals] == [
            "it did not prove the job's secret (a hello without the secret, or a replayed one)"]
        assert out[0].refusals[0][0].startswith("127.0.0.1:")
        assert any("refused a connection from 127.0.0.1:" in r.getMessage() and
                   "(1 refused)" in r.getMessage() for r in caplog.records)
    finally:
        for c in out.values():
            c.close()


def test_agreements_carry_the_build_and_the_shared_digest():
    parts = {0: {"plan": "aaaa", "rounds": [[0, 1]]}, 1: {"plan": "bbbb", "rounds": [[0, 1]]}}
    with _store(2) as clients:
        got = _on_hosts(clients, {h: (lambda c, h: agree.agree_shared(
            parts[h], 2, "the shared identity of inmem", c, h)) for h in (0, 1)})
        for h in (0, 1):
            assert isinstance(got[h], agree.AgreementMismatch), got
            assert (f"plan: this host \"{parts[h]['plan']}\", host {1 - h} "
                    f"\"{parts[1 - h]['plan']}\"") in str(got[h])
            assert "rounds" not in str(got[h]).split("):", 1)[1]
        # Alike: the digest is kept, and every later agreement carries it.
        same = {"plan": "aaaa"}
        got = _on_hosts(clients, {h: (lambda c, h: agree.agree_shared(
            same, 2, "again", c, h)) for h in (0, 1)})
        assert got == {0: agree.shared_digest(same), 1: agree.shared_digest(same)}
        with agree._state.lock:  # host 1 as if it had agreed on another plan
            agree._state.shared[(id(clients[1]), 1)] = "0123456789abcdef"
        got = _on_hosts(clients, {h: (lambda c, h: agree.exchange("x", 2, "step 7", 30, c, h))
                                  for h in (0, 1)})
    assert isinstance(got[0], agree.AgreementMismatch)
    assert f"shared {agree.shared_digest(same)}" in str(got[0])
    assert "shared 0123456789abcdef" in str(got[0])
    assert f"capricorn_jax {agree.PACKAGE_VERSION}" in str(got[0])


def test_the_secret_file_is_created_owner_only_and_a_readable_one_is_refused(tmp_path,
                                                                               monkeypatch):
    monkeypatch.delenv(secret.SECRET_ENV, raising=False)
    monkeypatch.delenv(secret.SECRET_FILE_ENV, raising=False)
    path = tmp_path / secret.SECRET_NAME
    key = secret.resolve_secret(path)  # absent: created
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(key) == 64 and secret.load_or_create(path) == key  # then read, not replaced
    assert secret.create_secret(path) == key  # a second creator reads the first one's
    os.chmod(path, 0o644)
    with pytest.raises(secret.SecretError, match=r"has mode 0644: others than its owner may "
                                                 r"read it; refused \(chmod 600 "):
        secret.resolve_secret(path)
    os.chmod(path, 0o640)
    with pytest.raises(secret.SecretError, match="mode 0640"):
        secret.read_secret(path)
    # A launcher's start: a new secret, named to its hosts by the environment.
    env = secret.start_job_secret(tmp_path)
    assert env == {secret.SECRET_FILE_ENV: str(path)}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and secret.read_secret(path) != key
    assert not [p for p in tmp_path.iterdir() if p.name != secret.SECRET_NAME]  # no leftovers


def test_the_environment_gives_the_secret_first_and_none_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(secret.SECRET_ENV, raising=False)
    monkeypatch.delenv(secret.SECRET_FILE_ENV, raising=False)
    with pytest.raises(secret.SecretError, match="CAPRICORN_CHANNEL_SECRET"):
        secret.resolve_secret(None)
    with pytest.raises(secret.SecretError, match="the chunk channel needs the job's secret"):
        ChunkChannel(0, 1, 1, "t", _DictStore(), 1.0, address="127.0.0.1")
    given = tmp_path / "given"
    secret.create_secret(given)
    monkeypatch.setenv(secret.SECRET_FILE_ENV, str(given))
    assert secret.resolve_secret(tmp_path / "other") == secret.read_secret(given)
    assert not (tmp_path / "other").exists()
    assert secret.start_job_secret(tmp_path) == {}  # the user's secret is kept
    monkeypatch.setenv(secret.SECRET_ENV, "short")
    with pytest.raises(secret.SecretError, match="holds 5 bytes"):
        secret.resolve_secret(None)
    monkeypatch.setenv(secret.SECRET_ENV, "a cluster's distributed secret")
    assert secret.resolve_secret(given) == b"a cluster's distributed secret"
