"""The host store: checkpoint versions in host RAM that outlive the training process.

One root per (job, host), by default on tmpfs (``/dev/shm``), so a crashed
training process leaves its checkpoints in RAM for its successor. Layout::

    ROOT/owner{o}/v{step:012d}.partial/   being written: chunk files
    ROOT/owner{o}/v{step:012d}/           committed: chunk files + MANIFEST.json

``owner`` is the host whose shards the version holds: this host's own, or a
peer's replica received through the transport. A version commits in two
steps: MANIFEST.json (with a CRC32 per chunk) is written to a temporary name
and renamed into place inside the partial directory, then the directory is
renamed to its final name; a reader only ever sees complete versions. Partial
directories left by a crash are removed when the store opens.

Design choice: plain files on tmpfs rather than an agent process holding the
bytes: tmpfs already survives the process, costs one memcpy per write, and
needs nothing to be started or supervised. The alternative (an agent per
host) would only pay off to pin memory or to serve peers itself; here peers
are served by the training processes through the transport.

A manifest holds the chunk checksums and what the checkpointer passes to
``commit``: the layout's fingerprint and leaf table, the host state and, under
partial expert checkpointing, a ``pec`` entry (K, the experts' mask, the
versions a restore to it reads, the PLT tracker).

Isolation: every path the store touches is checked to lie inside its root;
data from another host reaches this store only through ``write_chunk`` of a
version received over the transport.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MANIFEST = "MANIFEST.json"
_VERSION = re.compile(r"^v(\d{12})$")
_PARTIAL = re.compile(r"^v(\d{12})\.partial$")


class ChecksumError(IOError):
    """A chunk's bytes do not match the CRC32 of its manifest."""


class StoreIsolationError(RuntimeError):
    """A path outside this host's root was about to be touched."""


def crc32(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


class VersionWriter:
    """Writes the chunks of one (owner, step) version; commit() publishes it."""

    def __init__(self, store: HostStore, owner: int, step: int):
        self.store, self.owner, self.step = store, owner, step
        self.partial = store._path(f"owner{owner}", f"v{step:012d}.partial")
        if self.partial.exists():
            shutil.rmtree(self.partial)
        self.partial.mkdir(parents=True)
        self.chunks: dict[str, dict[str, int]] = {}

    def write_chunk(self, name: str, data: bytes | memoryview) -> None:
        if "/" in name or name == MANIFEST:
            raise ValueError(f"bad chunk name {name!r}")
        with open(self.store._check(self.partial / name), "wb") as f:
            f.write(data)
        self.chunks[name] = {"nbytes": len(data), "crc32": crc32(data)}

    def commit(self, meta: dict[str, Any]) -> Path:
        """Writes the manifest last, renames the version into place; returns its dir."""
        manifest = {"owner": self.owner, "step": self.step, "chunks": self.chunks, **meta}
        tmp = self.store._check(self.partial / (MANIFEST + ".tmp"))
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, self.partial / MANIFEST)
        final = self.store._path(f"owner{self.owner}", f"v{self.step:012d}")
        if final.exists():
            shutil.rmtree(final)
        os.replace(self.partial, final)
        return final

    def abort(self) -> None:
        shutil.rmtree(self.partial, ignore_errors=True)


class HostStore:
    """The checkpoint store of one host.

    Args:
      root: this (job, host)'s directory; created if missing.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.removed_partials = self._remove_partials()

    def _check(self, path: Path) -> Path:
        resolved = Path(os.path.abspath(path))
        if resolved != self.root and self.root not in resolved.parents:
            raise StoreIsolationError(f"{resolved} is outside this host's store {self.root}")
        return resolved

    def _path(self, *parts: str) -> Path:
        return self._check(self.root.joinpath(*parts))

    def _remove_partials(self) -> list[str]:
        removed = []
        for owner_dir in self.root.glob("owner*"):
            for entry in owner_dir.iterdir():
                if _PARTIAL.match(entry.name) or entry.name.endswith(".tmp"):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(f"{owner_dir.name}/{entry.name}")
        return removed

    def begin(self, owner: int, step: int) -> VersionWriter:
        return VersionWriter(self, owner, step)

    def owners(self) -> list[int]:
        return sorted(int(p.name[5:]) for p in self.root.glob("owner*") if p.name[5:].isdigit())

    def versions(self, owner: int) -> list[int]:
        """Committed steps of ``owner``, ascending (manifest present)."""
        owner_dir = self._path(f"owner{owner}")
        if not owner_dir.is_dir():
            return []
        steps = []
        for entry in owner_dir.iterdir():
            m = _VERSION.match(entry.name)
            if m and (entry / MANIFEST).is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def manifest(self, owner: int, step: int) -> dict[str, Any]:
        return json.loads(self._path(f"owner{owner}", f"v{step:012d}", MANIFEST).read_text())

    def read_chunk(self, owner: int, step: int, name: str,
                   manifest: dict | None = None) -> bytearray:
        """A chunk's bytes, checked against the manifest's CRC32 (``read_chunk_into``).

        Raises:
          ChecksumError: naming the chunk, when its bytes do not match.
        """
        manifest = manifest or self.manifest(owner, step)
        data = bytearray(manifest["chunks"][name]["nbytes"])
        self.read_chunk_into(owner, step, name, memoryview(data), manifest)
        return data

    def read_chunk_into(self, owner: int, step: int, name: str, out: memoryview,
                        manifest: dict | None = None) -> None:
        """Reads a chunk into ``out`` (exactly its size), checked against the
        manifest's size and CRC32.

        Raises:
          ChecksumError: naming the chunk, when its size or bytes do not match.
        """
        manifest = manifest or self.manifest(owner, step)
        expected = manifest["chunks"][name]
        path = self._path(f"owner{owner}", f"v{step:012d}", name)
        with open(path, "rb") as f:
            n = f.readinto(out) if len(out) == expected["nbytes"] else -1
            extra = f.read(1)
        if n != expected["nbytes"] or extra or crc32(out) != expected["crc32"]:
            raise ChecksumError(f"owner{owner}/v{step:012d}/{name}: checksum mismatch")

    def verify(self, owner: int, step: int) -> bool:
        """Whether every chunk of the version matches its checksum."""
        try:
            manifest = self.manifest(owner, step)
            for name in manifest["chunks"]:
                self.read_chunk(owner, step, name, manifest)
        except (OSError, ValueError, KeyError):
            return False
        return True

    def prune(self, owner: int, keep: Iterable[int]) -> None:
        """Removes committed versions of ``owner`` not in ``keep``."""
        keep = set(keep)
        for step in self.versions(owner):
            if step not in keep:
                self.remove(owner, step)

    def remove(self, owner: int, step: int) -> None:
        """Removes one committed version of ``owner`` (nothing if absent)."""
        shutil.rmtree(self._path(f"owner{owner}", f"v{step:012d}"), ignore_errors=True)

    def wipe(self) -> None:
        """Removes everything (a lost machine's RAM)."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)

    def bytes_held(self) -> int:
        """Bytes of every file in the store.

        The writer threads prune and rename versions while the training thread
        walks the store: a file or directory that vanishes during the walk is
        skipped (``os.walk`` ignores directories it cannot list), never an error.
        """
        total = 0
        for directory, _, files in os.walk(self.root):
            for name in files:
                try:
                    total += os.stat(os.path.join(directory, name)).st_size
                except FileNotFoundError:
                    continue
        return total
