"""Fault injection for launch.train: kills, a corrupted store, and the store audit.

Two sides. The supervisor's ``FaultInjector`` SIGKILLs ``--kill_host`` at each
kill step and, before the restart, wipes its RAM store (``--kill_mode=host``,
a lost machine) or flips a byte of its newest own version
(``--corrupt_store``, RAM bit rot). The worker's side is ``pause_for_kill``:
the doomed host writes a marker file at the kill point (after a step, or
halfway through writing replicas) and waits there, so the kill lands at that
point however fast the steps run; the injector fires when it sees the marker.
Design choice: the victim announces the point and waits. Alternative not
taken: the supervisor watching the metrics for the step and killing then,
which races with a fast step (the host may be steps ahead, or done).

``audit_store_if_asked`` is a test aid (``CAPRICORN_AUDIT_STORE=1``): the
worker ends itself if it touches another host's store, since data from peers
may reach a host only through the transport.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from absl import logging

from capricorn_jax.experimental import HostStore

from launch import cluster as cluster_lib
from launch.config import CheckpointConfig, FaultConfig


def pause_marker(workdir: str | Path, host: int) -> Path:
    """The file host ``host`` writes when it waits at its kill point."""
    return Path(workdir) / f".paused_host{host}"


class FaultInjector:
    """Kills host K at the requested point of each armed attempt (supervisor side)."""

    def __init__(self, faults: FaultConfig, workdir: str, steps: int):
        self.faults = faults
        self.marker = pause_marker(workdir, faults.kill_host)
        self.fired = False
        self.cluster: cluster_lib.LocalCluster | None = None
        self.kill_steps = faults.kill_steps(steps)
        self.kills = 0  # kills done so far
        # Told the host about to be killed (the console then hides its peers' fallout).
        self.before_kill: Callable[[int], None] | None = None

    @property
    def pending(self) -> bool:
        return self.kills < len(self.kill_steps)

    def arm(self, cluster: cluster_lib.LocalCluster) -> None:
        """The next attempt's cluster: it will be killed at the next kill step."""
        self.cluster, self.fired = cluster, False

    def extra_args(self, host: int) -> tuple[str, ...]:
        """The internal flags that make ``host`` pause at the next kill point."""
        if host != self.faults.kill_host or not self.pending:
            return ()
        at = self.kill_steps[self.kills]
        if self.faults.kill_point == "mid_replication":
            return (f"--pause_mid_replication_at={at + 1}",)
        return (f"--pause_after_step_at={at}",)

    def tick(self) -> None:
        """Kills host K once it waits at its kill point (the marker exists)."""
        if self.fired or self.cluster is None or not self.marker.exists():
            return
        self.fired = True
        if self.before_kill is not None:
            self.before_kill(self.faults.kill_host)
        self.cluster.kill_host(self.faults.kill_host, signal.SIGKILL)
        print(f"fault: SIGKILLed host {self.faults.kill_host} at step "
              f"{self.kill_steps[self.kills]} ({self.faults.kill_point}, mode "
              f"{self.faults.kill_mode})", flush=True)
        self.kills += 1

    def after_kill(self, checkpoint: CheckpointConfig) -> None:
        """Between the killed attempt and the restart: the store damage asked for."""
        host = self.faults.kill_host
        if self.faults.kill_mode == "host":
            shutil.rmtree(checkpoint.store_dir(host), ignore_errors=True)
            print(f"fault: wiped host {host}'s RAM store (machine loss)", flush=True)
        if self.faults.corrupt_store:
            corrupt_newest_own_chunk(checkpoint.store_dir(host), host)
        self.marker.unlink(missing_ok=True)


def corrupt_newest_own_chunk(root: Path, host: int) -> None:
    """Flips a byte in the first chunk of host ``host``'s newest own version,
    through the store's API (a view of the chunk in its shared-memory slot)."""
    store = HostStore(root)
    try:
        versions = store.versions(host)
        if not versions:
            print(f"fault: host {host} has no own version to corrupt", flush=True)
            return
        view = store.chunk_view(host, versions[-1], "d0.c0")
        view[view.size // 2] ^= 0xFF
        print(f"fault: flipped a byte in owner{host}/v{versions[-1]:012d}/d0.c0 of host {host}",
              flush=True)
    finally:
        store.close()


def pause_for_kill(workdir: str, host: int, where: str) -> None:
    """Fault injection: mark the kill point and wait for the supervisor's SIGKILL."""
    logging.warning("host %d: paused %s", host, where)
    sys.stdout.flush()
    sys.stderr.flush()
    pause_marker(workdir, host).write_text(where)
    time.sleep(120)
    logging.error("host %d: not killed within 120 s of pausing", host)
    os._exit(1)


_AUDITED_EVENTS = {"open", "os.listdir", "os.scandir", "os.rename", "os.replace", "os.remove",
                   "os.rmdir", "os.mkdir", "shutil.rmtree", "os.unlink"}


def audit_store_if_asked(checkpoint: CheckpointConfig, host: int) -> None:
    """Test aid (CAPRICORN_AUDIT_STORE=1): ends the process if it touches another
    host's store; data from peers may reach this host only through the transport."""
    if os.environ.get("CAPRICORN_AUDIT_STORE") != "1":
        return
    job_root = os.path.abspath(checkpoint.job_root)
    own = os.path.join(job_root, f"host{host}")

    def hook(event: str, args: tuple) -> None:
        if event not in _AUDITED_EVENTS:
            return
        for arg in args[:2]:
            if isinstance(arg, (str, bytes, os.PathLike)):
                path = os.path.abspath(os.fsdecode(arg))
                if path.startswith(job_root + os.sep) and not (
                        path == own or path.startswith(own + os.sep)):
                    os.write(2, f"STORE ISOLATION VIOLATION: host {host} {event} {path}\n"
                             .encode())
                    os._exit(3)

    sys.addaudithook(hook)
