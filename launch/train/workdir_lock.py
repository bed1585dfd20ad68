"""One job per workdir, however its processes were started.

Every process of a launch.train job holds WORKDIR's locks for its whole life
(``flock``: the kernel drops them however the process ends, SIGKILL included):

- the job lock, ``WORKDIR/.capricorn.lock``: held *shared* by every process
  of the job (the supervisor, each worker, the single GPU process); the file
  names the job that holds it. A process joins only the job the file names:
  another job's process is refused, naming the workdir, the job, and the pid
  and machine that took the lock.
- the host lock, ``WORKDIR/.capricorn.host{H}.lock``: held *exclusively* by
  host H's worker, so two processes of one job cannot both be host H (a
  command line started twice on one machine).

A process's job (``job_identity``): the supervisor's own (machine and pid),
which it hands its workers in ``CAPRICORN_JOB_ID``; for a worker started by
hand with ``--process_id``, ``CAPRICORN_JOB_ID`` when the cluster's scheduler
sets it (the same on every host), else ``--coordinator`` and ``--hosts``,
which every host of one job is given alike; for the single GPU process, its
own. The supervisor holds the job lock through its restarts, so another job
cannot take the workdir between two attempts; ``prepare_workdir`` and
``--fresh``'s deletions run only once the lock is held.

Joining: a process takes the job lock exclusively when nobody holds it and
writes its job into the file, then turns it into a shared one; a process
that finds it held takes it shared and reads whose it is. ``flock`` does not
turn an exclusive lock into a shared one atomically (another process can
take it exclusively in between and write its own job), so every process
reads the file again once it holds the shared lock and proceeds only if it
names its own job: the file changes only under the exclusive lock, which no
one can take while a shared one is held, so all holders agree on one job.

A filesystem whose ``flock`` fails (ENOLCK on an NFS mount without a lock
daemon, EOPNOTSUPP, EINVAL, ENOSYS on a Lustre mount without ``-o flock``)
is a refusal naming the lock file, the filesystem (type and mount point) and
the errno, never a traceback: running without the lock would let a second
job or ``--fresh`` delete what a running job writes.

Design choice: a shared job lock naming its job, plus an exclusive lock per
host. Alternatives not taken: one exclusive lock per workdir (the
supervisor's earlier lock): the hosts of one real multi-host job share a
workdir on a shared filesystem, so all but one of them would be refused;
only per-host exclusive locks: a second job would be refused only on the
host numbers its first job's live processes hold (a job of more hosts, or
one started while the first restarts, would get in); a lock server or the
job's key-value store: it exists only once jax.distributed is up, after the
workdir is already read, and not at all for the single GPU process.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

JOB_ENV = "CAPRICORN_JOB_ID"
"""The environment variable that names the job of a worker started with
``--process_id`` (the supervisor sets it for its workers)."""

LOCK_NAME = ".capricorn.lock"
"""The workdir's job lock file (shared by the job's processes)."""

HOST_LOCK_NAME = ".capricorn.host{host}.lock"
"""A host's lock file (exclusive: one process per host of the job)."""

EXCLUSIVE_WAIT_S = 10.0
"""How long a joiner waits while another process holds the job lock
exclusively (for the milliseconds of writing its job into the file); past it
the holder is taken for a foreign tool, or an older launcher that held the
lock exclusively for a whole job, and the joiner is refused."""

_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


class WorkdirRefused(RuntimeError):
    """The workdir cannot be held: another job has it, or locking fails there."""


class WorkdirInUse(WorkdirRefused):
    """Another job holds the workdir (one job per workdir: two would write the
    same stores and metrics), or another process is already this host."""


class LockUnsupported(WorkdirRefused):
    """``flock`` does not work on the workdir's filesystem."""


def job_identity(role: str, process_id: int = -1, coordinator: str = "",
                 hosts: int = 1) -> str:
    """The job this process belongs to (module docstring). ``role``:
    ``supervisor``, ``worker`` (``--process_id``) or ``single`` (one GPU
    process)."""
    if role == "worker":
        given = os.environ.get(JOB_ENV, "").strip()
        if given:
            return given
        return f"--coordinator={coordinator} --hosts={hosts}"
    return f"{role} {socket.gethostname()}:{os.getpid()}"


def filesystem_of(path: str | os.PathLike[str]) -> str:
    """``TYPE at MOUNTPOINT`` of the filesystem holding ``path`` (from
    /proc/self/mounts), or ``the filesystem of PATH`` where that is unknown."""
    real = os.path.realpath(path)
    best: tuple[str, str] | None = None
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ").replace("\\011", "\t")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and (best is None or len(mount) >= len(best[1])):
                    best = (fields[2], mount)
    except OSError:
        pass
    return f"{best[0]} at {best[1]}" if best else f"the filesystem of {real}"


