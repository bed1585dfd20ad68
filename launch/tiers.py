"""The in-memory tier as the launchers build it, shared by train and bench.

``memory_options`` turns the commands' checkpoint flags into
``InMemoryOptions`` (the one place for the rules: ``--ckpt_budget``'s -1 for
none, ``--traffic_class`` to the chunk channel's IP TOS byte and send policy);
``memory_tier`` builds a host's ``InMemoryCheckpointer`` from those options
and the trainer (the one builder of both commands); ``host_tiers`` reads each
host's tier off a restore.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from capricorn_jax import RestoreInfo



def memory_options(*, store_root: str, job: str, replicas: int, chunk_bytes: int,
                   replication_timeout_s: float, budget_s: float, pec: Any,
                   traffic_class: str, channel_secret_file: str | None = None,
                   time_scale: float = 1.0) -> Any:
    """``InMemoryOptions`` from a command's checkpoint flags.

    Args:
      budget_s: ``--ckpt_budget``: -1 for none (a version waits for the
        previous one), else the cost budget ``max_wait_s``.
      pec: the ``PecOptions`` of a PEC strategy, else None.
      traffic_class: ``--traffic_class``: "priority" sends the chunk channel
        in the low-priority class (``LOW_PRIORITY_TOS``) and every part of a
        version at its step's start (``chunk_send="at_once"``: the class lets
        the collectives pass); "fifo" the default class, held to the windows.
      time_scale: launch.bench's ``--time_scale`` (the step and the links
        that many times slower): the tier's wall-clock bounds that follow the
        step or the link, multiplied by it: the replication timeout (and so
        the chunk channel's, 4x it), the writer timeout and the cost budget.
    """
    import capricorn_jax

    priority = traffic_class == "priority"
    return capricorn_jax.InMemoryOptions(
        store_root=store_root, job=job, replicas=replicas, chunk_bytes=chunk_bytes,
        replication_timeout_s=replication_timeout_s * time_scale,
        writer_timeout_s=capricorn_jax.InMemoryOptions.writer_timeout_s * time_scale,
        max_wait_s=None if budget_s < 0 else budget_s * time_scale, pec=pec,
        chunk_tos=capricorn_jax.LOW_PRIORITY_TOS if priority else 0,
        chunk_send="at_once" if priority else "windows",
        channel_secret_file=channel_secret_file)


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
