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

``persistent_write_fault`` is the worker's side of the faults that kill no
host (``persist_error``, ``persist_hang``): a hook inside the victim's
persistent write of the version, after the hosts' pre-check, that raises an
I/O error or hangs there (the other hosts must drop the step within their
bound and go on).

``audit_store_if_asked`` is a test aid (``CAPRICORN_AUDIT_STORE=1``): the
worker ends itself if it touches another host's store, since data from peers
may reach a host only through the transport.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from absl import logging

from capricorn_jax.experimental import HostStore
from launch.cluster import processes as cluster_lib
from launch.cluster.netns import ShapedNetwork
from launch.train import rollback
from launch.train.config import CheckpointConfig
from launch.train.fault_plan import (
    NETWORK_FAULTS,
    PARTITION,
    PAUSE,
    PAUSING_POINTS,
    PERSIST_FAULTS,
    RECOVERY_POINTS,
    ROLLBACK,
    SLOW_LINK,
    SLOW_LINK_FACTOR,
    STALL_CHANNEL,
    Fault,
    FaultConfig,
)


def pause_marker(workdir: str | Path, host: int) -> Path:
    """The file host ``host`` writes when it reaches its fault point."""
    return Path(workdir) / f".paused_host{host}"


class FaultInjector:
    """Runs the fault plan, one fault per attempt (supervisor side).

    Args:
      plan: the faults (``FaultConfig.plan``).
      workdir: the job's WORKDIR (the victims' markers).
      network: the job's shaped links (the network faults act on them).
      checkpoint: the job's stores (a roll-back reads and prunes them).
    """

    def __init__(self, plan: tuple[Fault, ...], workdir: str,
                 network: ShapedNetwork | None = None,
                 checkpoint: CheckpointConfig | None = None):
        self.plan, self.workdir, self.network = plan, workdir, network
        self.checkpoint = checkpoint
        self.stopped_at: float | None = None  # a roll-back: when every host had stopped
        self.fired = False
        self.cluster: cluster_lib.LocalCluster | None = None
        self.kills = 0  # faults done so far
        self.resume_at: float | None = None  # a pause's SIGCONT time (monotonic)
        # Told the hosts about to be killed or paused, and which ("killed",
        # "paused"): the console then hides their peers' fallout.
        self.before_kill: Callable[[tuple[int, ...], str], None] | None = None

    @property
    def pending(self) -> bool:
        return self.kills < len(self.plan)

    @property
    def fault(self) -> Fault:
        """The fault armed in this attempt."""
        return self.plan[self.kills]

    def arm(self, cluster: cluster_lib.LocalCluster) -> None:
        """The next attempt's cluster: the next fault strikes it."""
        self.cluster, self.fired, self.resume_at = cluster, False, None
        self.stopped_at = None
        for host in self.fault.hosts:
            pause_marker(self.workdir, host).unlink(missing_ok=True)

    def extra_args(self, host: int) -> tuple[str, ...]:
        """The internal flag that makes a victim announce its fault point."""
        if not self.pending or host not in self.fault.hosts:
            return ()
        seconds = f":{self.fault.pause_s:g}" if self.fault.point == STALL_CHANNEL else ""
        return (f"--fault_at={self.fault.point}:{self.fault.step}{seconds}",)

    def tick(self) -> None:
        """Kills the victims together once one of them reached its point.

        Hosts lost at once (a rack, a switch) die at the same moment: the first
        victim at its point, the others wherever they are then. Waiting for
        every victim's point instead can wait forever: a host whose replica
        writer is busy drops a version's replicas and never writes it
        halfway (found by the soak, seed 2 trials 39 and 42)."""
        if self.resume_at is not None and time.monotonic() >= self.resume_at:
            self._resume()
        if self.fired or self.cluster is None or not any(
                pause_marker(self.workdir, h).exists() for h in self.fault.hosts):
            return
        if self.fault.point == ROLLBACK and not self._rollback_due():
            return
        self.fired = True
        fault = self.fault
        if fault.point == PAUSE:
            self._pause()
            return
        if fault.point in NETWORK_FAULTS:
            self._network(cut=True)
            return
        if self.before_kill is not None:
            self.before_kill(fault.hosts, "killed")
        for host in fault.hosts:
            self.cluster.kill_host(host, signal.SIGKILL)
        where = ("recovering" if fault.point == "recovery" else "serving a peer's version"
                 if fault.point == "mid_serve" else f"after step {fault.step} to roll back to "
                 f"version {fault.version}" if fault.point == ROLLBACK
                 else f"at step {fault.step}")
        victims = ", ".join(str(h) for h in fault.hosts)
        print(f"fault: SIGKILLed host{'s' if len(fault.hosts) > 1 else ''} {victims} {where} "
              f"({fault.point}, mode {fault.mode})", flush=True)

    def _rollback_due(self) -> bool:
        """A roll-back strikes once every host stopped after its step and the
        stores hold its version (``rollback.ready``), or ``rollback.WAIT_S``
        after the last host stopped (said on one line)."""
        if not all(pause_marker(self.workdir, h).exists() for h in self.fault.hosts):
            return False
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
        assert self.checkpoint is not None, "a roll-back needs the job's checkpoint config"
        if rollback.ready(self.fault, self.checkpoint, self.workdir, len(self.fault.hosts)):
            return True
        if time.monotonic() - self.stopped_at < rollback.WAIT_S:
            return False
        print(f"fault: rollback: version {self.fault.version} not held where the roll-back "
              f"restores it from after {rollback.WAIT_S:g} s; rolling back anyway", flush=True)
        return True

    def _pause(self) -> None:
        fault = self.fault
        assert self.cluster is not None
        if self.before_kill is not None:
            self.before_kill(fault.hosts, "paused")
        for host in fault.hosts:
            self.cluster.signal_host(host, signal.SIGSTOP)
        self.resume_at = time.monotonic() + fault.pause_s
        victims = ", ".join(str(h) for h in fault.hosts)
        print(f"fault: paused host{'s' if len(fault.hosts) > 1 else ''} {victims} (SIGSTOP) "
              f"after step {fault.step} for {fault.pause_s:g} s", flush=True)

    def _network(self, cut: bool) -> None:
        """A partition or a slow link of the victims starts (``cut``) or ends."""
        fault, network = self.fault, self.network
        assert network is not None, "a network fault needs the job's shaped links"
        victims = ", ".join(str(h) for h in fault.hosts)
        plural = "s" if len(fault.hosts) > 1 else ""
        if cut and self.before_kill is not None:
            self.before_kill(fault.hosts, "cut off" if fault.point == PARTITION else "slowed")
        for host in fault.hosts:
            if fault.point == PARTITION:
                network.set_link(host, up=not cut)
            else:
                network.set_rate(host, network.options.gbps / SLOW_LINK_FACTOR if cut else None)
        if not cut:
            self.resume_at = None
            what = "reconnected" if fault.point == PARTITION else "restored the link rate of"
            print(f"fault: {what} host{plural} {victims}", flush=True)
            return
        self.resume_at = time.monotonic() + fault.pause_s
        what = ("cut off host{p} {v} (link down)" if fault.point == PARTITION else
                f"slowed the link of host{{p}} {{v}} {SLOW_LINK_FACTOR:g}x")
        print(f"fault: {what.format(p=plural, v=victims)} after step {fault.step} for "
              f"{fault.pause_s:g} s", flush=True)

    def _resume(self) -> None:
        assert self.cluster is not None
        if self.fault.point in NETWORK_FAULTS:
            self._network(cut=False)
            return
        self.resume_at = None
        for host in self.fault.hosts:
            self.cluster.signal_host(host, signal.SIGCONT)
        victims = ", ".join(str(h) for h in self.fault.hosts)
        print(f"fault: resumed host{'s' if len(self.fault.hosts) > 1 else ''} {victims} "
              f"(SIGCONT)", flush=True)

    def after_attempt(self) -> None:
        """The attempt ended: a pause still running is ended (its hosts are
        gone); a cut or slowed link is restored before the restart."""
        if self.resume_at is not None and self.pending and self.fault.point in NETWORK_FAULTS:
            self._network(cut=False)
        self.resume_at = None

    def after_kill(self, checkpoint: CheckpointConfig, hosts: int) -> None:
        """Between the killed attempt and the restart: the store damage asked for."""
        fault = self.fault
        if fault.point == ROLLBACK:
            assert self.checkpoint is not None, "a roll-back needs the job's checkpoint config"
            for line in rollback.apply(fault, self.checkpoint, self.workdir, hosts):
                print(f"fault: {line}", flush=True)
            for host in fault.hosts:
                pause_marker(self.workdir, host).unlink(missing_ok=True)
            self.kills += 1
            return
        wiped = range(hosts) if fault.wipe_all else fault.hosts if fault.mode == "host" else ()
        for host in wiped:
            shutil.rmtree(checkpoint.store_dir(host), ignore_errors=True)
        if fault.wipe_all:
            print("fault: every host's RAM store lost", flush=True)
        elif wiped:
            print(f"fault: wiped the RAM store of host {', '.join(map(str, wiped))} "
                  f"(machine loss)", flush=True)
        if fault.corrupt and not fault.wipe_all:
            for host in fault.hosts:
                corrupt_newest_own_chunk(checkpoint.store_dir(host), host)
        for host in fault.hosts:
            pause_marker(self.workdir, host).unlink(missing_ok=True)
        self.kills += 1


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


