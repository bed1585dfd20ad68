"""The in-memory checkpoint tier: a version of the whole train state every step,
in this host's RAM and in the RAM of m-1 peers.

Lifecycle (all hosts call the same methods in the same order, from the thread
that runs the training steps, because each call runs collectives):

* ``InMemoryCheckpointer(...)`` opens this host's store (removing partial
  versions a crash left) and compiles nothing yet.
* ``restore()`` (once, at start) agrees with the other hosts on the newest
  version every host's shards can be read at, and loads it (``recovery``).
* ``save(step, state, host_state)`` after each training step: dispatches the
  pack + replicate program on ``state`` (async; its outputs are fresh arrays,
  so the next step may donate ``state``), and hands the outputs to two writer
  threads: one writes this host's own version, one the replicas it received.
  A save waits for the previous own version's writer for at most
  ``writer_timeout_s``; a replica version that arrives while the replica
  writer is still busy is dropped (and shows up as under-replicated).
* ``close()`` drains the writers.

When a version is safe: version v of owner o is *replicated* when every holder
of o (placement) reports, through the status vector all-gathered by each
replicate call, that it committed v or newer. The store keeps, per owner, the
newest committed version and the newest one replicated everywhere, so a
consistent version survives any single host loss at any moment.

Alternative not taken: a blocking save that returns when every replica is
written. It is simpler but puts the peer's disk-less write and the slowest
host on every step's critical path.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from capricorn_jax._src import placement
from capricorn_jax._src.options import InMemoryOptions
from capricorn_jax._src.packing import PackPlan, decode_trailer, encode_trailer, make_plan
from capricorn_jax._src.store import HostStore
from capricorn_jax._src.transport import Transport, local_rows

log = logging.getLogger("capricorn_jax")


@dataclasses.dataclass
class SaveReport:
    """What one save() knows when it returns (for the ``checkpoint`` event).

    ``committed`` and ``replicated`` lag the save by the writers' latency: they
    describe the newest versions confirmed so far, not necessarily ``step``.
    ``store_bytes`` is this host's store now; ``store_kib_per_host`` every
    host's, as of the previous save (it travels in the all-gathered statuses).
    """

    step: int
    bytes: int
    store_bytes: int
    committed: int
    replicated: int
    under_replicated: list[dict[str, int]]
    skipped: bool
    store_kib_per_host: list[int] = dataclasses.field(default_factory=list)


class InMemoryCheckpointer:
    """Per-step in-memory checkpoints with peer replication.

    Args:
      options: InMemoryOptions.
      mesh: the training mesh.
      abstract_state: the state's pytree of ShapeDtypeStructs.
      state_shardings: the matching NamedShardings.
      host, hosts: this process's index and the process count.
      device_host: host of each mesh device; default: the devices' processes.
    """

    def __init__(self, options: InMemoryOptions, mesh, abstract_state: Any,
                 state_shardings: Any, host: int, hosts: int,
                 device_host: list[int] | None = None):
        if options.replicas > hosts:
            raise ValueError(f"replicas={options.replicas} exceeds the {hosts} hosts")
        self.options, self.mesh, self.host, self.hosts = options, mesh, host, hosts
        self.abstract_state, self.state_shardings = abstract_state, state_shardings
        self.store = HostStore(Path(options.store_root) / options.job / f"host{host}")
        if self.store.removed_partials:
            log.warning("host %d: removed partial versions %s", host, self.store.removed_partials)
        self.plan: PackPlan = make_plan(abstract_state, state_shardings, mesh,
                                        options.chunk_bytes, device_host)
        self.holders = placement.holders(hosts, options.replicas)
        self.sources = placement.replica_sources(hosts, options.replicas, host)
        # Status vector: newest version held of each owner, then the store's KiB.
        self.transport = Transport(self.plan, mesh, state_shardings,
                                   placement.send_rounds(hosts, options.replicas), hosts + 1)
        self._newest = {o: int((self.store.versions(o) or [-1])[-1]) for o in range(hosts)}
        self._replicated_everywhere = -1
        self._pending: dict[int, float] = {}  # own step -> time saved, until replicated
        self._last_statuses = None
        self._store_bytes = 0
        self.on_pause = None
        self._own_q: queue.Queue = queue.Queue(maxsize=1)
        self._rep_q: queue.Queue = queue.Queue(maxsize=1)
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._run, args=(self._own_q, self._write_own), daemon=True,
                             name="ckpt-own-writer"),
            threading.Thread(target=self._run, args=(self._rep_q, self._write_replicas),
                             daemon=True, name="ckpt-replica-writer"),
        ]
        for t in self._threads:
            t.start()

    # ----- writers (background threads) -----
    def _run(self, q: queue.Queue, work) -> None:
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                work(*item)
            except BaseException as e:  # noqa: BLE001 - reported by the next save
                log.exception("host %d: checkpoint writer failed", self.host)
                self._errors.append(e)
            finally:
                q.task_done()

    def _write_version(self, owner: int, step: int, rows: list[np.ndarray],
                       pause_halfway: bool = False) -> None:
        writer = self.store.begin(owner, step)
        names = [(j, k) for j in range(len(rows)) for k in range(self.plan.num_chunks)]
        for n, (j, k) in enumerate(names):
            if pause_halfway and n == len(names) // 2 and self.on_pause is not None:
                self.on_pause(step)
            lo, hi = self.plan.chunk_range(k)
            writer.write_chunk(f"d{j}.c{k}", memoryview(rows[j][lo:hi]))
        writer.commit({
            "fingerprint": self.plan.fingerprint(), "leaves": self.plan.leaf_table(),
            "payload_bytes": self.plan.payload_bytes, "chunk_bytes": self.plan.chunk_bytes,
            "devices": len(rows), "host_state": decode_trailer(self.plan, rows[0]),
        })
        self._newest[owner] = step
        # Keep the newest version and the newest one every holder confirmed.
        safe = [v for v in self.store.versions(owner) if v <= self._replicated_everywhere]
        self.store.prune(owner, {step, *safe[-1:]})

    def _write_own(self, step: int, own) -> None:
        self._write_version(self.host, step, local_rows(own, self.plan))

    def _write_replicas(self, step: int, received: list) -> None:
        stall = self.options.stall_replica_writer_at
        if stall is not None and stall[0] == step:
            log.warning("host %d: fault injection: replica writer stalls %.1fs at step %d",
                        self.host, stall[1], step)
            time.sleep(stall[1])
        pause = self.options.pause_mid_replication_at == step
        for owner, array in zip(self.sources, received, strict=True):
            self._write_version(owner, step, local_rows(array, self.plan), pause_halfway=pause)

    # ----- the training thread's API -----
    def status_vector(self) -> np.ndarray:
        newest = [self._newest[o] for o in range(self.hosts)]
        self._store_bytes = self.store.bytes_held()  # one walk of the store per save
        return np.array([*newest, self._store_bytes // 1024], np.int64)

    def save(self, step: int, state: Any, host_state: dict[str, Any]) -> SaveReport:
        """Checkpoints ``state`` as version ``step`` (see the module docstring)."""
        own, received, statuses = self.transport.replicate(
            state, encode_trailer(host_state), self.status_vector())
        return self._enqueue(step, own, received, statuses)

    def trailer_rows(self, host_state: dict[str, Any]):
        """The [devices, trailer] input of a scheduled step (InStepSender)."""
        return self.transport.rows_of(encode_trailer(host_state), np.uint8)

    def save_transferred(self, step: int, own, received: list) -> SaveReport:
        """Commits version ``step`` whose payloads a scheduled step already moved.

        Args:
          step: the version (the state the scheduled step started from).
          own: [devices, payload] this host's packed payload (output of the step).
          received: one [devices, payload] array per replication round.
        """
        if len(received) != len(self.sources):
            raise ValueError(f"{len(received)} received payloads for {len(self.sources)} rounds")
        statuses = self.transport.gather_status(self.status_vector())
        return self._enqueue(step, own, received, statuses)

    def _enqueue(self, step: int, own, received: list, statuses) -> SaveReport:
        if self._errors:
            raise RuntimeError(f"host {self.host}: checkpoint writer failed") from self._errors[0]
        report = self._read_statuses()
        self._last_statuses = statuses
        for array in (own, *received):
            array.copy_to_host_async()  # start the device-to-host copy now; writers read it
        skipped = False
        try:
            self._own_q.put((step, own), timeout=self.options.writer_timeout_s)
            self._pending[step] = time.monotonic()
        except queue.Full:
            skipped = True
            log.warning("host %d: own writer busy for %.0fs; version %d skipped", self.host,
                        self.options.writer_timeout_s, step)
        if received:
            try:
                self._rep_q.put_nowait((step, received))
            except queue.Full:
                log.warning("host %d: replica writer busy; replicas of version %d from hosts %s "
                            "dropped", self.host, step, self.sources)
        report.step, report.skipped = step, skipped
        report.bytes = self.plan.payload_bytes * len(self.plan.host_positions(self.host))
        return report

    def _read_statuses(self) -> SaveReport:
        """Folds in the statuses gathered by the previous save (already computed)."""
        report = SaveReport(step=-1, bytes=0, store_bytes=self._store_bytes,
                            committed=self._newest[self.host],
                            replicated=self._replicated_everywhere,
                            under_replicated=[], skipped=False)
        if self._last_statuses is None:
            return report
        rows = np.asarray(self._last_statuses)
        per_host = rows[[self.plan.host_positions(h)[0] for h in range(self.hosts)]]
        report.store_kib_per_host = [int(x) for x in per_host[:, self.hosts]]
        # per_host[x][o]: newest version of owner o held by host x.
        confirmed = [int(min(per_host[x][o] for x in self.holders[o])) for o in range(self.hosts)]
        self._replicated_everywhere = max(self._replicated_everywhere, min(confirmed))
        report.replicated = self._replicated_everywhere
        now = time.monotonic()
        for step, saved in sorted(self._pending.items()):
            if confirmed[self.host] >= step:
                del self._pending[step]
            elif now - saved > self.options.replication_timeout_s:
                del self._pending[step]
                missing = [int(x) for x in self.holders[self.host] if per_host[x][self.host] < step]
                log.warning("host %d: version %d under-replicated: not confirmed by hosts %s "
                            "after %.0fs", self.host, step, missing,
                            self.options.replication_timeout_s)
                report.under_replicated.append({"owner": self.host, "step": step,
                                                "missing": missing})
        return report

    def wait_until_finished(self, timeout_s: float | None = None) -> None:
        """Blocks until both writers are idle (bounded by ``timeout_s``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for q in (self._own_q, self._rep_q):
            while q.unfinished_tasks:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"host {self.host}: checkpoint writers still busy")
                time.sleep(0.01)
        if self._errors:
            raise RuntimeError(f"host {self.host}: checkpoint writer failed") from self._errors[0]

    def close(self, timeout_s: float = 60.0) -> None:
        self.wait_until_finished(timeout_s)
        for q in (self._own_q, self._rep_q):
            q.put(None)
        for t in self._threads:
            t.join(timeout=5.0)
