"""launch.train's supervisor: runs the simulated cluster and reports on the job.

With ``--hosts=H`` on CPU the process a user starts is the supervisor: it
starts H workers (this same command line plus ``--process_id`` and the
coordinator's address, ``launch.cluster``), restarts all of them after each
injected kill (``launch.faults``), and prints a one-line report of the
metrics and each recovery. Unless ``--resume``, it first clears what an
earlier job of the workdir left: the metrics, the RAM stores and the
persistent checkpoints.

Design choice: restart every host after a failure, as a jax.distributed job
must (its processes cannot rejoin one by one). Alternative not taken:
restarting only the failed host, which the collectives do not support.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from launch import cluster as cluster_lib
from launch.config import Config
from launch.faults import FaultInjector
from launch.metrics import read_metrics, summarize

# Flags the fault injector sets per worker; never passed through from the command line.
_INTERNAL_FLAGS = ("--pause_mid_replication_at", "--pause_after_step_at")


def report(metrics_path: Path, injected: bool) -> None:
    """Prints the job's summary and its recoveries (``injected``: a kill was asked for)."""
    records = read_metrics(metrics_path)
    print("report:", json.dumps(summarize(records)), flush=True)
    for r in records:
        if r.get("event") == "recovery":
            moved = ("" if r.get("bytes_moved") is None
                     else f", {r['bytes_moved']} bytes from peers")
            print(f"recovery: resumed from step {r['step']} via tier {r['tier']} "
                  f"(hosts: {', '.join(r['tiers'])}) in {r['seconds']:.2f}s{moved}", flush=True)
    if injected and not any(r.get("event") == "recovery" for r in records):
        print("recovery: none happened", flush=True)


def supervise(config: Config, argv: Sequence[str]) -> int:
    """Runs the simulated cluster (restarting it after an injected failure); its exit code.

    ``argv``: the flags this process was started with, passed on to the workers.
    """
    cluster, train, checkpoint = config.cluster, config.train, config.checkpoint
    metrics_path = train.metrics_path
    if not train.resume:
        metrics_path.unlink(missing_ok=True)
        shutil.rmtree(checkpoint.job_root, ignore_errors=True)
        shutil.rmtree(Path(train.workdir) / "checkpoints", ignore_errors=True)
    injector = (FaultInjector(config.faults, train.workdir, train.steps)
                if config.faults.kill_host >= 0 else None)
    deadline = time.monotonic() + cluster.timeout_s
    while True:
        coordinator = f"127.0.0.1:{cluster_lib.free_port()}"
        armed = injector is not None and injector.pending
        hosts = cluster_lib.LocalCluster(
            lambda h, c=coordinator, a=armed: cluster_lib.worker_argv(
                "launch.train", argv, h, c, _INTERNAL_FLAGS,
                injector.extra_args(h) if a else ()),
            cluster.hosts, cluster.devices_per_host,
            cpu_sets=cluster_lib.cpu_sets_per_host(cluster.hosts) if cluster.pin_hosts else None)
        if armed:
            injector.arm(hosts)
        code = cluster_lib.run(hosts, max(1.0, deadline - time.monotonic()),
                               on_tick=injector.tick if armed else None)
        if not (armed and injector.fired):
            break
        injector.after_kill(checkpoint)
        print("fault: restarting all hosts; they recover from the in-memory tier", flush=True)
    if code == 0 and metrics_path.exists():
        report(metrics_path, injector is not None)
    elif code != 0:
        print(f"train: job failed with exit code {code}", file=sys.stderr, flush=True)
    return code
