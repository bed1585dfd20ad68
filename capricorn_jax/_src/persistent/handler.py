"""The Orbax handler of the two tiers: host RAM every step, disk when asked.

``CapricornHandler`` is an Orbax ``AsyncCheckpointHandler`` that owns an
``InMemoryCheckpointer``; ``manager.CheckpointManager`` drives it:

* **memory tier, every step.** ``save_to_memory`` runs
  ``InMemoryCheckpointer.save`` (pack, replicate to peers, background
  writers). All hosts call it for every step, in the same order, from the
  training thread (the memory tier runs collectives).
* **persistent tier, when Orbax's policy says so.** ``async_save`` returns at
  once with a commit future (``_PersistFuture``, a daemon thread) that waits
  until this host's in-memory writer has committed version ``step``, reads it
  from the host store into aligned host buffers (``memory_read``), wraps them
  as ``jax.Array``s without copying (on CPU device memory is host memory; on
  an accelerator they go to ``pinned_host`` memory when the device has it,
  ``host_arrays.host_memory_kind``), and hands them to an inner
  ``ocp.StandardCheckpointHandler`` once Orbax has created the item's
  directory. The training thread only pays Orbax's barriers and directory
  creation. Peak extra host memory of a persistent save is about 1.1-1.4x
  this host's state (``launch/experiments/orbax_rss.py`` at tag experiments-2026-12-05).

On disk a step is exactly what ``StandardCheckpointHandler`` writes under the
item name, and its step metadata names ``StandardCheckpointHandler`` as the
item's handler (the handler instance reports that typestr), so a process that
never imports capricorn_jax restores it with plain Orbax::

    ocp.CheckpointManager(path).restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))

Each host also writes its small JSON host state (data-iterator position...) as
``capricorn_host_state.<host>.json`` in the item directory; plain Orbax
ignores that file.

Design decision: the disk copy comes from the host-RAM copy the memory tier
already holds. Alternative not taken: Orbax's own async save of the training
arrays, a second device-to-host copy of the state for every persistent step.
``async_save`` called without a preceding in-memory save of the same state
(which is what a plain ``ocp.CheckpointManager`` does) raises an error that
names the fix.

Pinning: the memory tier keeps only its newest versions (the writer prunes an
older own version once a newer one is committed). The persistent reader holds
its version's bytes in RAM before the next ``save_to_memory`` may start a newer
version: that call waits (bounded) for the reader (``await_reader``). The
alternative, a pin API in the store, would avoid the wait but needs the store
to track readers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from capricorn_jax._src.memory.tier.checkpointer import InMemoryCheckpointer, SaveReport
from capricorn_jax._src.memory.tier.recovery import restorable_version
from capricorn_jax._src.memory.wire.host_arrays import (
    check_host_memory_kind,
    global_arrays,
    host_memory_kind,
)
from capricorn_jax._src.persistent import integrity
from capricorn_jax._src.persistent.memory_read import (
    carried_blocks,
    check_tree,
    read_own_blocks,
    read_pec_blocks,
)
from capricorn_jax._src.persistent.outcomes import (
    PeerFailed,
    PeerOutcomes,
    poll_until,
    wait_watching,
)

log = logging.getLogger("capricorn_jax")

HOST_STATE_FILE = "capricorn_host_state.{host}.json"


class CapricornHandler(ocp.AsyncCheckpointHandler):
    """Orbax handler of the two tiers (see the module docstring).

    Args:
      checkpointer: the in-memory tier (an ``InMemoryCheckpointer``); None for a
        handler that only restores persistent steps (e.g. on another topology).
        The handler closes it in ``close()``.
      use_ocdbt: passed to the inner ``ocp.StandardCheckpointHandler``.
      host_memory_kind: memory kind of the arrays handed to Orbax, as
        ``InMemoryOptions.host_memory_kind`` (``host_arrays.host_memory_kind``):
        "auto" (the devices' memory on CPU, ``pinned_host`` on accelerators
        that have it), or "device", "pinned_host", "unpinned_host".
      read_timeout_s: how long the persistent reader waits for the in-memory
        writer to commit its version, and how long ``save_to_memory`` waits
        for the reader before starting a newer version. One persistent write
        on this host is bounded by ``write_timeout_s`` (twice this: the read,
        then the directory and the files), the wait for the other hosts'
        outcomes after it by the same, and both by ``commit_timeout_s``, which
        ``manager.CheckpointManager`` gives Orbax as its barrier timeout.
      fsync: make each persistent step durable before it is committed (every
        file and directory of the step fsynced before its rename, the root
        after: ``finalize``); False skips it (a filesystem whose fsync costs
        more than a lost step, or one with no fsync). Object stores never do it.

    Attributes:
      on_persist: optional hook ``(step, phase)`` called in the background
        thread: phase "read" once the version's bytes are in RAM, "written" once
        this host's files are written (before Orbax commits the step). An
        exception it raises fails this host's write (fault injection).
    """

    def __init__(self, checkpointer: InMemoryCheckpointer | None = None, *,
                 use_ocdbt: bool = True, host_memory_kind: str = "auto",
                 read_timeout_s: float = 300.0, fsync: bool = True):
        check_host_memory_kind(host_memory_kind)
        tier = None if checkpointer is None else checkpointer.pec
        if tier is not None:
            kp = tier.dyn.options.k_persist
            if kp is not None and kp < tier.shape[1] and kp % tier.ranks:
                raise ValueError(f"k_persist={kp}: a persisted step carries k_persist/R experts "
                                 f"of every MoE layer from each of the R={tier.ranks} "
                                 f"expert-parallel ranks, so k_persist must be a multiple of "
                                 f"{tier.ranks} (or None: all {tier.shape[1]} experts)")
        self.checkpointer = checkpointer
        self.host_memory_kind = host_memory_kind
        self.read_timeout_s = read_timeout_s
        self.fsync = fsync
        self.on_persist: Callable[[int, str], None] | None = None
        self._inner = ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt)
        self._use_ocdbt = use_ocdbt
        self._partial: ocp.PyTreeCheckpointHandler | None = None  # restores of some leaves
        # What Orbax records as this item's handler in the step metadata: the
        # files are the standard handler's, so plain Orbax can restore them.
        # (Instance attribute: the class keeps its own typestr for the global
        # handler-type registry, which refuses two classes with one typestr.)
        self.typestr = ocp.StandardCheckpointHandler.typestr
        self._lock = threading.Lock()
        self._memory: _MemorySave | None = None
        self._reader: tuple[int, threading.Event] | None = None
        self._writer: _PersistFuture | None = None
        self._next_pec: dict[str, Any] | None = None
        self._closed = False
        self._saves = 0  # persistent saves started (the same count on every host)
        self.last_host_state: dict[str, Any] = {}
        self.last_verdict: integrity.Verdict | None = None  # the newest restore's CRC check

    def registry(self, item: str = "state") -> ocp.handlers.DefaultCheckpointHandlerRegistry:
        """A handler registry mapping ``item`` (save and restore args) to this handler."""
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add(item, CapricornSave, self)
        registry.add(item, CapricornRestore, self)
        return registry

    # ----- memory tier (training thread, collective) -----
    def save_to_memory(self, step: int, state: Any, host_state: dict[str, Any] | None = None,
                       tokens_per_expert: Any = None) -> SaveReport:
        """Checkpoints ``state`` as in-memory version ``step`` (all hosts, every
        step); ``tokens_per_expert``: PEC only, the step's [moe_layers, experts]."""
        ckpt = self._require_checkpointer("save")
        self.await_reader()
        if step in ckpt.store.versions(ckpt.host):
            # A version with this number left by an earlier run: drop it (and
            # the newer ones) so the persistent reader can only see the
            # version written now.
            ckpt.drop_newer_than(step - 1)
        extra = {} if tokens_per_expert is None else {"tokens_per_expert": tokens_per_expert}
        report = ckpt.save(step, state, host_state or {}, **extra)
        with self._lock:
            self._memory = _MemorySave(step, report.skipped)
        return report

    def adopt_memory_version(self, step: int, state: Any) -> None:
        """Takes in-memory version ``step``, saved by the caller through the
        checkpointer, as the one the next ``async_save`` of ``state`` persists."""
        del state  # the version is named by its step (CapricornSave.memory_version)
        self._require_checkpointer("persist")
        with self._lock:
            self._memory = _MemorySave(step, False)

    def set_pec_record(self, record: dict[str, Any] | None) -> None:
        """The PEC record of the next persistent save (the manager decides it:
        which experts the step carries, ...); its ``async_save`` takes it."""
        with self._lock:
            self._next_pec = record

    def await_reader(self) -> None:
        """Waits (bounded) until the persistent save in flight has read its
        in-memory version, so the next in-memory save cannot prune it mid-read.
        ``save_to_memory`` calls it; callers that save through the checkpointer
        themselves call it before each save."""
        with self._lock:
            reader = self._reader
        if reader is None:
            return
        step, event = reader
        if not event.wait(self.read_timeout_s):
            log.warning("persistent save of step %d has not read its in-memory version after "
                        "%.0fs; the memory tier goes on and that step may fail", step,
                        self.read_timeout_s)
        with self._lock:
            if self._reader is reader:
                self._reader = None

    def memory_step(self) -> int | None:
        """The version the memory tier's recovery restores now (collective, no
        chunk read): ``recovery.restorable_version``, the one decision recovery
        takes too, PEC's rule under PEC."""
        ckpt = self.checkpointer
        return None if ckpt is None else restorable_version(ckpt)

    # ----- persistent tier -----
    async def async_save(self, directory, args: CapricornSave) -> list[ocp.Future]:
        """Starts writing the persistent tier from the in-memory version; returns at once."""
        return [self._start(directory, args)]

    @property
    def write_timeout_s(self) -> float:
        """The bound of one persistent write on this host (read, then write),
        and of the wait for the other hosts' outcomes after it."""
        return 2 * self.read_timeout_s

    @property
    def commit_timeout_s(self) -> float:
        """Orbax's barrier timeout (``AsyncOptions.timeout_secs``): this host's
        write, then the wait for the others' outcomes."""
        return 2 * self.write_timeout_s

    def save(self, directory, args: CapricornSave) -> None:
        """The synchronous save: ``async_save``'s write, waited for (bounded by
        ``commit_timeout_s``; a write still running then raises TimeoutError)."""
        self._start(directory, args).result(timeout=self.commit_timeout_s)

    def _start(self, directory, args: CapricornSave) -> _PersistFuture:
        if not isinstance(args, CapricornSave):
            raise TypeError(f"CapricornHandler saves CapricornSave args, got {type(args).__name__}")
        with self._lock:
            memory, self._memory = self._memory, None
        if memory is None or args.memory_version != memory.step:
            held = "no version" if memory is None else f"version {memory.step}"
            raise RuntimeError(
                f"CapricornHandler.async_save: this save persists in-memory version "
                f"{args.memory_version} and the memory tier's newest save is {held}; the "
                f"persistent tier is written from that host-RAM copy. Use "
                f"capricorn_jax.CheckpointManager (its save() runs the in-memory tier every step "
                f"and names the version), or call handler.save_to_memory(step, state, "
                f"host_state) and pass CapricornSave(..., memory_version=step).")
        with self._lock:
            pec_step, self._next_pec = self._next_pec, None
        if pec_step is not None and pec_step["step"] != memory.step:
            raise RuntimeError(f"the persistent PEC record is for step {pec_step['step']}, "
                               f"the in-memory version for step {memory.step}")
        self._saves += 1
        future = _PersistFuture(self, epath.Path(directory), memory, pec_step,
                                self._peer_outcomes(memory.step))
        with self._lock:
            self._reader = (memory.step, future.read)
            self._writer = future
        future.start()
        return future

    def _peer_outcomes(self, step: int) -> PeerOutcomes | None:
        """The outcomes of this save on every host; None with one host."""
        ckpt = self.checkpointer
        if ckpt is None or ckpt.hosts == 1 or jax.process_count() == 1:
            return None
        from jax._src import distributed

        client = distributed.global_state.client
        assert client is not None, "jax.distributed is initialized when several processes run"
        return PeerOutcomes(client, self._saves, step, ckpt.host, ckpt.hosts)

    def abort(self) -> None:
        """Stops the persistent write in flight (its Orbax save failed elsewhere)."""
        with self._lock:
            writer = self._writer
        if writer is not None:
            writer.cancel()

    def _write_step(self, future: _PersistFuture) -> None:
        """The background work of one persistent save (runs in ``future``'s thread)."""
        ckpt, step, directory = self.checkpointer, future.memory.step, future.directory
        assert ckpt is not None, "a persistent write starts only from a handler with a memory tier"
        try:
            if future.memory.skipped:
                raise RuntimeError(f"in-memory version {step} was skipped (its writer was busy); "
                                   f"no host-RAM copy to write persistent step {step} from")
            if ckpt.pec is None:
                blocks, host_state = read_own_blocks(ckpt, step, self.read_timeout_s)
                shapes = None
            else:
                blocks, host_state, plan = read_pec_blocks(ckpt, step, self.read_timeout_s)
                blocks, shapes = carried_blocks(ckpt, blocks, plan, future.pec)
            # Each block's CRC32C, from the host copy the files are written from.
            crcs = integrity.record(blocks, ckpt.abstract_state, ckpt.state_shardings,
                                    list(ckpt.mesh.devices.flat), shapes)
        finally:
            future.read.set()
        self._hook(step, "read")
        # Orbax creates the step's directories in the background (primary host);
        # the write starts once this item's directory exists. Every wait from
        # here on stops at once when another host's write failed (outcomes).
        peers = future.peers
        poll_until(directory.exists, self.read_timeout_s, f"{directory} not created", peers,
                   future.cancelled.is_set,
                   lambda: _Aborted(f"persistent save of step {step} aborted"))
        kind = host_memory_kind(self.host_memory_kind, ckpt.mesh.devices.flat[0])
        tree = global_arrays(blocks, ckpt.abstract_state, ckpt.state_shardings, ckpt.mesh, kind,
                             shapes)
        del blocks
        futures = asyncio.run(self._inner.async_save(directory,
                                                     args=ocp.args.StandardSave(tree)))
        wait_watching(futures or [], self.read_timeout_s, peers)
        del tree, futures
        (directory / HOST_STATE_FILE.format(host=ckpt.host)).write_text(json.dumps(host_state))
        integrity.write(directory, ckpt.host, crcs)
        self._hook(step, "written")

    def _agree_written(self, future: _PersistFuture, mine: str) -> None:
        """Every host's outcome of ``future``'s write (background thread).

        Each host sets its outcome ("" or its error) under the save's key in
        the ``jax.distributed`` key-value store and reads every host's, within
        ``write_timeout_s``; when some host failed (or did not answer), this
        host's commit future fails too, naming it, so no host reaches Orbax's
        barrier and the step is dropped everywhere at once. Keys of their own
        (not ``multihost.agree``'s numbered agreements, which the training
        thread runs meanwhile)."""
        if future.peers is None:  # one host
            if mine:
                assert future.error is not None, "an outcome is set only with its error"
                raise future.error
            return
        future.peers.publish(mine)
        failed = future.peers.gather(self.write_timeout_s)
        if failed:
            raise RuntimeError(f"host {future.peers.host}: persistent step "
                               f"{future.memory.step} dropped on every host: "
                               + "; ".join(failed)) from future.error

    def _hook(self, step: int, phase: str) -> None:
        if self.on_persist is not None:
            self.on_persist(step, phase)

    def restore(self, directory, args: CapricornRestore | None = None) -> Any:
        """Restores a persistent step (the memory tier is the manager's business)."""
        if args is None:
            args = CapricornRestore()
        if not isinstance(args, CapricornRestore):
            raise TypeError(f"CapricornHandler restores with CapricornRestore args, got "
                            f"{type(args).__name__}")
        directory = epath.Path(directory)
        abstract = self.target(args.abstract_state)
        name = directory.parent.name
        step = int(name) if name.isdigit() else None
        with integrity.corruption_named(step, abstract):
            if abstract is not None:
                check_tree(abstract, self._inner.metadata(directory).tree,
                           "the persistent checkpoint")
            if abstract is not None and any(leaf is ocp.PLACEHOLDER
                                            for leaf in jax.tree.leaves(abstract)):
                state = self._restore_some(directory, abstract)
            else:
                state = self._inner.restore(directory, args=ocp.args.StandardRestore(abstract))
        host = jax.process_index()
        path = directory / HOST_STATE_FILE.format(host=host)
        self.last_host_state = json.loads(path.read_text()) if path.exists() else {}
        # Raises integrity.PersistentChecksumError (carrying the state) on a mismatch.
        self.last_verdict = integrity.verify(directory, state, step)
        return state

    def _restore_some(self, directory: epath.Path, abstract: Any) -> Any:
        """Restores the leaves of ``abstract`` that are not ``ocp.PLACEHOLDER``
        (those stay placeholders). The standard handler takes no placeholders;
        the PyTree handler beneath it reads the same files."""
        if self._partial is None:
            self._partial = ocp.PyTreeCheckpointHandler(use_ocdbt=self._use_ocdbt)

        def restore_args(leaf: Any) -> Any:
            if leaf is ocp.PLACEHOLDER:
                return ocp.PLACEHOLDER
            sharding = getattr(leaf, "sharding", None)
            if sharding is None:
                return ocp.RestoreArgs(restore_type=np.ndarray, dtype=leaf.dtype)
            return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=tuple(leaf.shape),
                                        dtype=leaf.dtype)

        return self._partial.restore(directory, args=ocp.args.PyTreeRestore(
            item=abstract, restore_args=jax.tree.map(restore_args, abstract)))

    def target(self, abstract_state: Any) -> Any:
        """The restore target: ``abstract_state``, or the in-memory tier's own state layout."""
        if abstract_state is not None or self.checkpointer is None:
            return abstract_state
        ckpt = self.checkpointer
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            ckpt.abstract_state, ckpt.state_shardings)

    def metadata(self, directory):
        return self._inner.metadata(epath.Path(directory))

    def finalize(self, directory) -> None:
        self._inner.finalize(directory)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inner.close()
        if self._partial is not None:
            self._partial.close()
        if self.checkpointer is not None:
            self.checkpointer.close()

    def _require_checkpointer(self, what: str) -> InMemoryCheckpointer:
        if self.checkpointer is None:
            raise RuntimeError(f"this CapricornHandler has no InMemoryCheckpointer and cannot "
                               f"{what}; pass CapricornHandler(checkpointer)")
        return self.checkpointer


