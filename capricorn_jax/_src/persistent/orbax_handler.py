"""Orbax integration: two-level checkpointing (host RAM every step, disk every K steps).

``CapricornHandler`` is an Orbax ``AsyncCheckpointHandler`` that owns an
``InMemoryCheckpointer``; ``CheckpointManager`` is a thin subclass of
``ocp.CheckpointManager`` that drives both tiers:

* **memory tier, every step.** ``CheckpointManager.save(step, args=Composite(
  state=CapricornSave(state, host_state)))`` first runs
  ``handler.save_to_memory`` (``InMemoryCheckpointer.save``: pack, replicate to
  peers, background writers). All hosts call ``save`` for every step, in the
  same order, from the training thread (the memory tier runs collectives).
* **persistent tier, when Orbax's policy says so.** Only when the manager's
  own decision (``should_save``: ``save_interval_steps``, ``save_on_steps``,
  ``save_decision_policy``) or ``force`` asks for it does ``save`` call
  ``ocp.CheckpointManager.save``, which runs the handler's ``async_save``. That
  returns at once with a commit future (a daemon thread) that waits until this
  host's in-memory writer has committed version ``step``, reads it from the
  host store (tmpfs, checksummed) chunk by chunk straight into one 64-byte
  aligned host buffer per shard block (the bytes ``packing.unpack`` yields),
  wraps those buffers as ``jax.Array``s without copying (on CPU device memory
  is host memory; on an accelerator they go to ``pinned_host`` memory when the
  device has it), and hands them to an inner ``ocp.StandardCheckpointHandler``
  once Orbax has created the item's directory. The disk copy therefore comes
  from the host-RAM copy the memory tier already holds, never from a second
  device-to-host copy of the training arrays, and the training thread only
  pays Orbax's barriers and directory creation. Peak extra host memory of a
  persistent save is about 1.1-1.4x this host's state (``launch/orbax_rss.py``).
  ``save`` returns True when a persistent step was started, False when only
  the memory tier saved (or the persistent save could not start; see below).

On disk a step is exactly what ``StandardCheckpointHandler`` writes under the
item name, and its step metadata names ``StandardCheckpointHandler`` as the
item's handler (the handler instance reports that typestr), so a process that
never imports capricorn_jax restores it with plain Orbax::

    ocp.CheckpointManager(path).restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))

Each host also writes its small JSON host state (data-iterator position...) as
``capricorn_host_state.<host>.json`` in the item directory; plain Orbax
ignores that file.

Restore (``CheckpointManager.restore(step=None, args=Composite(
state=CapricornRestore(abstract_state)))``, collective) takes the newest step
across tiers: the memory tier (``recover``: a version every host's shards can
be read at) when it is at least the newest committed persistent step, else
the persistent step, read by the inner standard handler into the shardings of
``abstract_state`` (any device count). ``manager.last_restore`` tells the
step, the tier and the host state.

Atomicity is Orbax's: a step is written in a temporary directory that is
renamed (plus a commit marker) only after every host's commit futures
finished, so a step killed while being written is never listed by
``latest_step``/``all_steps`` (``cleanup_tmp_directories`` removes it at the
next start). Failures of the persistent tier never stop training: before each
persistent save every host probes that it can create a directory in the root
and the answers are all-gathered (so all hosts skip, or none); an unwritable
root is then recorded without starting Orbax, whose background directory
creation would otherwise leave threads waiting 300 s for a signal. A failure
inside the background write is collected at the next ``save`` (or
``wait_until_finished``/``close``), and the primary host removes the
uncommitted directory. Either way the failure is logged to the
``capricorn_jax`` logger and appended to ``manager.persistent_errors``. Every
wait is bounded (``read_timeout_s``, Orbax's ``AsyncOptions.timeout_secs``).

Design decision: a ``CheckpointManager`` subclass that runs the memory tier on
every ``save`` call and defers to Orbax's own policy for the disk tier.
Alternative not taken: a bare handler under a plain ``ocp.CheckpointManager``.
With ``save_interval_steps=K`` a plain manager never calls the handler on the
other K-1 steps, so the memory tier would only run every K steps; with
``save_interval_steps=1`` it would create (and finalize, with barriers and a
rename) a disk step directory every step. ``CapricornHandler.async_save``
called without a preceding in-memory save of the same state (which is what a
plain manager does) raises an error that names this fix.

Partial expert checkpointing (an ``InMemoryCheckpointer`` with
``InMemoryOptions.pec``; MoC-System's two-level PEC, K_persist <= K):

* **what a persisted step holds.** The background reader assembles, from this
  host's own store, the state a memory-tier restore to version ``step`` gives
  (``read_pec_blocks``: non-expert state from ``step``, every expert with its
  Adam moments from its newest in-memory copy). With ``PecOptions.k_persist``
  None (= N) the step is that whole state, a standard step plain Orbax
  restores. With K_persist < N it keeps, of every MoE layer, the K_persist
  experts of ``pec.persist_mask``: per expert-parallel rank the K_persist/R
  whose newest *persisted* copy is oldest (a round robin with no counter:
  ceil(N/K_persist) consecutive persisted steps carry every expert, so the
  experts of a failed step are carried within the next ceil(N/K_persist)),
  ties to the freshest values in memory. An expert leaf [N, ...] is written
  as [K_persist, ...], the carried experts in ascending order, sharded like
  the full leaf (so K_persist must be a multiple of R); non-expert leaves are
  written whole. The first persisted
  step (no expert has a copy yet) carries every expert.
* **the record.** ``_pec_record`` decides the step in the training thread
  (collective: every host takes the primary host's experts) and the manager
  stores it in the step's custom metadata under ``capricorn_pec``: the
  experts carried, the training step of each one's values (``data_step``,
  possibly older than the step), the cumulative assignments of the memory
  tier's ``PecTier`` (the PLT of a restore is a difference of those counts),
  the memory tracker, and the PLT a restore of this step would have when
  written (also in ``last_persist`` and launch.train's ``persist`` event).
* **restore.** A PEC step is restored (``_restore_persistent``) by
  ``pec.persisted_plan``: non-expert state from the step, each expert from its
  newest persisted copy at or before it (parameters and moments from that one
  step): every needed step is read with Orbax placeholders for the leaves it
  does not give, and the expert leaves are gathered in one jitted program into
  the target's sharding. ``last_restore.pec`` reports the sources, the data
  steps and the PLT; a PEC memory tier goes on from the restored step with no
  expert in memory yet (its next version is full) and the restore's losses.
* **retention.** Orbax's policy (``max_to_keep``, ``keep_period``...) is
  extended: a step that holds some expert's newest persisted copy is never
  deleted (``_KeepNewestCopies``, an ``AnyPreservationPolicy`` member), so the
  newest step always restores. With a constant K_persist that is at most
  ceil(N/K_persist) steps beyond ``max_to_keep``.

Alternative not taken: persisting K_persist of the experts the version itself
carries (a subset of its K), as in MoC-System's buffer rotation. The memory
tier already holds a copy of every expert, and the experts a version carries
follow the memory tier's own round robin, so with ``persist_every`` a multiple
of N/K the same experts would be persisted every time and others never.

Pinning: the memory tier keeps only its newest versions (the writer prunes an
older own version once a newer one is committed). The persistent reader holds
its version's bytes in RAM before the next ``save_to_memory`` may start a newer
version: that call waits (bounded) for the reader. The alternative, a pin API
in the store, would avoid the wait but needs the store to track readers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from capricorn_jax._src.partial import pec as pec_lib
from capricorn_jax._src.memory.checkpointer import InMemoryCheckpointer, SaveReport
from capricorn_jax._src.memory.packing import make_pec_plan
from capricorn_jax._src.memory.recovery import (
    PecRestore,
    _allgather_json,
    _PecBlocks,
    _read_rows,
    choose_version,
    recover,
)

log = logging.getLogger("capricorn_jax")

HOST_STATE_FILE = "capricorn_host_state.{host}.json"
PEC_METADATA = "capricorn_pec"  # key of a PEC step's record in the step's custom metadata
_PEC_FORMAT = 1
_ALIGN = 64  # the CPU client wraps host buffers aligned to 64 bytes without a copy


# --------------------------------------------------------------------------- args


class CapricornHandler(ocp.AsyncCheckpointHandler):
    """Orbax handler of the two tiers (see the module docstring).

    Args:
      checkpointer: the in-memory tier (an ``InMemoryCheckpointer``); None for a
        handler that only restores persistent steps (e.g. on another topology).
        The handler closes it in ``close()``.
      use_ocdbt: passed to the inner ``ocp.StandardCheckpointHandler``.
      host_memory_kind: memory kind of the arrays handed to Orbax: "auto" (the
        devices' memory on CPU, ``pinned_host`` on accelerators that have it),
        or an explicit kind ("device", "pinned_host", "unpinned_host").
      read_timeout_s: how long the persistent reader waits for the in-memory
        writer to commit its version, and how long ``save_to_memory`` waits
        for the reader before starting a newer version.

    Attributes:
      on_persist: optional hook ``(step, phase)`` called in the background
        thread: phase "read" once the version's bytes are in RAM, "written" once
        this host's files are written (before Orbax commits the step).
    """

    def __init__(self, checkpointer: InMemoryCheckpointer | None = None, *,
                 use_ocdbt: bool = True, host_memory_kind: str = "auto",
                 read_timeout_s: float = 300.0):
        tier = None if checkpointer is None else getattr(checkpointer, "pec", None)
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
        self.last_host_state: dict[str, Any] = {}

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
            self._memory = _MemorySave(step, id(state), report.skipped)
        return report

    def adopt_memory_version(self, step: int, state: Any) -> None:
        """Takes in-memory version ``step``, saved by the caller through the
        checkpointer, as the one the next ``async_save`` of ``state`` persists."""
        self._require_checkpointer("persist")
        with self._lock:
            self._memory = _MemorySave(step, id(state), False)

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
        """The newest version every host's shards can be read at (collective, no data read)."""
        ckpt = self.checkpointer
        if ckpt is None:
            return None
        inventory = {str(o): ckpt.store.versions(o) for o in ckpt.store.owners()}
        gathered = _allgather_json(inventory, ckpt.hosts)
        decision = choose_version([{int(o): v for o, v in inv.items()} for inv in gathered],
                                  ckpt.hosts)
        return None if decision is None else decision[0]

    # ----- persistent tier -----
    async def async_save(self, directory, args: CapricornSave) -> list[ocp.Future]:
        """Starts writing the persistent tier from the in-memory version; returns at once."""
        return [self._start(directory, args)]

    def save(self, directory, args: CapricornSave) -> None:
        self._start(directory, args).result()

    def _start(self, directory, args: CapricornSave) -> _PersistFuture:
        if not isinstance(args, CapricornSave):
            raise TypeError(f"CapricornHandler saves CapricornSave args, got {type(args).__name__}")
        with self._lock:
            memory, self._memory = self._memory, None
        if memory is None or memory.state_id != id(args.state):
            raise RuntimeError(
                "CapricornHandler.async_save: the in-memory tier holds no version of this state, "
                "and the persistent tier is written from that host-RAM copy. Use "
                "capricorn_jax.CheckpointManager (its save() runs the in-memory tier every step "
                "and the persistent tier when Orbax's policy says so), or call "
                "handler.save_to_memory(step, state, host_state) first.")
        with self._lock:
            pec_step, self._next_pec = self._next_pec, None
        if pec_step is not None and pec_step["step"] != memory.step:
            raise RuntimeError(f"the persistent PEC record is for step {pec_step['step']}, "
                               f"the in-memory version for step {memory.step}")
        future = _PersistFuture(self, epath.Path(directory), memory, pec_step)
        with self._lock:
            self._reader = (memory.step, future.read)
            self._writer = future
        future.start()
        return future

    def abort(self) -> None:
        """Stops the persistent write in flight (its Orbax save failed elsewhere)."""
        with self._lock:
            writer = self._writer
        if writer is not None:
            writer.cancel()

    def _persist(self, future: _PersistFuture) -> None:
        """The background work of one persistent save (runs in ``future``'s thread)."""
        ckpt, step, directory = self.checkpointer, future.memory.step, future.directory
        try:
            if future.memory.skipped:
                raise RuntimeError(f"in-memory version {step} was skipped (its writer was busy); "
                                   f"no host-RAM copy to write persistent step {step} from")
            if ckpt.pec is None:
                blocks, host_state = read_own_blocks(ckpt, step, self.read_timeout_s)
                shapes = None
            else:
                blocks, host_state, plan = read_pec_blocks(ckpt, step, self.read_timeout_s)
                blocks, shapes = _carried(ckpt, blocks, plan, future.pec)
        finally:
            future.read.set()
        self._hook(step, "read")
        # Orbax creates the step's directories in the background (primary host);
        # the write starts once this item's directory exists.
        deadline = time.monotonic() + self.read_timeout_s
        while not directory.exists():
            if future.cancelled.is_set():
                raise _Aborted(f"persistent save of step {step} aborted")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{directory} not created after {self.read_timeout_s:.0f}s")
            time.sleep(0.01)
        tree = host_arrays(ckpt, blocks, self._memory_kind(), shapes)
        del blocks
        futures = asyncio.run(self._inner.async_save(directory,
                                                     args=ocp.args.StandardSave(tree)))
        for f in futures or []:
            f.result()
        del tree, futures
        (directory / HOST_STATE_FILE.format(host=ckpt.host)).write_text(json.dumps(host_state))
        self._hook(step, "written")

    def _hook(self, step: int, phase: str) -> None:
        if self.on_persist is not None:
            self.on_persist(step, phase)

    def _memory_kind(self) -> str | None:
        if self.host_memory_kind != "auto":
            return self.host_memory_kind
        device = self.checkpointer.mesh.devices.flat[0]
        if device.platform == "cpu":
            return None  # device memory is host memory
        kinds = {m.kind for m in device.addressable_memories()}
        if "pinned_host" in kinds:
            return "pinned_host"
        log.warning("%s has no pinned_host memory; the persistent tier copies its host buffers "
                    "to the device before Orbax writes them", device.platform)
        return None

    def restore(self, directory, args: CapricornRestore | None = None) -> Any:
        """Restores a persistent step (the memory tier is the manager's business)."""
        if args is None:
            args = CapricornRestore()
        if not isinstance(args, CapricornRestore):
            raise TypeError(f"CapricornHandler restores with CapricornRestore args, got "
                            f"{type(args).__name__}")
        directory = epath.Path(directory)
        abstract = self.target(args.abstract_state)
        if abstract is not None:
            check_tree(abstract, self._inner.metadata(directory).tree, "the persistent checkpoint")
        if abstract is not None and any(leaf is ocp.PLACEHOLDER
                                        for leaf in jax.tree.leaves(abstract)):
            state = self._restore_some(directory, abstract)
        else:
            state = self._inner.restore(directory, args=ocp.args.StandardRestore(abstract))
        host = jax.process_index()
        path = directory / HOST_STATE_FILE.format(host=host)
        self.last_host_state = json.loads(path.read_text()) if path.exists() else {}
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
    """An Orbax commit future: a daemon thread running ``CapricornHandler._persist``.

    A daemon thread (not Orbax's signal-waiting commit thread) so that a save
    whose directory creation failed never holds the process or the host
    buffers longer than ``cancel()`` or the timeout.
    """

    def __init__(self, handler: CapricornHandler, directory: epath.Path, memory: _MemorySave,
                 pec: dict[str, Any] | None = None):
        self.handler, self.directory, self.memory = handler, directory, memory
        self.pec = pec  # the PEC record of the step (experts carried, ...), None: full
        self.read = threading.Event()  # the version's bytes are in RAM (or the read failed)
        self.cancelled = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"capricorn-persist-{memory.step}")

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self.handler._persist(self)
        except _Aborted as e:
            log.info("%s", e)
            self._error = e
        except BaseException as e:  # noqa: BLE001 - raised by result()
            log.error("persistent save of step %d failed on host %d: %s: %s", self.memory.step,
                      jax.process_index(), type(e).__name__, e)
            self._error = e

    def result(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"persistent save of step {self.memory.step} still running after "
                               f"{timeout}s")
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        self.cancelled.set()


