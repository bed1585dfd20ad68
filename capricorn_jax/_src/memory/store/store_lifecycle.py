"""The life of host stores on the RAM disk, outside any one store object.

Lifecycle: an open store holds a shared ``flock`` on ``ROOT/.lock`` (released
by ``close``, and by the kernel when the process dies, however it dies), so
``store_in_use(root)`` tells a live store from one a finished or crashed job
left; ``remove_unused`` deletes stores under a directory only while it holds
every one of their locks exclusively (a job that starts meanwhile waits, then
finds its root gone and starts afresh). The lock is shared, not exclusive,
because several store objects of one root are legitimately open at once (a
successor's reader, a fault injector's audit, tests); it is a liveness
signal, not a writers' mutex. Alternative not taken: a pid file, which lies
after the pid is reused and says nothing about a process that is a zombie.
A slot's pages are reserved when it grows (``posix_fallocate`` after the
``ftruncate``): on tmpfs a file only truncated to its size gets its pages at
first touch, and a page the RAM disk cannot supply then kills the process
with SIGBUS in the middle of a copy; reserved up front, a full RAM disk is an
``ENOSPC`` at ``begin``, raised as ``StoreFullError``. With a ``StoreLimit``
the store also refuses to grow when the RAM disk would then have more bytes in
use than the bound, or less free space than the growth; the error names the
RAM disk, its size, free and used bytes, the bytes wanted, the bound and
``python -m capricorn_jax.stores`` (list and prune). After a clean finish
``InMemoryCheckpointer.release`` reclaims the store or shrinks it to one
version per owner (``drop_free_slots``).

Design choice: these functions read and delete stores by their files alone
(no ``HostStore`` opened, standard library only), so the store tools
(``capricorn_jax.stores``) and a second process can use them without the package or
JAX. Alternative not taken (the previous state): one 800-line ``store`` module
holding them with the arena and the store's records.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import shutil
from pathlib import Path

from capricorn_jax._src.memory.store.head_seal import check_seal


class StoreFullError(OSError):
    """A slot could not grow: the RAM disk is full or the stores' bound is reached.

    An ``OSError`` with ``errno.ENOSPC``; its message names the RAM disk, its
    size, free and used bytes, the bytes wanted, the bound, and the command
    that lists and prunes stores.
    """

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)


@dataclasses.dataclass(frozen=True)
class StoreLimit:
    """A bound on the RAM disk holding ``shared_root``: a slot may grow only
    while the disk's used bytes stay within ``max_bytes``.

    Checked only when a slot grows (the first versions of a job), from
    ``os.statvfs``: the used bytes of the whole RAM disk, every job's stores
    and anything else on it. Alternative not taken: walking the stores under
    ``shared_root``, which on a simulated cluster (hosts sharing one RAM disk)
    lists other hosts' stores and ignores what else fills the disk.
    """

    shared_root: Path
    max_bytes: int

    @classmethod
    def fraction_of(cls, shared_root: str | os.PathLike, fraction: float) -> StoreLimit:
        """``fraction`` of the size of the filesystem (RAM disk) holding ``shared_root``."""
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        root = Path(shared_root).resolve()
        root.mkdir(parents=True, exist_ok=True)
        st = os.statvfs(root)
        return cls(root, int(fraction * st.f_blocks * st.f_frsize))


def tree_bytes(path: str | os.PathLike) -> int:
    """Bytes of the files under ``path`` (their sizes; 0 if it is missing)."""
    total = 0
    for directory, _, files in os.walk(os.fspath(path)):
        for name in files:
            try:
                total += os.stat(os.path.join(directory, name)).st_size
            except FileNotFoundError:
                continue
    return total


def mount_point(path: str | os.PathLike) -> Path:
    """The mount point of the filesystem holding ``path`` (the RAM disk)."""
    p = Path(path).resolve()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


LOCK = ".lock"


def store_in_use(root: str | os.PathLike) -> bool:
    """Whether a process (this one included) has the store at ``root`` open.

    Tries a non-blocking exclusive ``flock`` on ``root/.lock``, which every
    open ``HostStore`` holds shared; False when there is no lock file.
    """
    try:
        fd = os.open(Path(root) / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the probe's lock
    return False


def remove_unused(path: str | os.PathLike) -> bool:
    """Deletes ``path`` (a store root, or a directory of them: a job's) unless
    a store under it is open; True if deleted (or already gone).

    Holds every ``.lock`` under ``path`` exclusively while deleting, so no
    store opens in the middle; nothing is deleted if any is held.
    """
    path = Path(path)
    if not path.exists():
        return True
    fds = []
    try:
        for lock in sorted(path.rglob(LOCK)):
            try:
                fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()
    finally:
        for fd in fds:
            os.close(fd)


def committed_steps(root: str | os.PathLike) -> dict[int, list[int]]:
    """{owner: committed steps, ascending} of the store at ``root``, read from
    its heads without opening it (no lock taken, nothing removed); a head
    that fails its seal (``head_seal``) is no version, as in the store."""
    out: dict[int, set[int]] = {}
    for head in Path(root).glob("owner*/slot*.head"):
        owner = head.parent.name[5:]
        if not owner.isdigit():
            continue
        try:
            record = json.loads(head.read_text())
            check_seal(head, record)
            step = int(record["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.setdefault(int(owner), set()).add(step)
    return {o: sorted(steps) for o, steps in sorted(out.items())}


def full_message(path: Path, nbytes: int, delta: int, limit: StoreLimit | None,
                  why: str, shared: Path) -> str:
    disk = mount_point(shared)
    st = os.statvfs(shared)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    bound = (f"the bound is {_mib(limit.max_bytes)} ({limit.max_bytes} bytes) in use"
             if limit is not None else "no bound is set")
    return (f"RAM disk {disk} cannot hold the checkpoint store's next version: {why}. "
            f"{path} needs {delta} more bytes ({_mib(delta)}; the slot grows to "
            f"{nbytes} bytes); the RAM disk is {_mib(size)} ({size} bytes) with {_mib(free)} "
            f"({free} bytes) free and {_mib(used)} ({used} bytes) in use; "
            f"{bound}. List and prune the stores: python -m capricorn_jax.stores "
            f"--store_root={shared} (then --action=prune --job=NAME, --older_than_h=H or --all)")
