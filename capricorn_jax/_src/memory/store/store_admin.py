"""The RAM stores of every job on this host: list them, prune the ones no job uses.

``python -m capricorn_jax.stores`` is the command line over these functions; they
take the store root (``--store_root`` of launch.train) and read the stores
without opening them (``store.committed_steps``: no lock taken, nothing
removed), so listing never disturbs a running job. A job's stores are
``STORE_ROOT/JOB/host{h}``; a job is *in use* while any process holds one of
its stores open (``store.store_in_use``, the flock every open ``HostStore``
holds), and ``prune`` never deletes such a job (``store.remove_unused`` holds
every lock of the job exclusively while it deletes). Nor, unless forced, a job
that *may restart* from its stores: one whose newest in-memory version is
newer than its newest persistent step (``restart_risk``; the persistent
directory is the one the job's ``CheckpointManager`` recorded in
``JOB/persistent.json``, ``record_persistent``). Between a crash and the
restart no process holds the stores, so the lock alone would let a prune
delete exactly what the restart needs.

Design choice: the liveness signal is the flock, which the kernel drops when
the process dies however it dies. Alternative not taken: a pid file, which
lies after the pid is reused.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from capricorn_jax._src.memory.store.store_lifecycle import (
    committed_steps,
    mount_point,
    remove_unused,
    store_in_use,
    tree_bytes,
)

_HOST = re.compile(r"^host(\d+)$")
PERSISTENT_RECORD = "persistent.json"


def default_store_root() -> str:
    """The default store root (``InMemoryOptions``' and launch.train's ``--store_root``)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "capricorn_jax")


@dataclasses.dataclass(frozen=True)
class JobStores:
    """One job's stores under a store root.

    Attributes:
      job: the job's name (its directory under the store root).
      path: that directory.
      hosts: {host: {owner: committed steps}} read from the heads.
      bytes: every file's size under ``path``.
      last_use: the newest modification time under ``path`` (seconds since the epoch).
      in_use: some process holds one of its stores open.
    """

    job: str
    path: Path
    hosts: dict[int, dict[int, list[int]]]
    bytes: int
    last_use: float
    in_use: bool


