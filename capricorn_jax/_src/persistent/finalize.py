"""A failed finalize on Orbax's primary host: recorded, never left to a barrier's timeout.

Why. In orbax-checkpoint 0.12.8 the primary host finalizes a step in its
background thread (the step's metadata, the commit file, the rename of its
temporary directory) and only then joins the other hosts at the step's last
barrier. When finalize raises (a full disk, an I/O error), the primary's
thread ends before that barrier, and every other host waits there until the
barrier's timeout (the handler's commit bound: 1200 s by default); their next
persistent save, which waits for the step in flight, blocks training that
long. Found with the chaos class ``disk_full_finalize`` (2026-12-05: a 12-step
job stopped after step 7, host 1 waiting at Orbax's barrier).

What. ``recording(cls)`` is ``cls`` (Orbax's atomic-rename step directory, or
the class a caller configured) whose ``finalize`` records an ``OSError``
instead of raising it: the primary's thread reaches the barrier, every host
goes on, and the step is *not* committed (the rename did not happen, so Orbax
never lists it after a reload). ``take_failures(directory)`` hands the
manager the failures of its directory's steps; it records each as a failed
persistent step (``persistent_errors``), removes the temporary directory and
reloads Orbax's step list.

Alternatives not taken: releasing the barrier from the primary by its key
(Orbax's barrier names are internal); a watchdog ending the waiting hosts
(they would restart and recover, for a failure that loses nothing).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_FAILED: dict[str, OSError] = {}  # final step path -> its finalize's error


def recording(cls: type) -> type:
    """``cls`` (an Orbax ``TemporaryPath`` class) whose finalize records an OSError."""

    class Recording(cls):
        async def finalize(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return await super().finalize(*args, **kwargs)
            except OSError as e:
                final = str(self.get_final())
                log.error("finalizing persistent step %s failed (%s); the step is not "
                          "committed, the other hosts go on", final, e)
                with _LOCK:
                    _FAILED[final] = e
                return None

    Recording.__name__ = Recording.__qualname__ = f"Recording{cls.__name__}"
    return Recording


def take_failures(directory: Any) -> dict[str, OSError]:
    """The finalize failures of steps in ``directory`` (step directory name ->
    error), removed from the record."""
    root = str(Path(str(directory)))
    with _LOCK:
        mine = {k: v for k, v in _FAILED.items() if str(Path(k).parent) == root}
        for k in mine:
            del _FAILED[k]
    return {Path(k).name: v for k, v in mine.items()}
