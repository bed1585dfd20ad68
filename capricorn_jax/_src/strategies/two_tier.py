"""Both tiers in one object, with the surface of Orbax's emergency manager.

``TwoTierCheckpointManager(local_directory, persistent_directory, global_mesh,
abstract_state, options)`` builds what the three-object form builds by hand
(``InMemoryCheckpointer`` over the RAM-disk root, its ``CapricornHandler``,
and ``CheckpointManager`` over the persistent directory), takes this host's
index and the host count from JAX, and the shardings from the abstract
state's leaves, as Orbax's emergency ``CheckpointManager`` does. Its methods
are that manager's (``docs/guide.md`` has the table, method by method):
``save(step, args=Composite(state=PyTreeSave(state)), force=)``,
``restore(step, args=)`` returning ``Composite(state=...)``, ``latest_step``,
``all_steps``, ``should_save``, ``reached_preemption``,
``wait_until_finished``, ``close`` and ``with``; plus the plain form
``save(step, state, host_state)`` and ``last_restore`` (the step, the tier
and the host state of the newest restore). A training loop written for
Orbax's manager switches with one import (``capricorn_jax.emergency``) and
one options line (``TwoTierOptions``, which takes Orbax's option names).

A host's JSON state (the data iterator's position...) travels beside the
arrays in both tiers: ``Composite(state=..., host_state=JsonSave(d))`` or
``save(step, state, host_state=d)``; ``restore`` returns it under
``host_state`` when asked (``JsonRestore()``) and always in ``last_restore``.

The scheduled strategies from the same object: with
``TwoTierOptions(schedule="gemini" | "capricorn")`` the loop runs its steps
through ``step = manager.train_step(loss_fn, ...)`` (``state, metrics =
step(state, batch)``), which builds the ``TrainStep`` from the loss and the
strategy by name over this manager's memory tier; ``save`` then hands each
version to the strategy, which moves its chunks inside the next step
(``strategies.scheduled_steps``). Restore and the persistent tier are the
same. On the threaded path (CPU) the chunk channel's ends prove the job's
secret: the environment's, ``TwoTierOptions.channel_secret_file``, else
``persistent_directory/.capricorn.secret`` (every host reads the persistent
directory). It lives on the strategies' floor because it builds a strategy.

Alternative not taken: a subclass of ``CheckpointManager`` with this
constructor: its ``save`` takes ``CapricornSave`` items, which a loop written
for Orbax's emergency manager does not build.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

from capricorn_jax._src.memory.tier.checkpointer import InMemoryCheckpointer
from capricorn_jax._src.memory.tier.options import InMemoryOptions
from capricorn_jax._src.memory.tier.restore_info import RestoreInfo
from capricorn_jax._src.memory.tier.sizing import memory_needs, preflight
from capricorn_jax._src.memory.tier.store_identity import agree_store_host
from capricorn_jax._src.multihost.secret import SECRET_NAME
from capricorn_jax._src.persistent.emergency_options import TwoTierOptions
from capricorn_jax._src.persistent.handler import CapricornHandler, CapricornRestore, CapricornSave
from capricorn_jax._src.persistent.manager import CheckpointManager
from capricorn_jax._src.persistent.preemption import Preemption
from capricorn_jax._src.profiling.loss_step import TPE, LossFn, make_train_step, shardings_of
from capricorn_jax._src.strategies.base import Strategy
from capricorn_jax._src.strategies.scheduled_steps import (
    ManagedStep,
    Scheduled,
    profiling_options,
)

log = logging.getLogger("capricorn_jax")

ITEM = "state"
"""The Orbax item the state is saved under (what a plain Orbax program restores)."""
HOST_STATE = "host_state"
"""The item name of a host's JSON state in ``save``'s and ``restore``'s args."""

_STATE_SAVES = (ocp.args.PyTreeSave, ocp.args.StandardSave)
_STATE_RESTORES = (ocp.args.PyTreeRestore, ocp.args.StandardRestore)


