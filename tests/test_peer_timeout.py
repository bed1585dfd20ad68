"""A silent host (SIGSTOP) ends the job within --peer_timeout_s, named: the
bound of the waits no Python timeout reaches (an in-graph collective)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.cluster.console import Console
from launch.errors import FlagError
from launch.train.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[1]

_WORKER = """
import sys, time
from launch import runtime
host, port, ready = int(sys.argv[1]), sys.argv[2], sys.argv[3]
runtime.init_distributed(2, f"127.0.0.1:{port}", host, peer_timeout_s=5)
import jax.numpy as jnp
from jax.experimental import multihost_utils
multihost_utils.sync_global_devices("ready")
open(ready, "w").close()  # a file, not a line: gloo's own prints share the pipe
if host == 1:
    time.sleep(600)  # the test pauses this host here
multihost_utils.process_allgather(jnp.ones(4))  # host 1 never joins
print("the collective returned", flush=True)
"""


@pytest.mark.slow
@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_a_paused_host_ends_the_job_within_the_peer_timeout_naming_it(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    ready = [tmp_path / f"ready{h}" for h in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(h), str(port), str(ready[h])],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for h in range(2)]
    try:
        deadline = time.monotonic() + 120  # both joined and passed the first barrier
        while not all(r.exists() for r in ready):
            ended = [h for h, p in enumerate(procs) if p.poll() is not None]
            if ended or time.monotonic() > deadline:
                raise AssertionError(f"hosts {ended} ended before the first barrier, or the "
                                     f"hosts did not all pass it within 120 s")
            time.sleep(0.1)
        os.kill(procs[1].pid, signal.SIGSTOP)
        paused = time.monotonic()
        out, _ = procs[0].communicate(timeout=180)
        waited = time.monotonic() - paused
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode != 0
    assert "the collective returned" not in out
    console_lines: list[str] = []
    console = Console(write=console_lines.append)
    for line in out.splitlines():
        console.line(0, line + "\n")
    assert console.silent == {1}
    assert ("fault: host 1 sent no heartbeat within --peer_timeout_s (paused, hung or cut off); "
            "the job stops\n") in console_lines
    # The bound is the heartbeat's (5 s) plus the service's polling, not the
    # collective's own timeout (minutes) nor the job's.
    assert waited < 120, waited


def test_console_names_each_silent_host_once():
    out: list[str] = []
    console = Console(write=out.append)
    report = ["E1204 20:39:02.066784   26274 coordination_service.cc:1549] Use error polling "
              "to propagate the following error to all tasks: UNAVAILABLE: The following tasks "
              "are unhealthy (stopped sending heartbeats):", "1", "3",
              "The tasks have crashed."]
    for host in (0, 2):  # two survivors report the same silent hosts
        for line in report:
            console.line(host, line + "\n")
    faults = [x for x in out if x.startswith("fault:")]
    assert faults == [f"fault: host {h} sent no heartbeat within --peer_timeout_s (paused, hung "
                      f"or cut off); the job stops\n" for h in (1, 3)]
    console.attempt()
    console.line(0, report[0] + "\n")
    console.line(0, "1\n")
    assert len([x for x in out if x.startswith("fault:")]) == 3  # a new attempt reports again


@pytest.mark.parametrize("bad", [4.0, 1800.0])
def test_peer_timeout_is_checked_against_the_agreement_bound(bad):
    with pytest.raises(FlagError, match=rf"--peer_timeout_s={bad:g} must be >= 5 and below the "
                       r"cross-host agreement bound \(1800 s\)"):
        ClusterConfig(hosts=2, devices_per_host=1, pin_hosts=False, platform="cpu",
                      timeout_s=60, process_id=-1, coordinator="", peer_timeout_s=bad)
