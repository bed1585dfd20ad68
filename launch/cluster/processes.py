"""The simulated multi-host cluster: H local processes joined by jax.distributed.

The supervisor starts one process per simulated host, each with its own CPU
device count, and passes it the coordinator address (127.0.0.1, a free port)
and its process id. It hands every line a host prints to ``on_line`` (by
default: printed with a ``[host i]`` prefix; launch.train filters them,
``launch.cluster.console``), and ends the whole job when any host fails (a jax.distributed job
cannot go on without one of its processes), when a deadline passes, or on
SIGINT/SIGTERM. No orphans: every child gets PR_SET_PDEATHSIG=SIGKILL, so it
dies with the supervisor even when the supervisor is SIGKILLed, and the
supervisor kills all of them on any exit path.

``kill_host`` / ``start_host`` exist for fault injection: the launcher
SIGKILLs a host's process and starts its replacement.

A worker runs the launcher's own command line with ``--process_id`` and
``--coordinator`` added (``worker_argv``: one rule for launch.train,
launch.bench and the experiments); ``run_workers`` runs such a job whose
workers leave their results in a scratch folder (``scratch_dir``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
KILL_WAIT_S = 30.0
"""How long a killed host's process may take to exit before the harness says so."""


def cpu_sets_per_host(hosts: int) -> list[frozenset[int]]:
    """This process's CPUs split into ``hosts`` disjoint sets (round robin).

    With fewer CPUs than hosts, host i gets CPU i % n: hosts share CPUs but
    each one is still held to a single core.
    """
    if hosts < 1:
        raise ValueError(f"hosts must be >= 1, got {hosts}")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < hosts:
        return [frozenset({cpus[i % len(cpus)]}) for i in range(hosts)]
    return [frozenset(cpus[i::hosts]) for i in range(hosts)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_argv(module: str, argv: Sequence[str], host: int, coordinator: str,
                internal: tuple[str, ...] = (), extra: Sequence[str] = ()) -> list[str]:
    """Interpreter arguments of host ``host``'s worker: ``-m module`` with the
    launcher's own flags ``argv``, less ``--process_id``, ``--coordinator`` and
    those starting with ``internal``, then ``extra`` and this host's
    ``--process_id`` and ``--coordinator``."""
    drop = ("--process_id", "--coordinator", *internal)
    passed = [a for a in argv if not a.startswith(drop)]
    return ["-m", module, *passed, *extra, f"--process_id={host}", f"--coordinator={coordinator}"]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class LocalCluster:
    """Starts, watches and stops the processes of a simulated cluster.

    Args:
      argv_for_host: the command line (after the interpreter) of host i.
      hosts: number of processes.
      devices_per_host: CPU devices each process gets (XLA_FLAGS).
      on_line: called with (host, line) for each line a host prints; the
        default writes ``[host i] line`` to stdout.
      on_exit: called with (host) when a host's output ends (its process
        exited), after its last ``on_line``.
      command_prefix: if given, host i's process runs under
        ``command_prefix(i)`` (``ip netns exec NS``: its own shaped link,
        ``launch.cluster.netns``).
      cpu_sets: if given, host i's process (and its XLA thread pools, which
        size themselves from the affinity) runs on ``cpu_sets[i % len]`` only:
        a quieter simulation, each host on its own cores instead of every
        host's threads competing for all of them.
    """

    def __init__(
        self,
        argv_for_host: Callable[[int], Sequence[str]],
        hosts: int,
        devices_per_host: int,
        on_line: Callable[[int, str], None] | None = None,
        cpu_sets: Sequence[Collection[int]] | None = None,
        on_exit: Callable[[int], None] | None = None,
        command_prefix: Callable[[int], Sequence[str]] | None = None,
    ):
        if cpu_sets is not None and (not cpu_sets or not all(cpu_sets)):
            raise ValueError(f"cpu_sets must be non-empty sets of CPUs, got {cpu_sets!r}")
        self.cpu_sets = [frozenset(c) for c in cpu_sets] if cpu_sets is not None else None
        self.argv_for_host = argv_for_host
        self.hosts = hosts
        self.devices_per_host = devices_per_host
        self.procs: dict[int, subprocess.Popen] = {}
        self._threads: list[threading.Thread] = []
        self._on_line = on_line or self._print_line
        self._on_exit = on_exit
        self._print_lock = threading.Lock()
        self._command_prefix = command_prefix

    def _print_line(self, host: int, line: str) -> None:
        with self._print_lock:
            sys.stdout.write(f"[host {host}] {line}")
            if not line.endswith("\n"):
                sys.stdout.write("\n")
            sys.stdout.flush()

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        flags.append(f"--xla_force_host_platform_device_count={self.devices_per_host}")
        env["XLA_FLAGS"] = " ".join(flags)
        env["JAX_PLATFORMS"] = "cpu"
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start_host(self, host: int) -> None:
        """Starts (or restarts) the process of ``host``."""
        cpus = None if self.cpu_sets is None else self.cpu_sets[host % len(self.cpu_sets)]

        def preexec() -> None:  # between fork and exec, in the child
            _die_with_parent()
            if cpus is not None:
                os.sched_setaffinity(0, cpus)

        proc = subprocess.Popen(
            [*(self._command_prefix(host) if self._command_prefix else ()), sys.executable,
             *self.argv_for_host(host)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self._env(), preexec_fn=preexec, text=True, bufsize=1,
        )
        self.procs[host] = proc
        thread = threading.Thread(target=self._forward, args=(host, proc), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _forward(self, host: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._on_line(host, line)
        if self._on_exit is not None:
            self._on_exit(host)

    def start(self) -> None:
        for host in range(self.hosts):
            self.start_host(host)

    def signal_host(self, host: int, sig: int) -> None:
        """Sends ``sig`` to host's process (if alive) and returns at once
        (e.g. SIGSTOP and SIGCONT: a paused host)."""
        proc = self.procs[host]
        if proc.poll() is None:
            proc.send_signal(sig)

    def kill_host(self, host: int, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to host's process and waits for it to end, at most
        ``KILL_WAIT_S`` (a process stuck in the kernel ignores even SIGKILL:
        then a RuntimeError names the host, never a hang)."""
        proc = self.procs[host]
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"host {host} (pid {proc.pid}) did not exit within "
                               f"{KILL_WAIT_S:g}s of signal {sig}") from None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every live host, SIGKILL those still alive after grace_s."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            p.terminate()
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                try:
                    p.wait(timeout=KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    print(f"cluster: pid {p.pid} did not exit within {KILL_WAIT_S:g}s of "
                          f"SIGKILL; left behind", file=sys.stderr)
        for t in self._threads:
            t.join(timeout=2.0)

    def wait(self, timeout_s: float, poll_s: float = 0.1,
             on_tick: Callable[[], None] | None = None) -> int:
        """Waits until every host exits 0 (-> 0) or one fails (-> its code).

        On a failure or when ``timeout_s`` passes, the remaining hosts are
        stopped. ``on_tick`` runs every poll (fault injection hooks in there).

        Returns:
          0, the first non-zero exit code, or 124 on timeout.
        """
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if on_tick is not None:
                    on_tick()
                codes = {h: p.poll() for h, p in self.procs.items()}
                failed = {h: c for h, c in codes.items() if c not in (None, 0)}
                if failed:
                    host, code = min(failed.items())
                    self._on_line(host, f"exited with code {code}; stopping the other hosts\n")
                    return code if code > 0 else 128 - code
                if all(c == 0 for c in codes.values()):
                    return 0
                if time.monotonic() > deadline:
                    self._on_line(0, f"job exceeded {timeout_s:.0f}s; stopping all hosts\n")
                    return 124
                time.sleep(poll_s)
        finally:
            self.stop()


def run(cluster: LocalCluster, timeout_s: float, on_tick: Callable[[], None] | None = None) -> int:
    """Starts ``cluster``, waits for it, and stops it on SIGINT/SIGTERM too.

    Both handlers are installed here, whatever this process inherited: a
    process started in the background by a non-interactive shell inherits
    SIGINT ignored, and Python then installs no KeyboardInterrupt handler, so
    an interrupt would otherwise leave the job running.
    """

    def _terminate(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        cluster.start()
        return cluster.wait(timeout_s, on_tick=on_tick)
    except KeyboardInterrupt:
        cluster.stop()
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def scratch_dir(path: str | None, prefix: str) -> Path:
    """``path`` (created), or a new temporary folder named ``prefix...``: where
    a tool's workers leave their results for the launcher."""
    folder = Path(path or tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def coordinator_address(network=None) -> str:
    """Where the jax.distributed coordinator (host 0) listens: 127.0.0.1, or
    host 0's address on its shaped link (``network``: a ``launch.cluster.netns.ShapedNetwork``)."""
    host = "127.0.0.1" if network is None else network.address(0)
    return f"{host}:{free_port()}"


def run_workers(module: str, argv: Sequence[str], hosts: int, devices_per_host: int,
                workdir: str | os.PathLike, timeout_s: float,
                internal: tuple[str, ...] = (), network=None,
                on_line: Callable[[int, str], None] | None = None) -> int:
    """Runs ``-m module`` once per simulated host with the launcher's flags
    ``argv`` (less ``internal``) and ``--workdir=workdir`` (a tool's scratch
    folder, where the workers leave their results), until every host exits
    or ``timeout_s`` passes; the job's exit code (``run``). ``network``: an
    open ``launch.cluster.netns.ShapedNetwork`` the hosts run behind; ``on_line``: as
    ``LocalCluster``'s."""
    coordinator = coordinator_address(network)
    # The chunk channel's secret: a new one in the tool's folder, named to its workers.
    from capricorn_jax.experimental.multihost import start_job_secret

    os.environ.update(start_job_secret(workdir))
    cluster = LocalCluster(
        lambda h: worker_argv(module, argv, h, coordinator, ("--workdir", *internal),
                              (f"--workdir={workdir}",)),
        hosts, devices_per_host, on_line=on_line,
        command_prefix=None if network is None else network.command_prefix)
    return run(cluster, timeout_s)


def run_tool_workers(tool: str, module: str, argv: Sequence[str], hosts: int,
                     devices_per_host: int, workdir: Path, timeout_s: float, link,
                     result_name: str) -> dict:
    """A measuring tool's job: its workers (``run_workers``, their chatter
    filtered by the console) behind the links ``link`` asks for
    (``launch.cluster.netns.links_for``); the JSON host 0 left in ``workdir/result_name``.
    When a host fails or left nothing: ``tool: error: ...`` and the job's exit code."""
    import json

    from launch.cluster.console import Console
    from launch.cluster.netns import links_for

    with links_for(tool, hosts, link) as network:
        code = run_workers(module, argv, hosts, devices_per_host, workdir, timeout_s,
                           network=network, on_line=Console().line)
    result_file = Path(workdir) / result_name
    if code != 0 or not result_file.exists():
        print(f"{tool}: error: a host failed (exit code {code}); no results", file=sys.stderr)
        sys.exit(code or 1)
    return json.loads(result_file.read_text())

