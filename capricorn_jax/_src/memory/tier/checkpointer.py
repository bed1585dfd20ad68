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
  ``writer_timeout_s`` (``max_wait_s`` under a cost budget); a replica
  version that arrives while the replica writer is still busy is dropped
  (counted in ``SaveReport.dropped_replicas``; under-replicated).
* Under a cost budget (``InMemoryOptions.max_wait_s``) a save skips its
  version on every host when any host's writers were busy at the previous
  save (every host decides from the same all-gathered statuses, so the
  collectives match); ``SaveReport.interval`` is the steps between the
  versions taken.
* ``close()`` drains the writers.
* ``release(keep)`` (after ``close``, on a clean finish only) gives the RAM
  back: "none" deletes this host's store, "final" keeps one version per
  owner (the safe version) and deletes the slots that hold none.

When a version is safe: each save all-gathers every host's *held* versions of
every owner (committed and not marked for removal) in the status vector; the
safe version is the newest one every holder of every owner holds
(``retention.safe_version``). Removals are decided on the training thread
only, right after adopting the safe version of the previous save's statuses
and before reporting this save's (``retention``, which proves that the safe
version then sits on all its holders at every moment); the writer of an
owner carries them out before its next write. A host keeps, per owner, the
safe version and the newest ``InMemoryOptions.window`` + 1 after it
(``retention.versions_to_keep``, the keep rule of every store), so one
version of every owner survives the loss of any m-1 hosts at any moment.

The writer threads are the base class (``writers.VersionWriters``), the
status round over their records the next one (``status_round.StatusRound``);
the reports and the release's work on the store are in ``reports``.

Alternative not taken: a blocking save that returns when every replica is
written. It is simpler but puts the peer's disk-less write and the slowest
host on every step's critical path.

Partial expert checkpointing (``InMemoryOptions.pec``; MoC-System): each
version carries the non-expert state and K experts of every MoE layer; the
checkpointer's ``pec`` (``pec_tier.PecTier``) decides and records each
version. Pruning follows the same rule, each version's needs being the
versions holding the newest copy of every expert (``plans.version_needs``);
the safe version is also complete and reads only versions every holder holds.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from capricorn_jax._src.memory.store.pinned import arena_copier
from capricorn_jax._src.memory.store.store import HostStore
from capricorn_jax._src.memory.store.store_lifecycle import StoreLimit
from capricorn_jax._src.memory.tier.hooks import NO_FAULTS, FaultHooks
from capricorn_jax._src.memory.tier.options import InMemoryOptions
from capricorn_jax._src.memory.tier.pec_tier import PecTier, PecVersion, version_needs_of
from capricorn_jax._src.memory.tier.phase_clock import PhaseClock
from capricorn_jax._src.memory.tier.reports import (
    DropCounts,
    SaveReport,
    StoreRelease,
    release_store,
)
from capricorn_jax._src.memory.tier.status_round import StatusRound
from capricorn_jax._src.memory.tier.writers import VersionWriters, _InSlot
from capricorn_jax._src.memory.wire import placement
from capricorn_jax._src.memory.wire.host_arrays import host_memory_kind
from capricorn_jax._src.memory.wire.packing import PackPlan, encode_trailer, make_plan
from capricorn_jax._src.memory.wire.transport import Transport
from capricorn_jax._src.partial.leaves import MoEShape
from capricorn_jax._src.partial.tracker import PltTracker

log = logging.getLogger("capricorn_jax")


