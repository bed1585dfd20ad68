"""The host store, a shared-memory arena: reused, preallocated slots instead of chunk files.

One root per (job, host) on a RAM disk (``/dev/shm``), so a crashed training
process leaves its checkpoints in RAM for its successor. Layout::

    ROOT/owner{o}/slot{k}.data      preallocated bytes of one version (mmap'ed, reused)
    ROOT/owner{o}/slot{k}.head      its commit record: step, generation, chunk table
    ROOT/owner{o}/slot{k}.writing   present while a version is being written

``owner`` is the host whose shards the version holds: this host's own, or a
peer's replica received through the transport. A writer takes a free slot
(one without a head), marks it ``.writing``, copies each chunk into the mapped
slot (``numpy.copyto``, which releases the GIL, so the writer threads copy in
parallel) and checksums it with CRC32C; ``commit`` writes the head (chunk
offsets, sizes, CRC32C, the caller's metadata) to a temporary name and renames
it into place, then removes the marker: the head is the record written last,
so a reader only ever sees complete versions, and a slot whose writer died is
found by its marker when the store opens (reported, then reused). Pruning a
version removes its head only; the slot's pages stay allocated and the next
version lands in them with no page faults and no zeroing.

The checkpointer sizes a version's slot once (``begin(owner, step,
nbytes)``) and places device row j's chunks back to back at j * payload
(``write_chunk(..., offset=)``), so a reader copies a whole row at once
(``read_span_into``) or reads it in place (``span_view``, then
``check_span``), checking each chunk's CRC32C on what it read. The head holds
what the checkpointer passes to ``commit``: the layout's fingerprint and leaf
table, the host state and, under partial expert checkpointing, a ``pec``
entry. A slot is reused only after its version was pruned; a read that races
the reuse fails its checksums on bytes of another generation and raises
``VersionGone`` (a ``FileNotFoundError``: callers treat it as a missing
version).

Design choice: reused slots rather than a new set of chunk files per version.
The file store this replaces paid, per version, tmpfs page allocation and
zeroing, one ``write`` per chunk and a zlib CRC32 (about 2 GB/s on one core of
this machine), together 1.7 GB/s on a box whose memcpy runs at 13 GB/s; a
reused mapping costs one memcpy per byte, and CRC32C (the ``crc32c`` package,
SSE4.2 / ARMv8 instructions, GIL released) runs at memcpy speed. The
alternative not taken, an agent process owning the buffer, would survive the
training process no better than tmpfs does and needs supervising.

Isolation: every path the store touches is checked to lie inside its root;
data from another host reaches this store only through ``write_chunk`` of a
version received over the transport.

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
``python -m launch.stores`` (list and prune). After a clean finish ``InMemoryCheckpointer.release`` reclaims the
store or shrinks it to one version per owner (``drop_free_slots``).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import crc32c as _crc32c
import numpy as np

from capricorn_jax._src.memory.pinned import SlotRegistry, align_up

log = logging.getLogger("capricorn_jax")
_SLOT = re.compile(r"^slot(\d+)\.(data|head|writing)$")
_ALIGN = 64  # chunk offsets: aligned for the CPU client's zero-copy wrap


class ChecksumError(IOError):
    """A chunk's bytes do not match the checksum of its commit record."""


class StoreIsolationError(RuntimeError):
    """A path outside this host's root was about to be touched."""


class VersionGone(FileNotFoundError):
    """The version was removed (pruned and its slot reused) while being read."""


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
    for directory, _, files in os.walk(path):
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


_LOCK = ".lock"


