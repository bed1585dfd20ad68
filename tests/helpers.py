"""Shared helpers for tests that run the launcher as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_train(*flags: str, timeout: float = 300.0,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs ``python -m launch.train FLAGS`` from the repo root; captures output."""
    env = {**os.environ, **(env or {})}
    env.pop("XLA_FLAGS", None)  # the launcher sets each host's device count
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "launch.train", *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


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
