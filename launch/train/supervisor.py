"""launch.train's supervisor: runs the simulated cluster and reports on the job.

With ``--hosts=H`` on CPU the process a user starts is the supervisor: it
starts H workers (this same command line plus ``--process_id`` and the
coordinator's address, ``launch.cluster.processes``), restarts all of them after each
injected kill (``launch.train.faults``), shows the job's console
(``launch.cluster.console``) and prints a summary at the end.

Nothing is deleted behind the user's back: a WORKDIR that holds checkpoints
(WORKDIR/checkpoints, the job's RAM stores under --store_root) is resumed
from, the newest version across the tiers (the workers pick it), and
metrics.jsonl is appended to; one line says what was found. ``--fresh``
deletes them first, one line per thing deleted. ``--resume`` (the default
behaviour) with nothing to resume says so on one line.

The supervisor holds WORKDIR's job lock (``launch.train.workdir_lock``) from
before ``prepare_workdir`` (``--fresh``'s deletions included) until the job
ends, through every restart; its workers join it as the same job
(``CAPRICORN_JOB_ID``), each also holding its host's lock.

Design choice: restart every host after a failure, as a jax.distributed job
must (its processes cannot rejoin one by one). Alternative not taken:
restarting only the failed host, which the collectives do not support.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from capricorn_jax.experimental import committed_steps
from launch.cluster import processes as cluster_lib
from launch.cluster.console import Console
from launch.cluster.netns import ShapedNetwork, links_for
from launch.metrics import read_metrics, summarize
from launch.train.config import CheckpointConfig, Config
from launch.train.faults import FaultInjector
from launch.train.workdir_lock import JOB_ENV, job_identity, workdir_lock

# Flags the fault injector sets per worker; never passed through from the command line.
_INTERNAL_FLAGS = ("--fault_at",)


def report(metrics_path: Path, injected: bool) -> None:
    """Prints the job's summary (its recoveries were shown as they happened;
    ``injected``: a kill was asked for)."""
    records = read_metrics(metrics_path)
    recoveries = [r for r in records if r.get("event") == "recovery"]
    summary = {**summarize(records), "recoveries": [
        {"step": r["step"], "tier": r["tier"], "seconds": round(r["seconds"], 3)}
        for r in recoveries]}
    print("report:", json.dumps(summary), flush=True)
    if injected and not recoveries:
        rerun = summary.get("steps_rerun_after_recovery", 0)
        print(f"recovery: no version every host could restore; the job started over from step "
              f"0 ({rerun} steps run again)" if rerun else "recovery: none happened", flush=True)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _ram_versions(job_root: Path) -> set[int]:
    """Steps of the versions in a job's RAM stores (in-memory tier heads, blocking saves)."""
    steps: set[int] = set()
    for store in job_root.glob("host*"):  # sealed heads only, as the store reads them
        for owned in committed_steps(store).values():
            steps.update(owned)
    for version in job_root.glob("host*/blocking/v*"):
        if re.fullmatch(r"v\d+", version.name):
            steps.add(int(version.name[1:]))
    return steps


def _steps_text(steps: Sequence[int]) -> str:
    if not steps:
        return "no committed version"
    ordered = sorted(steps)
    return (f"{len(ordered)} {'step' if len(ordered) == 1 else 'steps'} "
            f"({', '.join(map(str, ordered[:6]))}{', ...' if len(ordered) > 6 else ''})")


def found_in_workdir(workdir: str, checkpoint: CheckpointConfig
                     ) -> list[tuple[str, Path, str, bool]]:
    """What an earlier job of ``workdir`` left: (what, where, how many, whether
    it is a checkpoint to resume from), for each thing that exists."""
    found = []
    persistent = Path(workdir) / "checkpoints"
    if persistent.exists():
        steps = [int(p.name) for p in persistent.iterdir() if p.name.isdigit()]
        found.append(("persistent checkpoints", persistent, _steps_text(steps), bool(steps)))
    if checkpoint.job_root.exists():
        steps = sorted(_ram_versions(checkpoint.job_root))
        hosts = len(list(checkpoint.job_root.glob("host*")))
        found.append(("RAM stores", checkpoint.job_root,
                      f"{_steps_text(steps)} on {hosts} hosts, "
                      f"{_size(checkpoint.job_root)} bytes", bool(steps)))
    metrics = Path(workdir) / "metrics.jsonl"
    if metrics.exists():
        with open(metrics, encoding="utf-8") as f:
            lines = sum(1 for line in f if line.strip())
        found.append(("metrics", metrics, f"{lines} records", False))
    return found