def store_in_use(root: str | os.PathLike) -> bool:
    """Whether a process (this one included) has the store at ``root`` open.

    Tries a non-blocking exclusive ``flock`` on ``root/.lock``, which every
    open ``HostStore`` holds shared; False when there is no lock file.
    """
    try:
        fd = os.open(Path(root) / _LOCK, os.O_RDONLY | os.O_CLOEXEC)
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
        for lock in sorted(path.rglob(_LOCK)):
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
    its heads without opening it (no lock taken, nothing removed)."""
    out: dict[int, set[int]] = {}
    for head in Path(root).glob("owner*/slot*.head"):
        owner = head.parent.name[5:]
        if not owner.isdigit():
            continue
        try:
            step = int(json.loads(head.read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.setdefault(int(owner), set()).add(step)
    return {o: sorted(steps) for o, steps in sorted(out.items())}


def checksum(data: Any) -> int:
    """CRC32C of a bytes-like object (hardware-accelerated, releases the GIL)."""
    return _crc32c.crc32c(data)


def _check_size(owner: int, step: int, names: list[str], data: np.ndarray,
                manifest: dict[str, Any]) -> None:
    total = sum(manifest["chunks"][n]["nbytes"] for n in names)
    if data.size != total:
        raise ChecksumError(f"owner{owner}/v{step:012d}/{names[0]}: size {data.size} != {total}")


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _full_message(path: Path, nbytes: int, delta: int, limit: StoreLimit | None,
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
            f"{bound}. List and prune the stores: python -m launch.stores "
            f"--store_root={shared} (then --action=prune --job=NAME, --older_than_h=H or --all)")


class _Slot:
    """One preallocated, mapped slot file."""

    def __init__(self, path: Path, index: int, store: HostStore | None = None):
        self.path, self.index = path, index
        self._store = store  # checks the bound and words the StoreFullError
        self._file = open(path, "r+b" if path.exists() else "w+b")  # noqa: SIM115
        self.capacity = os.fstat(self._file.fileno()).st_size
        self._maps: list[mmap.mmap] = []
        self.view: np.ndarray = np.zeros(0, np.uint8)
        if self.capacity:
            self._map()

    def _map(self) -> None:
        registry = getattr(self._store, "registry", None)
        if registry is not None and self.capacity == align_up(self.capacity):
            # 2 MiB-aligned, registered with the GPU runtime once (a slot another
            # store object grew to an unaligned size is mapped plainly)
            aligned = registry.map_file(self._file.fileno(), self.capacity)
            registry.register(aligned)
            self._maps.append(aligned)  # kept mapped (views may outlive close) until exit
            self.view = aligned.view[:self.capacity]
            return
        m = mmap.mmap(self._file.fileno(), self.capacity)
        self._maps.append(m)  # earlier maps stay alive while views of them may exist
        self.view = np.frombuffer(m, np.uint8)

    def grow(self, nbytes: int) -> None:
        """Grows the file to ``nbytes`` with its pages reserved (module docstring).

        Raises:
          StoreFullError: the bound or the RAM disk's free space is exceeded.
        """
        if nbytes <= self.capacity:
            return
        if getattr(self._store, "registry", None) is not None:
            nbytes = align_up(nbytes)  # whole huge pages, as the aligned mapping covers
        old, delta, fd = self.capacity, nbytes - self.capacity, self._file.fileno()
        if self._store is not None:
            self._store._reserve(nbytes, delta, self.path)
        os.ftruncate(fd, nbytes)
        try:
            os.posix_fallocate(fd, old, delta)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                pass  # no fallocate on this filesystem: pages at first touch, as before
            else:
                os.ftruncate(fd, old)  # gives back what was reserved
                if e.errno != errno.ENOSPC:
                    raise
                why = f"posix_fallocate of {delta} bytes failed: {e.strerror}"
                if self._store is None:
                    raise StoreFullError(f"{self.path}: {why}") from e
                raise StoreFullError(self._store._full_message(self.path, nbytes, delta,
                                                               why)) from e
        self.capacity = nbytes
        self._map()

    def refresh(self) -> None:
        """Maps the file again if another store object grew it."""
        size = os.fstat(self._file.fileno()).st_size
        if size > self.capacity:
            self.capacity = size
            self._map()

    def close(self) -> None:
        self.view = np.zeros(0, np.uint8)
        for m in self._maps:
            if not isinstance(m, mmap.mmap):
                continue  # an aligned mapping: the registry unmaps it (SlotRegistry.close)
            try:
                m.close()
            except BufferError:  # a caller still holds a view; the GC closes it
                pass
        self._maps.clear()
        self._file.close()


class VersionWriter:
    """Writes the chunks of one (owner, step) version into a slot; ``commit`` publishes it.

    ``write_chunk`` may be called from several threads at once.
    """

    def __init__(self, store: HostStore, owner: int, step: int, slot: _Slot):
        self.store, self.owner, self.step, self.slot = store, owner, step, slot
        self.chunks: dict[str, dict[str, int]] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._done = False

    def write_chunk(self, name: str, data: Any, offset: int | None = None) -> None:
        """Copies ``data`` (bytes-like) into the slot and checksums it.

        Args:
          offset: where in the slot the chunk goes. A caller that places the
            chunks of a row back to back (the checkpointer: row * payload +
            chunk start) lets a reader copy the whole row at once
            (``read_span_into``); default: after the previous chunk, aligned.
        """
        if "/" in name:
            raise ValueError(f"bad chunk name {name!r}")
        src = np.frombuffer(data, np.uint8)
        with self._lock:
            if name in self.chunks:
                raise ValueError(f"chunk {name!r} written twice")
            if offset is None:
                offset = self._next
            if offset < 0:
                raise ValueError(f"chunk {name!r}: negative offset {offset}")
            self._next = max(self._next, _round_up(offset + src.size))
            self.slot.grow(self._next)
            view = self.slot.view
            self.chunks[name] = {"offset": offset, "nbytes": int(src.size)}
        dst = view[offset:offset + src.size]
        np.copyto(dst, src)
        self.chunks[name]["crc32c"] = checksum(dst)

    def adopt_chunk(self, name: str, offset: int, nbytes: int) -> None:
        """Records a chunk whose bytes a device copy already put in the slot at
        ``offset`` (``pinned.SlotCopier``, after its ``wait``), checksumming
        them in place: the CRC32C runs on the calling thread (a writer pool's),
        never the copy's issuer. Same rules as ``write_chunk``."""
        if "/" in name or offset < 0 or nbytes < 0:
            raise ValueError(f"bad chunk {name!r} at {offset} ({nbytes} bytes)")
        with self._lock:
            if name in self.chunks:
                raise ValueError(f"chunk {name!r} written twice")
            if offset + nbytes > self.slot.capacity:
                raise ValueError(f"chunk {name!r} [{offset}, {offset + nbytes}) is beyond the "
                                 f"slot's {self.slot.capacity} bytes")
            self._next = max(self._next, _round_up(offset + nbytes))
            self.chunks[name] = {"offset": offset, "nbytes": int(nbytes)}
            view = self.slot.view
        self.chunks[name]["crc32c"] = checksum(view[offset:offset + nbytes])

    def commit(self, meta: dict[str, Any]) -> Path:
        """Writes the head last (temporary name, renamed into place); returns its path."""
        head = {"owner": self.owner, "step": self.step, "generation": time.time_ns(),
                "slot": self.slot.index, "chunks": self.chunks, **meta}
        path = self.store._slot_path(self.owner, self.slot.index, "head")
        tmp = self.store._check(path.with_suffix(".head.tmp"))
        tmp.write_text(json.dumps(head))
        os.replace(tmp, path)
        self.store._committed(self.owner, self.step, self.slot.index)
        self._finish()
        return path

    def abort(self) -> None:
        """Drops the version: the slot is free again."""
        self._finish()

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self.store._release(self.owner, self.slot.index)


class HostStore:
    """The checkpoint store of one host: per owner, a few reused slots.

    Args:
      root: this (job, host)'s directory; created if missing.
      limit: the bound on every store under ``limit.shared_root`` (checked
        when a slot grows); None: only the RAM disk's own space bounds it.
      registry: maps each slot 2 MiB-aligned, sized in whole huge pages, and
        registers it with the GPU runtime (``pinned.SlotRegistry``); None:
        plain ``mmap``.

    Holds a shared ``flock`` on ``root/.lock`` until ``close`` (module
    docstring, Lifecycle).
    """

    def __init__(self, root: str | os.PathLike, *, limit: StoreLimit | None = None,
                 registry: SlotRegistry | None = None):
        self.root = Path(root).resolve()
        self.limit = limit
        self.registry = registry  # maps (and registers) slots: pinned.SlotRegistry
        self._lock_fd: int | None = self._take_lock()
        self._lock = threading.Lock()
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._busy: set[tuple[int, int]] = set()  # slots with a writer
        self._unreadable: set[Path] = set()  # damaged heads already reported
        # head path -> ((inode, mtime_ns, size), step): a head is renamed into
        # place whole, so an unchanged identity is the same record; parsing
        # every head at every commit was most of a writer's Python time.
        self._head_steps: dict[Path, tuple[tuple[int, int, int], int]] = {}
        self.removed_partials = self._remove_partials()

    def _take_lock(self) -> int:
        """Opens and share-locks ROOT/.lock (creating the root): the liveness signal.

        Waits only while ``remove_unused`` holds it to delete this root, then
        locks the new file of the recreated root.
        """
        path = self.root / _LOCK
        while True:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass  # deleted while we waited: lock the new one
            os.close(fd)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = None

    def _reserve(self, nbytes: int, delta: int, path: Path) -> None:
        """Raises StoreFullError if growing ``path`` by ``delta`` bytes breaks the
        bound or exceeds the RAM disk's free space (with a limit only)."""
        limit = self.limit
        if limit is None:
            return
        st = os.statvfs(limit.shared_root)
        free = st.f_bavail * st.f_frsize
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        if used + delta > limit.max_bytes:
            why = (f"the RAM disk would have {used + delta} bytes in use, over the bound of "
                   f"{limit.max_bytes}")
        elif delta > free:
            why = f"{delta} bytes wanted, {free} free"
        else:
            return
        raise StoreFullError(self._full_message(path, nbytes, delta, why))

    def _full_message(self, path: Path, nbytes: int, delta: int, why: str) -> str:
        # Without a limit, the store root is taken as ROOT/../.. (STORE_ROOT/JOB/host{h}).
        shared = self.limit.shared_root if self.limit is not None else self.root.parent.parent
        return _full_message(path, nbytes, delta, self.limit, why, shared)

    # paths ---------------------------------------------------------------
    def _check(self, path: Path) -> Path:
        resolved = Path(os.path.abspath(path))
        if resolved != self.root and self.root not in resolved.parents:
            raise StoreIsolationError(f"{resolved} is outside this host's store {self.root}")
        return resolved

    def _path(self, *parts: str) -> Path:
        return self._check(self.root.joinpath(*parts))

    def _slot_path(self, owner: int, index: int, kind: str) -> Path:
        return self._path(f"owner{owner}", f"slot{index}.{kind}")

    def _remove_partials(self) -> list[str]:
        removed = []
        for owner_dir in self.root.glob("owner*"):
            for entry in owner_dir.iterdir():
                m = _SLOT.match(entry.name)
                if m and m.group(2) == "writing":
                    # A marker without a head: the writer died mid-version. With
                    # a head, it died after committing (the head is written
                    # first, the marker removed last): the version stands.
                    step = entry.read_text().strip() or "-1"
                    if not entry.with_name(f"slot{m.group(1)}.head").exists():
                        removed.append(f"{owner_dir.name}/v{int(step):012d} (slot {m.group(1)})")
                    entry.unlink(missing_ok=True)
                elif entry.name.endswith(".tmp"):
                    entry.unlink(missing_ok=True)
        return removed

    # slots ---------------------------------------------------------------
    def _slot(self, owner: int, index: int) -> _Slot:
        key = (owner, index)
        if key not in self._slots:
            self._slots[key] = _Slot(self._slot_path(owner, index, "data"), index, self)
        return self._slots[key]

    def _slot_indices(self, owner: int) -> dict[int, set[str]]:
        owner_dir = self._path(f"owner{owner}")
        found: dict[int, set[str]] = {}
        if owner_dir.is_dir():
            for entry in owner_dir.iterdir():
                m = _SLOT.match(entry.name)
                if m:
                    found.setdefault(int(m.group(1)), set()).add(m.group(2))
        return found

    def begin(self, owner: int, step: int, nbytes: int = 0) -> VersionWriter:
        """A writer of version ``step`` of ``owner`` in a free slot.

        Args:
          nbytes: the version's size if known (the slot is grown once to it);
            a writer grows its slot as chunks arrive otherwise.
        """
        self._path(f"owner{owner}").mkdir(parents=True, exist_ok=True)
        with self._lock:
            indices = self._slot_indices(owner)
            free = [i for i, kinds in indices.items()
                    if "head" not in kinds and "writing" not in kinds
                    and (owner, i) not in self._busy]
            if free:
                # The smallest free slot that fits, else the largest one (grown).
                sizes = {i: self._slot(owner, i).capacity for i in free}
                fits = [i for i in free if sizes[i] >= nbytes]
                index = min(fits, key=sizes.get) if fits else max(free, key=sizes.get)
            else:
                index = max(indices, default=-1) + 1
            self._busy.add((owner, index))
            slot = self._slot(owner, index)
        self._slot_path(owner, index, "writing").write_text(str(step))
        try:
            slot.grow(_round_up(nbytes))
        except BaseException:
            self._release(owner, index)  # the slot is free again, as it was
            raise
        return VersionWriter(self, owner, step, slot)

    def _committed(self, owner: int, step: int, index: int) -> None:
        """After a head is in place: older heads of the same step are dropped."""
        for other in self._heads(owner).get(step, []):
            if other != index:
                self._slot_path(owner, other, "head").unlink(missing_ok=True)

    def _release(self, owner: int, index: int) -> None:
        self._slot_path(owner, index, "writing").unlink(missing_ok=True)
        with self._lock:
            self._busy.discard((owner, index))

    def _heads(self, owner: int) -> dict[int, list[int]]:
        """{step: [slot indices whose committed head names it]}."""
        out: dict[int, list[int]] = {}
        for index, kinds in self._slot_indices(owner).items():
            if "head" in kinds:
                path = self._slot_path(owner, index, "head")
                try:
                    st = path.stat()
                    identity = (st.st_ino, st.st_mtime_ns, st.st_size)
                    cached = self._head_steps.get(path)
                    if cached is not None and cached[0] == identity:
                        step = cached[1]
                    else:
                        step = int(json.loads(path.read_text())["step"])
                        self._head_steps[path] = (identity, step)
                except FileNotFoundError:
                    continue  # pruned while we listed
                except (ValueError, KeyError, TypeError):
                    # Heads are renamed into place whole: this one was damaged
                    # in RAM. Not a version (its slot stays taken until pruned
                    # by hand or the store is wiped); said once per store object.
                    if path not in self._unreadable:
                        self._unreadable.add(path)
                        log.warning("%s: unreadable commit record; its version is ignored",
                                    path.relative_to(self.root))
                    continue
                out.setdefault(step, []).append(index)
        return out

    # reading -------------------------------------------------------------
    def owners(self) -> list[int]:
        return sorted(int(p.name[5:]) for p in self.root.glob("owner*") if p.name[5:].isdigit())

    def versions(self, owner: int) -> list[int]:
        """Committed steps of ``owner``, ascending (head present)."""
        return sorted(self._heads(owner))

    def _head(self, owner: int, step: int) -> dict[str, Any]:
        best = None
        for index in self._heads(owner).get(step, []):
            try:
                head = json.loads(self._slot_path(owner, index, "head").read_text())
            except (FileNotFoundError, ValueError):
                continue
            if head["step"] == step and (best is None or head["generation"] > best["generation"]):
                best = head
        if best is None:
            raise VersionGone(f"owner{owner}/v{step:012d}: no such version")
        return best

    def manifest(self, owner: int, step: int) -> dict[str, Any]:
        """The version's commit record: its chunk table and the caller's metadata."""
        return self._head(owner, step)

    def _still_there(self, owner: int, manifest: dict[str, Any]) -> bool:
        try:
            head = json.loads(self._slot_path(owner, manifest["slot"], "head").read_text())
        except (FileNotFoundError, ValueError):
            return False
        return head["generation"] == manifest["generation"]

    def chunk_view(self, owner: int, step: int, name: str,
                   manifest: dict | None = None) -> np.ndarray:
        """The chunk's bytes in the slot, no copy and not checked (valid until
        the version is pruned; ``verify`` or ``read_chunk_into`` check)."""
        manifest = manifest or self.manifest(owner, step)
        entry = manifest["chunks"][name]
        slot = self._slot(owner, manifest["slot"])
        if entry["offset"] + entry["nbytes"] > slot.capacity:
            slot.refresh()
        view = slot.view
        if entry["offset"] + entry["nbytes"] > view.size:
            raise ChecksumError(f"owner{owner}/v{step:012d}/{name}: beyond its slot")
        return view[entry["offset"]:entry["offset"] + entry["nbytes"]]

    def read_chunk(self, owner: int, step: int, name: str,
                   manifest: dict | None = None) -> bytearray:
        """A chunk's bytes, checked against its CRC32C (``read_chunk_into``)."""
        manifest = manifest or self.manifest(owner, step)
        data = bytearray(manifest["chunks"][name]["nbytes"])
        self.read_chunk_into(owner, step, name, memoryview(data), manifest)
        return data

    def read_chunk_into(self, owner: int, step: int, name: str, out: memoryview,
                        manifest: dict | None = None) -> None:
        """Copies a chunk into ``out`` (exactly its size) and checks its CRC32C.

        Raises:
          ChecksumError: naming the chunk, when its size or bytes do not match.
          VersionGone: the version was pruned (its slot reused) meanwhile.
        """
        self.read_span_into(owner, step, [name], np.frombuffer(out, np.uint8), manifest)

    def span_view(self, owner: int, step: int, names: list[str],
                  manifest: dict | None = None) -> np.ndarray:
        """One zero-copy view of chunks ``names``, which must lie back to back
        in the slot in this order (a row the checkpointer wrote); not checked
        (``check_span`` does).

        Raises:
          ValueError: the chunks are not contiguous in the slot.
        """
        manifest = manifest or self.manifest(owner, step)
        chunks = manifest["chunks"]
        start = end = chunks[names[0]]["offset"]
        for name in names:
            if chunks[name]["offset"] != end:
                raise ValueError(f"owner{owner}/v{step:012d}: chunk {name} is not contiguous "
                                 f"with the previous one of {names}")
            end += chunks[name]["nbytes"]
        slot = self._slot(owner, manifest["slot"])
        if end > slot.capacity:
            slot.refresh()
        view = slot.view
        if end > view.size:
            raise ChecksumError(f"owner{owner}/v{step:012d}/{names[-1]}: beyond its slot")
        return view[start:end]

    def check_span(self, owner: int, step: int, names: list[str], data: np.ndarray,
                   manifest: dict | None = None) -> None:
        """Checks ``data`` (the bytes of chunks ``names`` back to back: a copy
        or the slot's own view, after the caller copied from it) against the
        chunks' CRC32C.

        Raises:
          ChecksumError: naming the first chunk whose size or bytes do not match.
          VersionGone: the version was pruned (its slot reused) meanwhile.
        """
        manifest = manifest or self.manifest(owner, step)
        _check_size(owner, step, names, data, manifest)
        lo = 0
        for name in names:
            entry = manifest["chunks"][name]
            if checksum(data[lo:lo + entry["nbytes"]]) != entry["crc32c"]:
                if not self._still_there(owner, manifest):
                    raise VersionGone(f"owner{owner}/v{step:012d}: removed while being read")
                raise ChecksumError(f"owner{owner}/v{step:012d}/{name}: checksum mismatch")
            lo += entry["nbytes"]

    def read_span_into(self, owner: int, step: int, names: list[str], out: np.ndarray,
                       manifest: dict | None = None) -> None:
        """Copies chunks ``names`` (back to back in the slot) into ``out`` with
        one copy, then checks each chunk's CRC32C on the copy."""
        manifest = manifest or self.manifest(owner, step)
        _check_size(owner, step, names, out, manifest)
        np.copyto(out, self.span_view(owner, step, names, manifest))
        self.check_span(owner, step, names, out, manifest)

    def verify(self, owner: int, step: int) -> bool:
        """Whether every chunk of the version matches its checksum."""
        try:
            manifest = self.manifest(owner, step)
            for name, entry in manifest["chunks"].items():
                if checksum(self.chunk_view(owner, step, name, manifest)) != entry["crc32c"]:
                    return False
        except (OSError, ValueError, KeyError):
            return False
        return True

    # removing ------------------------------------------------------------
    def prune(self, owner: int, keep: Iterable[int]) -> None:
        """Removes committed versions of ``owner`` not in ``keep`` (slots kept for reuse)."""
        keep = set(keep)
        for step in self.versions(owner):
            if step not in keep:
                self.remove(owner, step)

    def remove(self, owner: int, step: int) -> None:
        """Removes one committed version of ``owner`` (nothing if absent)."""
        for index in self._heads(owner).get(step, []):
            self._slot_path(owner, index, "head").unlink(missing_ok=True)

    def drop_free_slots(self) -> int:
        """Deletes the slot files that hold no version (no head, no writer),
        giving their pages back to the RAM disk; the bytes freed."""
        freed = 0
        with self._lock:
            for owner in self.owners():
                for index, kinds in self._slot_indices(owner).items():
                    if "head" in kinds or "writing" in kinds or (owner, index) in self._busy:
                        continue
                    slot = self._slots.pop((owner, index), None)
                    if slot is not None:
                        slot.close()
                    path = self._slot_path(owner, index, "data")
                    try:
                        freed += path.stat().st_size
                        path.unlink()
                    except FileNotFoundError:
                        continue
        return freed

    def wipe(self) -> None:
        """Removes everything (a lost machine's RAM) but the lock, which stays held."""
        with self._lock:
            for slot in self._slots.values():
                slot.close()
            self._slots.clear()
        for entry in list(self.root.iterdir()) if self.root.is_dir() else ():
            if entry.name == _LOCK:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        """Unmaps the slots and releases the lock (the bytes stay in the RAM disk)."""
        with self._lock:
            for slot in self._slots.values():
                slot.close()
            self._slots.clear()
        self._release_lock()

    def destroy(self) -> None:
        """Deletes this root and everything in it, then releases the lock."""
        with self._lock:
            for slot in self._slots.values():
                slot.close()
            self._slots.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        self._release_lock()

    def bytes_held(self) -> int:
        """Bytes of the arena in RAM: every slot's size, free ones included
        (the heads, a few KiB each, are not counted)."""
        total = 0
        for directory, _, files in os.walk(self.root):
            for name in files:
                if not name.endswith(".data"):
                    continue
                try:
                    total += os.stat(os.path.join(directory, name)).st_size
                except FileNotFoundError:
                    continue
        return total
