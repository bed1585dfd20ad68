"""Both tiers in one object: the constructor of Orbax's emergency manager.

``TwoTierCheckpointManager(local_directory, persistent_directory, global_mesh,
abstract_state, options)`` builds what the three-object form builds by hand
(``InMemoryCheckpointer`` over the RAM-disk root, its ``CapricornHandler``,
and ``CheckpointManager`` over the persistent directory), takes this host's
index and the host count from JAX, and the shardings from the abstract
state's leaves (as Orbax's emergency ``CheckpointManager`` does). ``save``,
``restore`` and ``close`` are the whole surface a training loop needs;
``memory`` and ``manager`` are the two tiers for anything else (the
three-object form stays for those who need it: another item name, handler
options, several items).

Alternative not taken: a subclass of ``CheckpointManager`` with this
constructor, which would keep Orbax's ``save(step, args=Composite(...))`` as
the way to save: the point of one object is one call per step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Sharding

from capricorn_jax._src.memory.tier.checkpointer import InMemoryCheckpointer
from capricorn_jax._src.memory.tier.options import InMemoryOptions, PecOptions
from capricorn_jax._src.memory.tier.restore_info import RestoreInfo
from capricorn_jax._src.persistent.barriers import DEFAULT_S as DEFAULT_BARRIER_S
from capricorn_jax._src.persistent.handler import CapricornHandler, CapricornRestore, CapricornSave
from capricorn_jax._src.persistent.manager import CheckpointManager

ITEM = "state"
"""The Orbax item the state is saved under (what a plain Orbax program restores)."""


@dataclasses.dataclass(frozen=True)
class TwoTierOptions:
    """The two tiers' options.

    Attributes:
      replicas: copies of each host's shards in host RAM (its own and
        ``replicas - 1`` peers'); 2 survives a machine's loss.
      save_interval_steps: a standard Orbax step every this many steps.
      max_to_keep: persistent steps kept.
      job: the memory tier's job name (default: from the persistent
        directory's real path, so a restart finds its versions).
      chunk_bytes: the memory tier's chunk (``InMemoryOptions.chunk_bytes``).
      pec: partial expert checkpointing (``PecOptions``), or None.
      barrier_timeout_s: the bound of Orbax's synchronous barriers when
        several processes run (``CheckpointManager``'s): a host that never
        arrives fails the save after that long instead of holding the others.
    """

    replicas: int = 2
    save_interval_steps: int = 10
    max_to_keep: int = 2
    job: str | None = None
    chunk_bytes: int = 4 << 20
    pec: PecOptions | None = None
    barrier_timeout_s: float = DEFAULT_BARRIER_S

    def __post_init__(self) -> None:
        if self.save_interval_steps < 1 or self.max_to_keep < 1:
            raise ValueError(f"save_interval_steps ({self.save_interval_steps}) and "
                             f"max_to_keep ({self.max_to_keep}) must be >= 1")


class TwoTierCheckpointManager:
    """Every step in host RAM (here and on peers), a standard Orbax step on
    disk every ``save_interval_steps`` (module docstring).

    Args:
      local_directory: the RAM disk root of the memory tier (a tmpfs, e.g.
        ``/dev/shm/...``).
      persistent_directory: the persistent tier's Orbax directory.
      global_mesh: the training mesh.
      abstract_state: the state's pytree of ``jax.ShapeDtypeStruct`` leaves,
        each with its ``sharding``.
      options: ``TwoTierOptions``.

    Raises:
      ValueError: a leaf without a sharding, named by its path.
    """

    def __init__(self, local_directory: str | os.PathLike, persistent_directory: str | os.PathLike,
                 global_mesh: Any, abstract_state: Any,
                 options: TwoTierOptions = TwoTierOptions()) -> None:
        def sharding_of(path: Any, leaf: Any) -> Sharding:
            sharding = getattr(leaf, "sharding", None)
            if not isinstance(sharding, Sharding):
                raise ValueError(f"abstract_state leaf {jax.tree_util.keystr(path)} has no "
                                 f"sharding: give each leaf jax.ShapeDtypeStruct(..., "
                                 f"sharding=...)")
            return sharding

        shardings = jax.tree_util.tree_map_with_path(sharding_of, abstract_state)
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract_state)
        persistent = os.path.abspath(persistent_directory)
        job = options.job or "job-" + hashlib.sha1(
            os.path.realpath(persistent).encode()).hexdigest()[:12]
        self.memory = InMemoryCheckpointer(
            InMemoryOptions(store_root=os.path.abspath(local_directory), job=job,
                            replicas=options.replicas, chunk_bytes=options.chunk_bytes,
                            pec=options.pec),
            global_mesh, abstract, shardings, host=jax.process_index(),
            hosts=jax.process_count())
        self.handler = CapricornHandler(self.memory)
        self.manager = CheckpointManager(
            persistent, options=ocp.CheckpointManagerOptions(
                save_interval_steps=options.save_interval_steps,
                max_to_keep=options.max_to_keep),
            handler_registry=self.handler.registry(ITEM),
            barrier_timeout_s=options.barrier_timeout_s)
        self._target = abstract_state

    def save(self, step: int, state: Any, host_state: dict[str, Any] | None = None) -> bool:
        """Saves ``step`` in memory, and on disk when it is due; whether it
        started a persistent step. Every host calls it for every step."""
        return self.manager.save(step, args=ocp.args.Composite(
            **{ITEM: CapricornSave(state, host_state=host_state)}))

    def restore(self, step: int | None = None) -> tuple[Any, RestoreInfo]:
        """(state, its RestoreInfo: step, tier, host state) of the newest step
        of either tier, or of ``step``.

        Raises:
          NoCheckpoint: no tier holds a version (a fresh start).
        """
        restored = self.manager.restore(step, args=ocp.args.Composite(
            **{ITEM: CapricornRestore(self._target)}))
        info = self.manager.last_restore
        assert info is not None, "CheckpointManager.restore records last_restore"
        return restored[ITEM], info

    @property
    def persistent_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    @property
    def persistent_errors(self) -> list[dict[str, Any]]:
        return self.manager.persistent_errors

    def wait_until_finished(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