class TwoTierCheckpointManager:
    """Every step in host RAM (here and on peers), a standard Orbax step on
    disk when the persistent options say so (module docstring).

    Args:
      local_directory: the RAM disk root of the memory tier (a tmpfs, e.g.
        ``/dev/shm/...``).
      persistent_directory: the persistent tier's Orbax directory.
      global_mesh: the training mesh.
      abstract_state: the state's pytree of ``jax.ShapeDtypeStruct`` leaves,
        each with its ``sharding``.
      options: ``TwoTierOptions`` (Orbax's emergency option names and ours).

    Raises:
      ValueError: a leaf without a sharding, named by its path;
        ``OptionRefused`` (a ValueError) for an option with no meaning here;
        ``schedule`` on fewer than 2 hosts.
      HostMemoryTooSmall: the RAM disk holding ``local_directory`` or the
        host's memory is smaller than the memory tier needs
        (``memory_needs``, ``sizing``), every number named.
    """

    def __init__(self, local_directory: str | os.PathLike, persistent_directory: str | os.PathLike,
                 global_mesh: Any, abstract_state: Any,
                 options: TwoTierOptions | None = None) -> None:
        options = TwoTierOptions() if options is None else options
        if not isinstance(options, TwoTierOptions):
            raise TypeError(f"options must be capricorn_jax.TwoTierOptions (it takes the field "
                            f"names of Orbax's emergency CheckpointManagerOptions), got "
                            f"{type(options).__module__}.{type(options).__name__}")

        shardings = shardings_of(abstract_state, "abstract_state")
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract_state)
        persistent = os.path.abspath(persistent_directory)
        job = options.job or "job-" + hashlib.sha1(
            os.path.realpath(persistent).encode()).hexdigest()[:12]
        hosts = jax.process_count()
        replicas = min(options.replicas, hosts)
        if replicas < options.replicas:
            log.warning("TwoTierOptions.replicas=%d capped at the %d host(s) of this job: %s",
                        options.replicas, hosts,
                        "no peer copy (one host)" if replicas == 1 else f"{replicas} copies")
        secret = None
        if options.schedule is not None:
            if replicas != 2:
                raise ValueError(f"TwoTierOptions(schedule={options.schedule!r}) moves each "
                                 f"version to a peer host inside the next step: it needs 2 "
                                 f"hosts or more, this job has {hosts}")
            profiling_options(options)  # refused now, not at the first step
            secret = options.channel_secret_file or (
                None if "://" in str(persistent_directory)
                else os.path.join(persistent, SECRET_NAME))
        self.options = options
        memory = InMemoryOptions(store_root=os.path.abspath(local_directory), job=job,
                                 replicas=replicas, chunk_bytes=options.chunk_bytes,
                                 pec=options.pec, channel_secret_file=secret)
        # Before the first step: a RAM disk or a host too small is refused with the numbers.
        self.memory_needs = memory_needs(abstract, shardings, replicas, memory.window)
        preflight(self.memory_needs, memory.store_root, os.path.join(memory.store_root, job),
                  memory.max_store_fraction)
        # This machine's store, whatever process index wrote it (store_identity).
        store_host = agree_store_host(os.path.join(memory.store_root, job),
                                      jax.process_index(), hosts)
        self.memory = InMemoryCheckpointer(memory, global_mesh, abstract, shardings,
                                           host=jax.process_index(), hosts=hosts,
                                           store_host=store_host)
        self.handler = CapricornHandler(self.memory, fsync=options.fsync)
        extra = {"cleanup_tmp_directories": options.cleanup_tmp_directories}
        if options.async_options is not None:
            extra["async_options"] = options.async_options
        self.manager = CheckpointManager(
            persistent, options=options.persistent.orbax(**extra),
            handler_registry=self.handler.registry(ITEM),
            barrier_timeout_s=options.barrier_bound_s)
        self._target = abstract_state
        self._mesh = global_mesh
        self._preemption = Preemption()
        self._step: ManagedStep | None = None  # train_step's, once made
        self._version: int | None = None  # the newest step saved or restored

    # ----- the loop's step -----
    def train_step(self, loss_fn: LossFn, *, batch_sharding: NamedSharding | None = None,
                   optimizer: Any = None,
                   apply_gradients: Callable[[Any, Any], Any] | None = None,
                   tokens_per_expert: str | Callable[[Any], Any] | None = TPE,
                   moe_layers: Sequence[int] | None = None,
                   boundaries: Sequence[str] | None = None) -> ManagedStep:
        """The loop's step, ``state, metrics = step(state, batch)``, made from
        the loss; with ``TwoTierOptions.schedule`` it runs the scheduled
        strategy's steps (each moves the last saved version inside itself).

        It takes the loss, not a jitted step: on the in-graph path (GPU) the
        chunks received in the backward pass are the cotangents of the
        step's carrier inputs, so the library takes the ``jax.grad`` itself
        (``profiling.loss_step``). Its first call traces the loss once (the
        ``layer_boundary`` names; the batch is its example), and with a
        schedule builds the strategy: every host calls it at the same step.

        Args:
          loss_fn: ``loss_fn(params, state, batch) -> (loss, aux)``, ``aux``
            a dict of metrics (the step's metrics are ``aux`` and ``loss``).
          batch_sharding, optimizer, apply_gradients, tokens_per_expert,
            moe_layers, boundaries: as ``capricorn_jax.make_train_step``
            (the state's shardings and the mesh are this manager's).

        Returns:
          The step; its ``train`` is the ``TrainStep`` once built, and
          ``manager.strategy`` / ``manager.events`` the strategy and its events.
        """
        if self._step is not None and self.options.schedule is not None:
            raise RuntimeError("train_step: this manager's scheduled strategy runs one step "
                               "function; call it once")
        kwargs = {"batch_sharding": batch_sharding, "optimizer": optimizer,
                  "apply_gradients": apply_gradients, "tokens_per_expert": tokens_per_expert,
                  "moe_layers": moe_layers, "boundaries": boundaries}

        def build(batch: Any) -> tuple[Any, Scheduled | None]:
            train = make_train_step(loss_fn, self._target, batch, mesh=self._mesh, **kwargs)
            if self.options.schedule is None:
                return train, None
            return train, Scheduled(self.options, self.memory, train, self._version)

        self._step = ManagedStep(build)
        return self._step

    @property
    def _scheduled(self) -> Scheduled | None:
        return None if self._step is None else self._step.scheduled

    @property
    def strategy(self) -> Strategy | None:
        """The scheduled strategy (its ``schedule_summary()``...), once the
        first step built it; None without ``schedule``."""
        return None if self._scheduled is None else self._scheduled.strategy

    @property
    def events(self) -> list[dict[str, Any]]:
        """The scheduled strategy's ``checkpoint`` events (``moved_in_step``
        on a version moved inside a step) and the profiling driver's events,
        in order; empty without ``schedule``."""
        return [] if self._scheduled is None else self._scheduled.events

    # ----- Orbax's emergency surface -----
    @property
    def directory(self) -> Any:
        """The persistent directory (Orbax's ``directory``)."""
        return self.manager.directory

    @property
    def global_mesh(self) -> Any:
        return self._mesh

    def should_save(self, step: int) -> bool:
        """Whether ``save(step)`` saves: the memory tier's interval or a due
        persistent step."""
        return step % self.options.local.save_interval_steps == 0 or self.manager.should_save(step)

    def save(self, step: int, state: Any = None, host_state: dict[str, Any] | None = None, *,
             args: Any = None, force: bool = False,
             custom_metadata: dict[str, Any] | None = None) -> bool:
        """Saves ``step`` in memory (here and on peers) when due, and on disk
        when the persistent options (or ``force``) say so. Every host calls
        it for every step, in the same order.

        Args:
          step: the step.
          state, host_state: the plain form (the train state; this host's JSON
            state, at most 8 KiB).
          args: Orbax's form instead: ``ocp.args.Composite(state=PyTreeSave(s) |
            StandardSave(s)[, host_state=JsonSave(d)])``.
          force: save both tiers now, whatever the intervals.
          custom_metadata: the persistent step's, as Orbax's (not with
            ``schedule``).

        With ``schedule`` (once ``train_step``'s first call built the
        strategy) the version goes to the strategy: the next step moves it
        (it is committed, and written to disk when due, at the next
        ``save``), or, at a profiled next step or with ``force``, it is
        saved now. The loop calls it after every step.

        Returns:
          Whether this step was saved (in memory at least, or deferred to the
          next step), as Orbax's emergency ``save``; ``persistent_steps`` and
          ``persistent_errors`` tell the disk.
        """
        state, host_state = _save_args(state, host_state, args)
        if not force and not self.should_save(step):
            return False
        self._version = step
        scheduled = self._scheduled
        if scheduled is None:
            self.manager.save(step, args=ocp.args.Composite(
                **{ITEM: CapricornSave(state, host_state=host_state)}), force=force,
                custom_metadata=custom_metadata)
        else:
            if custom_metadata is not None:
                raise ValueError("save(custom_metadata=) is not taken with TwoTierOptions("
                                 "schedule=...): a version reaches the disk a step later")
            self.handler.await_reader()  # no prune under the disk writer's read
            self._persist(scheduled.save(step, state, host_state, force), state,
                          step if force else None)
        if not self.options.enable_async_checkpointing:
            self.manager.wait_until_finished()
        return True

    def _persist(self, events: list[dict[str, Any]], state: Any, forced: int | None) -> None:
        """Each version the scheduled strategy committed goes on to the disk
        tier, which writes it from the host store when due (or ``forced``)."""
        for event in events:
            version = event["version"]
            self.manager.persist(version, ocp.args.Composite(**{ITEM: CapricornSave(state)}),
                                 force=version == forced)

    def _flush(self) -> None:
        """The version the scheduled strategy deferred, saved now (no step
        follows to move it); every host calls it at the same point."""
        scheduled = self._scheduled
        if scheduled is not None:
            pending = scheduled.flush()
            if pending:
                self.handler.await_reader()
                self._persist(pending, self._target, None)

    def restore(self, step: int | None = None, args: Any = None) -> Any:
        """The newest step of either tier, or ``step`` (collective).

        Args:
          step: a persistent step or the memory tier's newest; None: the newest.
          args: None, or ``ocp.args.Composite(state=PyTreeRestore(item=target) |
            StandardRestore(target)[, host_state=JsonRestore()])``; the target
            defaults to the constructor's ``abstract_state``.

        Returns:
          ``ocp.args.Composite(state=...)`` (and ``host_state=`` when asked);
          ``last_restore`` has the step, the tier and the host state.

        Raises:
          NoCheckpoint: no tier holds a version (a ``FileNotFoundError``, as Orbax's).
        """
        target, want_host_state = _restore_args(args, self._target)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            **{ITEM: CapricornRestore(target)}))
        items = {ITEM: restored[ITEM]}
        if self.last_restore is not None:
            self._version = self.last_restore.step
            if self._scheduled is not None:
                self._scheduled.restored(self.last_restore.step)
        if want_host_state:
            items[HOST_STATE] = self.last_restore.host_state if self.last_restore else {}
        return ocp.args.Composite(**items)

    def restore_state(self, step: int | None = None) -> tuple[Any, RestoreInfo]:
        """0.18's ``restore``: (state, its RestoreInfo). Kept for one release."""
        state = self.restore(step).state
        assert self.last_restore is not None, "restore records last_restore"
        return state, self.last_restore

    def latest_step(self) -> int | None:
        """The newest step of either tier (collective: the memory tier's
        newest restorable version is agreed by every host)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self, read: bool | None = None) -> list[int]:
        """The persistent steps and the memory tier's restorable version (collective)."""
        del read  # Orbax's: both tiers are read every time here
        memory = self.handler.memory_step()
        return sorted(set(self.manager.all_steps()) | ({memory} if memory is not None else set()))

    def reached_preemption(self, step: int) -> bool:
        """Whether to save ``step`` to both tiers and stop: JAX's preemption
        sync point, agreed by every process (Orbax's), or SIGTERM to a single
        process (``preemption``). Every process calls it at every step."""
        return self._preemption.reached(step, self.manager.reached_preemption)

    def wait_until_finished(self) -> None:
        """Waits for the persistent save in flight; with ``schedule``, first
        saves the version the strategy left for a next step (collective)."""
        self._flush()
        self.manager.wait_until_finished()

    def close(self) -> None:
        self._flush()
        self._preemption.close()
        self.manager.close()
        if self.strategy is not None:
            self.strategy.close()

    def __enter__(self) -> TwoTierCheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- ours -----
    @property
    def last_restore(self) -> RestoreInfo | None:
        """The step, tier and host state of the newest ``restore``."""
        return self.manager.last_restore

    @property
    def persistent_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    @property
    def persistent_errors(self) -> list[dict[str, Any]]:
        return self.manager.persistent_errors