@dataclasses.dataclass(frozen=True)
class _MemorySave:
    step: int
    state_id: int
    skipped: bool


@dataclasses.dataclass(frozen=True)
class RestoreInfo:
    """Where the last ``CheckpointManager.restore`` got the state.

    Attributes:
      step: the step restored.
      tier: "memory" or "persistent".
      seconds: wall time of the restore on this host.
      host_state: this host's JSON state saved with that step ({} if none).
      memory_tiers: for the memory tier, how each host got its shards
        ("local" or "peer", see ``recover``); None otherwise.
      bytes_moved: for the memory tier, bytes that came from peers (all hosts).
      pec: under partial expert checkpointing, where the experts came from
        and the restore's PLT (memory tier: ``recover``'s; persistent tier:
        ``source`` holds the persisted step of each expert and ``data_steps``
        the training step of its values); None otherwise.
    """

    step: int
    tier: str
    seconds: float
    host_state: dict[str, Any]
    memory_tiers: list[str] | None = None
    bytes_moved: int | None = None
    pec: PecRestore | None = None


# --------------------------------------------------------------------------- bytes


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start: start + nbytes]


def read_own_blocks(ckpt: InMemoryCheckpointer, step: int, timeout_s: float
                    ) -> tuple[dict[int, list[np.ndarray]], dict[str, Any]]:
    """This host's shard blocks of its committed in-memory version ``step``.

    Waits (at most ``timeout_s``) for the own writer to commit the version, then
    reads its chunks (checksummed) straight into one aligned buffer per unique
    block: peak memory is the host's shards plus one chunk.

    Returns:
      ({mesh position: [block of each leaf]}, host_state), the blocks being what
      ``packing.unpack`` returns for these payloads.
    """
    host, plan, store = ckpt.host, ckpt.plan, ckpt.store
    _await_version(ckpt, step, timeout_s)
    manifest = store.manifest(host, step)
    if manifest["fingerprint"] != plan.fingerprint():
        raise ValueError(f"in-memory version {step} has another layout than the checkpointer")
    positions = plan.host_positions(host)
    local = {p: j for j, p in enumerate(positions)}
    blocks: dict[int, list[np.ndarray]] = {p: [] for p in positions}
    pieces: list[list[tuple[int, int, np.ndarray, int]]] = [[] for _ in positions]
    for i, slot in enumerate(plan.leaves):
        by_key: dict[tuple, np.ndarray] = {}
        for p in positions:
            key = plan.block_keys[i][p]
            if key not in by_key:
                by_key[key] = _aligned(slot.block_bytes)
            buf = by_key[key]
            blocks[p].append(buf.view(np.dtype(slot.dtype)).reshape(slot.block_shape))
            # Device p carries bytes [rank*segment, (rank+1)*segment) of the block.
            lo = plan.ranks[i][p] * slot.segment
            n = min(slot.segment, slot.block_bytes - lo)
            if n > 0:
                pieces[local[p]].append((slot.offset, slot.offset + n, buf, lo))
    for j, row_pieces in enumerate(pieces):
        for k in range(plan.num_chunks):
            clo, chi = plan.chunk_range(k)
            data = np.frombuffer(store.read_chunk(host, step, f"d{j}.c{k}", manifest), np.uint8)
            for lo, hi, buf, dst in row_pieces:
                a, b = max(lo, clo), min(hi, chi)
                if a < b:
                    buf[dst + a - lo: dst + b - lo] = data[a - clo: b - clo]
    return blocks, manifest.get("host_state", {})


