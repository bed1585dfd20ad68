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

Not supported: an ``InMemoryCheckpointer`` with partial expert checkpointing
(its versions hold K experts, the disk tier needs whole ones).

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
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import SingleDeviceSharding

from capricorn_jax._src.inmemory import InMemoryCheckpointer, SaveReport
from capricorn_jax._src.recovery import _allgather_json, choose_version, recover

log = logging.getLogger("capricorn_jax")

HOST_STATE_FILE = "capricorn_host_state.{host}.json"
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
        if checkpointer is not None and getattr(checkpointer, "pec", None) is not None:
            raise ValueError("CapricornHandler writes the persistent tier from whole in-memory "
                             "versions; a checkpointer with partial expert checkpointing "
                             "(InMemoryOptions.pec) is not supported")
        self.checkpointer = checkpointer
        self.host_memory_kind = host_memory_kind
        self.read_timeout_s = read_timeout_s
        self.on_persist: Callable[[int, str], None] | None = None
        self._inner = ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt)
        # What Orbax records as this item's handler in the step metadata: the
        # files are the standard handler's, so plain Orbax can restore them.
        # (Instance attribute: the class keeps its own typestr for the global
        # handler-type registry, which refuses two classes with one typestr.)
        self.typestr = ocp.StandardCheckpointHandler.typestr
        self._lock = threading.Lock()
        self._memory: _MemorySave | None = None
        self._reader: tuple[int, threading.Event] | None = None
        self._writer: _PersistFuture | None = None
        self._closed = False
        self.last_host_state: dict[str, Any] = {}

    def registry(self, item: str = "state") -> ocp.handlers.DefaultCheckpointHandlerRegistry:
        """A handler registry mapping ``item`` (save and restore args) to this handler."""
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add(item, CapricornSave, self)
        registry.add(item, CapricornRestore, self)
        return registry

    # ----- memory tier (training thread, collective) -----
    def save_to_memory(self, step: int, state: Any, host_state: dict[str, Any] | None = None
                       ) -> SaveReport:
        """Checkpoints ``state`` as in-memory version ``step`` (all hosts, every step)."""
        ckpt = self._require_checkpointer("save")
        self.await_reader()
        own = ckpt.store.versions(ckpt.host)
        if step in own:
            # A version with this number left by an earlier run: drop it so the
            # persistent reader can only see the version written now.
            ckpt.store.prune(ckpt.host, [v for v in own if v != step])
        report = ckpt.save(step, state, host_state or {})
        with self._lock:
            self._memory = _MemorySave(step, id(state), report.skipped)
        return report

    def adopt_memory_version(self, step: int, state: Any) -> None:
        """Takes in-memory version ``step``, saved by the caller through the
        checkpointer, as the one the next ``async_save`` of ``state`` persists."""
        self._require_checkpointer("persist")
        with self._lock:
            self._memory = _MemorySave(step, id(state), False)

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
        future = _PersistFuture(self, epath.Path(directory), memory)
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
            blocks, host_state = read_own_blocks(ckpt, step, self.read_timeout_s)
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
        tree = host_arrays(ckpt, blocks, self._memory_kind())
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
        state = self._inner.restore(directory, args=ocp.args.StandardRestore(abstract))
        host = jax.process_index()
        path = directory / HOST_STATE_FILE.format(host=host)
        self.last_host_state = json.loads(path.read_text()) if path.exists() else {}
        return state

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
    """Save args: the train state and this host's JSON state (at most 8 KiB)."""

    state: Any
    host_state: dict[str, Any] | None = None


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

    def __init__(self, handler: CapricornHandler, directory: epath.Path, memory: _MemorySave):
        self.handler, self.directory, self.memory = handler, directory, memory
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
    """

    step: int
    tier: str
    seconds: float
    host_state: dict[str, Any]
    memory_tiers: list[str] | None = None
    bytes_moved: int | None = None


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
    deadline = time.monotonic() + timeout_s
    while step not in store.versions(host):
        if time.monotonic() > deadline:
            raise TimeoutError(f"host {host}: in-memory version {step} not committed after "
                               f"{timeout_s:.0f}s")
        time.sleep(0.005)
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


def host_arrays(ckpt: InMemoryCheckpointer, blocks: dict[int, list[np.ndarray]],
                memory_kind: str | None) -> Any:
    """Global arrays (this host's shards) wrapping host ``blocks`` (no copy on CPU)."""
    devices = list(ckpt.mesh.devices.flat)
    leaves, treedef = jax.tree.flatten(ckpt.abstract_state)
    out = []
    for i, (leaf, sharding) in enumerate(zip(leaves, jax.tree.leaves(ckpt.state_shardings),
                                             strict=True)):
        if memory_kind is not None:
            sharding = sharding.with_memory_kind(memory_kind)
        arrays = [jax.device_put(blocks[p][i], SingleDeviceSharding(devices[p],
                                                                    memory_kind=memory_kind))
                  for p in sorted(blocks)]
        out.append(jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays))
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
        super().__init__(directory, *args, handler_registry=handler_registry, **kwargs)

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
        self.last_memory_report = self.handler.save_to_memory(step, cap.state, cap.host_state)
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
        try:
            return super().save(step, args=args, metrics=metrics, force=force,
                                custom_metadata=custom_metadata)
        except Exception as e:  # noqa: BLE001 - the memory tier goes on
            self._record(step, e)
            return False

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
        restored = super().restore(step, directory=directory, args=ocp.args.Composite(
            **{self.item: CapricornRestore(abstract)}))
        self.last_restore = RestoreInfo(step, "persistent", time.perf_counter() - start,
                                        self.handler.last_host_state)
        return restored

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
                                        recovered.bytes_moved)
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
