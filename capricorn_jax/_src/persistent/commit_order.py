"""Old persistent steps are deleted only after their successor is committed.

Why. Orbax's ``CheckpointManager.save`` chooses the steps to delete when a
save starts, counting the new step as kept (``max_to_keep``, the preservation
policy), drops them from its step list at once, and deletes them in the
save's finalize thread after the new step's commit futures returned, whether
or not the new step's finalize (the rename that commits it) succeeded. With
``max_to_keep=1`` a full disk at the new step's finalize leaves no step at
all; with ``max_to_keep=N`` each failed save deletes one more committed step
(found against orbax-checkpoint 0.12.8: ``save_interval_steps=2``,
``max_to_keep=2``, ENOSPC at the finalize of steps 6 and 8 left step 4 only).

What. ``CommittedFirst`` wraps the manager's deleter: while a save's finalize
runs (``finalizing(step)``), the steps it was handed are deleted only when
``step`` is committed (its final directory exists and its finalize recorded
no failure, ``finalize.failed``); otherwise nothing is deleted and the
manager reloads its step list from disk, so every earlier step is listed
and restorable again. Deletions asked outside a save (``manager.delete``) go
through unchanged. Under PEC the keep policy counted the failed step's
expert copies; since nothing is deleted, every step it would have dropped
stays, and the next committed save's policy decides again from disk.

Alternative not taken: overriding Orbax's ``_finalize`` with a copy that
checks the commit before deleting: it would fork Orbax's barrier and
progress-tracker logic; the deleter is a documented protocol
(``CheckpointDeleter``: ``delete``, ``delete_steps``, ``close``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from capricorn_jax._src.persistent import finalize

log = logging.getLogger("capricorn_jax")


class CommittedFirst:
    """A ``CheckpointDeleter`` that deletes a save's old steps only once the
    save's own step is committed.

    Args:
      inner: Orbax's deleter.
      step_path: the final directory of a step.
    """

    def __init__(self, inner: Any, step_path: Callable[[int], Any]):
        self._inner = inner
        self._step_path = step_path
        self._local = threading.local()
        self.kept: list[tuple[int, list[int]]] = []  # (failed step, the steps it kept)

    def finalizing(self, step: int | None) -> None:
        """The step whose finalize runs on this thread (None: none)."""
        self._local.step = step

    def committed(self, step: int) -> bool:
        """Whether persistent step ``step`` is committed on disk (renamed into
        its final name, its finalize not failed)."""
        path = self._step_path(step)
        return Path(str(path)).is_dir() and not finalize.failed(path)

    def delete(self, step: int) -> None:
        self._inner.delete(step)

    def delete_steps(self, steps: Sequence[int]) -> None:
        step = getattr(self._local, "step", None)
        if steps and step is not None and not self.committed(step):
            log.warning("persistent step %d did not commit: steps %s, which its save would have "
                        "replaced, are kept", step, sorted(steps))
            self.kept.append((step, sorted(steps)))
            return
        self._inner.delete_steps(steps)

    def close(self) -> None:
        self._inner.close()
