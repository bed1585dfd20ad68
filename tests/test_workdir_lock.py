"""One job per workdir in every mode (``launch.train.workdir_lock``).

Fast: the job lock shared by one job's processes and refused to another's,
one process per host, a dead job's record no obstacle; a filesystem whose
flock fails (ENOLCK, EOPNOTSUPP, EINVAL) is a refusal naming the path, the
filesystem and the errno, also as the command's one error line; ``--fresh``
in the single GPU process refused (nothing deleted) while another job holds
the workdir. Slow (real JAX processes): a worker started by hand with
``--process_id`` keeps a second job's worker and supervisor out of its
workdir, and a second process for its own host number too.
"""

import errno
import fcntl
import json
import os
import subprocess
import sys
import time
import types

import pytest

from launch.cluster.processes import free_port
from launch.train import command
from launch.train.workdir_lock import (
    HOST_LOCK_NAME,
    JOB_ENV,
    LOCK_NAME,
    LockUnsupported,
    WorkdirInUse,
    filesystem_of,
    hold,
    job_identity,
    workdir_lock,
)
from tests.helpers import ROOT, assert_no_orphans, child_env, run_train

# Holds the workdir as the supervisor does, with the name the supervisor
# module has always exported, until killed.
_HOLDER = ("import sys, time; sys.path.insert(0, sys.argv[2]); "
           "from launch.train.supervisor import workdir_lock\n"
           "with workdir_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(120)")


def test_one_job_shares_the_lock_another_is_refused(tmp_path):
    a = hold(str(tmp_path), "job-a", "worker", 0)
    b = hold(str(tmp_path), "job-a", "worker", 1)  # another host of the same job
    with pytest.raises(WorkdirInUse, match=r"another process is already host 1 of this job "
                                           rf"\(job 'job-a', host 1's worker, pid {os.getpid()}"):
        hold(str(tmp_path), "job-a", "worker", 1)
    with pytest.raises(WorkdirInUse, match=rf"--workdir {tmp_path} is in use by another job "
                                           rf"\(job 'job-a', host 0's worker, pid {os.getpid()} "
                                           rf"on .*\); this process is of job 'job-b'"):
        hold(str(tmp_path), "job-b", "worker", 5)  # a host number job-a does not run
    a.release()
    with pytest.raises(WorkdirInUse):  # held while any process of job-a holds it
        hold(str(tmp_path), "job-b", "worker", 0)
    b.release()
    c = hold(str(tmp_path), "job-b", "worker", 0)  # the record job-a left is no obstacle
    assert json.loads((tmp_path / LOCK_NAME).read_text())["job"] == "job-b"
    c.release()


def test_a_worker_belongs_to_its_coordinator_or_the_given_job(monkeypatch):
    monkeypatch.delenv(JOB_ENV, raising=False)
    assert job_identity("worker", 1, "10.0.0.1:1234", 2) == "--coordinator=10.0.0.1:1234 --hosts=2"
    monkeypatch.setenv(JOB_ENV, "slurm-77")
    assert job_identity("worker", 1, "10.0.0.1:1234", 2) == "slurm-77"
    # A supervisor or the single GPU process is a job of its own, whatever it inherited.
    assert job_identity("supervisor") == job_identity("supervisor") != "slurm-77"
    assert str(os.getpid()) in job_identity("single process")


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL])
def test_a_filesystem_without_flock_is_a_named_refusal(tmp_path, monkeypatch, capsys, code):
    def flock(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", flock)
    with pytest.raises(LockUnsupported) as refused:
        with workdir_lock(str(tmp_path)):
            pass
    message = str(refused.value)
    assert f"cannot lock {tmp_path / LOCK_NAME}: {errno.errorcode[code]} " in message
    assert filesystem_of(tmp_path) in message and "flock does not work there" in message
    # The command: one error line and exit code 2, no traceback.
    config = types.SimpleNamespace(
        cluster=types.SimpleNamespace(process_id=0, coordinator="127.0.0.1:1", hosts=2),
        train=types.SimpleNamespace(workdir=str(tmp_path)))
    with pytest.raises(SystemExit) as exited:
        command._hold_workdir(config, "worker", 0)
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"train: error: --workdir {tmp_path}: cannot ")
    assert errno.errorcode[code] in err[0]


