"""launch.bench's stores: a run never deletes another live run's (issue 50).

A bench run that had committed every version found none in its recovery
measurement: the bench deleted its whole ``--store_root`` (one fixed folder
by default) at the start and the end of every run, so a second bench started
or ended meanwhile deleted the first one's stores. These tests put a live
run's store (open, as its workers hold it) under the root and run a second
run's start and end over it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from capricorn_jax.experimental import HostStore
from launch.bench import stores


def _live_run_store(root, pid: int) -> HostStore:
    """A store of a run whose supervisor is ``pid``, open (its lock held) with
    one committed version, laid out as the bench's workers lay it out."""
    store = HostStore(stores.run_root(root, pid) / "bench-inmem" / "host0")
    writer = store.begin(0, 7, 64)
    writer.write_chunk("d0.c0", np.arange(64, dtype=np.uint8).tobytes(), offset=0)
    writer.commit({})
    return store


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_removable_keeps_live_runs_only():
    alive = {11, 12}.__contains__
    names = ["run11", "run12", "run13", "bench-inmem", "runx", "run99"]
    # Its own folder and dead runs' go (if unused), as does the old layout's.
    assert stores.removable(names, own=12, alive=alive) == [
        "bench-inmem", "run12", "run13", "run99", "runx"]


def test_a_starting_run_keeps_a_live_runs_stores(tmp_path):
    root = tmp_path / "shm"
    other = os.getppid()  # alive for the whole test
    live = _live_run_store(root, other)
    stale = stores.run_root(root, _dead_pid())
    (stale / "bench-inmem" / "host0").mkdir(parents=True)
    removed = stores.clear_stale(root, own=os.getpid())
    assert removed == [stale.name]
    assert live.versions(0) == [7] and live.verify(0, 7)
    live.close()


def test_a_dead_runs_open_store_is_not_deleted(tmp_path):
    # A folder whose supervisor is gone but whose store is still open (a
    # worker outliving it) stays: the removal is lock-respecting.
    root = tmp_path / "shm"
    orphan = _live_run_store(root, _dead_pid())
    assert stores.clear_stale(root, own=os.getpid()) == []
    assert orphan.versions(0) == [7]
    orphan.close()


def test_an_ending_run_keeps_a_live_runs_stores(tmp_path):
    root = tmp_path / "shm"
    live = _live_run_store(root, os.getppid())
    mine = stores.run_root(root, os.getpid())
    (mine / "bench-pec" / "host0").mkdir(parents=True)
    stores.release(root, mine)
    assert not mine.exists()
    assert live.versions(0) == [7] and live.verify(0, 7)
    live.close()
    stores.release(root, stores.run_root(root, os.getppid()))
    assert not root.exists()  # the last run out removes the root


def test_workers_get_the_runs_folder():
    run = stores.run_root("/dev/shm/x", 5)
    assert stores.worker_argv(["--steps=3", "--store_root=/dev/shm/x", "--reps=1"], run) == [
        "--steps=3", "--reps=1", "--store_root=/dev/shm/x/run5"]
    assert stores.worker_argv(["--store_root", "/a", "--reps=1"], run) == [
        "--reps=1", "--store_root=/dev/shm/x/run5"]


def test_the_command_keeps_a_live_runs_stores(tmp_path, monkeypatch):
    # The command's own start and end around its workers (stubbed: a host
    # failed), with another run's store open under the same --store_root.
    import pytest
    from absl import flags

    from launch.bench import command
    from launch.bench.config import BenchConfig

    root = tmp_path / "shm"
    live = _live_run_store(root, os.getppid())
    fv = command.define_flags(flags.FlagValues())
    fv(["bench", f"--store_root={root}", f"--workdir={tmp_path / 'w'}", "--hosts=2"])
    config = BenchConfig.from_flags(fv)
    seen = []

    def workers(*args):
        seen.append(args)
        assert live.versions(0) == [7]  # not deleted by this run's start
        return 1

    monkeypatch.setattr(command, "_run_cluster", workers)
    monkeypatch.setattr(sys, "argv", ["bench", f"--store_root={root}"])
    with pytest.raises(SystemExit):
        command.run(config)
    assert seen and seen[0][-1][-1] == f"--store_root={stores.run_root(root)}"
    assert live.versions(0) == [7] and live.verify(0, 7)  # nor by its end
    live.close()