def _unsupported(path: Path, e: OSError) -> LockUnsupported:
    name = errno.errorcode.get(e.errno or 0, str(e.errno))
    kind = ("flock does not work there" if e.errno in _NO_FLOCK
            else "the lock could not be taken")
    return LockUnsupported(
        f"--workdir {path.parent}: cannot lock {path}: {name} ({e.strerror}) on "
        f"{filesystem_of(path.parent)}; {kind}. launch.train needs working flock on the "
        f"workdir to keep a second job out of it: use a --workdir on a local disk or a mount "
        f"with locking (NFS with its lock service, Lustre with -o flock)")


def _read(fd: int) -> dict:
    """The lock file's record (a bare pid from an older launcher: ``pid``)."""
    text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if isinstance(record, dict):
        return record
    return {"pid": text} if text else {}


def _write(fd: int, record: dict) -> None:
    data = json.dumps(record, sort_keys=True).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _describe(record: dict) -> str:
    """Who holds a lock, from its file: the job, the role, the pid and machine."""
    if not record:
        return "holder unknown"
    parts = []
    if record.get("job"):
        parts.append(f"job {record['job']!r}")
    who = record.get("role", "")
    if record.get("host") is not None:
        who = f"host {record['host']}'s {who or 'process'}"
    where = f"pid {record.get('pid', '?')}"
    if record.get("node"):
        where += f" on {record['node']}"
    parts.append(f"{who}, {where}" if who else where)
    return ", ".join(parts)


def _flock(fd: int, op: int, path: Path) -> bool:
    """``flock(fd, op | LOCK_NB)``: True when taken, False when another holds
    it; any other failure is a ``LockUnsupported`` naming the filesystem."""
    import fcntl

    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        raise _unsupported(path, e) from None
    return True


def _open(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise _unsupported(path, e) from None


def _join_job(workdir: str, record: dict) -> int:
    """Holds the job lock shared for ``record['job']`` (module docstring); its fd."""
    import fcntl

    path = Path(workdir) / LOCK_NAME
    fd = _open(path)
    deadline = time.monotonic() + EXCLUSIVE_WAIT_S
    try:
        while True:
            if _flock(fd, fcntl.LOCK_EX, path):  # nobody holds it: ours to name
                _write(fd, record)
                held = _flock(fd, fcntl.LOCK_SH, path)  # not atomic: checked below
            else:
                held = _flock(fd, fcntl.LOCK_SH, path)
            if held:
                holder = _read(fd)
                if holder.get("job") == record["job"]:
                    return fd
                raise WorkdirInUse(
                    f"--workdir {workdir} is in use by another job ({_describe(holder)}); "
                    f"this process is of job {record['job']!r}. One job per workdir: wait "
                    f"for that job to end or use another --workdir")
            if time.monotonic() > deadline:
                raise WorkdirInUse(
                    f"--workdir {workdir} is in use by another job ({_describe(_read(fd))}, "
                    f"holding {path} exclusively for over {EXCLUSIVE_WAIT_S:g} s); one job "
                    f"per workdir")
            time.sleep(0.02)
    except BaseException:
        os.close(fd)
        raise


def _take_host(workdir: str, host: int, record: dict) -> int:
    """Holds host ``host``'s lock exclusively; its fd."""
    import fcntl

    path = Path(workdir) / HOST_LOCK_NAME.format(host=host)
    fd = _open(path)
    try:
        if not _flock(fd, fcntl.LOCK_EX, path):
            raise WorkdirInUse(
                f"--workdir {workdir}: another process is already host {host} of this job "
                f"({_describe(_read(fd))}); one process per host")
        _write(fd, record)
        return fd
    except BaseException:
        os.close(fd)
        raise


class WorkdirLock:
    """The locks this process holds on a workdir (``hold``); ``release`` drops them."""

    def __init__(self, workdir: str, job: str, fds: list[int]) -> None:
        self.workdir, self.job, self._fds = workdir, job, fds

    def release(self) -> None:
        while self._fds:
            os.close(self._fds.pop())  # closing the descriptor drops the flock


def hold(workdir: str, job: str, role: str, host: int | None = None) -> WorkdirLock:
    """Joins ``workdir``'s job lock as a process of job ``job`` and, given
    ``host``, takes that host's lock; kept until ``release`` or the process
    ends.

    Raises:
      WorkdirInUse: another job holds the workdir, or another process is host ``host``.
      LockUnsupported: ``flock`` fails on the workdir's filesystem.
    """
    record = {"job": job, "role": role, "pid": os.getpid(), "node": socket.gethostname(),
              "host": host}
    fds = [_join_job(workdir, record)]
    try:
        if host is not None:
            fds.append(_take_host(workdir, host, record))
    except BaseException:
        os.close(fds[0])
        raise
    return WorkdirLock(workdir, job, fds)


@contextlib.contextmanager
def workdir_lock(workdir: str, job: str | None = None, role: str = "supervisor",
                 host: int | None = None) -> Iterator[WorkdirLock]:
    """``hold`` for the duration of a ``with`` (``job``: this process's own,
    ``job_identity(role)``, when not given)."""
    lock = hold(workdir, job or job_identity(role), role, host)
    try:
        yield lock
    finally:
        lock.release()