def _await_version(ckpt: InMemoryCheckpointer, step: int, timeout_s: float) -> None:
    """Waits (at most ``timeout_s``) until this host's own version ``step`` is committed."""
    deadline = time.monotonic() + timeout_s
    while step not in ckpt.store.versions(ckpt.host):
        if time.monotonic() > deadline:
            raise TimeoutError(f"host {ckpt.host}: in-memory version {step} not committed after "
                               f"{timeout_s:.0f}s")
        time.sleep(0.005)


def read_pec_blocks(ckpt: InMemoryCheckpointer, step: int, timeout_s: float
                    ) -> tuple[dict[int, list[np.ndarray]], dict[str, Any], pec_lib.RestorePlan]:
    """This host's shard blocks of the state a memory-tier restore to PEC
    version ``step`` gives: non-expert state from ``step``, every expert
    (parameters and optimizer state) from its newest copy at or before it.

    Reads from this host's own store only: the version and each version its
    manifest says a restore to it reads (the writer keeps them while ``step``
    is the newest, and the next in-memory save waits for this read). Each
    version is read whole (checksummed) and folded in before the next one.

    Returns:
      ({mesh position: [block of each leaf]}, host_state, the restore plan:
      each expert's source step).
    """
    host, store, tier = ckpt.host, ckpt.store, ckpt.pec
    _await_version(ckpt, step, timeout_s)
    manifest = store.manifest(host, step)
    shape = tier.shape
    top = manifest.get("pec")
    if top is None:  # a version saved whole (without PEC): it is its own source
        tracker = pec_lib.whole_version_tracker(shape, tier.tracker.top_k, step)
        needed, tokens = [step], step * tier.tokens_per_step
    else:
        tracker = pec_lib.PltTracker.from_dict(top["tracker"])
        needed, tokens = sorted({*top["needed"], step}), top["tokens"]
    metas = {v: (manifest if v == step else store.manifest(host, v)).get("pec") or {}
             for v in needed}
    masks = {v: (pec_lib.mask_from_hex(m["mask"], shape) if "mask" in m
                 else np.ones(shape, bool)) for v, m in metas.items()}
    plan = pec_lib.restore_plan(pec_lib.saved_from_masks(masks, shape), step, tracker, tokens)
    blocks = _PecBlocks(ckpt, plan.source)
    for v in needed:
        count = metas[v].get("count")
        layout = ckpt.plan if count is None else make_pec_plan(ckpt.plan, tier.layers, count)
        rows = _read_rows(ckpt, host, v, layout)
        blocks.fold(v, rows, layout, masks[v], v == step)
        del rows
    return blocks.result(), manifest.get("host_state", {}), plan