class InMemoryCheckpointer(StatusRound):
    """Per-step in-memory checkpoints with peer replication.

    Args:
      options: InMemoryOptions.
      mesh: the training mesh.
      abstract_state: the state's pytree of ShapeDtypeStructs.
      state_shardings: the matching NamedShardings.
      host, hosts: this process's index and the process count.
      device_host: host of each mesh device; default: the devices' processes.
      model: the model config (num_experts, top_k, moe_layers); PEC only.
      tokens_per_step: tokens of one training step (global batch x sequence
        length), the PLT's unit; PEC only.
      hooks: test-only fault injection (``hooks.FaultHooks``); None: none.
      store_host: the index in this host's store directory's name
        (``STORE_ROOT/JOB/host{i}``), when this machine's store was written
        under another process index (``store_identity``); None: ``host``.
    """

    def __init__(self, options: InMemoryOptions, mesh, abstract_state: Any,
                 state_shardings: Any, host: int, hosts: int,
                 device_host: list[int] | None = None, *, model: MoEShape | None = None,
                 tokens_per_step: int = 0, hooks: FaultHooks | None = None,
                 store_host: int | None = None):
        if options.replicas > hosts:
            raise ValueError(f"replicas={options.replicas} exceeds the {hosts} hosts")
        if options.pec is not None and (model is None or tokens_per_step < 1):
            raise ValueError(f"InMemoryOptions.pec needs model= (num_experts, top_k, "
                             f"moe_layers) and tokens_per_step= > 0, got model={model!r}, "
                             f"tokens_per_step={tokens_per_step}")
        self.options, self.mesh, self.host, self.hosts = options, mesh, host, hosts
        self.abstract_state, self.state_shardings = abstract_state, state_shardings
        limit = StoreLimit.fraction_of(options.store_root, options.max_store_fraction)
        # Own versions copied straight into registered slots (pinned.SlotCopier),
        # or None: the host copy (``_to_host``) then the writers' copy.
        registry, self.copier = arena_copier(options.arena_copy, mesh.devices.flat[0])
        store_name = f"host{host if store_host is None else store_host}"
        self.store = HostStore(Path(options.store_root) / options.job / store_name,
                               limit=limit, registry=registry)
        self._closed = False
        if self.store.removed_partials:
            log.warning("host %d: removed partial versions %s", host, self.store.removed_partials)
        self.plan: PackPlan = make_plan(abstract_state, state_shardings, mesh,
                                        options.chunk_bytes, device_host)
        self.holders = placement.holders(hosts, options.replicas)
        sources = placement.replica_sources(hosts, options.replicas, host)
        self.rounds = placement.send_rounds(hosts, options.replicas)
        # Status vector: per owner the newest held version, then the mask of
        # the held ones before it (retention.encode_held), then the store's
        # KiB, then whether the writers are busy (the cost budget's input),
        # then the caller's note (``status_note``, set by ``note_status``),
        # then whether the caller's chunk channel is lost (``note_channel``),
        # then the versions this host will never hold (``_lost_here``, as
        # (newest, mask): PEC rolls them back on every host).
        self.status_len = 2 * hosts + 6
        # A small integer the caller wants every host to see: it travels with
        # this host's status in each save's round; ``agreed_note`` is host 0's,
        # as of the previous round (the same value on every host). Lets a
        # strategy agree on a decision without a collective of its own.
        self.status_note = 0
        self.agreed_note: int | None = None
        self.channel_lost = False
        self._lost_here: set[int] = set()  # versions dropped here, until a round told every host
        self._corrupt_seen = 0  # writers.corrupt_replicas already in _lost_here
        self.drops = DropCounts()  # versions not taken or held, by cause (the lag alarm's)
        flip_at = None if hooks is None else hooks.flip_exchange_at
        self.transport = Transport(self.plan, mesh, state_shardings, self.rounds,
                                   self.status_len, flip_input=flip_at is not None)
        self._flip_at = flip_at  # fault injection: the first exchanged version >= it
        self.pec: PecTier | None = None
        if options.pec is not None:
            assert model is not None  # checked above
            self.pec = PecTier(options.pec, model, tokens_per_step, self.abstract_state,
                               self.transport)
        self.hooks = NO_FAULTS if hooks is None else hooks
        self.sources = sources
        self.writers = VersionWriters(self.store, host, hosts, sources, self.copier, hooks,
                                      options.write_threads)
        # PEC: version -> (versions a restore to it reads, complete).
        self._needs: dict[int, tuple[tuple[int, ...], bool]] = {}
        if self.pec is not None:
            for o, steps in self.writers.held.items():
                for v in sorted(steps):
                    try:
                        self._needs.setdefault(v, version_needs_of(self.store.manifest(o, v), v))
                    except (OSError, ValueError, KeyError):  # unreadable: not held
                        log.warning("host %d: version %d of owner %d has an unreadable "
                                    "manifest; ignored", host, v, o)
                        steps.discard(v)
        self._safe = -1
        self._reported: set[int] = set()  # versions reported in newly_committed
        self._last_taken = -1  # the newest version this host's writer was given
        self._pending: dict[int, float] = {}  # own step -> its clock's start, until replicated
        self._rounds_since: dict[int, int] = {}  # own step -> status rounds read since its save
        self._last_statuses: Any = None  # the previous round's gathered statuses
        self._store_bytes = 0
        self._memory_kind = host_memory_kind(options.host_memory_kind, mesh.devices.flat[0])
        # What the training thread waits for in each save, by phase (its
        # strategy reads and resets it: ``Strategy.blocked_phases``).
        self.clock = PhaseClock()

    def drop_newer_than(self, step: int) -> None:
        """Removes every stored version newer than ``step`` (a recovery to
        ``step``, -1 for a fresh start, abandons them: the steps after it are
        trained again and must not mix with the old ones). Call before saving."""
        with self.writers.lock:
            for owner, held in self.writers.held.items():
                for v in sorted(v for v in held if v > step):
                    held.discard(v)
                    self.store.remove(owner, v)
                self.writers.newest[owner] = max(held, default=-1)
            self._reported = {v for v in self._reported if v <= step}
        self._lost_here = {v for v in self._lost_here if v <= step}

    # ----- the training thread's API -----
    def _skip(self, step: int, status_round: tuple[SaveReport, Any] | None = None,
              cause: str = "budget") -> SaveReport:
        """Takes no version at ``step``; the statuses still travel. ``cause``:
        the ``drops`` counter it adds to."""
        setattr(self.drops, cause, getattr(self.drops, cause) + 1)
        if status_round is not None:
            report, self._last_statuses = status_round
        else:
            report, status = self._begin_save()
            with self.clock.phase("status_round"):
                self._last_statuses = self.transport.gather_status(status)
        report.step, report.skipped = step, True
        return report

    def skip(self, step: int, tokens_per_expert: Any = None) -> SaveReport:
        """Takes no version at ``step`` on purpose (every host calls it at the
        same step: the status round still runs): a scheduled strategy whose
        previous version is still on the link under a cost budget. PEC:
        ``tokens_per_expert`` of the step that made ``step`` (its lost
        tokens are counted as for a budget's skip)."""
        if self.pec is not None:
            self.pec.skip(step, tokens_per_expert)
        else:
            _refuse_pec_args(tokens_per_expert, None)
        return self._skip(step, cause="skipped")

    def drop(self, step: int, status_round: tuple[SaveReport, Any] | None = None, *,
             corrupt: bool = True) -> SaveReport:
        """Takes no version at ``step`` on this host alone: a peer's payload of
        it failed its end-to-end check (a frame corrupted in transit,
        ``corrupt``) or never came (a lost chunk channel). The statuses still
        travel (the same collectives as a save); no holder can commit the
        version, since this host holds none of it, so the safe version stays
        the previous one. PEC: the version, which the tier recorded when it
        was planned, is rolled back on every host once a round tells them
        (``note_lost``)."""
        self.note_lost([step])
        report = self._skip(step, status_round, cause="corrupt" if corrupt else "lost")
        report.corrupt = corrupt
        return report

    def begin_round(self) -> tuple[SaveReport, np.ndarray]:
        """The first half of a ``save_transferred`` whose status round the
        caller runs in a program of its own (``status_round=``): adopts the
        previous save's statuses, decides removals, then takes the status
        vector this save reports (in that order: ``retention``)."""
        return self._begin_save()

    def save(self, step: int, state: Any, host_state: dict[str, Any], *,
             tokens_per_expert: Any = None, expert_mask: Any = None) -> SaveReport:
        """Checkpoints ``state`` as version ``step`` (see the module docstring).

        Args:
          step: the version (the number of steps ``state`` holds).
          state: the train state.
          host_state: this host's small JSON state (the trailer).
          tokens_per_expert: PEC only, required: [moe_layers, experts] kept
            assignments of the step that produced ``state``.
          expert_mask: PEC only: bool [moe_layers, experts] to save instead of
            the policy's choice.
        """
        trailer = encode_trailer(host_state)
        if self.pec is None:
            _refuse_pec_args(tokens_per_expert, expert_mask)
            if self._over_budget():
                return self._skip(step)
            report, status = self._begin_save()
            with self.clock.phase("exchange"):
                own, received, statuses, corrupt = self.transport.replicate(
                    state, trailer, status, flip=self._flip(step))
            return self._enqueue(report, step, own, received, statuses, corrupt=corrupt)
        if self._over_budget():
            self.pec.skip(step, tokens_per_expert)
            return self._skip(step)
        with self.clock.phase("pec_decision"):
            version = self.pec.version(step, tokens_per_expert, expert_mask)
        report, status = self._begin_save()
        with self.clock.phase("exchange"):
            own, received, statuses, corrupt = version.transport.replicate(
                state, trailer, status, version.gather, flip=self._flip(step))
        return self._enqueue(report, step, own, received, statuses, version, corrupt)

    def _flip(self, step: int) -> int:
        """Fault injection (``FaultHooks.flip_exchange_at``): the byte this
        host's exchange of version ``step`` corrupts in transit (0: none),
        once, at the first version at or after the hook's."""
        if self._flip_at is None or step < self._flip_at:
            return 0
        self._flip_at = None
        if self.hooks.on_flip is not None:
            self.hooks.on_flip(step)
        return 0xFF

    def trailer_rows(self, host_state: dict[str, Any]):
        """The [devices, trailer] input of a scheduled step (InStepSender)."""
        return self.transport.rows_of(encode_trailer(host_state), np.uint8)

    def save_transferred(self, step: int, own, received: list, *,
                         tokens_per_expert: Any = None,
                         version: PecVersion | None = None,
                         status_round: tuple[SaveReport, Any] | None = None,
                         corrupt: list | None = None) -> SaveReport:
        """Commits version ``step`` whose payloads a scheduled step already moved.

        Args:
          step: the version (the state the scheduled step started from).
          own: [devices, payload] this host's packed payload (output of the step).
          received: one payload per replication round: a [devices, payload]
            array, or this host's rows as a numpy [local devices, payload]
            array in local device order (what a receiver outside XLA filled;
            the writer reads it as is, so the caller must not reuse it).
          tokens_per_expert: PEC, when ``version`` is None: [moe_layers,
            experts] of the step that produced version ``step``; the payloads
            are then taken as packed with the full plan (a full version).
          version: PEC: the version ``plan_pec_version`` decided, whose
            ``transport.pack_local(leaves, trailer, gather)`` packed ``own``.
          status_round: (the report of ``begin_round``, the statuses its
            status vector was all-gathered into by the caller's program);
            None: this call runs the round.
          corrupt: per round, the moving step's end-to-end verdict (bool
            [devices, k], True: a received payload failed its CRC32C; the
            in-step sender's), read by the replica writer as the exchange's.
        """
        if len(received) != len(self.sources):
            raise ValueError(f"{len(received)} received payloads for {len(self.sources)} rounds")
        # The plan the payloads were packed with: the version's; without one,
        # the full plan (under PEC its full-version program's, as ``version``
        # below will be: checked before the PEC tier records anything).
        if version is not None:
            plan = version.plan
        else:
            plan = self.plan if self.pec is None else self.pec.transport(None).plan
        local = len(plan.host_positions(self.host))
        for r in received:
            if isinstance(r, np.ndarray) and r.shape != (local, plan.payload_bytes):
                raise ValueError(f"host {self.host}: a received payload of shape {r.shape}; "
                                 f"version {step} needs ({local}, {plan.payload_bytes}) "
                                 f"(local devices, payload bytes)")
        if self.pec is None:
            _refuse_pec_args(tokens_per_expert, version)
            if self._over_budget():  # the step moved it; nothing is written
                return self._skip(step, status_round)
        elif version is None:
            if self._over_budget():
                self.pec.skip(step, tokens_per_expert)
                return self._skip(step, status_round)
            version = self.pec.version(step, tokens_per_expert, full=True)
        elif version.step != step or tokens_per_expert is not None:
            raise ValueError(f"version is PEC version {version.step} (already recorded, no "
                             f"tokens_per_expert), saving {step}")
        if status_round is not None:
            report, statuses = status_round
        else:
            report, status = self._begin_save()
            with self.clock.phase("status_round"):
                statuses = self.transport.gather_status(status)
        return self._enqueue(report, step, own, received, statuses, version, corrupt)

    def plan_pec_version(self, step: int, tokens_per_expert: Any,
                         expert_mask: Any = None) -> PecVersion:
        """PEC: decides and records version ``step`` without moving it, for a
        scheduled step that packs it (``version.transport``, ``version.gather``)
        and ``save_transferred(..., version=...)`` that commits it."""
        if self.pec is None:
            raise ValueError("plan_pec_version needs PEC (InMemoryOptions.pec)")
        with self.clock.phase("pec_decision"):
            return self.pec.version(step, tokens_per_expert, expert_mask)

    def drop_counts(self) -> DropCounts:
        """The versions this host did not take or hold so far, by cause
        (``reports.DropCounts``); ``corrupt`` also counts the replicas the
        writers found corrupt (the in-graph exchange's end-to-end check)."""
        with self.writers.lock:
            found = len(self.writers.corrupt_replicas)
        return dataclasses.replace(self.drops, corrupt=self.drops.corrupt + found)

    def busy_hosts(self) -> tuple[int, ...]:
        """The hosts whose writers were still busy with an earlier version at
        the last status round gathered (the same on every host)."""
        per_host = self._statuses()  # decoded and checked (``status_round``)
        if per_host is None:
            return ()
        return tuple(int(h) for h in np.flatnonzero(per_host[:, 2 * self.hosts + 1]))

    def took(self, step: int) -> bool:
        """Whether this host took its own version ``step``: its copy is held or
        queued for its writer. Not after ``drop`` (a peer's frame failed its
        check), a skip, or a write that failed: a persistent step of that
        version has nothing to read here."""
        with self.writers.lock:
            return step in self.writers.held.get(self.host, ()) or step in self.writers.own_queued

    def missing_for_read(self, step: int) -> list[int]:
        """Versions older than ``step`` that a read of this host's own version
        ``step`` needs (PEC: the versions holding its experts' newest copies)
        and this host's own store does not hold nor its writer has queued (so
        will never hold). Version ``step`` itself may still be in flight and is
        not checked."""
        needed = self._needs.get(step, ((step,), True))[0]
        with self.writers.lock:
            queued = set(self.writers.own_queued)
        held = set(self.store.versions(self.host))
        return sorted(v for v in needed if v < step and v not in held and v not in queued)

    def resume_pec(self, tracker: PltTracker, k: int | None = None,
                   cumulative: Any = None) -> None:
        """PEC: continue from ``tracker`` (e.g. ``PltTracker(L, N, top_k, step)``
        after a restore from another tier at ``step``), with ``cumulative``
        ([L, N] assignments of each expert up to that step; None keeps the
        current counts); ``recover`` and ``CheckpointManager.restore`` call it."""
        if self.pec is None:
            raise ValueError("resume_pec needs PEC (InMemoryOptions.pec)")
        self.pec.resume(tracker, self.pec.dyn.options.k if k is None else k, cumulative)
        self._lost_here.clear()

    def _enqueue(self, report: SaveReport, step: int, own, received: list, statuses,
                 version: PecVersion | None = None, corrupt: list | None = None) -> SaveReport:
        if self.writers.errors:
            raise RuntimeError(f"host {self.host}: checkpoint writer failed") \
                from self.writers.errors[0]
        plan = self.plan if version is None else version.plan
        meta = None if version is None else version.meta
        if meta is not None:
            self._needs[step] = (tuple(meta["needed"]), bool(meta["complete"]))
        self._last_statuses = statuses
        # Start the device-to-host copies now; the writers read them. With a
        # copier (pinned.SlotCopier) this host's own rows go straight into a
        # slot taken now; its writer waits for the copy and checksums in place.
        with self.clock.phase("d2h"):
            if self.copier is not None and not isinstance(own, np.ndarray):
                own = self.writers.copy_into_slot(step, own, plan)
            else:
                own = own if isinstance(own, np.ndarray) else self._to_host(own)
            received = [a if isinstance(a, np.ndarray) else self._to_host(a) for a in received]
        skipped = False
        wait = self.options.writer_timeout_s
        if self.options.max_wait_s is not None:
            wait = self.options.max_wait_s
        try:
            with self.writers.lock:
                self.writers.own_queued.add(step)
            with self.clock.phase("writer_handoff"):
                self.writers.own_q.put((step, own, plan, meta), timeout=wait)
            self._pending[step] = time.monotonic()
            if self._last_taken >= 0:
                report.interval = step - self._last_taken
            self._last_taken = step
        except queue.Full:
            with self.writers.lock:
                self.writers.own_queued.discard(step)
            if isinstance(own, _InSlot):  # the copy must land before the slot is free
                assert self.copier is not None  # an _InSlot comes from _copy_into_slot
                self.copier.wait()
                own.writer.abort()
            skipped = True
            self.drops.own_busy += 1
            self.note_lost([step])
            log.warning("host %d: own writer busy for %.1fs; version %d skipped", self.host,
                        wait, step)
        if received:
            try:
                self.writers.rep_q.put_nowait((step, received, plan, meta, corrupt))
            except queue.Full:
                report.dropped_replicas = len(received)
                self.drops.replicas_busy += 1
                self.note_lost([step])
                log.warning("host %d: replica writer busy; replicas of version %d from hosts %s "
                            "dropped", self.host, step, self.sources)
                if self.hooks.pauses_at(step) and self.hooks.on_pause is not None:
                    self.hooks.on_pause(step)  # fault injection: the point is here for this version
        report.step, report.skipped = step, skipped
        report.bytes = plan.payload_bytes * len(plan.host_positions(self.host))
        if version is not None:
            assert self.pec is not None  # a PecVersion comes from the PEC tier
            report.pec_k, report.pec_plt = version.k, self.pec.plt()
        return report

    def _to_host(self, array: jax.Array) -> jax.Array:
        if self._memory_kind is None:
            array.copy_to_host_async()
            return array
        return jax.device_put(array, array.sharding.with_memory_kind(self._memory_kind))

    def wait_until_finished(self, timeout_s: float | None = None) -> None:
        """Blocks until both writers are idle (bounded by ``timeout_s``);
        raises a writer's first failure."""
        self.writers.wait_until_finished(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        self.wait_until_finished(timeout_s)
        if self.copier is not None:
            self.copier.close()
        self.writers.stop()
        self._closed = True

    def confirm(self, timeout_s: float = 60.0) -> SaveReport:
        """One more status round with every writer drained (a collective: every
        host calls it at the same point): the report's safe version and
        ``newly_committed`` then account for every version saved so far."""
        self.wait_until_finished(timeout_s)
        return self._status_round()

    def release(self, keep: str) -> StoreRelease:
        """Gives this host's store back to the RAM disk after a clean finish.

        Call after ``close()``, and only when the job finished cleanly (after
        a failure the store is what the restarted job resumes from). Every
        host calls it once, whatever its ``keep`` (it all-gathers the status
        vectors once more, every writer being drained, so the safe version
        it adopts is the newest version every holder holds, normally the
        final one); then each host releases its own store, which is closed
        afterwards.

        Args:
          keep: "none" deletes this host's store (and the job's directory
            once no host's store is left in it): for when the persistent tier
            holds the final step. "final" keeps, per owner, the versions a
            restore to the safe version reads (the safe version; under PEC
            also the versions holding its experts' newest copies) and deletes
            the slot files that hold no version, so a resumed job still finds
            the final safe version in RAM; with no safe version yet, every
            committed version stays and only the free slots go.

        Design choice: the caller decides, after the persistent tier has
        closed, because only it knows whether that tier holds the final step.
        Alternative not taken: ``close`` releasing on its own, which would
        also run after an injected failure and delete what the restart needs.
        """
        if keep not in ("none", "final"):
            raise ValueError(f"keep must be 'none' or 'final', got {keep!r}")
        if not self._closed:
            raise RuntimeError(f"host {self.host}: release({keep!r}) before close(): the "
                               f"writers may still be writing")
        # The final statuses: every host's writers are drained (close), so the
        # safe version catches up with what the hosts hold.
        self._status_round()
        safe = self._safe
        wanted = set(self._needs.get(safe, ((safe,), True))[0]) | {safe}
        return release_store(self.store, keep, safe, wanted)


def _refuse_pec_args(tokens_per_expert: Any, other: Any) -> None:
    if tokens_per_expert is not None or other is not None:
        raise ValueError("tokens_per_expert, expert_mask and version are for PEC "
                         "(InMemoryOptions.pec); this checkpointer saves whole versions")
