"""``inmem`` and ``pec``: every step to host RAM and m-1 peers, after the step.

The strategy over ``InMemoryCheckpointer`` that moves each version after
the step that made it (the tier's own replication). With the checkpointer's
PEC options it is ``pec``: each version carries K of the N experts of every
MoE layer, chosen from the load of the step that made it. ``restore`` is the
in-memory tier's recovery (``memory.recovery.recover``).

Design choice: a thin adapter that turns ``SaveReport``s into ``checkpoint``
events and leaves every decision to the checkpointer, so the scheduled
strategies (``strategies.scheduled``) reuse it for the versions they do not
move inside a step. Alternative not taken: a strategy per PEC mode; the PEC
options live on the checkpointer, which knows them anyway.
"""

from __future__ import annotations

import numpy as np

from capricorn_jax._src.memory.tier.recovery import recover
from capricorn_jax._src.memory.tier.reports import SaveReport
from capricorn_jax._src.memory.tier.restore_info import NoCheckpoint, RestoreInfo
from capricorn_jax._src.memory.tier.writer_door import TierWriter
from capricorn_jax._src.partial.tracker import PltTracker
from capricorn_jax._src.strategies.base import CheckpointEvent, HostState, State, Strategy
from capricorn_jax._src.strategies.shared_identity import agree_on_start


class InMemoryStrategy(Strategy):
    """capricorn_jax's in-memory tier with the unscheduled (after-step) transfer.

    Args:
      checkpointer: the host's memory tier (an InMemoryCheckpointer, used
        through ``TierWriter``; its PEC options make this ``pec``).
      name: the strategy's name in events and reports.
    """

    def __init__(self, checkpointer: TierWriter, name: str = "inmem") -> None:
        self.ckpt, self.name = checkpointer, name
        self.bytes_per_step = 0
        # Before any collective: every host shares the plan, rounds and options
        # (``strategies.shared_identity``); later agreements carry the digest.
        self.shared = agree_on_start(checkpointer, name)

    def _event(self, version: int, report: SaveReport) -> CheckpointEvent:
        if not report.skipped:  # a skipped version moved nothing: keep the last version's
            self.bytes_per_step = report.bytes
        event = {"version": version, "bytes": report.bytes, "store_bytes": report.store_bytes,
                 "store_kib_per_host": report.store_kib_per_host,
                 "committed": report.committed, "replicated": report.safe_version,
                 "skipped": report.skipped, "interval": report.interval,
                 "dropped_replicas": report.dropped_replicas,
                 "newly_committed": report.newly_committed,
                 "under_replicated": report.under_replicated}
        if report.pec_k is not None:
            event.update(pec_k=report.pec_k, plt=report.pec_plt)
        return event

    def save(self, step: int, state: State, host_state: HostState, *,
             tokens_per_expert: np.ndarray | None = None,
             next_step_profiled: bool = False) -> list[CheckpointEvent]:
        """Version ``step``; with PEC, ``tokens_per_expert`` of the step that made it."""
        pec = {} if self.ckpt.pec is None else {"tokens_per_expert": tokens_per_expert}
        return [self._event(step, self.ckpt.save(step, state, host_state, **pec))]

    def close(self) -> None:
        self.ckpt.close()

    def blocked_phases(self) -> dict[str, float]:
        """The checkpointer's phase clock since the last call (``memory.phase_clock``)."""
        return self.ckpt.clock.take()

    def restore(self) -> tuple[State, RestoreInfo]:
        recovered = recover(self.ckpt)
        if recovered is None:
            raise NoCheckpoint(f"{self.name}: no version every host can restore in the memory "
                               f"tier")
        return recovered

    def resume_at(self, step: int) -> None:
        """PEC: the tracker never saw the steps run without this strategy; its
        portion of lost tokens starts over at ``step`` (benchmark timing only)."""
        pec = self.ckpt.pec
        if pec is not None and pec.tracker.step != step:
            self.ckpt.resume_pec(PltTracker(*pec.shape, pec.tracker.top_k, step))
