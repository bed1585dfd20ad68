"""A planner's own thread: re-plans prepared while the training thread runs on.

Capricorn re-plans at a new load from its models (``planners``) with two
agreements through the key-value store and a partition of the payload. On
the training thread they lengthened the steps that re-planned: 15-25 ms each
at the FIFO point of issue 53, 7 ms per steady step on average, the store's
round trips queued behind the checkpoint's bytes. ``PlanThread`` runs such a
job on one daemon thread, in submission order; the job's agreements go on
its own stream (``multihost.agree``), so they never pair with an agreement
of the training thread. The training thread takes the job's outcome at a
point every host reaches at the same step (``Job.outcome``), one step after
it submitted the job: by then its round trips overlapped a whole step.

Design choice: one thread per planner and one agreement stream per thread
(``plan_stream``: numbered in construction order, the same on every host).
Alternative not taken: the chunk sender's thread, which is busy at exactly
the window in which a re-plan would run (the step's transfers).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

from capricorn_jax._src.multihost.agree import current_timeout

_streams = itertools.count()

JOIN_MARGIN_S = 60.0
"""How much longer than an agreement's bound the training thread waits for a
job's outcome (the job's agreements are bounded; this bounds the rest)."""


def plan_stream() -> str:
    """A new agreement stream: ``plan0``, ``plan1``, ... in call order (every
    host builds its strategies, and so their planners, in the same order)."""
    return f"plan{next(_streams)}"


class Job:
    """One submitted job: its step, and its outcome once the thread ran it."""

    def __init__(self, step: int, fn: Callable[[], Any]) -> None:
        self.step, self.fn = step, fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def outcome(self) -> Any:
        """The job's return value (waiting for it, bounded); raises its error."""
        bound = current_timeout() + JOIN_MARGIN_S
        if not self.done.wait(bound):
            raise TimeoutError(f"the re-plan submitted at step {self.step} did not finish "
                               f"within {bound:g}s")
        if self.error is not None:
            raise RuntimeError(f"the re-plan submitted at step {self.step} failed") \
                from self.error
        return self.result


class PlanThread:
    """Runs submitted jobs in order on one daemon thread (started at the first)."""

    def __init__(self, name: str = "capricorn-plan") -> None:
        self.name = name
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.ran = 0  # jobs run (tests)
        self.thread_names: set[str] = set()  # the threads jobs ran on (tests)

    def submit(self, step: int, fn: Callable[[], Any]) -> Job:
        job = Job(step, fn)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self.thread_names.add(threading.current_thread().name)
            try:
                job.result = job.fn()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                job.error = e
            self.ran += 1
            job.done.set()

    def close(self) -> None:
        """Ends the thread after the jobs submitted so far."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(1.0)
            self._thread = None


__all__ = ["JOIN_MARGIN_S", "Job", "PlanThread", "plan_stream"]
