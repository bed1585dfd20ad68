"""When to stop for a preemption: JAX's agreed sync point, or SIGTERM in one process.

Why. Orbax's ``reached_preemption(step)`` is JAX's preemption sync point
(``multihost_utils.reached_preemption_sync_point``): once any process of a
``jax.distributed`` job gets SIGTERM (JAX's coordination agent catches it),
every process answers True at the same step, so they all save that step and
stop together. Measured here (jax 0.10.2, CPU, 2 processes over gloo):
SIGTERM to process 1 made both answer True at the same step. Without
``jax.distributed`` (one process) JAX has no preemption service and Orbax
answers False for ever, while SIGTERM ends the process.

What. ``Preemption`` answers JAX's sync point when a distributed client runs;
otherwise it installs a SIGTERM handler (only over the default one, from the
main thread; a handler the program set stays, and then only JAX's answer
counts) that makes the next ``reached`` True. ``close`` puts the default back.

Alternative not taken: our own agreement over the key-value store at every
step: a round trip per step for what JAX's service already agrees.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("capricorn_jax")


def _distributed() -> bool:
    from jax._src import distributed

    return distributed.global_state.client is not None


class Preemption:
    """``reached(step, sync_point)``: whether to save ``step`` and stop."""

    def __init__(self) -> None:
        self._term = threading.Event()
        self._installed = False
        if _distributed() or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, self._on_term)
            self._installed = True

    def _on_term(self, signum: int, frame: Any) -> None:
        del signum, frame
        if not self._term.is_set():
            log.warning("SIGTERM: the next step is saved to both tiers, then the job stops")
        self._term.set()

    def reached(self, step: int, sync_point: Callable[[int], bool]) -> bool:
        """True at the step every process stops at: ``sync_point(step)``
        (JAX's, through Orbax) with a distributed client, else whether this
        process got SIGTERM."""
        if _distributed():
            return bool(sync_point(step))
        return self._term.is_set()

    def close(self) -> None:
        if self._installed and signal.getsignal(signal.SIGTERM) == self._on_term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._installed = False
