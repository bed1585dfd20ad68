"""The two-tier checkpoint manager: host RAM every step, disk every K steps.

``CheckpointManager`` is a thin subclass of ``ocp.CheckpointManager`` that
drives both tiers of a ``handler.CapricornHandler``:

* **memory tier, every step.** ``CheckpointManager.save(step, args=Composite(
  state=CapricornSave(state, host_state)))`` first runs
  ``handler.save_to_memory`` (pack, replicate to peers, background writers).
  All hosts call ``save`` for every step, in the same order, from the
  training thread (the memory tier runs collectives).
* **persistent tier, when Orbax's policy says so.** Only when the manager's
  own decision (``should_save``: ``save_interval_steps``, ``save_on_steps``,
  ``save_decision_policy``) or ``force`` asks for it does ``save`` call
  ``ocp.CheckpointManager.save``, which runs the handler's ``async_save``
  (written in the background from the memory tier's host-RAM copy). ``save``
  returns True when a persistent step was started, False when only the
  memory tier saved (or the persistent save could not start; see below).

Restore (``CheckpointManager.restore(step=None, args=Composite(
state=CapricornRestore(abstract_state)))``, collective) takes the newest step
across tiers: the memory tier (``recover``: a version every host's shards can
be read at) when it is at least the newest committed persistent step, else
the persistent step, read by the handler's inner standard handler into the
shardings of ``abstract_state`` (any device count), or under PEC assembled
from several persisted steps (``pec_steps``). ``manager.last_restore`` tells
the step, the tier and the host state.

Atomicity is Orbax's: a step is written in a temporary directory that is
renamed (plus a commit marker) only after every host's commit futures
finished, so a step killed while being written is never listed by
``latest_step``/``all_steps`` (``cleanup_tmp_directories`` removes it at the
next start). Failures of the persistent tier never stop training: before each
persistent save every host probes that it can create a directory in the root
and that its store holds the in-memory versions the step is read from, and
the answers are all-gathered (so all hosts skip, or none); a step some host
cannot write is then recorded without starting Orbax, whose barriers would
otherwise leave the other hosts waiting for their timeout. A failure
inside the background write is collected at the next ``save`` (or
``wait_until_finished``/``close``), and the primary host removes the
uncommitted directory. Either way the failure is logged to the
``capricorn_jax`` logger and appended to ``manager.persistent_errors``.

A step is whole on every host or dropped by every host, within one bound:
the hosts agree after writing as well as before. Each host's commit future
is the handler's write (bounded by ``CapricornHandler.write_timeout_s``)
followed by an exchange of every host's outcome through the
``jax.distributed`` key-value store (bounded by the same): when one host's
write failed after the pre-check (an I/O error, its version skipped, the
read timed out) or did not finish (a hang), every host's commit future fails
naming it, so no host reaches Orbax's ``async_write_complete`` barrier, the
primary host does not commit the step, each host records the failure, and
the next persistent step goes on. Orbax's barrier timeout
(``AsyncOptions.timeout_secs``) is set from the handler's
``commit_timeout_s`` unless the caller gave ``async_options`` (Orbax's own
default is 1200 s in orbax-checkpoint 0.12.8): it bounds the rest. Alternative
not taken: Orbax's barrier alone: a host that failed never arrives, and the
others learn it only at the barrier's timeout, with an error that names no
host.

Design decision: a ``CheckpointManager`` subclass that runs the memory tier on
every ``save`` call and defers to Orbax's own policy for the disk tier.
Alternative not taken: a bare handler under a plain ``ocp.CheckpointManager``.
With ``save_interval_steps=K`` a plain manager never calls the handler on the
other K-1 steps, so the memory tier would only run every K steps; with
``save_interval_steps=1`` it would create (and finalize, with barriers and a
rename) a disk step directory every step. ``CapricornHandler.async_save``
called without a preceding in-memory save of the same state (which is what a
plain manager does) raises an error that names this fix.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import tempfile
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from capricorn_jax._src.memory.store.store import ChecksumError
from capricorn_jax._src.memory.store.store_admin import record_persistent
from capricorn_jax._src.memory.tier.checkpointer import SaveReport
from capricorn_jax._src.memory.tier.pec_tier import PecTier
from capricorn_jax._src.memory.tier.recovery import recover
from capricorn_jax._src.memory.tier.restore_info import NoCheckpoint, PecRestore, RestoreInfo
from capricorn_jax._src.multihost.agree import allgather_json, broadcast_json
from capricorn_jax._src.persistent import barriers, finalize
from capricorn_jax._src.persistent.commit_order import CommittedFirst
from capricorn_jax._src.persistent.handler import CapricornHandler, CapricornRestore, CapricornSave
from capricorn_jax._src.persistent.integrity import PersistentChecksumError
from capricorn_jax._src.persistent.memory_read import check_tree
from capricorn_jax._src.persistent.pec_steps import (
    PEC_METADATA,
    PecSteps,
    restore_step,
    resume_memory_tier,
)

log = logging.getLogger("capricorn_jax")


class CheckpointManager(ocp.CheckpointManager):
    """``ocp.CheckpointManager`` with the memory tier on every ``save`` (module docstring).

    Takes ``ocp.CheckpointManager``'s arguments; ``handler_registry`` must map one
    item to a ``CapricornHandler`` (``handler.registry("state")`` builds one).
    ``barrier_timeout_s`` bounds Orbax's synchronous barriers when several
    processes run (``barriers``: a host that never arrives fails the save, or
    this constructor, after that long instead of holding the others for ever).

    Attributes:
      handler: the CapricornHandler; item: its item name.
      last_memory_report: the SaveReport of the newest in-memory save.
      persistent_errors: one dict per failed persistent save ({"step", "error"}),
        in the order they were noticed (metrics can report ``len()``).
      last_restore: RestoreInfo of the newest restore() of the capricorn item.
    """

    def __init__(self, directory: Any, *args: Any, handler_registry: Any = None,
                 barrier_timeout_s: float = barriers.DEFAULT_S, **kwargs: Any) -> None:
        self.item, self.handler = _find_handler(handler_registry)
        if jax.process_count() > 1:
            barriers.bound(barrier_timeout_s)  # before Orbax's first barrier (its root)
        if len(args) < 2:  # options not given by position
            kwargs["options"] = _recorded_finalize(
                _bounded_options(kwargs.get("options"), self.handler), directory,
                self.handler.fsync)
        self.persistent_errors: list[dict[str, Any]] = []
        self.last_memory_report: SaveReport | None = None
        self.last_restore: RestoreInfo | None = None
        self._failed_cleanup = False
        self._persist_step: int | None = None
        self._pec = PecSteps(lambda step: self.metadata(step).custom_metadata)
        self.last_persist: dict[str, Any] | None = None
        super().__init__(directory, *args, handler_registry=handler_registry, **kwargs)
        # Old steps go only once the save that replaces them committed (commit_order).
        orbax_deleter: Any = self.__dict__["_checkpoint_deleter"]
        self._deleter = CommittedFirst(
            orbax_deleter, lambda s: self._get_save_directory(s, self.directory))
        self._checkpoint_deleter: Any = self._deleter
        if self.handler.checkpointer is not None:  # `stores prune` reads it (restart_risk)
            try:
                record_persistent(self.handler.checkpointer.store.root.parent, self.directory)
            except OSError as e:
                log.warning("could not record the persistent directory beside the RAM "
                            "stores: %s", e)
        tier = self._pec_tier()
        if tier is not None:
            # Retention under PEC: Orbax's own policy (max_to_keep, ...), and
            # every step that holds some expert's newest persisted copy.
            # Orbax ships no type information (no py.typed): its policy types are Any here.
            self._preservation_policy: Any = ocp.checkpoint_managers.AnyPreservationPolicy(
                [self._preservation_policy, self._pec.keep_policy(tier.shape)])

    # ----- save -----
    def save(self, step: int, items=None, save_kwargs=None, metrics=None, force: bool = False,
             args=None, custom_metadata: dict[str, Any] | None = None) -> bool:
        """Saves ``step`` in memory, and on disk when Orbax's policy (or ``force``) asks.

        Every host calls it for every step, in the same order.

        Returns:
          True when a persistent step was started (it completes in the
          background; ``wait_until_finished`` waits for it), False when only the
          memory tier saved this step or when the persistent save failed (see
          ``persistent_errors``).
        """
        if items is not None or save_kwargs is not None:
            raise TypeError("capricorn_jax.CheckpointManager.save takes args=ocp.args.Composite"
                            "(...), not the deprecated items/save_kwargs")
        cap = self._item_args(args, CapricornSave, "save")
        self.last_memory_report = self.handler.save_to_memory(step, cap.state, cap.host_state,
                                                              cap.tokens_per_expert)
        return self._save_if_due(step, self._naming(args, cap, step), metrics, force,
                                 custom_metadata)

    def persist(self, step: int, args, force: bool = False) -> bool:
        """The persistent half of ``save`` for a version the memory tier already holds.

        For callers that drive the ``InMemoryCheckpointer`` themselves (e.g.
        a version moved inside the training step and committed with
        ``save_transferred``): when Orbax's policy (or ``force``) asks, writes
        in-memory version ``step`` to disk from the host store, as ``save``
        would. Every host calls it for the same steps.

        Returns:
          As ``save``.
        """
        cap = self._item_args(args, CapricornSave, "persist")
        self.handler.adopt_memory_version(step, cap.state)
        return self._save_if_due(step, self._naming(args, cap, step), None, force, None)

    def _naming(self, args, cap: CapricornSave, step: int):
        """``args`` with the item's save naming in-memory version ``step`` (the
        record the handler pairs the persistent save with)."""
        if cap.memory_version not in (None, step):
            raise ValueError(f"save({step}): CapricornSave.memory_version is "
                             f"{cap.memory_version}, not the step saved")
        items = {key: args[key] for key in args.keys()}
        items[self.item] = dataclasses.replace(cap, memory_version=step)
        return ocp.args.Composite(**items)

    def _save_if_due(self, step: int, args, metrics, force: bool,
                 custom_metadata: dict[str, Any] | None) -> bool:
        if not self.is_saving_in_progress():
            self._collect_errors()  # non-blocking: the previous save has finished
        if not force and not self.should_save(step):
            return False
        self._collect_errors()  # waits for the previous persistent save, as Orbax would
        self._persist_step = step
        unwritable = self._cannot_persist(step)
        if unwritable is not None:
            self._record(step, unwritable)
            return False
        record = None
        if self._pec_tier() is not None:
            ckpt = self.handler.checkpointer
            assert ckpt is not None, "a PEC tier lives in the handler's memory tier"
            try:
                record = self._pec.decide(step, ckpt,  # collective
                                          [s for s in self.all_steps() if s < step])
            except ValueError as e:
                self._record(step, e)
                return False
            self._pec.remember(step, record)
            self.handler.set_pec_record(record)
            custom_metadata = {**(custom_metadata or {}), PEC_METADATA: record}
        try:
            started = super().save(step, args=args, metrics=metrics, force=force,
                                   custom_metadata=custom_metadata)
        except Exception as e:  # noqa: BLE001 - the memory tier goes on
            self._record(step, e)
            return False
        if not started:
            self._pec.forget(step)
            self.handler.set_pec_record(None)
        elif record is not None:
            self.last_persist = {key: record[key] for key in
                                 ("step", "k_persist", "plt", "accumulated_plt", "experts")}
        return started

    def _cannot_persist(self, step: int) -> OSError | None:
        """Why some host cannot write its part of persistent step ``step``
        (collective), or None.

        Every host checks that it can create directories in the root (each
        writes its own files of a step), that it took version ``step`` (not
        dropped, skipped or failed: without this, a host that dropped it
        failed inside Orbax's save while the others waited at Orbax's barrier
        for its bound, 300 s, found by the chaos soak) and that its own store
        holds the older in-memory versions a read of version ``step`` needs
        (PEC: the versions of its experts' newest copies); the answers are all-gathered,
        so either every host starts the Orbax save or none does. Without this,
        a host that cannot write fails alone inside Orbax's background save,
        and the others learn it only after their own writes (the handler's
        outcome exchange), having read and written for nothing.
        Object stores (``gs://``...) have no directory permissions and are
        not probed.
        """
        mine = ""
        if "://" not in str(self.directory):  # a local or mounted filesystem
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".capricorn-probe-", dir=str(self.directory)))
            except OSError as e:
                mine = f"host {jax.process_index()}: {self.directory} is not writable: {e}"
        ckpt = self.handler.checkpointer
        if not mine and ckpt is not None and not ckpt.took(step):
            mine = (f"host {jax.process_index()}: took no in-memory version {step} (dropped, "
                    f"skipped or its write failed)")
        missing = [] if mine or ckpt is None else ckpt.missing_for_read(step)
        if missing:
            mine = (f"host {jax.process_index()}: its store lacks in-memory versions {missing} "
                    f"that version {step} reads")
        everyone = allgather_json(mine, what=f"the pre-check of persistent step {step}")
        problems = [x for x in everyone if x]
        if not problems:
            return None
        kind = PermissionError if "not writable" in problems[0] else FileNotFoundError
        return kind("; ".join(problems))

    def _collect_errors(self) -> None:
        """Waits for the persistent save in flight; records (not raises) its
        failure, also one the primary's finalize recorded (``finalize``):
        that step is then forgotten (Orbax's step list reloaded)."""
        try:
            super().wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._record(self._persist_step, e)
        failed = finalize.take_failures(self.directory)
        for name, error in failed.items():
            self._record(int(name) if name.isdigit() else self._persist_step, error)
        if self._failed_cleanup:
            # Orbax dropped the steps the failed save counted out from its list
            # at save time; nothing was deleted (commit_order): list them again.
            self.reload()
        self._cleanup_failed()

    def _finalize(self, step: int, steps_to_remove: list[int]) -> None:
        """Orbax's finalize of ``step``, whose deletions wait for its commit
        (``commit_order``)."""
        self._deleter.finalizing(step)
        try:
            super()._finalize(step, steps_to_remove)
        finally:
            self._deleter.finalizing(None)

    def is_committed(self, step: int) -> bool:
        """Whether persistent step ``step`` is committed: renamed into its final
        directory (made durable first unless the handler's ``fsync`` is off)
        with no failure recorded for it. Waits for the save in flight."""
        self._collect_errors()
        if any(e.get("step") == step for e in self.persistent_errors):
            return False
        return step in self.all_steps() and self._deleter.committed(step)

    def _record(self, step: int | None, error: BaseException) -> None:
        log.error("persistent checkpoint of step %s failed: %s: %s; training goes on with the "
                  "in-memory tier", step, type(error).__name__, error)
        self.persistent_errors.append({"step": step, "error": f"{type(error).__name__}: {error}"})
        self._failed_cleanup = True
        self._pec.forget(step)
        self.handler.abort()

    def _cleanup_failed(self) -> None:
        """After a failure, the primary host removes Orbax's uncommitted step directories.

        Orbax never lists them as steps; removing them frees the disk at once
        rather than at the next start with ``cleanup_tmp_directories``. Runs
        only when no persistent save is in flight, so every temporary
        directory left is one of a failed (or killed) save.
        """
        if not self._failed_cleanup or self.is_saving_in_progress():
            return
        self._failed_cleanup = False
        if jax.process_index() != (self._multiprocessing_options.primary_host or 0):
            return
        try:
            for entry in self.directory.iterdir():
                if entry.is_dir() and ocp.utils.is_tmp_checkpoint(entry):
                    log.warning("removing %s left by a failed persistent save", entry)
                    entry.rmtree(missing_ok=True)
        except OSError as e:
            log.warning("could not remove uncommitted checkpoint directories: %s", e)

    def wait_until_finished(self) -> None:
        """Waits for the persistent save in flight; its failure is recorded, not raised."""
        self._collect_errors()

    def close(self) -> None:
        self._collect_errors()
        super().close()

    # ----- restore -----
    def restore(self, step: int | None = None, items=None, restore_kwargs=None, directory=None,
                args=None):
        """Restores the capricorn item from the newest step across tiers (collective).

        With args that hold no CapricornRestore, behaves as ``ocp.CheckpointManager``
        (persistent tier only). With ``step`` given, restores that persistent step, or
        the memory tier if its newest version is that step.

        Returns:
          ``ocp.args.Composite(item=state)``; see ``last_restore`` for the tier.
        """
        if not (isinstance(args, ocp.args.Composite) and any(
                isinstance(a, CapricornRestore) for a in args.values())):
            if isinstance(args, CapricornRestore | CapricornSave):
                raise TypeError(f"wrap {type(args).__name__} in ocp.args.Composite"
                                f"({self.item}=...)")
            if isinstance(args, ocp.args.Composite) and self.item in args.keys() and isinstance(
                    args[self.item], CapricornSave):
                raise TypeError(f"item {self.item!r}: CapricornSave is a save argument; restore "
                                f"takes CapricornRestore(abstract_state)")
            return super().restore(step, items=items, restore_kwargs=restore_kwargs,
                                   directory=directory, args=args)
        cap = self._item_args(args, CapricornRestore, "restore")
        if len(list(args.keys())) > 1:
            raise ValueError(f"restore the capricorn item {self.item!r} alone; restore the other "
                             f"items ({sorted(k for k in args.keys() if k != self.item)}) of a "
                             f"persistent step with a separate restore() call")
        start = time.perf_counter()
        self._collect_errors()
        if self.handler.checkpointer is not None:  # versions still being written count
            self.handler.checkpointer.wait_until_finished(self.handler.read_timeout_s)
        abstract = self.handler.target(cap.abstract_state)
        if directory is None:
            persistent = list(self.all_steps())
            memory = self.handler.memory_step()  # collective
        else:
            persistent, memory = list(ocp.utils.checkpoint_steps(directory)), None
        newest_disk = max(persistent) if persistent else None
        newest = step is None  # an older step is taken when the newest fails its CRC32C
        if step is None:
            if memory is not None and (newest_disk is None or memory >= newest_disk):
                state = self._restore_memory(abstract, newest_disk, start)
                if state is not None:
                    return ocp.args.Composite(**{self.item: state})
            step = newest_disk
            if step is None:
                raise NoCheckpoint(f"no checkpoint in the memory tier nor in "
                                   f"{directory or self.directory}")
        elif step not in persistent:
            state = self._restore_memory(abstract, step, start) if step == memory else None
            # _restore_memory records last_restore whenever it returns a state.
            if state is None or self.last_restore is None or self.last_restore.step != step:
                raise FileNotFoundError(f"step {step} is neither a persistent step "
                                        f"({persistent}) nor the memory tier's newest version "
                                        f"({memory})")
            return ocp.args.Composite(**{self.item: state})
        fallback = sorted((s for s in persistent if s < step), reverse=True) if newest else []
        step, (state, host_state, pec) = self._restore_checked(step, fallback, abstract, directory)
        self.last_restore = RestoreInfo(step, "persistent", time.perf_counter() - start,
                                        host_state, pec=pec)
        return ocp.args.Composite(**{self.item: state})

    def _restore_checked(self, step: int, fallback: list[int], abstract: Any, directory):
        """``_restore_persistent`` of ``step`` whose CRC32C check passed on every
        host, else of the first of ``fallback`` (older steps, newest first) that
        passes, saying so; raises ``PersistentChecksumError`` when none does."""
        for candidate in [step, *fallback]:
            self._checksum_failure: PersistentChecksumError | None = None
            restored = self._restore_persistent(candidate, abstract, directory)
            mine = "" if self._checksum_failure is None else str(self._checksum_failure)
            failures = [x for x in allgather_json(  # every host takes the same verdict
                mine, what=f"the CRC32C check of persistent step {candidate}") if x]
            if not failures:
                return candidate, restored
            rest = [s for s in fallback if s < candidate]
            log.error("persistent step %d failed its CRC32C check: %s; %s", candidate,
                      "; ".join(failures),
                      f"restoring persistent step {rest[0]}" if rest else "no older step to take")
            if not rest:
                raise PersistentChecksumError(
                    f"no persistent step restores with its recorded CRC32Cs (tried "
                    f"{[step, *fallback]}): " + "; ".join(failures), candidate, "")
        raise AssertionError("unreachable: the loop returns or raises")

    def _restore_persistent(self, step: int, abstract: Any, directory
                            ) -> tuple[Any, dict[str, Any], PecRestore | None]:
        """Persistent step ``step``: (state, host state, PEC restore info or None).

        A step with a PEC record is restored by ``pec_steps.restore_step``
        (assembled from several steps when it does not carry every expert). A
        PEC memory tier then goes on from the restored step
        (``pec_steps.resume_memory_tier``).
        """
        record = None
        if directory is None:
            record = self._pec.record_of(step)
            # Every host takes the primary host's view: whether the step is a
            # PEC step, and which steps it may read.
            primary = broadcast_json({"pec": record is not None, "steps": [
                s for s in self.all_steps() if s <= step]},
                what=f"the primary host's view of persistent step {step}")
            if primary["pec"] != (record is not None):
                raise ValueError(f"persistent step {step}: host {jax.process_index()} reads its "
                                 f"PEC record differently from the primary host")
        if record is None:
            state = self._restore_step(step, abstract, directory)
            resume_memory_tier(self.handler.checkpointer, step, None, None)
            return state, self.handler.last_host_state, None
        state, host_state, info, plan = restore_step(
            step, record, self._pec.copies(primary["steps"]), abstract, self._read_step)
        resume_memory_tier(self.handler.checkpointer, step, record, plan)
        return state, host_state, info

    def _restore_step(self, step: int, abstract: Any, directory) -> Any:
        """Persistent step ``step``; a CRC32C mismatch is kept for
        ``_restore_checked`` (which every host reaches with the same
        collectives behind it) and the state read is returned."""
        try:
            restored = super().restore(step, directory=directory, args=ocp.args.Composite(
                **{self.item: CapricornRestore(abstract)}))
        except PersistentChecksumError as e:
            if getattr(self, "_checksum_failure", None) is None:
                self._checksum_failure = e
            return e.state
        return restored[self.item]

    def _read_step(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        """Persistent step ``step`` read into ``target`` (``pec_steps.ReadStep``)."""
        return self._restore_step(step, target, None), self.handler.last_host_state

    def _pec_tier(self) -> PecTier | None:
        """The memory tier's PEC bookkeeping; None without PEC (or without a memory tier)."""
        ckpt = self.handler.checkpointer
        return None if ckpt is None else ckpt.pec

    def _restore_memory(self, abstract: Any, at_least: int | None, start: float) -> Any:
        """The memory tier's newest version, if it is at least ``at_least`` (collective)."""
        ckpt = self.handler.checkpointer
        assert ckpt is not None, "a memory step exists only with a memory tier"
        mine = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), ckpt.abstract_state)
        check_tree(abstract, mine, "the in-memory checkpoint")
        try:
            recovered = recover(ckpt)
        except ChecksumError as e:  # every host raises it: the verdicts are agreed
            if at_least is None:
                raise
            log.warning("memory tier: %s; using the persistent tier", e)
            return None
        if recovered is None or (at_least is not None and recovered[1].step < at_least):
            # Every version newer than the persistent step failed its checksums.
            log.warning("memory tier gave %s; using the persistent tier",
                        None if recovered is None else f"version {recovered[1].step}")
            return None
        restored, info = recovered

        def place(x, target):
            sharding = getattr(target, "sharding", None)
            return x if sharding is None or x.sharding == sharding else jax.device_put(x, sharding)

        state = jax.tree.map(place, restored, abstract)
        self.last_restore = dataclasses.replace(info, seconds=time.perf_counter() - start)
        return state

    # ----- helpers -----
    def _item_args(self, args, kind: type, what: str):
        if not isinstance(args, ocp.args.Composite):
            raise TypeError(f"{what} takes args=ocp.args.Composite({self.item}="
                            f"{kind.__name__}(...)), got {type(args).__name__}")
        if self.item not in args.keys():
            raise TypeError(f"{what}: args have no item {self.item!r} "
                            f"(items: {sorted(args.keys())})")
        value = args[self.item]
        if not isinstance(value, kind):
            raise TypeError(f"{what}: item {self.item!r} takes {kind.__name__}, got "
                            f"{type(value).__name__}")
        return value


def _bounded_options(options, handler: CapricornHandler):
    """``options`` with Orbax's barrier timeout set to the handler's write bound
    (unless the caller set ``async_options``)."""
    options = ocp.CheckpointManagerOptions() if options is None else options
    if options.async_options is not None:
        return options
    return dataclasses.replace(options, async_options=ocp.AsyncOptions(
        timeout_secs=math.ceil(handler.commit_timeout_s)))


def _recorded_finalize(options, directory: Any, fsync: bool):
    """``options`` whose step directories are made durable before their rename
    (``fsync``) and record a failed finalize on the primary instead of leaving
    the other hosts at Orbax's barrier (``finalize``); local paths only
    (Orbax's atomic rename; object stores keep Orbax's own choice)."""
    if "://" in str(directory):
        return options
    base = options.temporary_path_class or ocp.path.atomicity.AtomicRenameTemporaryPath
    return dataclasses.replace(options, temporary_path_class=finalize.recording(
        base, directory, fsync))


def _find_handler(registry) -> tuple[str, CapricornHandler]:
    entries = {} if registry is None else registry.get_all_entries()
    found = {(item, id(h)): (item, h) for (item, _), h in entries.items()
             if isinstance(h, CapricornHandler)}
    if len(found) != 1:
        raise ValueError("capricorn_jax.CheckpointManager needs a handler_registry that maps "
                         "exactly one item to a CapricornHandler, e.g. "
                         f"handler_registry=CapricornHandler(checkpointer).registry('state'); "
                         f"found {len(found)}")
    item, handler = next(iter(found.values()))
    if item is None:
        raise ValueError("register the CapricornHandler under an item name, e.g. 'state'")
    if not registry.has(item, CapricornRestore):
        registry.add(item, CapricornRestore, handler)
    return item, handler
