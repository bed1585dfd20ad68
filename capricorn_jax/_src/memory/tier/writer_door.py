"""The memory tier as the strategies drive it: ``TierWriter``.

The strategies (``strategies.inmemory``, ``strategies.channel_replication``,
``strategies.scheduled`` and its window feedback) and the scheduled steps
they build (``scheduling.in_graph.transfers.ScheduledTransfers``) save versions
through a host's checkpointer, commit versions their own steps moved, skip
or drop versions, time their phases on its clock and agree on a small note
and on a lost chunk channel through its status round; at start-up they recover through it
(``memory.recovery.recover``, a ``TierReader``'s work). ``TierWriter`` names
everything they use of the checkpointer, and nothing else;
``InMemoryCheckpointer`` is one.

Design choice: a structural protocol extending ``TierReader`` (a strategy
also restores), which the strategies are typed against, so mypy rejects any
member outside this list: the checkpointer's writers, store bookkeeping and
status round stay its own, and the one state a strategy sets (its status
note) goes through a named method. Alternative not taken: the strategies
typed against ``InMemoryCheckpointer``, whose every attribute (``writers``,
``status_note``, ...) a strategy could then read or assign unseen.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np

from capricorn_jax._src.memory.tier.pec_tier import PecVersion
from capricorn_jax._src.memory.tier.phase_clock import PhaseClock
from capricorn_jax._src.memory.tier.reader import TierReader
from capricorn_jax._src.memory.tier.reports import SaveReport


class TierWriter(TierReader, Protocol):
    """What a strategy does with a host's memory tier (beside ``TierReader``'s
    members, which recovery reads: of those a strategy itself reads ``host``,
    ``options`` (``job``, the timeouts, ``chunk_tos``, ``max_wait_s``: a cost
    budget), ``transport`` (its program: rows, measuring the link),
    ``pec`` (None: whole versions), ``hooks`` (the channel's fault points)
    and calls ``resume_pec``)."""

    @property
    def clock(self) -> PhaseClock:
        """The training thread's phase clock: a strategy times its phases on it and takes them."""
        ...

    @property
    def rounds(self) -> list[dict[int, int]]:
        """The replication rounds (host -> peer): a strategy finds its channel's peers in them."""
        ...

    @property
    def sources(self) -> list[int]:
        """The hosts whose replicas this host receives: a strategy checks their count."""
        ...

    @property
    def agreed_note(self) -> int | None:
        """Host 0's status note as of the previous status round (the same on every host)."""
        ...

    def note_status(self, value: int) -> None:
        """Sets the small integer this host's next status rounds carry (``agreed_note``)."""
        ...

    def note_channel(self, lost: bool) -> None:
        """Whether this host's chunk channel is lost (carried by the next status rounds)."""
        ...

    def channel_lost_anywhere(self) -> bool:
        """Whether any host's chunk channel was lost as of the previous round (agreed)."""
        ...

    def save(self, step: int, state: Any, host_state: dict[str, Any], *,
             tokens_per_expert: Any = None, expert_mask: Any = None) -> SaveReport:
        """Checkpoints ``state`` as version ``step``: packs, replicates and writes it."""
        ...

    def save_transferred(self, step: int, own: Any, received: list, *,
                         tokens_per_expert: Any = None,
                         version: PecVersion | None = None,
                         status_round: tuple[SaveReport, Any] | None = None,
                         corrupt: list | None = None) -> SaveReport:
        """Commits version ``step`` whose payloads the strategy's own step moved
        (``corrupt``: per round, its end-to-end verdict on the received ones)."""
        ...

    def skip(self, step: int, tokens_per_expert: Any = None) -> SaveReport:
        """Takes no version at ``step``, on every host alike (the status round still runs)."""
        ...

    def drop(self, step: int, status_round: tuple[SaveReport, Any] | None = None, *,
             corrupt: bool = True) -> SaveReport:
        """Takes no version at ``step`` on this host alone (a peer's payload came
        corrupt, or never came)."""
        ...

    def note_lost(self, versions: Any) -> None:
        """Versions this host will never hold (PEC rolls them back on every host)."""
        ...

    def begin_round(self) -> tuple[SaveReport, np.ndarray]:
        """A save's status vector, for a strategy that runs the status round in its own program."""
        ...

    def plan_pec_version(self, step: int, tokens_per_expert: Any,
                         expert_mask: Any = None) -> PecVersion:
        """PEC: decides and records version ``step`` for the strategy's step to pack."""
        ...

    def trailer_rows(self, host_state: dict[str, Any]) -> jax.Array:
        """The [devices, trailer] rows of ``host_state`` a strategy's pack takes."""
        ...

    def close(self) -> None:
        """Drains the writers and frees the copier (the strategy's ``close``)."""
        ...