def _carried(ckpt: InMemoryCheckpointer, blocks: dict[int, list[np.ndarray]],
             plan: pec_lib.RestorePlan, record: dict[str, Any] | None
             ) -> tuple[dict[int, list[np.ndarray]], list[tuple[int, ...]] | None]:
    """The blocks of a persisted step carrying ``record``'s experts, and the
    global shape of each leaf (None: every expert, the state's own shapes).

    An expert leaf keeps only the carried experts of its layer, in ascending
    order: each device's block holds those of its expert-parallel rank (the
    same number on every rank), so the leaf stays sharded like the full one.
    """
    if record is None:
        return blocks, None
    tier = ckpt.pec
    data_step = np.asarray(record["data_step"], np.int64)
    mask = pec_lib.mask_from_hex(record["mask"], tier.shape)
    if not np.array_equal(data_step[mask], plan.source[mask]):
        raise RuntimeError(f"step {record['step']}: the memory tier's copies changed between the "
                           f"persistent record and the read")
    if mask.all():
        return blocks, None
    ep = tier.experts
    shapes = [tuple(leaf.shape) for leaf in jax.tree.leaves(ckpt.abstract_state)]
    out = {p: list(row) for p, row in blocks.items()}
    for i, layer in zip(ep.leaves, ep.layers, strict=True):
        shapes[i] = (int(mask[layer].sum()), *shapes[i][1:])
        done: dict[int, np.ndarray] = {}
        for p in out:
            rank = ep.expert_rank[p]
            if rank not in done:
                local = mask[layer, rank * ep.local_experts:(rank + 1) * ep.local_experts]
                part = blocks[p][i][np.flatnonzero(local)]
                done[rank] = _aligned(part.nbytes).view(part.dtype).reshape(part.shape)
                done[rank][...] = part
            out[p][i] = done[rank]
    return out, shapes