def _finished_workdir(tmp_path):
    work, shm = tmp_path / "w", tmp_path / "shm"
    (work / "checkpoints" / "4").mkdir(parents=True)
    (work / "metrics.jsonl").write_text('{"step": 0}\n')
    from launch.train.config import job_name

    (shm / job_name(str(work)) / "host0").mkdir(parents=True)
    return work, shm


def _holding(argv, **popen):
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **popen)
    assert proc.stdout is not None
    return proc


def test_fresh_is_refused_and_deletes_nothing_while_another_job_holds_the_workdir(tmp_path):
    work, shm = _finished_workdir(tmp_path)
    before = sorted(p for p in tmp_path.rglob("*") if LOCK_NAME not in p.name)
    holder = _holding([sys.executable, "-c", _HOLDER, str(work), str(ROOT)])
    try:
        assert holder.stdout.readline().strip() == "held"
        # The single GPU process: it ran --fresh's deletions without any lock.
        proc = run_train("--platform=gpu", "--hosts=1", "--fresh", f"--workdir={work}",
                         f"--store_root={shm}", "--model=tiny", "--steps=2", timeout=120)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and "fresh: deleted" not in proc.stdout
        err = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith(
            f"train: error: --workdir {work} is in use by another job ("), err
        assert f"supervisor, pid {holder.pid} on " in err[0]
        assert sorted(p for p in tmp_path.rglob("*") if LOCK_NAME not in p.name) == before
    finally:
        holder.kill()
        holder.wait(30)


def _wait_for_host_lock(work, host, pid, proc, timeout_s=60.0):
    path = work / HOST_LOCK_NAME.format(host=host)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if json.loads(path.read_text()).get("pid") == pid:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    pytest.fail(f"host {host} (pid {pid}) took no lock on {work} in {timeout_s:g} s")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_worker_started_by_hand_refuses_a_second_job(tmp_path):
    work = tmp_path / "run"
    env = child_env(1)
    env.pop(JOB_ENV, None)
    coordinator = f"127.0.0.1:{free_port()}"
    common = ["--hosts=2", "--devices_per_host=1", "--model=tiny", "--steps=2",
              f"--workdir={work}", f"--store_root={tmp_path / 'shm'}"]
    # Host 0 of job A, started by hand: it waits for its host 1 in
    # jax.distributed's initialization, holding the workdir all the while.
    first = _holding([sys.executable, "-m", "launch.train", *common, "--process_id=0",
                      f"--coordinator={coordinator}"], cwd=ROOT, env=env,
                     stderr=subprocess.STDOUT)
    try:
        _wait_for_host_lock(work, 0, first.pid, first)
        holder = f"job '--coordinator={coordinator} --hosts=2', host 0's worker, pid {first.pid}"
        # Another job's worker (another coordinator), on a host number job A has not started.
        other = run_train(*common, "--process_id=1", f"--coordinator=127.0.0.1:{free_port()}",
                          timeout=60)
        assert other.returncode == 2, other.stdout[-2000:] + other.stderr[-2000:]
        assert (f"train: error: --workdir {work} is in use by another job ({holder}"
                in other.stderr), other.stderr
        # Another job's supervisor.
        supervisor = run_train(*common, "--fresh", timeout=60)
        assert supervisor.returncode == 2, supervisor.stdout[-2000:] + supervisor.stderr[-2000:]
        assert f"is in use by another job ({holder}" in supervisor.stderr
        assert "fresh: deleted" not in supervisor.stdout
        # Job A's own command line for host 0, started twice.
        twice = run_train(*common, "--process_id=0", f"--coordinator={coordinator}", timeout=60)
        assert twice.returncode == 2, twice.stdout[-2000:] + twice.stderr[-2000:]
        assert f"another process is already host 0 of this job ({holder}" in twice.stderr
        assert "Traceback" not in other.stderr + supervisor.stderr + twice.stderr
        assert first.poll() is None  # job A is undisturbed
    finally:
        first.kill()
        first.wait(30)
    assert_no_orphans(str(work))
