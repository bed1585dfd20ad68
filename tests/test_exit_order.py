"""The workers' ordered exit (``launch.runtime.exit_in_order``), on real processes.

A job of two jax.distributed processes whose every process keeps threads
polling the job's key-value store until it exits, as Orbax's write of a
dropped persistent step does (chaos seed 34, trial 15). With the
interpreter's exit, a host whose poll meets the store shut down aborts
inside jaxlib: measured on this box (2026-12-04), 4 of 4 runs of this job
with the interpreter's exit ended with SIGABRT on both hosts (one polling
thread: 1 of 3 runs, host 1). In order, every host exits 0, every time.

And no host leaves before every host has arrived at the exit: a host that
left while its peer still read a collective's socket failed the peer's read
("connection reset by peer", once in CI, in release()'s status round).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.cluster.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import sys, threading, time
import jax
host, address = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(address, 2, host)
from capricorn_jax.experimental import distributed_client
client = distributed_client()

def poll():
    while True:
        try:
            client.key_value_try_get("never/set")
        except Exception:
            pass

for _ in range(4):
    threading.Thread(target=poll, daemon=True).start()
time.sleep(0.5)
from launch import runtime
runtime.exit_in_order()
print("NOT REACHED: exit_in_order returned")
"""


LATE_HOST_0 = """
import socket, sys, time
import jax
host, address = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(address, 2, host)
jax.devices()  # the backend's start is itself a rendezvous of the hosts: done here
from capricorn_jax.experimental import distributed_client
from launch import runtime
client = distributed_client()
if host == 0:
    listener = socket.create_server(("127.0.0.1", 0))
    client.key_value_set("test/port", str(listener.getsockname()[1]))
    peer, _ = listener.accept()
    time.sleep(2.0)  # host 0 is still working when host 1 is done
    peer.setblocking(False)
    try:
        print("host 1 gone before host 0 arrived" if peer.recv(1) == b"" else "unexpected byte")
    except BlockingIOError:
        print("host 1 still there when host 0 arrived")
else:
    port = int(client.blocking_key_value_get("test/port", 60_000))
    conn = socket.create_connection(("127.0.0.1", port))  # closed when this process ends
runtime.exit_in_order()
"""


def _job(worker: str = WORKER) -> list[tuple[int, str]]:
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", worker, str(host), address], env=env,
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for host in (0, 1)]
    out = []
    for proc in procs:
        text, _ = proc.communicate(timeout=120)
        out.append((proc.returncode, text))
    return out


def test_every_host_exits_0_while_threads_still_poll_the_store():
    for _ in range(4):
        results = _job()
        assert [code for code, _ in results] == [0, 0], [text[-2000:] for _, text in results]
        assert not any("NOT REACHED" in text for _, text in results)


def test_no_host_leaves_before_every_host_arrived():
    results = _job(LATE_HOST_0)
    assert [code for code, _ in results] == [0, 0], [text[-2000:] for _, text in results]
    assert "host 1 still there when host 0 arrived" in results[0][1], results[0][1][-2000:]
