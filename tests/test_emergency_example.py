"""The MaxText-shaped example (examples/maxtext_style): the one-import switch
from Orbax's emergency manager, a host lost and resumed from the peer tier,
and a real SIGTERM ending the job at one agreed step on the simulated
cluster (2 processes x 2 CPU devices)."""

from __future__ import annotations

import difflib
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from capricorn_jax._src.memory.store.store_lifecycle import committed_steps
from capricorn_jax._src.memory.tier.recovery import choose_version
from tests.helpers import ROOT, PumpedProcesses, child_env
from tests.test_orbax_handler import _free_port

EXAMPLE = ROOT / "examples" / "maxtext_style"


def test_the_switch_is_one_import_and_one_options_line():
    ours = (EXAMPLE / "train_capricorn.py").read_text().splitlines()
    theirs = (EXAMPLE / "train_orbax.py").read_text().splitlines()
    changed = [line for line in difflib.unified_diff(theirs, ours, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert changed == [
        "-from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency",
        "+from capricorn_jax import emergency",
        "-    options = emergency.CheckpointManagerOptions(local=emergency.LocalCheckpointOptions("
        "save_interval_steps=1, max_to_keep=1), persistent=persistent)  # noqa: E501",
        "+    options = emergency.CheckpointManagerOptions(local=emergency.LocalCheckpointOptions("
        "save_interval_steps=1), persistent=persistent, replicas=2)  # noqa: E501",
    ]


def _store_of(local_dir: Path) -> Path:
    """The one RAM store a machine's local directory holds (``JOB/host{i}``)."""
    stores = sorted(local_dir.glob("*/host*"))
    assert len(stores) == 1, stores
    return stores[0]


class _Job(PumpedProcesses):
    """The example's two processes, their output pumped line by line."""

    def __init__(self, root: Path, steps: int, step_s: float = 0.3, machines: tuple = (0, 1)):
        """``machines[pid]``: the machine (its local directory) process ``pid`` runs on."""
        port = _free_port()
        super().__init__([
            [sys.executable, str(EXAMPLE / "train_capricorn.py"),
             f"--coordinator=127.0.0.1:{port}", "--num_processes=2", f"--process_id={pid}",
             f"--local_dir={root / f'local{machines[pid]}'}",
             f"--persistent_dir={root / 'ckpt'}", f"--steps={steps}", "--persist_every=5",
             f"--step_s={step_s}"] for pid in range(2)], child_env(2), timeout_s=180)

    def finish(self, timeout: float | None = 240) -> list[int]:
        return super().finish(timeout)


@pytest.mark.slow
@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_the_switched_loop_loses_a_host_and_resumes_from_the_peer_tier(tmp_path):
    job = _Job(tmp_path, steps=12)
    job.wait_for(1, r"host 1: step 9 loss")
    job.kill()  # host 1's machine is lost; the launcher restarts every process
    shutil.rmtree(tmp_path / "local1")
    again = _Job(tmp_path, steps=12, step_s=0.0)
    resumed = [again.wait_for(pid, r"resumed at step (\d+), data position (\d+), tier (.*)")
               for pid in range(2)]
    assert again.finish() == [0, 0], again.text(0)[-3000:] + again.text(1)[-3000:]
    step = int(resumed[0].group(1))
    # The newest version committed on both hosts: past persistent step 5 (a version
    # becomes safe within a few saves: 9 was saved when the machine was lost).
    assert 6 <= step <= 9 and all(int(m.group(1)) == step for m in resumed)
    assert all(int(m.group(2)) == step + 1 for m in resumed)  # the data position, restored
    assert resumed[0].group(3) == "['local', 'peer']"  # host 1's shards from its peer
    for pid in range(2):
        assert f"host {pid}: done at step 12" in again.text(pid)


@pytest.mark.slow
@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_sigterm_stops_every_host_at_one_step_saved_to_both_tiers(tmp_path):
    job = _Job(tmp_path, steps=40)
    job.wait_for(0, r"host 0: step 3 loss")
    os.kill(job.procs[1].pid, signal.SIGTERM)  # one host preempted
    stops = [job.wait_for(pid, r"preempted: step (\d+) saved, exiting") for pid in range(2)]
    assert job.finish() == [0, 0]
    step = int(stops[0].group(1))
    assert int(stops[1].group(1)) == step and step < 40
    assert (tmp_path / "ckpt" / str(step)).is_dir()  # the persistent tier holds it too
    again = _Job(tmp_path, steps=step + 1, step_s=0.0)
    for pid in range(2):
        assert again.wait_for(pid, r"resumed at step (\d+)").group(1) == str(step)
    assert again.finish() == [0, 0]


@pytest.mark.slow
@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_a_restart_with_swapped_process_ids_recovers_from_each_machines_store(tmp_path):
    """The scheduler numbers the processes the other way round after the
    restart: each machine's RAM store is found by what it holds, not by the
    process index that wrote it, and the job resumes from memory."""
    job = _Job(tmp_path, steps=12)
    job.wait_for(1, r"host 1: step 9 loss")
    job.kill()
    # What each machine's store holds when the job dies ({owner: committed steps}),
    # listed in the new process order: process p runs on machine 1 - p.
    held = [committed_steps(_store_of(tmp_path / f"local{machine}")) for machine in (1, 0)]
    expected = choose_version(held, 2)
    again = _Job(tmp_path, steps=12, step_s=0.0, machines=(1, 0))
    resumed = [again.wait_for(pid, r"resumed at step (\d+), data position (\d+), tier (.*)")
               for pid in range(2)]
    assert again.finish() == [0, 0], again.text(0)[-3000:] + again.text(1)[-3000:]
    step = int(resumed[0].group(1))
    assert 6 <= step <= 9 and int(resumed[1].group(1)) == step
    # From memory, each owner's shards from the machine its new process runs on
    # ("local": the copy the other process wrote there as its peer's replica),
    # unless the kill came between a version's two copies: then the newest
    # version both machines reach, one owner's shards over the network.
    assert expected is not None and step == expected[0], (held, step)
    tiers = ["local" if expected[1][h] == h else "peer" for h in range(2)]
    assert resumed[0].group(3) == str(tiers), (held, resumed[0].group(3))
    assert "RAM store was written as host 1's" in again.text(0)