def _save_args(state: Any, host_state: dict[str, Any] | None, args: Any
               ) -> tuple[Any, dict[str, Any] | None]:
    """(state, host state) of ``save``'s plain or Orbax form."""
    if args is None:
        if state is None:
            raise TypeError("save(step, state, host_state) or save(step, args=ocp.args.Composite("
                            "state=ocp.args.PyTreeSave(state)))")
        return state, host_state
    if state is not None or host_state is not None:
        raise TypeError("save takes the state either plainly or in args, not both")
    if isinstance(args, (*_STATE_SAVES, CapricornSave)):
        args = ocp.args.Composite(**{ITEM: args})
    if not isinstance(args, ocp.args.Composite):
        raise TypeError(f"save args: ocp.args.Composite(state=ocp.args.PyTreeSave(state)), got "
                        f"{type(args).__name__}")
    unknown = sorted(set(args.keys()) - {ITEM, HOST_STATE})
    if unknown or ITEM not in args.keys():
        raise ValueError(f"save args hold items {sorted(args.keys())}: this manager saves "
                         f"{ITEM!r} (the train state) and optionally {HOST_STATE!r} "
                         f"(ocp.args.JsonSave of this host's JSON state)")
    item = args[ITEM]
    if isinstance(item, CapricornSave):
        state, host_state = item.state, item.host_state
    elif isinstance(item, _STATE_SAVES):
        state = item.item
    else:
        raise TypeError(f"save args: {ITEM!r} takes ocp.args.PyTreeSave or StandardSave, got "
                        f"{type(item).__name__}")
    if HOST_STATE in args.keys():
        json_item = args[HOST_STATE]
        if not isinstance(json_item, ocp.args.JsonSave):
            raise TypeError(f"save args: {HOST_STATE!r} takes ocp.args.JsonSave, got "
                            f"{type(json_item).__name__}")
        host_state = json_item.item
    return state, host_state


