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

Lifecycle (the liveness lock, the RAM disk's bound, removing unused stores):
``store_lifecycle``. The slots and the version writer: ``arena``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from capricorn_jax._src.memory.store.arena import (
    HEAD_FORMAT,
    VersionWriter,
    _Slot,
    checksum,
    round_up,
)
from capricorn_jax._src.memory.store.head_seal import SEAL, check_seal
from capricorn_jax._src.memory.store.pinned import SlotRegistry
from capricorn_jax._src.memory.store.store_lifecycle import (
    LOCK,
    StoreFullError,
    StoreLimit,
    full_message,
    mount_point,
)

log = logging.getLogger("capricorn_jax")
_SLOT = re.compile(r"^slot(\d+)\.(data|head|writing)$")


class ChecksumError(IOError):
    """A chunk's bytes do not match the checksum of its commit record."""


class StoreIsolationError(RuntimeError):
    """A path outside this host's root was about to be touched."""


class StoreFormatError(RuntimeError):
    """A commit record of another format (another version of capricorn_jax
    wrote this store): reading it as this code's would misread its chunks."""


class StoreLockUnsupported(OSError):
    """The store root's filesystem refused ``flock`` (the store's liveness signal)."""


class VersionGone(FileNotFoundError):
    """The version was removed (pruned and its slot reused) while being read."""


def _check_format(path: Path, head: Any) -> None:
    if not isinstance(head, dict):
        raise ValueError(f"{path}: a commit record that is not an object")
    found = head.get("format", "none (written before formats were recorded)")
    if found != HEAD_FORMAT:
        raise StoreFormatError(
            f"{path}: a commit record of format {found}, this code reads {HEAD_FORMAT}: "
            f"another version of capricorn_jax wrote this store; start the job with --fresh "
            f"(or remove the store with python -m capricorn_jax.stores --action=prune), or run the "
            f"version that wrote it")


_MAX_BYTES = 1 << 48  # no slot is bigger: larger offsets or sizes are damage


def _check_head(path: Path, head: Any) -> dict[str, Any]:
    """``head`` (a parsed commit record of slot file ``path``) when every field
    a reader acts on has its type and range; else ``ValueError`` naming the
    field (the version is then ignored, never read from a wrong place)."""

    def whole(value: Any, what: str, high: int = _MAX_BYTES) -> int:
        if type(value) is not int or not 0 <= value < high:
            raise ValueError(f"{path}: {what} is {value!r}, not an integer in [0, {high})")
        return value

    check_seal(path, head)  # an object, no field changed since it was written (head_seal)
    whole(head.get("step"), "step")
    whole(head.get("owner"), "owner")
    whole(head.get("generation"), "generation", 1 << 63)
    index = whole(head.get("slot"), "slot")
    if (path.name.split(".")[0], path.parent.name) != (f"slot{index}", f"owner{head['owner']}"):
        raise ValueError(f"{path}: names owner {head['owner']}, slot {index}")
    chunks = head.get("chunks")
    if not isinstance(chunks, dict):
        raise ValueError(f"{path}: chunks is not a table")
    try:  # every chunk lies inside its slot's file (written before the head)
        slot_bytes = path.with_name(f"slot{index}.data").stat().st_size
    except FileNotFoundError:
        slot_bytes = 0
    for name, entry in chunks.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: chunk {name!r} is not a record")
        end = whole(entry.get("offset"), f"chunk {name!r} offset") + whole(
            entry.get("nbytes"), f"chunk {name!r} nbytes")
        whole(end, f"chunk {name!r} end", slot_bytes + 1)
        whole(entry.get("crc32c"), f"chunk {name!r} crc32c", 1 << 32)
    return head


def _check_size(owner: int, step: int, names: list[str], data: np.ndarray,
                manifest: dict[str, Any]) -> None:
    total = sum(manifest["chunks"][n]["nbytes"] for n in names)
    if data.size != total:
        raise ChecksumError(f"owner{owner}/v{step:012d}/{names[0]}: size {data.size} != {total}")


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
        path = self.root / LOCK
        while True:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            except OSError as e:
                os.close(fd)
                raise StoreLockUnsupported(
                    f"cannot lock {path}: {errno.errorcode.get(e.errno or 0, e.errno)} "
                    f"({e.strerror}) on the filesystem at {mount_point(path)}; the RAM store "
                    f"needs a working flock on its store root (a tmpfs such as /dev/shm "
                    f"has one)") from None
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
        return full_message(path, nbytes, delta, self.limit, why, shared)

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
                index = (min(fits, key=sizes.__getitem__) if fits
                         else max(free, key=sizes.__getitem__))
            else:
                index = max(indices, default=-1) + 1
            self._busy.add((owner, index))
            slot = self._slot(owner, index)
        self._slot_path(owner, index, "writing").write_text(str(step))
        try:
            slot.grow(round_up(nbytes))
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
                        head = json.loads(path.read_text())
                        _check_format(path, head)
                        step = _check_head(path, head)["step"]
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
            path = self._slot_path(owner, index, "head")
            try:
                head = _check_head(path, json.loads(path.read_text()))
            except (FileNotFoundError, ValueError):
                continue
            if head["step"] == step and (best is None or head["generation"] > best["generation"]):
                best = head
        if best is None:
            raise VersionGone(f"owner{owner}/v{step:012d}: no such version")
        return best

    def manifest(self, owner: int, step: int) -> dict[str, Any]:
        """The version's commit record: its chunk table and the caller's
        metadata (without the head's seal, checked when it was read)."""
        return {k: v for k, v in self._head(owner, step).items() if k != SEAL}

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
        self.chunk_view(owner, step, name, manifest)  # inside its slot before any allocation
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
            if entry.name == LOCK:
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
