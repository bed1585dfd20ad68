"""What the training thread waited for in a save, phase by phase.

With the layers' compute off the cores (an accelerator, or the emulated one
of the launcher), what a checkpoint strategy adds to a step is the time the
training thread spends in its ``save`` rather than dispatching the next step.
A ``PhaseClock`` accumulates that time per named phase (the pack's dispatch,
the status round, the bookkeeping, the device-to-host copy's start, the hand
off to the writer or the sender, the wait for the peer's payload...); the
strategy hands the totals to its caller (``Strategy.blocked_phases``) after
each save, and the bench reports them per step.

Phases nest exclusively: a phase entered inside another pauses the outer one,
so the totals add up to at most the time spent inside the outermost phases,
and no second counts twice.

Design choice: one clock per checkpointer, ticked on the training thread
only (no lock), read and reset by the strategy that owns it. Alternative not
taken: a profiler trace of the save (``jax.profiler``), which costs more than
the phases it would measure (a few ms each on this machine) and needs a
viewer to read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class PhaseClock:
    """Per-phase accumulated seconds of the thread that ticks it.

    Attributes:
      totals: phase name -> seconds since the last ``take``.
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._stack: list[list] = []  # [name, start of its current slice]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Counts the time inside the block as ``name`` (less the time of
        phases nested in it, counted as theirs)."""
        now = time.perf_counter()
        if self._stack:  # pause the outer phase
            outer = self._stack[-1]
            self._add(outer[0], now - outer[1])
        self._stack.append([name, now])
        try:
            yield
        finally:
            now = time.perf_counter()
            _, start = self._stack.pop()
            self._add(name, now - start)
            if self._stack:  # resume the outer phase
                self._stack[-1][1] = now

    def _add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """The totals since the last call (seconds per phase), reset to none."""
        out, self.totals = self.totals, {}
        return out