def host_arrays(ckpt: InMemoryCheckpointer, blocks: dict[int, list[np.ndarray]],
                memory_kind: str | None, shapes: list[tuple[int, ...]] | None = None) -> Any:
    """Global arrays (this host's shards) wrapping host ``blocks`` (no copy on
    CPU); ``shapes``: the global shape of each leaf, when not the state's."""
    devices = list(ckpt.mesh.devices.flat)
    leaves, treedef = jax.tree.flatten(ckpt.abstract_state)
    out = []
    for i, (leaf, sharding) in enumerate(zip(leaves, jax.tree.leaves(ckpt.state_shardings),
                                             strict=True)):
        shape = leaf.shape if shapes is None else shapes[i]
        if memory_kind is not None:
            sharding = sharding.with_memory_kind(memory_kind)
        arrays = [jax.device_put(blocks[p][i], SingleDeviceSharding(devices[p],
                                                                    memory_kind=memory_kind))
                  for p in sorted(blocks)]
        out.append(jax.make_array_from_single_device_arrays(shape, sharding, arrays))
    return jax.tree.unflatten(treedef, out)


def _flat(tree: Any) -> dict[tuple, Any]:
    return ocp.tree.to_flat_dict(tree)


def _name(path: tuple) -> str:
    return "/".join(str(k) for k in path)


def check_tree(abstract: Any, saved: Any, where: str) -> None:
    """Raises ValueError naming the first leaf where ``abstract`` and ``saved`` differ.

    Args:
      abstract: the restore target (leaves with .shape and .dtype).
      saved: the saved tree (Orbax metadata tree, or ShapeDtypeStructs).
      where: what ``saved`` is, for the message.
    """
    want, have = _flat(abstract), _flat(saved)
    missing = [k for k in want if k not in have]
    extra = [k for k in have if k not in want]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"leaf {_name(missing[0])} of the target is not in {where}")
        if extra:
            parts.append(f"leaf {_name(extra[0])} of {where} is not in the target")
        raise ValueError(f"restore target does not match {where}: " + "; ".join(parts) +
                         f" ({len(missing)} missing, {len(extra)} extra leaves)")
    for key, target in want.items():
        if target is ocp.PLACEHOLDER:  # a leaf not restored
            continue
        got = have[key]
        shape, dtype = tuple(getattr(got, "shape", ())), getattr(got, "dtype", None)
        if tuple(target.shape) != shape:
            raise ValueError(f"restore target does not match {where} at leaf {_name(key)}: "
                             f"shape {shape} in {where}, {tuple(target.shape)} in the target")
        if dtype is not None and np.dtype(dtype) != np.dtype(target.dtype):
            raise ValueError(f"restore target does not match {where} at leaf {_name(key)}: "
                             f"dtype {np.dtype(dtype).name} in {where}, "
                             f"{np.dtype(target.dtype).name} in the target")


# --------------------------------------------------------------------------- manager


