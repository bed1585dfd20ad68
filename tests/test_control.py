"""``control``: no checkpoint, a version's bytes to the peer host every step.

The unit tests run the control's connections in this process (two hosts'
``Links`` over loopback, the key-value store a dict): each version's bytes
reach the peer and are acknowledged, a version handed over while one waits
replaces it, and ``close`` abandons what is left within its bound. The
registry's view of it (not in-memory, a peer needed, its table label) and
its refusal of one host too. The slow test runs it in launch.bench beside
``none`` on 2 hosts x 1 device: the peer acknowledged exactly the bytes the
sender sent, the in-memory tier's bytes of a version of the same state
(its pack plan over the state's leaves), and the losses are ``none``'s bit
for bit (the bench fails a run whose strategies' losses differ).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import jax
import pytest

from capricorn_jax.experimental import make_plan, spec
from launch import control, strategies
from launch.trainer import OptimizerOptions, Trainer, make_mesh
from models import get_config
from tests.helpers import ROOT, assert_no_orphans, child_env


class _Store:
    """jax.distributed's key-value client, as far as the control uses it."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.cond = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self.cond:
            self.values[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.values, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]


def _pair(job: str, timeout_s: float = 20.0) -> tuple[control.Links, control.Links]:
    """Host 0's and host 1's links of a 2-host job, built at once (each waits for the other)."""
    store, built = _Store(), {}

    def make(host: int) -> None:
        built[host] = control.Links(host, 2, 2, 0, store, address="127.0.0.1",
                                    timeout_s=timeout_s, job=job)

    other = threading.Thread(target=make, args=(1,))
    other.start()
    make(0)
    other.join(timeout_s)
    return built[0], built[1]


def _close_both(a: control.Links, b: control.Links, timeout_s: float) -> None:
    """Closes both ends at once (each waits, bounded, for the other's end)."""
    other = threading.Thread(target=b.close, args=(timeout_s,))
    other.start()
    a.close(timeout_s)
    other.join(timeout_s * 3)


def test_each_version_reaches_the_peer_and_is_acknowledged():
    a, b = _pair("unit")
    assert (a.peers, a.sources, b.peers, b.sources) == ([1], [1], [0], [0])
    sizes = {1: 3 * control.BUFFER_BYTES + 17, 2: 5, 3: 0}
    for version, size in sizes.items():
        a.offer(version, size)
        assert a.drain(20)  # one at a time: none replaces another
        b.offer(version, size + 1)
        assert b.drain(20)
    _close_both(a, b, 10)
    got = a.summary()
    assert [(v["version"], v["bytes"], v["sent"], v["received"], v["outcome"])
            for v in got["versions"]] == [(v, n, n, n, "sent") for v, n in sizes.items()]
    assert [(r["version"], r["source"], r["received"]) for r in got["received"]] == [
        (v, 1, n + 1) for v, n in sizes.items()]
    assert [r["received"] for r in b.summary()["received"]] == list(sizes.values())
    assert got["errors"] == [] and got["refused"] == 0
    assert (got["skipped"], got["abandoned"], got["failed"]) == (0, 0, 0)
    assert got["bytes_sent"] == sum(sizes.values())


def test_a_stalled_peer_gets_a_skip_and_close_abandons_within_its_bound():
    """The peer stops reading: version 1 fills the link and waits there,
    version 2 waits for it and version 3 replaces it (skipped); ``close``
    gives up on 1 and 3 after its bound, and ``save``'s offer never waited."""
    a, b = _pair("stall")
    b.receivers[0].stop()
    b.receivers[0].thread.join(5)
    offers = []
    for version in (1, 2, 3):
        t0 = time.monotonic()
        a.offer(version, 256 * control.BUFFER_BYTES)
        offers.append(time.monotonic() - t0)
        deadline = time.monotonic() + 10
        while a.senders[0].records[0].outcome == "queued" and time.monotonic() < deadline:
            time.sleep(0.01)  # the sender took 1 (else 2 would replace it)
    assert max(offers) < 0.5
    assert not a.drain(0.5)
    t0 = time.monotonic()
    a.close(0.5)
    assert time.monotonic() - t0 < 5.0
    b.close(0.5)
    versions = a.summary()["versions"]
    assert [v["outcome"] for v in versions] == ["abandoned", "skipped", "abandoned"]
    assert 0 < versions[0]["sent"] < versions[0]["bytes"] and versions[0]["received"] is None
    assert versions[1]["sent"] == versions[2]["sent"] == 0
    assert not a.senders[0].thread.is_alive() and not a.receivers[0].thread.is_alive()