def _restore_args(args: Any, default: Any) -> tuple[Any, bool]:
    """(restore target, whether the host state was asked for) of ``restore``'s args."""
    if args is None:
        return default, False
    if isinstance(args, (*_STATE_RESTORES, CapricornRestore)):
        args = ocp.args.Composite(**{ITEM: args})
    if not isinstance(args, ocp.args.Composite):
        raise TypeError(f"restore args: ocp.args.Composite(state=ocp.args.PyTreeRestore(...)), "
                        f"got {type(args).__name__}")
    unknown = sorted(set(args.keys()) - {ITEM, HOST_STATE})
    if unknown:
        raise ValueError(f"restore args hold items {unknown} that this manager does not save "
                         f"(it saves {ITEM!r} and {HOST_STATE!r})")
    target = default
    if ITEM in args.keys():
        item = args[ITEM]
        if isinstance(item, CapricornRestore):
            given = item.abstract_state
        elif isinstance(item, ocp.args.PyTreeRestore):
            given = item.item
        elif isinstance(item, ocp.args.StandardRestore):
            given = item.item
        else:
            raise TypeError(f"restore args: {ITEM!r} takes ocp.args.PyTreeRestore or "
                            f"StandardRestore, got {type(item).__name__}")
        target = default if given is None else given
    if HOST_STATE in args.keys() and not isinstance(args[HOST_STATE], ocp.args.JsonRestore):
        raise TypeError(f"restore args: {HOST_STATE!r} takes ocp.args.JsonRestore, got "
                        f"{type(args[HOST_STATE]).__name__}")
    return target, HOST_STATE in args.keys()