@ocp.args.register_with_handler(CapricornHandler, for_save=True)
@dataclasses.dataclass
class CapricornSave(ocp.args.CheckpointArgs):
    """Save args: the train state, this host's JSON state (at most 8 KiB) and,
    under partial expert checkpointing, the step's kept assignments per expert
    ([moe_layers, experts], the PLT's input)."""

    state: Any
    host_state: dict[str, Any] | None = None
    tokens_per_expert: Any = None
    memory_version: int | None = None
    """The in-memory version the persistent save is written from (the
    explicit record pairing a persistent save with its memory-tier save;
    ``CheckpointManager`` sets it to the step it saves)."""


@ocp.args.register_with_handler(CapricornHandler, for_restore=True)
@dataclasses.dataclass
class CapricornRestore(ocp.args.CheckpointArgs):
    """Restore args: the target pytree of ``jax.ShapeDtypeStruct`` (with ``.sharding``).

    None restores into the in-memory tier's own layout.
    """

    abstract_state: Any = None


class _Aborted(RuntimeError):
    """The manager gave up on this persistent save (its Orbax part failed)."""


class _PersistFuture:
    """An Orbax commit future: a daemon thread running ``CapricornHandler._write_step``.

    A daemon thread (not Orbax's signal-waiting commit thread) so that a save
    whose directory creation failed never holds the process or the host
    buffers longer than ``cancel()`` or the timeout.
    """

    def __init__(self, handler: CapricornHandler, directory: epath.Path, memory: _MemorySave,
                 pec: dict[str, Any] | None = None, peers: PeerOutcomes | None = None):
        self.handler, self.directory, self.memory = handler, directory, memory
        self.peers = peers  # every host's outcome of this save (None: one host)
        self.error: BaseException | None = None  # this host's own failure
        self.pec = pec  # the PEC record of the step (experts carried, ...), None: full
        self.read = threading.Event()  # the version's bytes are in RAM (or the read failed)
        self.cancelled = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"capricorn-persist-{memory.step}")

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        mine = ""
        try:
            self.handler._write_step(self)
        except _Aborted as e:
            log.info("%s", e)
            self.error, mine = e, f"aborted: {e}"
        except PeerFailed as e:  # another host's failure, reported by that host
            log.info("host %d: persistent save of step %d %s", jax.process_index(),
                     self.memory.step, e)
            self.error, mine = e, str(e)
        except BaseException as e:  # noqa: BLE001 - raised by result()
            log.error("persistent save of step %d failed on host %d: %s: %s", self.memory.step,
                      jax.process_index(), type(e).__name__, e)
            self.error, mine = e, f"{type(e).__name__}: {e}"
        try:
            self.handler._agree_written(self, mine)
        except BaseException as e:  # noqa: BLE001 - raised by result()
            self._error = e

    def result(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"host {jax.process_index()}: persistent save of step "
                               f"{self.memory.step} (reading in-memory version {self.memory.step} "
                               f"and writing its files) still running after {timeout}s")
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        self.cancelled.set()


@dataclasses.dataclass(frozen=True)
class _MemorySave:
    step: int
    skipped: bool