def test_a_stranger_connection_is_refused_and_the_peer_still_connects():
    store = _Store()
    done: dict[int, control.Links] = {}
    host0 = threading.Thread(target=lambda: done.setdefault(0, control.Links(
        0, 2, 2, 0, store, address="127.0.0.1", timeout_s=20, job="stranger")))
    host0.start()
    address, port, _ = store.blocking_key_value_get("capricorn/control/stranger/0",
                                                    20000).split("|")
    import socket

    with socket.create_connection((address, int(port)), timeout=5) as stranger:
        stranger.sendall(b"x" * 24)  # a hello of the right size, the wrong nonce
        host1 = control.Links(1, 2, 2, 0, store, address="127.0.0.1", timeout_s=20,
                              job="stranger")
        host0.join(20)
    assert done[0].refused == 1
    _close_both(done[0], host1, 5)


class _CountingSocket:
    """A socket whose ``recv_into`` calls that returned bytes are counted."""

    def __init__(self, sock) -> None:
        self.sock, self.reads = sock, 0

    def recv_into(self, view) -> int:
        n = self.sock.recv_into(view)
        self.reads += n > 0
        return n

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_the_receiver_wakes_once_per_64_kib_not_once_per_packet():
    """A version trickling in 1 KiB pieces (a slow link's packets) wakes the
    receiver thread once per ``RCVLOWAT_BYTES`` queued: its Python and GIL
    run per wake-up, in the training process (per packet: 66 ms of CPU per
    step at the priority point of 0.21.0)."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname(), timeout=10)
        conn, _ = server.accept()
    nbytes, piece = 256 << 10, 1 << 10
    counted = _CountingSocket(conn)
    receiver = control._Receiver(counted, 0, 1)
    try:
        sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sender.sendall(control._HEADER.pack(control._MAGIC, 7, nbytes))
        for _ in range(nbytes // piece):
            sender.sendall(bytes(piece))
            time.sleep(0.0005)
        ack = control._recv_exact(sender, control._ACK.size)
    finally:
        receiver.stop()
        receiver.thread.join(5)
        sender.close()
        conn.close()
    assert ack == control._ACK.pack(control._ACK_MAGIC, 7, nbytes)
    assert receiver.records == [{"version": 7, "source": 1, "bytes": nbytes, "received": nbytes}]
    # The header, then one wake-up per 64 KiB (a few more where a wake-up
    # raced the mark): 256 wake-ups without the mark.
    assert counted.reads <= 1 + 2 * nbytes // control.RCVLOWAT_BYTES, counted.reads


def test_the_registry_knows_the_control_as_no_checkpoint_needing_a_peer():
    from launch import gpu_bench, tables

    s = spec("control")
    assert not s.in_memory and not s.scheduled and not s.pec
    assert s.label == "control (bulk bytes, no ckpt)"
    assert "control" in strategies.STRATEGIES and "control" not in strategies.IN_MEMORY
    assert "control" in strategies.PEER_ONLY
    assert "control" not in gpu_bench.STRATEGIES.split(",")  # its parts run one host
    assert tables.LABELS["control"] == s.label
    assert not strategies.uses_channel("control", "threaded", "cpu")


def test_one_host_is_refused_naming_the_strategy_and_the_reason():
    trainer = Trainer(get_config("tiny"), make_mesh(4), OptimizerOptions())
    with pytest.raises(ValueError, match=r"strategy 'control' needs 2 hosts or more: .* "
                                         r"this job has 1 host \(no peer\)"):
        strategies.make_strategy("control", trainer)
    with pytest.raises(ValueError, match="strategy 'control' moves what the in-memory tier's "
                                         r"peer replicas move: it needs replicas in \[2, 2\]"):
        control.Links(0, 2, 1, 0, _Store(), address="127.0.0.1")
    with pytest.raises(ValueError, match="traffic_class must be one of"):
        control.BulkControl(trainer, traffic_class="bulk")


def _version_bytes_of_tiny_on_two_hosts() -> int:
    """What the in-memory tier counts as one host's version of the tiny
    model on 2 hosts x 1 device (``SaveReport.bytes``: its pack plan's
    payload per device times the host's devices)."""
    trainer = Trainer(get_config("tiny"), make_mesh(2, jax.devices()[:2]), OptimizerOptions())
    plan = make_plan(trainer.abstract_state, trainer.state_shardings, trainer.mesh, 1 << 20,
                     device_host=[0, 1])
    assert plan.payload_bytes * len(plan.host_positions(1)) == plan.payload_bytes
    return plan.payload_bytes * len(plan.host_positions(0))


@pytest.mark.soak  # CI: tests/test_bench.py's long-run contract runs it too
@pytest.mark.multiprocess
def test_control_in_the_bench_moves_a_version_per_step_and_trains_as_none(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "launch.bench", "--strategies=none,control", "--hosts=2",
         "--devices_per_host=1", "--model=tiny", "--dispatch=fixed", "--steps=3", "--reps=2",
         "--warmup=2", "--bandwidth_mib=0", "--link_probe_mib=0", "--nocollectives",
         f"--store_root={tmp_path / 'shm'}", f"--workdir={tmp_path / 'w'}", f"--json={out}"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["strategies"]
    assert set(rows) == {"none", "control"}
    # The bench compared both rows' losses bit for bit at every replayed step
    # (2 reps x 3 steps and the last block's untimed one): a difference fails the run.
    assert rows["control"]["steps_compared"] == rows["none"]["steps_compared"] == 7
    want = _version_bytes_of_tiny_on_two_hosts()
    assert rows["control"]["ckpt_bytes_per_step"] == 2 * want  # both hosts
    assert rows["none"]["ckpt_bytes_per_step"] == 0
    assert "recovery" not in rows["control"] and "versions_committed" not in rows["control"]
    summary = rows["control"]["schedule"]  # host 0's records
    assert summary["version_bytes"] == want and summary["tos"] == 0
    assert (summary["peers"], summary["sources"], summary["errors"]) == ([1], [1], [])
    # A version per save: 2 warm-up steps, 3 + 4 steps in the two repetitions.
    versions = summary["versions"]
    assert len(versions) == 9 and len({v["version"] for v in versions}) == 9
    sent = [v for v in versions if v["outcome"] == "sent"]
    assert len(sent) >= 5 and all(v["outcome"] == "skipped" and v["sent"] == 0
                                  for v in versions if v not in sent)
    assert all(v["bytes"] == v["sent"] == v["received"] == want for v in sent)
    # What host 0 received from host 1: whole versions of the same size.
    assert len(summary["received"]) >= 5
    assert all(r["received"] == r["bytes"] == want for r in summary["received"])
    assert "| control |" in proc.stdout
    assert_no_orphans(str(tmp_path / "w"))


def test_the_control_listens_where_the_chunk_channel_would():
    """One rule for the address a host advertises (the chunk channel's): with
    no coordinator in this process, the address the host's name resolves to."""
    from capricorn_jax.experimental import job_address
    from launch import control

    assert control.job_address() == job_address(None)