def reached(config: FaultConfig, workdir: str, host: int, point: str, step: int = -1) -> None:
    """Worker side: this host got to ``point`` of ``step``. If it is the armed
    fault's, says so to the injector (a marker file) and, at a pausing point,
    waits there for the SIGKILL (bounded: it ends itself after 120 s)."""
    at = config.at()
    if at is None or at[0] != point or (point not in RECOVERY_POINTS and at[1] != step):
        return
    where = {"after_step": f"paused after step {step}",
             "mid_step": f"in step {step}, running on until killed",
             "mid_replication": f"paused halfway through writing replicas of version {step + 1}",
             "mid_persist": f"writing persistent version {step + 1}, running on until killed",
             "recovery": "paused at the start of its recovery",
             "mid_serve": f"paused in its recovery, about to serve a peer version {step}",
             ROLLBACK: f"paused after step {step} for a roll-back",
             PAUSE: f"finished step {step}; the launcher stops it for a while",
             PARTITION: f"finished step {step}; the launcher cuts its link for a while",
             SLOW_LINK: f"finished step {step}; the launcher slows its link for a while"}[point]
    # A line of the launcher's faults (as "fault: SIGKILLed host ..."), not a
    # warning: the user asked for it.
    print(f"fault: host {host} {where} (its fault point)", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    pause_marker(workdir, host).write_text(where)
    if point in PAUSING_POINTS:
        wait_for_kill(host)


def persistent_write_fault(config: FaultConfig, host: int
                           ) -> Callable[[int, str], None] | None:
    """The ``CapricornHandler.on_persist`` hook of this worker's armed
    persist_error / persist_hang fault, or None: once version step + 1's bytes
    are read, the write raises an I/O error, or hangs for good (a daemon
    thread: the handler's bounds end the wait for it)."""
    at = config.at()
    if at is None or at[0] not in PERSIST_FAULTS:
        return None
    point, version = at[0], at[1] + 1

    def hook(step: int, phase: str) -> None:
        if step != version or phase != "read":
            return
        print(f"fault: host {host}: "
              f"{'an I/O error' if point == 'persist_error' else 'hanging'} in the persistent "
              f"write of version {version} (its fault point)", flush=True)
        if point == "persist_error":
            raise OSError(errno.EIO, f"injected I/O error in host {host}'s persistent write "
                                     f"of version {version}")
        threading.Event().wait()

    return hook


def full_disk_path_class(config: FaultConfig, host: int) -> type | None:
    """The Orbax ``temporary_path_class`` of this worker's armed
    disk_full_finalize fault, or None: Orbax's atomic-rename path whose
    finalize of the fault's version raises ENOSPC before committing it (the
    primary finalizes; the others' files are written by then)."""
    version = config.full_disk_at
    if version is None:
        return None
    from orbax.checkpoint.path import atomicity

    class FullDiskAtFinalize(atomicity.AtomicRenameTemporaryPath):
        async def finalize(self, *args, **kwargs):
            if self.get_final().name == str(version):
                print(f"fault: host {host}: the disk is full when Orbax finalizes persistent "
                      f"step {version} (its fault point)", flush=True)
                raise OSError(errno.ENOSPC, f"injected: no space left on device finalizing "
                                            f"step {version}")
            return await super().finalize(*args, **kwargs)

    return FullDiskAtFinalize


def wait_for_kill(host: int) -> None:
    """Waits for the supervisor's SIGKILL (bounded)."""
    time.sleep(120)
    logging.error("host %d: not killed within 120 s of its fault point", host)
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