class CheckpointManager(ocp.CheckpointManager):
    """``ocp.CheckpointManager`` with the memory tier on every ``save`` (module docstring).

    Takes ``ocp.CheckpointManager``'s arguments; ``handler_registry`` must map one
    item to a ``CapricornHandler`` (``handler.registry("state")`` builds one).

    Attributes:
      handler: the CapricornHandler; item: its item name.
      last_memory_report: the SaveReport of the newest in-memory save.
      persistent_errors: one dict per failed persistent save ({"step", "error"}),
        in the order they were noticed (metrics can report ``len()``).
      last_restore: RestoreInfo of the newest restore() of the capricorn item.
    """

    def __init__(self, directory, *args, handler_registry=None, **kwargs):
        self.item, self.handler = _find_handler(handler_registry)
        self.persistent_errors: list[dict[str, Any]] = []
        self.last_memory_report: SaveReport | None = None
        self.last_restore: RestoreInfo | None = None
        self._failed_cleanup = False
        self._persist_step: int | None = None
        self._pec_records: dict[int, dict[str, Any] | None] = {}
        self.last_persist: dict[str, Any] | None = None
        super().__init__(directory, *args, handler_registry=handler_registry, **kwargs)
        tier = self._pec_tier()
        if tier is not None:
            # Retention under PEC: Orbax's own policy (max_to_keep, ...), and
            # every step that holds some expert's newest persisted copy.
            self._preservation_policy = ocp.checkpoint_managers.AnyPreservationPolicy(
                [self._preservation_policy, _KeepNewestCopies(self, tier.shape)])

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
        return self._persist(step, args, metrics, force, custom_metadata)

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
        return self._persist(step, args, None, force, None)

    def _persist(self, step: int, args, metrics, force: bool,
                 custom_metadata: dict[str, Any] | None) -> bool:
        if not self.is_saving_in_progress():
            self._collect_errors()  # non-blocking: the previous save has finished
        if not force and not self.should_save(step):
            return False
        self._collect_errors()  # waits for the previous persistent save, as Orbax would
        self._persist_step = step
        unwritable = self._unwritable()
        if unwritable is not None:
            self._record(step, PermissionError(unwritable))
            return False
        if self._pec_tier() is not None:
            try:
                record = self._pec_record(step)  # collective
            except ValueError as e:
                self._record(step, e)
                return False
            self._pec_records[step] = record
            self.handler.set_pec_record(record)
            custom_metadata = {**(custom_metadata or {}), PEC_METADATA: record}
        try:
            started = super().save(step, args=args, metrics=metrics, force=force,
                                   custom_metadata=custom_metadata)
        except Exception as e:  # noqa: BLE001 - the memory tier goes on
            self._record(step, e)
            return False
        if not started:
            self._pec_records.pop(step, None)
            self.handler.set_pec_record(None)
        elif step in self._pec_records:
            record = self._pec_records[step]
            self.last_persist = {key: record[key] for key in
                                 ("step", "k_persist", "plt", "accumulated_plt", "experts")}
        return started

    def _unwritable(self) -> str | None:
        """Why some host cannot create directories in the persistent root (collective), or None.

        Every host probes (each writes its own files of a step) and the answers
        are all-gathered, so either every host starts the Orbax save or none
        does. Object stores (``gs://``...) have no directory permissions and are
        not probed. Without this, an unwritable root fails inside Orbax's background
        directory creation, whose waiting threads linger for Orbax's barrier
        timeout (300 s) before the failure is known.
        """
        mine = ""
        if "://" not in str(self.directory):  # a local or mounted filesystem
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".capricorn-probe-", dir=str(self.directory)))
            except OSError as e:
                mine = f"host {jax.process_index()}: {self.directory} is not writable: {e}"
        everyone = _allgather_json(mine, jax.process_count())
        problems = [x for x in everyone if x]
        return "; ".join(problems) if problems else None

    def _collect_errors(self) -> None:
        """Waits for the persistent save in flight; records (not raises) its failure."""
        try:
            super().wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._record(self._persist_step, e)
        self._cleanup_failed()

    def _record(self, step: int | None, error: BaseException) -> None:
        log.error("persistent checkpoint of step %s failed: %s: %s; training goes on with the "
                  "in-memory tier", step, type(error).__name__, error)
        self.persistent_errors.append({"step": step, "error": f"{type(error).__name__}: {error}"})
        self._failed_cleanup = True
        self._pec_records.pop(step, None)
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
        if step is None:
            if memory is not None and (newest_disk is None or memory >= newest_disk):
                state = self._restore_memory(abstract, newest_disk, start)
                if state is not None:
                    return ocp.args.Composite(**{self.item: state})
            step = newest_disk
            if step is None:
                raise FileNotFoundError(f"no checkpoint in the memory tier nor in "
                                        f"{directory or self.directory}")
        elif step not in persistent:
            state = self._restore_memory(abstract, step, start) if step == memory else None
            if state is None or self.last_restore.step != step:
                raise FileNotFoundError(f"step {step} is neither a persistent step "
                                        f"({persistent}) nor the memory tier's newest version "
                                        f"({memory})")
            return ocp.args.Composite(**{self.item: state})
        state, host_state, pec = self._restore_persistent(step, abstract, directory)
        self.last_restore = RestoreInfo(step, "persistent", time.perf_counter() - start,
                                        host_state, pec=pec)
        return ocp.args.Composite(**{self.item: state})

    def _restore_persistent(self, step: int, abstract: Any, directory
                            ) -> tuple[Any, dict[str, Any], PecRestore | None]:
        """Persistent step ``step``: (state, host state, PEC restore info or None).

        A step with a PEC record that does not carry every expert is assembled
        (``_assemble``): non-expert state from ``step``, each expert from its
        newest persisted copy at or before it. A PEC memory tier then goes on
        from the restored step (``_resume_memory_tier``).
        """
        record = None
        if directory is None:
            record = self._pec_record_of(step)
            # Every host takes the primary host's view: whether the step is a
            # PEC step, and which steps it may read.
            primary = _allgather_json({"pec": record is not None, "steps": [
                s for s in self.all_steps() if s <= step]}, jax.process_count())[0]
            if primary["pec"] != (record is not None):
                raise ValueError(f"persistent step {step}: host {jax.process_index()} reads its "
                                 f"PEC record differently from the primary host")
        if record is None:
            state = self._restore_step(step, abstract, directory)
            self._resume_memory_tier(step, None, None)
            return state, self.handler.last_host_state, None
        copies = self._copies(primary["steps"])
        tracker = pec_lib.PltTracker.from_dict(record["tracker"])
        plan = pec_lib.persisted_plan(copies, step, record["cumulative"], tracker.restored_lost,
                                      record["tokens"], tracker.top_k)
        needed = sorted({*(int(s) for s in np.unique(plan.source)), step})
        if needed == [step]:  # the step carries every expert: a standard full step
            state = self._restore_step(step, abstract, None)
            host_state = self.handler.last_host_state
        else:
            if abstract is None:
                raise ValueError(f"persistent step {step} carries some experts only; restoring "
                                 f"it needs CapricornRestore(abstract_state) (or a handler with "
                                 f"an InMemoryCheckpointer)")
            state, host_state = self._assemble(step, needed, plan, record, copies, abstract)
        self._resume_memory_tier(step, record, plan)
        info = PecRestore(plan.plt, plan.accumulated_plt, plan.source.tolist(), needed,
                          int(record["k_persist"]), plan.data_step.tolist())
        return state, host_state, info

    def _restore_step(self, step: int, abstract: Any, directory) -> Any:
        restored = super().restore(step, directory=directory, args=ocp.args.Composite(
            **{self.item: CapricornRestore(abstract)}))
        return restored[self.item]

    def _assemble(self, point: int, needed: list[int], plan: pec_lib.PersistedPlan,
                  record: dict[str, Any], copies: dict[int, tuple], abstract: Any
                  ) -> tuple[Any, dict[str, Any]]:
        """The state of a restore to ``point`` from several persisted steps.

        Step ``point`` gives every non-expert leaf; each needed step gives the
        carried experts that are the newest copies (its other leaves are not
        read: Orbax placeholders). Each expert leaf is then gathered, in one
        jitted program, from the rows of those steps into the target's sharding:
        an expert's parameters and moments come from one step, its source.
        """
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        paths = [jax.tree_util.keystr(path) for path, _ in flat]
        targets = [leaf for _, leaf in flat]
        layer_of = {path: int(layer) for path, layer in record["expert_leaves"].items()}
        unknown = sorted(set(layer_of) - set(paths))
        if unknown:
            raise ValueError(f"restore target has no leaf {unknown[0]}, an expert leaf of "
                             f"persistent step {point}")
        base: list[Any] = []
        host_state: dict[str, Any] = {}
        pieces: dict[str, list[tuple[Any, np.ndarray, int]]] = {path: [] for path in layer_of}
        for v in [point, *(s for s in needed if s != point)]:
            mask = copies[v][0]

            def target(path: str, leaf: Any, v: int = v, mask: np.ndarray = mask) -> Any:
                if path not in layer_of:
                    return leaf if v == point else ocp.PLACEHOLDER
                layer = layer_of[path]
                if not np.any(plan.source[layer] == v):
                    return ocp.PLACEHOLDER
                shape = (int(mask[layer].sum()), *leaf.shape[1:])
                return jax.ShapeDtypeStruct(shape, leaf.dtype,
                                            sharding=_fitting(getattr(leaf, "sharding", None),
                                                              shape))

            tree = jax.tree.unflatten(treedef, [target(p, leaf)
                                                for p, leaf in zip(paths, targets, strict=True)])
            leaves = treedef.flatten_up_to(self._restore_step(v, tree, None))
            if v == point:
                base, host_state = leaves, self.handler.last_host_state
            for n, path in enumerate(paths):
                if path in layer_of and leaves[n] is not ocp.PLACEHOLDER:
                    pieces[path].append((leaves[n], np.flatnonzero(mask[layer_of[path]]), v))
        index: dict[str, np.ndarray] = {}
        for path, parts in pieces.items():
            row = plan.source[layer_of[path]]
            index[path], offset = np.full(row.shape, -1, np.int64), 0
            for _, experts, v in parts:
                take = row[experts] == v
                index[path][experts[take]] = offset + np.flatnonzero(take)
                offset += experts.size
            assert np.all(index[path] >= 0), path
        shardings = {p: getattr(t, "sharding", None) for p, t in zip(paths, targets, strict=True)
                     if p in layer_of}
        if all(sh is not None for sh in shardings.values()):
            gather = jax.jit(lambda arrays: {p: jnp.concatenate(arrays[p])[index[p]]
                                             for p in arrays}, out_shardings=shardings)
            experts = gather({p: [a for a, _, _ in parts] for p, parts in pieces.items()})
        else:  # a target without shardings restores numpy arrays
            experts = {p: np.concatenate([np.asarray(a) for a, _, _ in parts])[index[p]]
                       for p, parts in pieces.items()}
        leaves = [experts[p] if p in layer_of else base[n] for n, p in enumerate(paths)]
        return jax.tree.unflatten(treedef, leaves), host_state

    def _resume_memory_tier(self, step: int, record: dict[str, Any] | None,
                            plan: pec_lib.PersistedPlan | None) -> None:
        """A PEC memory tier goes on from persistent step ``step``: no copy of any
        expert in memory yet (its next version carries all), the losses of the
        restores so far, and the cumulative assignments at ``step``."""
        tier = self._pec_tier()
        if tier is None:
            return
        tracker = pec_lib.PltTracker(*tier.shape, tier.tracker.top_k, step)
        k = cumulative = None
        if record is not None:
            before = pec_lib.PltTracker.from_dict(record["tracker"])
            tracker.restored_lost[:] = before.restored_lost + plan.lost
            k, cumulative = int(record["memory_k"]), record["cumulative"]
        self.handler.checkpointer.resume_pec(tracker, k, cumulative)

    # ----- PEC records -----
    def _pec_tier(self):
        ckpt = self.handler.checkpointer
        return None if ckpt is None else ckpt.pec

    def _pec_record_of(self, step: int) -> dict[str, Any] | None:
        """The PEC record of persistent step ``step`` (its custom metadata), None
        for a step without one (written without PEC) or unreadable."""
        if step in self._pec_records:
            return self._pec_records[step]
        try:
            custom = self.metadata(step).custom_metadata or {}
        except Exception as e:  # noqa: BLE001 - a step being deleted, or damaged
            log.warning("persistent step %d: no readable metadata (%s: %s); taken as a step "
                        "without PEC", step, type(e).__name__, e)
            return None
        record = custom.get(PEC_METADATA)
        if record is not None and record.get("format") != _PEC_FORMAT:
            raise ValueError(f"persistent step {step}: unknown PEC record format "
                             f"{record.get('format')!r}")
        self._pec_records[step] = record
        return record

    def _copies(self, steps: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """{step with a PEC record: (experts carried, assignments at their values,
        the training step of their values)} (``pec.persisted_plan``'s copies)."""
        out = {}
        for step in steps:
            record = self._pec_record_of(step)
            if record is not None:
                shape = tuple(record["shape"])
                out[step] = (pec_lib.mask_from_hex(record["mask"], shape),
                             np.asarray(record["at_copy"], np.int64),
                             np.asarray(record["data_step"], np.int64))
        return out

    def _pec_record(self, step: int) -> dict[str, Any]:
        """Decides the PEC record of persistent step ``step`` (collective).

        The experts it carries (``pec.persist_mask`` over the committed steps'
        newest copies, as the primary host sees them: every host takes its
        decision), the training step and the cumulative assignments of each
        carried expert's values (the memory tier's tracker at ``step``), and
        the PLT a restore from the persistent tier would have once it is written.

        Raises:
          ValueError: version ``step`` is not the memory tier's newest on some host.
        """
        ckpt = self.handler.checkpointer
        tier = ckpt.pec
        tracker, shape = tier.tracker, tier.shape
        k = tier.dyn.options.k_persist or shape[1]
        copies = self._copies([s for s in self.all_steps() if s < step])
        newest = pec_lib.newest_copies({s: c[0] for s, c in copies.items()}, shape)
        mask = pec_lib.persist_mask(k, newest, tier.ranks, fresh=tracker.saved_step)
        problem = ""
        if tracker.step != step:
            problem = (f"host {ckpt.host}: persistent step {step} under PEC is written from the "
                       f"memory tier's newest version, which is {tracker.step}")
        everyone = _allgather_json({"problem": problem, "mask": pec_lib.mask_to_hex(mask)},
                                   jax.process_count())
        problems = [e["problem"] for e in everyone if e["problem"]]
        if problems:
            raise ValueError("; ".join(problems))
        mask = pec_lib.mask_from_hex(everyone[0]["mask"], shape)
        cumulative = tier.cumulative
        data_step = np.where(mask, tracker.saved_step, -1)
        at_copy = np.where(mask, cumulative - tracker.since_save, -1)
        tokens = step * tier.tokens_per_step
        plan = pec_lib.persisted_plan({**copies, step: (mask, at_copy, data_step)}, step,
                                      cumulative, tracker.restored_lost, tokens, tracker.top_k)
        paths = jax.tree_util.tree_flatten_with_path(ckpt.abstract_state)[0]
        return {
            "format": _PEC_FORMAT, "step": step, "k_persist": int(mask.sum(axis=1).max()),
            "experts": [np.flatnonzero(row).tolist() for row in mask],
            "shape": list(shape), "mask": pec_lib.mask_to_hex(mask), "ranks": tier.ranks,
            "data_step": data_step.tolist(), "at_copy": at_copy.tolist(),
            "cumulative": cumulative.tolist(), "tracker": tracker.to_dict(),
            "memory_k": tier.k, "tokens": tokens, "plt": plan.plt,
            "accumulated_plt": plan.accumulated_plt, "source": plan.source.tolist(),
            "expert_leaves": {jax.tree_util.keystr(path): layer
                              for (path, _), layer in zip(paths, tier.layers, strict=True)
                              if layer is not None},
        }

    def _restore_memory(self, abstract: Any, at_least: int | None, start: float) -> Any:
        """The memory tier's newest version, if it is at least ``at_least`` (collective)."""
        ckpt = self.handler.checkpointer
        mine = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), ckpt.abstract_state)
        check_tree(abstract, mine, "the in-memory checkpoint")
        recovered = recover(ckpt)
        if recovered is None or (at_least is not None and recovered.step < at_least):
            # Every version newer than the persistent step failed its checksums.
            log.warning("memory tier gave %s; using the persistent tier",
                        None if recovered is None else f"version {recovered.step}")
            return None

        def place(x, target):
            sharding = getattr(target, "sharding", None)
            return x if sharding is None or x.sharding == sharding else jax.device_put(x, sharding)

        state = jax.tree.map(place, recovered.state, abstract)
        self.last_restore = RestoreInfo(recovered.step, "memory", time.perf_counter() - start,
                                        recovered.host_state, recovered.tiers,
                                        recovered.bytes_moved, recovered.pec)
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


class _KeepNewestCopies:
    """An Orbax preservation policy: keeps every persistent step that holds some
    expert's newest persisted copy (a restore of the newest step reads them)."""

    def __init__(self, manager: CheckpointManager, shape: tuple[int, int]):
        self.manager, self.shape = manager, shape

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        del context
        steps = [info.step for info in checkpoints]
        masks = {s: c[0] for s, c in self.manager._copies(steps).items()}
        keep = pec_lib.covering_steps(masks, self.shape)
        return [s in keep for s in steps]


def _fitting(sharding: Any, shape: tuple[int, ...]) -> Any:
    """``sharding`` if it can hold an array of ``shape``, else the same devices, replicated."""
    if sharding is None:
        return None
    try:
        sharding.shard_shape(shape)
        return sharding
    except ValueError:
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
        devices = np.array(sorted(sharding.device_set, key=lambda d: d.id))
        return NamedSharding(Mesh(devices, ("devices",)), PartitionSpec())


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
