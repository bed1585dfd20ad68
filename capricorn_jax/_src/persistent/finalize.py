"""Finalizing a persistent step: durable before it is named, recorded when it fails.

Why. In orbax-checkpoint 0.12.8 the primary host finalizes a step in its
background thread (the step's metadata, the commit file, the rename of its
temporary directory) and only then joins the other hosts at the step's last
barrier. When finalize raises (a full disk, an I/O error), the primary's
thread ends before that barrier, and every other host waits there until the
barrier's timeout (the handler's commit bound: 1200 s by default); their next
persistent save, which waits for the step in flight, blocks training that
long. Found with the chaos class ``disk_full_finalize`` (2026-12-05: a 12-step
job stopped after step 7, host 1 waiting at Orbax's barrier).

What. ``recording(cls, root, fsync)`` is ``cls`` (Orbax's atomic-rename step
directory, or the class a caller configured) whose ``finalize``

* makes the step durable before its rename names it (``fsync``: every file
  and directory of the temporary step directory, right before Orbax's rename,
  after its last files; then the root after the rename), so a power cut after
  the commit cannot leave a committed name over missing bytes; object stores
  skip it (no rename, no fsync);
* records an ``OSError`` instead of raising it: the primary's thread reaches
  the barrier, every host goes on, and the step is *not* committed (the
  rename did not happen, so Orbax never lists it after a reload).

``failed(directory, step)`` tells the manager whether a step's finalize failed
(its deleter deletes nothing then: ``manager``), ``take_failures(directory)``
hands it the failures of its directory's steps to record.

Alternatives not taken: releasing the barrier from the primary by its key
(Orbax's barrier names are internal); a watchdog ending the waiting hosts
(they would restart and recover, for a failure that loses nothing); fsync of
each host's own files by that host (Orbax does not tell a handler which files
it wrote; the primary's walk of the step directory covers them on a local or
NFS filesystem, where a writer's close flushes its data to the server).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_FAILED: dict[str, OSError] = {}  # final step path -> its finalize's error


def fsync_tree(root: str | os.PathLike[str]) -> int:
    """fsyncs every file and directory under ``root`` (``root`` last); returns
    how many were synced."""
    count = 0
    for here, dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(here, name))
            count += 1
        for name in dirs:
            fsync_path(os.path.join(here, name))
            count += 1
    fsync_path(root)
    return count + 1


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsyncs one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recording(cls: type, root: Any, fsync: bool = True) -> type:
    """``cls`` (an Orbax ``TemporaryPath`` class) whose finalize makes the step
    directories of ``root`` durable (``fsync``) and records an OSError."""
    root = str(Path(str(root)).absolute())

    class Recording(cls):
        async def finalize(self, *args: Any, **kwargs: Any) -> Any:
            final = Path(str(self.get_final())).absolute()
            step_directory = str(final.parent) == root  # not one of its items
            try:
                if step_directory and fsync:
                    tmp = getattr(self, "_tmp_path", None)
                    if tmp is not None and hasattr(tmp, "rename"):
                        # Orbax's finalize writes its last files, then renames
                        # this path: sync everything right before that rename.
                        self._tmp_path = _durable_rename(tmp)
                    else:  # another TemporaryPath: its files as they are now
                        fsync_tree(str(self.get()))
                done = await super().finalize(*args, **kwargs)
                if step_directory and fsync:
                    fsync_path(root)
                return done
            except OSError as e:
                log.error("finalizing persistent step %s failed (%s); the step is not "
                          "committed, the other hosts go on", final, e)
                with _LOCK:
                    _FAILED[str(final)] = e
                return None

    Recording.__name__ = Recording.__qualname__ = f"Recording{cls.__name__}"
    return Recording


def _durable_rename(path: Any) -> Any:
    """``path`` (an ``epath`` path) whose ``rename`` first fsyncs the tree under it."""

    class DurableRename(type(path)):  # type: ignore[misc]
        def rename(self, target: Any) -> Any:
            fsync_tree(str(self))
            return super().rename(target)

    return DurableRename(str(path))


def failed(step_directory: Any) -> bool:
    """Whether the finalize of ``step_directory`` (a step's final path) failed
    and is not yet taken by ``take_failures``."""
    with _LOCK:
        return str(Path(str(step_directory)).absolute()) in _FAILED


def take_failures(directory: Any) -> dict[str, OSError]:
    """The finalize failures of steps in ``directory`` (step directory name ->
    error), removed from the record."""
    root = str(Path(str(directory)).absolute())
    with _LOCK:
        mine = {k: v for k, v in _FAILED.items() if str(Path(k).parent) == root}
        for k in mine:
            del _FAILED[k]
    return {Path(k).name: v for k, v in mine.items()}