def prepare_workdir(config: Config) -> None:
    """--fresh: deletes what an earlier job left, one line per thing; else
    says what the job resumes from (nothing is deleted). Its callers hold the
    workdir's lock (``launch.train.workdir_lock``): nothing is deleted under
    a job that runs there."""
    t, checkpoint = config.train, config.checkpoint
    found = found_in_workdir(t.workdir, checkpoint)
    if t.fresh:
        for what, path, count, _ in found:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            print(f"fresh: deleted {what} {path} ({count})", flush=True)
        if not found:
            print(f"fresh: nothing to delete in {t.workdir}", flush=True)
        return
    resumable = [f"{what} {path} ({count})" for what, path, count, ok in found if ok]
    if resumable:
        print(f"resume: found {'; '.join(resumable)}; resuming from the newest "
              f"(--fresh deletes them and starts over)", flush=True)
    elif t.resume or found:
        kept = "; appending to metrics.jsonl" if any(w == "metrics" for w, *_ in found) else ""
        print(f"resume: nothing to resume in {t.workdir} (no checkpoint); starting from "
              f"step 0{kept}", flush=True)


def supervise(config: Config, argv: Sequence[str]) -> int:
    """Runs the simulated cluster (restarting it after an injected failure); its exit code.

    ``argv``: the flags this process was started with, passed on to the workers.
    With ``--link_gbps`` the hosts run behind shaped links (``launch.cluster.netns``),
    set up before the first attempt and removed however the job ends.
    """
    job = job_identity("supervisor")
    with workdir_lock(config.train.workdir, job, "supervisor"), _job_env(job), \
            links_for("train", config.cluster.hosts, config.cluster.link) as network:
        return _supervise(config, argv, network)


@contextlib.contextmanager
def _job_env(job: str) -> Iterator[None]:
    """``CAPRICORN_JOB_ID`` set to ``job`` for the workers this process starts
    (they join its workdir lock, ``launch.train.workdir_lock``)."""
    before = os.environ.get(JOB_ENV)
    os.environ[JOB_ENV] = job
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(JOB_ENV, None)
        else:
            os.environ[JOB_ENV] = before


def _supervise(config: Config, argv: Sequence[str], network: ShapedNetwork | None) -> int:
    cluster, train, checkpoint = config.cluster, config.train, config.checkpoint
    metrics_path = train.metrics_path
    prepare_workdir(config)
    # The chunk channel's secret: a new one per job start, in the workdir (0600),
    # named to the workers by the environment (unless the user's environment gives one).
    from capricorn_jax.experimental.multihost import start_job_secret

    os.environ.update(start_job_secret(train.workdir))
    console = Console(verbose=train.verbose)
    plan = config.faults.plan(train.steps)
    injector = FaultInjector(plan, train.workdir, network, checkpoint) if plan else None
    if injector is not None:
        injector.before_kill = console.injected_kill
    deadline = time.monotonic() + cluster.timeout_s
    while True:
        coordinator = cluster_lib.coordinator_address(network)
        # The injector when a fault is pending for this attempt, else None.
        armed = injector if injector is not None and injector.pending else None
        console.attempt()

        def argv_for(h: int, c: str = coordinator,
                     a: FaultInjector | None = armed) -> list[str]:
            return cluster_lib.worker_argv("launch.train", argv, h, c, _INTERNAL_FLAGS,
                                           a.extra_args(h) if a is not None else ())

        hosts = cluster_lib.LocalCluster(
            argv_for,
            cluster.hosts, cluster.devices_per_host,
            on_line=console.line, on_exit=console.ended,
            command_prefix=None if network is None else network.command_prefix,
            cpu_sets=cluster_lib.cpu_sets_per_host(cluster.hosts) if cluster.pin_hosts else None)
        if armed is not None:
            armed.arm(hosts)
        code = cluster_lib.run(hosts, max(1.0, deadline - time.monotonic()),
                               on_tick=armed.tick if armed is not None else None)
        if injector is not None:
            injector.after_attempt()
        # A fired fault ends the attempt, except a pause the job outlasted.
        if code == 0 or armed is None or not armed.fired:
            break
        armed.after_kill(checkpoint, cluster.hosts)
        print("fault: restarting all hosts; they recover", flush=True)
    if code == 0 and metrics_path.exists():
        report(metrics_path, injector is not None)
    elif code != 0:
        print(f"train: job failed with exit code {code}", file=sys.stderr, flush=True)
    return code
