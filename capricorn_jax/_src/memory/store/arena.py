"""The store's arena: preallocated, mapped slot files and the writer of one version.

A ``_Slot`` is one file ``ROOT/owner{o}/slot{k}.data`` mapped into memory
(2 MiB-aligned and registered with the GPU runtime when the store has a
``pinned.SlotRegistry``), grown with its pages reserved (``posix_fallocate``)
so a full RAM disk is an error at ``begin``, never a SIGBUS mid-copy. A
``VersionWriter`` copies (``write_chunk``) or adopts (``adopt_chunk``, bytes a
device copy already put there) each chunk and checksums it with CRC32C;
``commit`` writes the head last. The store that owns the slots
(``store.HostStore``) decides which slot a version takes and when it is free.

Design choice: the arena apart from the store's records (heads, versions,
reads), each a module a reader can hold; the arena reaches its store only
through the small ``SlotOwner`` protocol, so it imports nothing of the store.
Alternative not taken: a protocol-free back reference typed ``HostStore``,
which would make the two modules import each other.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import crc32c as _crc32c
import numpy as np

from capricorn_jax._src.memory.store.head_seal import seal
from capricorn_jax._src.memory.store.pinned import SlotRegistry, align_up
from capricorn_jax._src.memory.store.store_lifecycle import StoreFullError

HEAD_FORMAT = "cjx-head/2"
"""The commit record's format, written into every head; a store whose heads
name another is refused (``store.StoreFormatError``). Format 2: every head
carries its seal (``head_seal``)."""

ALIGN = 64  # chunk offsets: aligned for the CPU client's zero-copy wrap


class SlotOwner(Protocol):
    """What a slot and a version writer ask of the store that owns them."""

    registry: SlotRegistry | None

    def _reserve(self, nbytes: int, delta: int, path: Path) -> None: ...

    def _full_message(self, path: Path, nbytes: int, delta: int, why: str) -> str: ...

    def _slot_path(self, owner: int, index: int, kind: str) -> Path: ...

    def _check(self, path: Path) -> Path: ...

    def _committed(self, owner: int, step: int, index: int) -> None: ...

    def _release(self, owner: int, index: int) -> None: ...


def checksum(data: Any) -> int:
    """CRC32C of a bytes-like object (hardware-accelerated, releases the GIL)."""
    return _crc32c.crc32c(data)


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Slot:
    """One preallocated, mapped slot file."""

    def __init__(self, path: Path, index: int, store: SlotOwner | None = None):
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

    def __init__(self, store: SlotOwner, owner: int, step: int, slot: _Slot):
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
            self._next = max(self._next, round_up(offset + src.size))
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
            self._next = max(self._next, round_up(offset + nbytes))
            self.chunks[name] = {"offset": offset, "nbytes": int(nbytes)}
            view = self.slot.view
        self.chunks[name]["crc32c"] = checksum(view[offset:offset + nbytes])

    def commit(self, meta: dict[str, Any]) -> Path:
        """Writes the head last (temporary name, renamed into place); returns its path."""
        head = {"format": HEAD_FORMAT, "owner": self.owner, "step": self.step,
                "generation": time.time_ns(),
                "slot": self.slot.index, "chunks": self.chunks, **meta}
        path = self.store._slot_path(self.owner, self.slot.index, "head")
        tmp = self.store._check(path.with_suffix(".head.tmp"))
        tmp.write_text(json.dumps(seal(head)))
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
