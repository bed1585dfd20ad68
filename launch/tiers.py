"""The in-memory tier as the launchers build it, shared by train and bench.

``memory_tier`` builds a host's ``InMemoryCheckpointer`` from its options and
the trainer (the one builder of both commands); ``chunk_tos`` maps
``--traffic_class`` to the chunk channel's IP TOS byte; ``host_tiers`` reads
each host's tier off a restore.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from capricorn_jax import RestoreInfo


LOW_PRIORITY_TOS = 0x08
"""IP TOS "maximize throughput": Linux's pfifo_fast puts it in its last band,
behind the default class the collectives send in."""


def chunk_tos(traffic_class: str) -> int:
    """The chunk channel's IP TOS byte (``InMemoryOptions.chunk_tos``) for
    ``--traffic_class``."""
    return LOW_PRIORITY_TOS if traffic_class == "priority" else 0


def memory_tier(options: Any, trainer: Any, mesh: Any, host: int, hosts: int,
                hooks: Any = None) -> Any:
    """The one builder of a launcher's ``InMemoryCheckpointer`` (train's and
    the bench's): ``options`` over ``trainer``'s state, model and batch."""
    import capricorn_jax

    cfg = trainer.cfg
    return capricorn_jax.InMemoryCheckpointer(
        options, mesh, trainer.abstract_state, trainer.state_shardings, host, hosts,
        model=cfg, tokens_per_step=cfg.global_batch * cfg.seq_len, hooks=hooks)


def host_tiers(info: RestoreInfo) -> list[str]:
    """Each host's tier of a restore: the memory tier's "local"/"peer", else "persistent"."""
    import jax

    return info.memory_tiers or ["persistent"] * jax.process_count()
