"""The memory tier as its readers see it: ``TierReader``.

Recovery (``memory.recovery``) and the persistent tier
(``persistent.memory_read``, ``persistent.pec_steps``, the manager) read a
host's versions back: from its store, by its layout, through its transport,
with its PEC record. ``TierReader`` names everything they use of the
checkpointer, and nothing else; ``InMemoryCheckpointer`` is one.

Design choice: a structural protocol the readers are typed against, so the
read side depends on a short, named list instead of the checkpointer's
class (whose writers, saves and status round it never touches), and
recovery imports nothing of the checkpointer. Alternative not taken: a
separate read-only object built by the checkpointer, one more thing to keep
in step with the store and the PEC record it would merely forward.
"""

from __future__ import annotations

from typing import Any, Protocol

from jax.sharding import Mesh

from capricorn_jax._src.memory.store.store import HostStore
from capricorn_jax._src.memory.tier.hooks import FaultHooks
from capricorn_jax._src.memory.tier.options import InMemoryOptions
from capricorn_jax._src.memory.tier.pec_tier import PecTier
from capricorn_jax._src.memory.wire.packing import PackPlan
from capricorn_jax._src.memory.wire.transport import Transport
from capricorn_jax._src.partial.tracker import PltTracker


class TierReader(Protocol):
    """What recovery and the persistent tier read of a host's memory tier.

    Attributes:
      host, hosts: this process's index and the process count.
      options: the tier's options (``write_threads`` for parallel reads).
      abstract_state, state_shardings, mesh: the train state's shapes,
        shardings and mesh (a restored version is assembled into them).
      plan: the layout of whole versions; transport: their program (a peer
        serves a version through it).
      store: this host's store.
      pec: the PEC record (None: versions are whole).
      hooks: fault injection (``hooks.FaultHooks``; a serve round's point).
    """

    host: int
    hosts: int
    options: InMemoryOptions
    abstract_state: Any
    state_shardings: Any
    mesh: Mesh
    plan: PackPlan
    transport: Transport
    store: HostStore
    pec: PecTier | None
    hooks: FaultHooks

    def drop_newer_than(self, step: int) -> None:
        """Removes every stored version newer than ``step`` (a recovery to it)."""
        ...

    def resume_pec(self, tracker: PltTracker, k: int | None = None,
                   cumulative: Any = None) -> None:
        """PEC: continues the record from ``tracker`` (a restore's)."""
        ...

    def missing_for_read(self, step: int) -> list[int]:
        """Older versions a read of own version ``step`` needs that will never be held."""
        ...

    def took(self, step: int) -> bool:
        """Whether this host took its own version ``step`` (held, or queued for its writer)."""
        ...

    def wait_until_finished(self, timeout_s: float | None = None) -> None:
        """Blocks until the writers are idle (bounded by ``timeout_s``)."""
        ...
