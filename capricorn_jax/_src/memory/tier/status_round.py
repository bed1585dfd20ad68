"""The in-memory tier's status round: what every save tells and learns of the hosts.

Each save all-gathers every host's status vector (``status_vector``: per
owner the newest held version and the mask of the held ones before it, the
store's KiB, whether the writers are busy, the caller's note, whether the
caller's chunk channel is lost here, the versions this host will never hold)
and reads the
previous round's (``_read_statuses``): the safe version
(``retention.safe_version``), the versions newly held everywhere, the own
versions that no holder confirmed in time (under-replicated), the cost
budget's skip (``_over_budget``), host 0's note and, under PEC, the versions
some host will never hold, which every host then rolls back in its tracker
at the same save (``_roll_back_lost``). Removals are decided
between reading and reporting (``_decide_removals``, in ``_begin_save``'s
order: ``retention``).

The gathered rows are decoded once per round and checked before any field
is acted on (``decode_statuses``: the width, every host's row, versions >=
-1, masks inside ``MASK_BITS``, a store size >= 0, flags 0 or 1). A round
that fails is a counted, named rejection (``status_rejections``, a warning
naming the host and the field), and is read as no round: every host
gathered the same rows, so every host skips it alike and the previous safe
version stays. Alternative not taken: trusting the rows because the job's
own collective carried them (a mismatched build or a corrupted row would
index past the vector or adopt a wild safe version).

Design choice: a base class of ``InMemoryCheckpointer`` that reads the
records of its writers component (``writers``: a ``writers.VersionWriters``,
whose ``held``, ``newest``, ``lock`` and queues are its public state) and
the saves' bookkeeping, apart from the lifecycle and the saves that run it,
so each module stays a size a reader can hold. Alternative not taken: a
status object the checkpointer calls, which would put an accessor between
the round and every record the saves keep.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from capricorn_jax._src.memory.store.store import HostStore
from capricorn_jax._src.memory.tier import retention
from capricorn_jax._src.memory.tier.options import InMemoryOptions
from capricorn_jax._src.memory.tier.pec_tier import PecTier
from capricorn_jax._src.memory.tier.phase_clock import PhaseClock
from capricorn_jax._src.memory.tier.reports import SaveReport
from capricorn_jax._src.memory.tier.writers import VersionWriters
from capricorn_jax._src.memory.wire.packing import PackPlan
from capricorn_jax._src.memory.wire.transport import Transport

CONFIRM_ROUNDS = 3
"""Status rounds, after the first that can confirm a version, before an
unconfirmed version may be reported under-replicated (with the wall bound)."""

log = logging.getLogger("capricorn_jax")

STATUS_TAIL = 6
"""Fields after the held pairs: store KiB, busy, note, channel lost, lost newest, lost mask."""


class StatusRejected(ValueError):
    """A gathered status round that cannot be read (``reason``: ``shape``,
    ``version``, ``mask``, ``store_kib`` or ``flag``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{message} (refused: {reason})")
        self.reason = reason


def decode_statuses(rows: Any, hosts: int, positions: list[int]) -> np.ndarray:
    """Every host's status vector, [hosts, 2 * hosts + ``STATUS_TAIL``] int64,
    from the gathered rows (one per device; ``positions``: each host's first
    device's), checked field by field.

    Raises:
      StatusRejected: a row or field out of range (see the module docstring).
    """
    a = np.asarray(rows)
    width = 2 * hosts + STATUS_TAIL
    if (a.ndim != 2 or a.shape[1] != width or a.dtype.kind not in "iu" or len(positions) != hosts
            or any(not 0 <= p < a.shape[0] for p in positions)):
        raise StatusRejected("shape", f"gathered statuses of {a.dtype} {a.shape}, not rows of "
                                      f"{width} integers with hosts at {positions}")
    per_host = a[positions].astype(np.int64)
    h, top = hosts, 1 << retention.MASK_BITS
    checks = (("version", per_host[:, list(range(h)) + [2 * h + 4]] < -1),
              ("mask", (per_host[:, list(range(h, 2 * h)) + [2 * h + 5]] < 0)
               | (per_host[:, list(range(h, 2 * h)) + [2 * h + 5]] >= top)),
              ("store_kib", per_host[:, [2 * h]] < 0),
              ("flag", ~np.isin(per_host[:, [2 * h + 1, 2 * h + 3]], (0, 1))))
    for reason, bad in checks:
        if bad.any():
            host = int(np.flatnonzero(bad.any(axis=1))[0])
            raise StatusRejected(reason, f"host {host}'s status vector {per_host[host].tolist()}")
    return per_host


class StatusRound:
    """The status round over the writers' records (see the module docstring);
    ``InMemoryCheckpointer`` sets the state below."""

    writers: VersionWriters
    store: HostStore
    host: int
    options: InMemoryOptions
    hosts: int
    plan: PackPlan
    holders: list[list[int]]
    transport: Transport
    pec: PecTier | None
    clock: PhaseClock
    status_note: int
    channel_lost: bool
    _lost_here: set[int]
    _corrupt_seen: int
    agreed_note: int | None
    _needs: dict[int, tuple[tuple[int, ...], bool]]
    _safe: int
    _reported: set[int]
    _pending: dict[int, float]
    _rounds_since: dict[int, int]
    _last_statuses: Any
    _store_bytes: int
    _decoded: tuple[Any, np.ndarray | None] | None = None  # (rows, decoded) of the last round
    _rejections: dict[str, int] | None = None

    @property
    def status_rejections(self) -> dict[str, int]:
        """Gathered status rounds refused so far, by reason (``decode_statuses``)."""
        return dict(self._rejections or {})

    def _statuses(self) -> np.ndarray | None:
        """The previous round's statuses per host, decoded and checked once
        (None: no round yet, or one refused: counted and logged)."""
        rows = self._last_statuses
        if rows is None:
            return None
        if self._decoded is None or self._decoded[0] is not rows:
            try:
                decoded: np.ndarray | None = decode_statuses(
                    rows, self.hosts, [self.plan.host_positions(h)[0] for h in range(self.hosts)])
            except StatusRejected as e:
                self._rejections = self._rejections or {}
                self._rejections[e.reason] = self._rejections.get(e.reason, 0) + 1
                log.warning("host %d: a status round refused: %s; read as no round", self.host, e)
                decoded = None
            self._decoded = (rows, decoded)
        return self._decoded[1]

    def _decide_removals(self) -> None:
        """Marks what each owner's store no longer keeps (training thread, after
        adopting the safe version, before reporting the held versions)."""
        with self.writers.lock:
            for owner, held in self.writers.held.items():
                if not held:
                    continue
                # A version saved whole reads itself; under PEC one without a
                # record (an unreadable manifest) is not restorable.
                needs = {v: self._needs.get(v, ((v,), self.pec is None)) for v in held}
                keep = retention.versions_to_keep(needs, self._safe, self.options.window)
                gone = held - keep
                if gone:
                    held -= gone
                    self.writers.doomed.setdefault(owner, []).extend(sorted(gone))
            if self.pec is not None:
                live = set().union(*self.writers.held.values())
                for v in [v for v in self._needs if v not in live and v < self._safe]:
                    del self._needs[v]

    def status_vector(self) -> np.ndarray:
        """This host's held versions per owner (newest, mask), its store's KiB,
        1 if a writer is still busy with an earlier version, the caller's
        note, 1 if the caller's chunk channel is lost here, and the versions
        it will never hold (newest, mask)."""
        with self.writers.lock:
            pairs = [retention.encode_held(self.writers.held.get(o, ()))
                     for o in range(self.hosts)]
            # Replicas the writers found corrupt (in-graph path): never held.
            fresh = self.writers.corrupt_replicas[self._corrupt_seen:]
            self._corrupt_seen += len(fresh)
        self.note_lost(step for _, step in fresh)
        lost = retention.encode_held(self._lost_here)
        self._store_bytes = self.store.bytes_held()  # one walk of the store per save
        writers = self.writers
        busy = int(writers.own_q.unfinished_tasks > 0 or writers.rep_q.unfinished_tasks > 0)
        return np.array([*(n for n, _ in pairs), *(m for _, m in pairs),
                         self._store_bytes // 1024, busy, int(self.status_note),
                         int(self.channel_lost), *lost], np.int64)

    def note_status(self, value: int) -> None:
        """Sets the note this host's status vector carries from the next round
        on (``status_note``); ``agreed_note`` becomes host 0's one round later."""
        self.status_note = value

    def note_lost(self, versions: Any) -> None:
        """Versions this host will never hold (dropped, abandoned with a lost
        channel, or not taken by a busy writer): its status vector names them
        from the next round on, and under PEC every host then rolls them back
        (``PecTier.roll_back``), so the versions after them do not name
        their experts' copies."""
        self._lost_here.update(int(v) for v in versions)
        if self._lost_here:  # the status vector names the newest MASK_BITS + 1
            newest = max(self._lost_here)
            self._lost_here = {v for v in self._lost_here
                               if v >= newest - retention.MASK_BITS}

    def note_channel(self, lost: bool) -> None:
        """Whether this host's chunk channel is lost (its status vector says
        so from the next round on; ``channel_lost_anywhere`` one round later)."""
        self.channel_lost = lost

    def channel_lost_anywhere(self) -> bool:
        """Whether some host's status vector, as of the previous round, said its
        chunk channel was lost (the same answer on every host)."""
        per_host = self._statuses()
        return per_host is not None and bool(per_host[:, 2 * self.hosts + 3].any())

    def _over_budget(self) -> bool:
        """Whether this version is skipped: under a cost budget, some host's
        writers were busy at the previous save (the same answer on every host:
        it reads the all-gathered statuses)."""
        per_host = self._statuses()
        if self.options.max_wait_s is None or per_host is None:
            return False
        return bool(per_host[:, 2 * self.hosts + 1].any())

    def _begin_save(self) -> tuple[SaveReport, np.ndarray]:
        with self.clock.phase("status_read"):
            report = self._read_statuses()
        with self.clock.phase("bookkeeping"):
            self._decide_removals()
            status = self.status_vector()
        report.store_bytes = self._store_bytes  # walked by this save's status_vector
        return report, status

    def _read_statuses(self) -> SaveReport:
        """Folds in the statuses gathered by the previous save (already computed)."""
        report = SaveReport(step=-1, bytes=0, store_bytes=self._store_bytes,
                            committed=self.writers.newest[self.host], safe_version=self._safe,
                            under_replicated=[], skipped=False)
        per_host = self._statuses()
        if per_host is None:
            return report
        h = self.hosts
        report.store_kib_per_host = [int(x) for x in per_host[:, 2 * h]]  # then: busy
        self.agreed_note = int(per_host[0, 2 * h + 2])
        self._roll_back_lost(per_host[:, 2 * h + 4:2 * h + 6])
        held = [{o: retention.decode_held(int(per_host[x][o]), int(per_host[x][h + o]))
                 for o in range(h)} for x in range(h)]
        self._safe = retention.safe_version(held, self.holders, self._safe,
                                            None if self.pec is None else self._needs)
        report.safe_version = self._safe
        everywhere = retention.held_everywhere(held, self.holders)
        report.newly_committed = sorted(everywhere - self._reported)
        if everywhere:  # older ones are gone from every store: forget them
            oldest = min(everywhere)
            self._reported = {v for v in self._reported | everywhere if v >= oldest}
        # per_host[x][o]: newest version of owner o held by host x.
        confirmed = [int(min(per_host[x][o] for x in self.holders[o])) for o in range(h)]
        # A version's replication clock starts at the second round read after
        # its save (a save's own round is gathered before its replicas are
        # written: the next one is the first its peers can confirm it in), and
        # it runs out only after CONFIRM_ROUNDS more rounds and
        # replication_timeout_s: a compile or a restart is one slow round, not
        # a peer that stopped confirming.
        now = time.monotonic()
        for step, started in sorted(self._pending.items()):
            rounds = self._rounds_since[step] = self._rounds_since.get(step, 0) + 1
            if confirmed[self.host] >= step:
                del self._pending[step], self._rounds_since[step]
            elif rounds == 2:
                self._pending[step] = now
            elif (rounds >= 2 + CONFIRM_ROUNDS
                  and now - started > self.options.replication_timeout_s):
                del self._pending[step], self._rounds_since[step]
                missing = [int(x) for x in self.holders[self.host] if per_host[x][self.host] < step]
                log.warning("host %d: version %d under-replicated: not confirmed by hosts %s "
                            "in %d status rounds over %.0fs", self.host, step, missing,
                            rounds - 1, now - started)
                report.under_replicated.append({"owner": self.host, "step": step,
                                                "missing": missing})
        return report

    def _roll_back_lost(self, lost_rows: Any) -> None:
        """PEC: the versions the hosts' statuses name as never held somewhere
        leave the tracker (``PecTier.roll_back``). Every host reads the same
        statuses at the same save, so every tracker rolls back alike; a
        version rolled back once is not again. A host stops naming a version
        once a round carrying it was read (every host has it then)."""
        lost = set().union(*(retention.decode_held(int(n), int(m)) for n, m in lost_rows))
        self._lost_here -= lost
        if self.pec is None or not lost:
            return
        rolled = self.pec.roll_back(lost)
        if rolled:
            log.warning("host %d: PEC versions %s are not held on every host; their saves "
                        "leave the tracker (the next versions save those experts again)",
                        self.host, rolled)

    def _status_round(self) -> SaveReport:
        """Gathers every host's statuses now and adopts them (a collective)."""
        self._last_statuses = self.transport.gather_status(self.status_vector())
        return self._read_statuses()
