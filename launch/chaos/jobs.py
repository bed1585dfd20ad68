"""launch.chaos's jobs: the ``launch.train`` processes a trial runs, and the
watch over a faulted job's persistent steps.

``run_watched`` runs a trial's job and, while it runs, lists its committed
persistent steps (Orbax's finalized step directories under
WORKDIR/checkpoints) every ``WATCH_S`` seconds, each listing tagged with
the metrics lines written by then (``oracle.DiskSnapshot``): the oracle
reads from them the newest persistent step committed before each recovery,
and whether a committed step left the disk too early (a failed finalize
that deleted an older step). ``reference`` runs the uninterrupted run of a
topology, once per topology.

Design choice: watching the directory from outside the job, so the record of
what was committed does not depend on the code under test reporting it.
Alternative not taken: a ``persist_committed`` event in the metrics, which
launch.train does not write and which a job killed between the commit and
the event would lose.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from launch.chaos.checks import committed_steps
from launch.chaos.config import Topology
from launch.chaos.oracle import DiskSnapshot

WATCH_S = 0.1
"""Seconds between two listings of a job's persistent steps (a persistent
write takes seconds: a step is seen, and a deletion too early twice)."""


def store_root(scratch: Path) -> Path:
    """The trials' RAM stores: on the RAM disk when there is one."""
    shm = Path("/dev/shm")
    return shm / f"capricorn-chaos-{scratch.name}" if shm.is_dir() else scratch / "shm"


def _command(flags_: list[str], workdir: Path, store: Path, fast_compile: bool,
             extra: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if fast_compile:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""),
                                     "--xla_backend_optimization_level=0"]).strip()
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(workdir.parent / "jax_cache"))
    return ([sys.executable, "-m", "launch.train", *flags_, f"--workdir={workdir}",
             f"--store_root={store}", "--fresh", *extra], env)


def run_train(flags_: list[str], workdir: Path, store: Path, timeout_s: float,
              fast_compile: bool, extra: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """A launch.train job (raises ``subprocess.TimeoutExpired`` past ``timeout_s``)."""
    args, env = _command(flags_, workdir, store, fast_compile, extra)
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=env)


def read_records(workdir: Path) -> list[dict]:
    """A job's metrics.jsonl (empty when it wrote none)."""
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines()]


def _listing(workdir: Path, snapshots: list[DiskSnapshot]) -> None:
    steps = frozenset(committed_steps(workdir / "checkpoints"))
    try:  # counted after the listing: a record past it was written later
        records = (workdir / "metrics.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        records = 0
    if snapshots and snapshots[-1].steps == steps:
        snapshots[-1] = dataclasses.replace(snapshots[-1], polls=snapshots[-1].polls + 1)
    else:
        snapshots.append(DiskSnapshot(records, steps))


def run_watched(flags_: list[str], workdir: Path, store: Path, timeout_s: float,
                fast_compile: bool, extra: Sequence[str] = ()
                ) -> tuple[subprocess.CompletedProcess, list[DiskSnapshot]]:
    """``run_train`` with the watch over its persistent steps (module
    docstring): the process and the listings, each kept once per change.
    A WORKDIR left by an earlier run is removed first (its steps are not
    this job's)."""
    shutil.rmtree(workdir, ignore_errors=True)
    args, env = _command(flags_, workdir, store, fast_compile, extra)
    snapshots: list[DiskSnapshot] = []
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, text=True, env=env)
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                out.seek(0)
                raise subprocess.TimeoutExpired(args, timeout_s, output=out.read())
            _listing(workdir, snapshots)
            time.sleep(WATCH_S)
        _listing(workdir, snapshots)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(args, proc.returncode, out.read(),
                                           err.read()), snapshots


def reference(topo: Topology, steps: int, model: str, scratch: Path, cache: dict,
              timeout_s: float, fast_compile: bool, extra: Sequence[str] = ()
              ) -> dict[int, float]:
    """Losses of the uninterrupted run of a topology (one run per topology)."""
    key = (topo.hosts, topo.devices_per_host)
    if key not in cache:
        work = scratch / f"ref-{topo.hosts}x{topo.devices_per_host}"
        proc = run_train([f"--hosts={topo.hosts}", f"--devices_per_host={topo.devices_per_host}",
                          f"--model={model}", f"--steps={steps}", "--ckpt=none",
                          "--eval_sequences=0", f"--log_every={steps}"],
                         work, store_root(scratch), timeout_s, fast_compile, extra)
        if proc.returncode != 0:
            raise RuntimeError(f"reference run {key} failed:\n{proc.stdout[-2000:]}"
                               f"{proc.stderr[-2000:]}")
        cache[key] = {r["step"]: r["loss"] for r in read_records(work) if "event" not in r}
    return cache[key]
