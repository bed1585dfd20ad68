"""The writers of the in-memory tier: two threads that put versions in the host store.

One thread writes this host's own versions, one the replicas it received
(each version's chunks in parallel on a small pool: file writes and their
CRC32C release the GIL). A writer removes the versions of its owner that the
training thread decided away before it writes (``_remove_doomed``), so a
removal never races a write of the same owner, and records each committed
version in ``held`` / ``newest``, which the status round reads under
``lock``. An own version may reach its slot straight from the device
(``pinned.SlotCopier``; ``copy_into_slot`` on the training thread, the
writer then waits for the copy and checksums in place). Fault injection
(``hooks.FaultHooks``, test-only) stalls the replica writer or pauses it
halfway through a version.

Design choice: the writers as a component of ``InMemoryCheckpointer`` (its
``writers``): it hands them versions through ``own_q`` / ``rep_q`` and its
status round reads their records (``held``, ``newest``, under ``lock``); the
writers' state is theirs and public, the checkpointer's saves and lifecycle
are not theirs to see. Alternative not taken (the previous state): the
writers as the checkpointer's base class, which shared every private name of
the two halves and let a save reach into a writer's internals.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any

import jax
import numpy as np

from capricorn_jax._src.memory.store.pinned import SlotCopier
from capricorn_jax._src.memory.store.store import HostStore
from capricorn_jax._src.memory.tier.hooks import NO_FAULTS, FaultHooks
from capricorn_jax._src.memory.wire.packing import PackPlan, decode_trailer
from capricorn_jax._src.memory.wire.transport import local_rows

log = logging.getLogger("capricorn_jax")


class VersionWriters:
    """The own and replica writer threads of one host (see the module doc).

    Args:
      store: this host's store.
      host, hosts: this process's index and the process count.
      sources: the owners whose replicas this host receives, one per round.
      copier: copies own versions straight into slots, or None.
      hooks: test-only fault injection; None: none.
      write_threads: chunks of one version written in parallel.
    """

    def __init__(self, store: HostStore, host: int, hosts: int, sources: list[int],
                 copier: SlotCopier | None, hooks: FaultHooks | None, write_threads: int):
        self.store, self.host, self.sources, self.copier = store, host, sources, copier
        self.hooks = NO_FAULTS if hooks is None else hooks
        # Guards held, newest and doomed (the writers commit, the training
        # thread decides removals and reports).
        self.lock = threading.Lock()
        self.held = {o: set(self.store.versions(o)) for o in self.store.owners()}
        self.newest = {o: max(self.held.get(o, ()), default=-1) for o in range(hosts)}
        self.doomed: dict[int, list[int]] = {}  # owner -> versions its writer removes
        self.own_queued: set[int] = set()  # own versions handed to the writer, not written yet
        self.own_q: queue.Queue = queue.Queue(maxsize=1)
        self.rep_q: queue.Queue = queue.Queue(maxsize=1)
        self.errors: list[BaseException] = []
        # (owner, version) of replicas not stored: their end-to-end check failed.
        self.corrupt_replicas: list[tuple[int, int]] = []
        self._write_pool = concurrent.futures.ThreadPoolExecutor(
            write_threads, thread_name_prefix="ckpt-chunk-writer")
        self._threads = [
            threading.Thread(target=self._run, args=(self.own_q, self._write_own), daemon=True,
                             name="ckpt-own-writer"),
            threading.Thread(target=self._run, args=(self.rep_q, self._write_replicas),
                             daemon=True, name="ckpt-replica-writer"),
        ]
        for t in self._threads:
            t.start()

    def _run(self, q: queue.Queue, work) -> None:
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                work(*item)
            except BaseException as e:  # noqa: BLE001 - reported by the next save
                log.exception("host %d: checkpoint writer failed", self.host)
                self.errors.append(e)
            finally:
                q.task_done()

    def copy_into_slot(self, step: int, own: jax.Array, plan: PackPlan) -> _InSlot:
        """Takes the own version's slot and starts the copier's copy of this
        host's device rows into it (training thread; the copy is asynchronous
        on an accelerator)."""
        assert self.copier is not None  # called only with a copier
        mesh = own.sharding.mesh  # type: ignore[attr-defined]  # a NamedSharding: the transport's
        position = {d: p for p, d in enumerate(mesh.devices.flat)}
        rows = [s.data for _, s in sorted((position[s.device], s)
                                          for s in own.addressable_shards)]
        writer = self.store.begin(self.host, step, len(rows) * plan.payload_bytes)
        try:
            self.copier.copy(rows, writer.slot.view, plan.payload_bytes)
        except BaseException:
            writer.abort()
            raise
        return _InSlot(writer, len(rows))

    def _write_version(self, owner: int, step: int, rows: list[np.ndarray] | _InSlot,
                       plan: PackPlan, pec_meta: dict | None,
                       pause_halfway: bool = False) -> None:
        self._remove_doomed(owner)
        if isinstance(rows, _InSlot):  # the bytes are (being) copied into the slot
            writer = rows.writer
            assert self.copier is not None  # an _InSlot comes from _copy_into_slot
            self.copier.wait()
            names = [(j, k) for j in range(rows.rows) for k in range(plan.num_chunks)]
            rows = [writer.slot.view[j * plan.payload_bytes:(j + 1) * plan.payload_bytes]
                    for j in range(rows.rows)]
            in_slot = True
        else:
            # Sized once; row j at j * payload, its chunks back to back, so a
            # reader copies a whole row at once (store.read_span_into).
            writer = self.store.begin(owner, step, len(rows) * plan.payload_bytes)
            names = [(j, k) for j in range(len(rows)) for k in range(plan.num_chunks)]
            in_slot = False

        def write(name: tuple[int, int]) -> None:
            j, k = name
            lo, hi = plan.chunk_range(k)
            if in_slot:  # checksummed in place, on the pool's thread
                writer.adopt_chunk(f"d{j}.c{k}", j * plan.payload_bytes + lo, hi - lo)
                return
            writer.write_chunk(f"d{j}.c{k}", rows[j][lo:hi].data,
                               offset=j * plan.payload_bytes + lo)

        halves = [names]
        on_pause = self.hooks.on_pause
        if pause_halfway and on_pause is not None:
            halves = [names[:len(names) // 2], names[len(names) // 2:]]
        for n, part in enumerate(halves):
            if n == 1 and on_pause is not None:
                on_pause(step)
            list(self._write_pool.map(write, part))  # raises the first failed write
        meta = {
            "fingerprint": plan.fingerprint(), "leaves": plan.leaf_table(),
            "payload_bytes": plan.payload_bytes, "chunk_bytes": plan.chunk_bytes,
            "devices": len(rows), "host_state": decode_trailer(plan, rows[0]),
        }
        if pec_meta is not None:
            meta["pec"] = pec_meta
        writer.commit(meta)
        with self.lock:
            self.held.setdefault(owner, set()).add(step)
            self.newest[owner] = max(self.newest.get(owner, -1), step)

    def _remove_doomed(self, owner: int) -> None:
        """Removes the versions of ``owner`` decided away (by that owner's writer,
        so a removal never races a write of the same owner)."""
        with self.lock:
            doomed = self.doomed.pop(owner, [])
        for v in doomed:
            self.store.remove(owner, v)

    def _write_own(self, step: int, own, plan: PackPlan, pec_meta: dict | None) -> None:
        try:
            self._write_version(self.host, step, _host_rows(own), plan, pec_meta)
        finally:
            with self.lock:
                self.own_queued.discard(step)

    def _write_replicas(self, step: int, received: list, plan: PackPlan,
                        pec_meta: dict | None, corrupt: list | None = None) -> None:
        """Writes version ``step`` of each source host; ``corrupt`` (the
        in-graph exchange's end-to-end check, per round: bool [devices,
        chunks]) set for a round on this host's rows, that replica is not
        stored (its owner's version is then held by no holder here, so it is
        never committed) and ``corrupt_replicas`` records it."""
        stall = self.hooks.stall_replica_writer_at
        if stall is not None and stall[0] == step:
            log.warning("host %d: fault injection: replica writer stalls %.1fs at step %d",
                        self.host, stall[1], step)
            time.sleep(stall[1])
        pause = self.hooks.pauses_at(step)
        checks = corrupt if corrupt is not None else [None] * len(received)
        for owner, array, bad in zip(self.sources, received, checks, strict=True):
            failed = [] if bad is None else _failed_chunks(bad)
            if failed:
                log.warning("host %d: version %d from host %d failed its end-to-end check in "
                            "transit (local device, chunk: %s); not stored", self.host, step,
                            owner, failed)
                self.corrupt_replicas.append((owner, step))
                continue
            self._write_version(owner, step, _host_rows(array), plan, pec_meta,
                                pause_halfway=pause)

    def wait_until_finished(self, timeout_s: float | None = None) -> None:
        """Blocks until both writers are idle (bounded by ``timeout_s``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for q in (self.own_q, self.rep_q):
            while q.unfinished_tasks:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"host {self.host}: checkpoint writers still busy")
                time.sleep(0.01)
        if self.errors:
            raise RuntimeError(f"host {self.host}: checkpoint writer failed") from self.errors[0]

    def stop(self) -> None:
        """Ends both threads (after ``wait_until_finished``) and the pool."""
        for owner in list(self.doomed):
            self._remove_doomed(owner)
        for q in (self.own_q, self.rep_q):
            q.put(None)
        for t in self._threads:
            t.join(timeout=5.0)
        self._write_pool.shutdown(wait=False)


@dataclasses.dataclass(frozen=True)
class _InSlot:
    """An own version whose rows a copier is putting into ``writer``'s slot."""

    writer: Any  # store.VersionWriter
    rows: int


def _failed_chunks(bad: Any) -> list[tuple[int, int]]:
    """(local device, chunk) pairs of this host's rows whose check failed."""
    rows = local_rows(bad) if not isinstance(bad, np.ndarray) else list(bad)
    return [(j, int(k)) for j, row in enumerate(rows) for k in np.flatnonzero(row)]


def _host_rows(payload: Any) -> list[np.ndarray] | _InSlot:
    """This host's rows of a payload: views of a [devices, n] array's local
    buffers (the writer copies them into the store), or a numpy array's rows."""
    if isinstance(payload, _InSlot):
        return payload
    if isinstance(payload, np.ndarray):
        return list(payload)
    return local_rows(payload, copy=False)
