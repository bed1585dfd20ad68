"""Shared helpers for tests that run the launcher as real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# XLA flags of every JAX process the tests start (this one included, see
# conftest.py): LLVM's backend optimizations off. The tests compare runs made
# with the same flags, never against numbers of an optimized build, and
# compiling the train step costs about half as much (measured: the tiny model's
# step 12 s -> 7 s, its init 7 s -> 2 s per process on 2 cores).
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",)


def child_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """The environment of a process a test starts: this one's, with the test XLA
    flags, the repo on PYTHONPATH and, given ``devices``, that many CPU devices
    (otherwise none forced: the launcher sets each host's count)."""
    env = {**os.environ, **extra}
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags += [f for f in TEST_XLA_FLAGS if f not in flags]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax")
"""What a launcher's supervisor never imports (its workers do): 1.7 s of CPU a launch."""

# ``python -m MODULE FLAGS``, then the top-level packages of HEAVY it imported, to a file.
_RECORDING_IMPORTS = """
import json, os, runpy, sys
heavy, out = os.environ.pop("_TEST_HEAVY").split(","), os.environ.pop("_TEST_IMPORTS_OUT")
module = sys.argv.pop(1)
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
finally:
    with open(out, "w") as f:
        json.dump(sorted({m.split(".")[0] for m in sys.modules} & set(heavy)), f)
"""


def run_launcher(module: str, *flags: str, timeout: float = 300.0,
                 env: dict[str, str] | None = None,
                 light: bool = True) -> subprocess.CompletedProcess:
    """Runs ``python -m MODULE FLAGS`` (``launch.train``, ``launch.bench``) from
    the repo root; captures output. With ``light``, a supervisor (no
    ``--process_id``, not ``--platform=gpu``) is checked to have imported none
    of ``HEAVY``: its flags, the hosts it starts, the faults it injects and its
    report need none (the bench's parent imports JAX to measure this host's
    copy bandwidth, ``--bandwidth_mib``)."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "imports.json"
        env = child_env(None, **(env or {}), _TEST_HEAVY=",".join(HEAVY),
                        _TEST_IMPORTS_OUT=str(out))
        proc = subprocess.run([sys.executable, "-c", _RECORDING_IMPORTS, module, *flags],
                              cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        supervisor = not any(f.startswith(("--process_id", "--platform=gpu")) for f in flags)
        if light and supervisor and out.exists():
            assert json.loads(out.read_text()) == [], (
                f"{module}'s supervisor imported {out.read_text()}")
    return proc


def run_train(*flags: str, timeout: float = 300.0,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``run_launcher("launch.train", *flags)``."""
    return run_launcher("launch.train", *flags, timeout=timeout, env=env)


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains ``text``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


def assert_no_orphans(text: str, grace_s: float = 5.0) -> None:
    deadline = time.monotonic() + grace_s
    while processes_mentioning(text) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(text) == [], f"processes left behind: {processes_mentioning(text)}"


def two_host_transport():
    """The tiny model's trainer on the 4 forced CPU devices as 2 hosts x 2
    devices, its pack plan (256 KiB chunks) and its transport (one peer
    replica, 3 versions): what the in-graph step tests move.

    Returns:
      (trainer, plan, transport).
    """
    from capricorn_jax._src.memory.wire.packing import make_plan
    from capricorn_jax._src.memory.wire.placement import send_rounds
    from capricorn_jax._src.memory.wire.transport import Transport
    from launch.trainer import OptimizerOptions, Trainer, make_mesh
    from models import get_config

    trainer = Trainer(get_config("tiny"), make_mesh(4), OptimizerOptions())
    plan = make_plan(trainer.abstract_state, trainer.state_shardings, trainer.mesh, 1 << 18,
                     device_host=[0, 0, 1, 1])
    transport = Transport(plan, trainer.mesh, trainer.state_shardings, send_rounds(2, 2), 3)
    return trainer, plan, transport


class StatusNotes:
    """A stand-in for the memory tier where a strategy only notes and reads
    the status note (``TierWriter.note_status``, ``agreed_note``): the test
    plays the status round by setting ``agreed_note``. ``members``: any other
    attribute the test's path reads (``transport``)."""

    def __init__(self, **members: Any) -> None:
        self.status_note = 0
        self.agreed_note: int | None = None
        for name, value in members.items():
            setattr(self, name, value)

    def note_status(self, value: int) -> None:
        self.status_note = value


def notes_of(strategy: Any) -> StatusNotes:
    """The ``StatusNotes`` a test put in ``strategy.ckpt``."""
    notes = strategy.ckpt
    assert isinstance(notes, StatusNotes)
    return notes


def netns_usable() -> bool:
    """Whether this process can build shaped links (root, iproute2's ip and tc)."""
    import shutil

    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


class PumpedProcesses:
    """Processes a test starts (one per simulated host), each one's output
    pumped line by line, so a test can wait for a line while they run."""

    def __init__(self, commands: list[list[str]], env: dict[str, str],
                 timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self.lines: list[list[str]] = [[] for _ in commands]
        self._cond = threading.Condition()
        self.procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True) for cmd in commands]
        for pid in range(len(commands)):
            threading.Thread(target=self._pump, args=(pid,), daemon=True).start()

    def _pump(self, pid: int) -> None:
        stdout = self.procs[pid].stdout
        assert stdout is not None
        for line in stdout:
            with self._cond:
                self.lines[pid].append(line)
                self._cond.notify_all()

    def wait_for(self, pid: int, pattern: str, timeout: float | None = None) -> re.Match:
        rx = re.compile(pattern)
        with self._cond:
            found = self._cond.wait_for(
                lambda: next((m for m in map(rx.search, self.lines[pid]) if m), None),
                timeout or self.timeout_s)
        assert found, f"{pattern!r} never printed by host {pid}:\n" + self.text(pid)[-4000:]
        return found

    def text(self, pid: int) -> str:
        with self._cond:
            return "".join(self.lines[pid])

    def finish(self, timeout: float | None = None) -> list[int]:
        try:
            return [p.wait(timeout or self.timeout_s) for p in self.procs]
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