@dataclasses.dataclass(frozen=True)
class PruneResult:
    """What ``prune`` did: (job, bytes freed) deleted; jobs skipped because in
    use; jobs asked for by name that do not exist; (job, why) kept because
    the job may restart from them (``restart_risk``; ``force`` deletes them)."""

    deleted: list[tuple[str, int]]
    in_use: list[str]
    missing: list[str]
    kept: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def record_persistent(job_dir: str | os.PathLike, directory: str | os.PathLike) -> None:
    """Records ``directory`` as the persistent tier of the job whose stores are
    under ``job_dir`` (written whole: a temporary file renamed into place)."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / PERSISTENT_RECORD
    tmp = path.with_name(f".{PERSISTENT_RECORD}.{os.getpid()}")
    where = str(directory) if "://" in str(directory) else str(Path(directory).absolute())
    tmp.write_text(json.dumps({"directory": where}))
    os.replace(tmp, path)


def newest_persistent_step(job_dir: str | os.PathLike) -> tuple[int | None, str | None]:
    """(newest committed persistent step, its directory) of the job whose stores
    are under ``job_dir``: (None, None) when no directory is recorded, (None,
    directory) when it holds no committed step. Committed steps are the
    directories named by a step number alone (Orbax's temporary ones carry a
    suffix)."""
    try:
        directory = json.loads((Path(job_dir) / PERSISTENT_RECORD).read_text())["directory"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
    try:
        steps = [int(p.name) for p in Path(directory).iterdir()
                 if p.name.isdigit() and p.is_dir()]
    except OSError:
        steps = []
    return (max(steps) if steps else None), str(directory)


def restart_risk(job: JobStores) -> str | None:
    """Why deleting ``job``'s stores may lose what its restart resumes from,
    or None: its newest in-memory version is newer than its newest persistent
    step (or no persistent step is known)."""
    newest = max((s for owners in job.hosts.values() for steps in owners.values()
                  for s in steps), default=None)
    if newest is None:
        return None
    step, directory = newest_persistent_step(job.path)
    if step is not None and newest <= step:
        return None
    where = ("no persistent directory recorded" if directory is None
             else f"newest persistent step {step if step is not None else 'none'} in {directory}")
    return f"it may restart from them (newest in-memory version {newest}, {where})"


def _newest_mtime(path: Path) -> float:
    newest = 0.0
    for directory, dirs, files in os.walk(path):
        for name in (*dirs, *files, "."):
            try:
                newest = max(newest, os.stat(os.path.join(directory, name)).st_mtime)
            except FileNotFoundError:
                continue
    return newest


def job_stores(path: str | os.PathLike) -> JobStores:
    """The stores of the job whose directory is ``path``."""
    path = Path(path)
    hosts = {}
    in_use = store_in_use(path)  # a store root directly at the job's level (not launch.train's)
    for entry in sorted(path.iterdir()) if path.is_dir() else ():
        m = _HOST.match(entry.name)
        if m and entry.is_dir():
            hosts[int(m.group(1))] = committed_steps(entry)
            in_use = in_use or store_in_use(entry)
    return JobStores(path.name, path, dict(sorted(hosts.items())), tree_bytes(path),
                     _newest_mtime(path), in_use)


def list_jobs(store_root: str | os.PathLike) -> list[JobStores]:
    """Every job under ``store_root`` (a directory each), by name; [] if it is missing."""
    root = Path(store_root)
    if not root.is_dir():
        return []
    return [job_stores(p) for p in sorted(root.iterdir()) if p.is_dir() and not p.is_symlink()]


def ram_disk(store_root: str | os.PathLike) -> tuple[Path, int, int]:
    """(mount point, size, free bytes) of the filesystem holding ``store_root``
    (or its nearest existing parent)."""
    p = Path(store_root).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return mount_point(p), st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def prune(store_root: str | os.PathLike, *, jobs: Iterable[str] = (),
          older_than_h: float | None = None, everything: bool = False,
          now: float | None = None, force: bool = False) -> PruneResult:
    """Deletes the jobs matched (named in ``jobs``, last used more than
    ``older_than_h`` hours before ``now``, or every one with ``everything``)
    that no process uses and, unless ``force``, that may not restart from
    them (``restart_risk``).

    Raises:
      ValueError: nothing to match on, or a bad name or age.
    """
    jobs = list(jobs)
    if not jobs and older_than_h is None and not everything:
        raise ValueError("prune needs a job name, an age (older_than_h) or everything=True")
    if older_than_h is not None and older_than_h < 0:
        raise ValueError(f"older_than_h must be >= 0, got {older_than_h}")
    for name in jobs:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"bad job name {name!r}")
    now = time.time() if now is None else now
    found = {j.job: j for j in list_jobs(store_root)}
    missing = [name for name in jobs if name not in found]
    chosen = [j for j in found.values()
              if everything or j.job in jobs
              or (older_than_h is not None and now - j.last_use > older_than_h * 3600)]
    deleted, in_use, kept = [], [], []
    for job in chosen:
        risk = None if force or job.in_use else restart_risk(job)
        if risk is not None:
            kept.append((job.job, risk))
            continue
        size = tree_bytes(job.path)
        if remove_unused(job.path):
            deleted.append((job.job, size))
        else:
            in_use.append(job.job)
    return PruneResult(deleted, in_use, missing, kept)


def _steps_text(owners: dict[int, list[int]]) -> str:
    if not owners:
        return "no version"
    return " ".join(f"owner{o} v{','.join(map(str, steps))}" if steps else f"owner{o} -"
                    for o, steps in owners.items())


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def describe(job: JobStores, now: float) -> str:
    """One line: job, hosts, versions per host, bytes, last use (ISO time, age), in use."""
    hosts = "; ".join(f"host{h}: {_steps_text(owners)}" for h, owners in job.hosts.items())
    when = datetime.datetime.fromtimestamp(job.last_use).isoformat(timespec="seconds")
    age_h = max(now - job.last_use, 0.0) / 3600
    n = len(job.hosts)
    return (f"{job.job}: {n} host{'' if n == 1 else 's'} ({hosts or 'none'}), {mib(job.bytes)} "
            f"({job.bytes} bytes), last use {when} ({age_h:.1f} h ago)"
            f"{', in use' if job.in_use else ''}")


def listing(store_root: str | os.PathLike, now: float | None = None) -> list[str]:
    """The lines of ``python -m capricorn_jax.stores --action=list``."""
    now = time.time() if now is None else now
    jobs = list_jobs(store_root)
    lines = [describe(j, now) for j in jobs]
    disk, size, free = ram_disk(store_root)
    total = sum(j.bytes for j in jobs)
    lines.append(f"total: {len(jobs)} jobs, {mib(total)} ({total} bytes) under {store_root}; "
                 f"RAM disk {disk}: {mib(size)}, {mib(free)} free")
    return lines
