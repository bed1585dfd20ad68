"""launch.chaos's oracle: the newest version that must survive each fault (pure).

For each fault that ends an attempt of a trial's job, ``expectations``
computes the newest version that must survive it and the tier it must come
from, from three inputs only: the fault plan (which hosts were killed, which
RAM stores were wiped or corrupted), the replica placement
(``placement_holders``: the hosts holding each owner's versions) and what the
run recorded as committed before the fault: the safe version of the memory
tier (``checkpoint`` events' ``replicated``: the newest version every holder
of every owner holds, ``retention.safe_version``) and the persistent steps
Orbax had committed (the step directories a watcher saw under
WORKDIR/checkpoints while the job ran, ``DiskSnapshot``). ``judge`` then
compares each resumption of the job (a ``recovery`` event, or a restart from
step 0 with none) with its expectation, and ``disk_problems`` checks that no
committed persistent step left the disk before ``max_to_keep`` newer ones
were committed.

The rules:

* The memory tier: the safe version S reported in the attempt survives a
  fault when every owner keeps a holder whose copy was neither wiped (mode
  ``host``, ``wipe_all``, a host wiped during the next recovery) nor
  possibly corrupted (``corrupt`` flips a byte of the victim's newest own
  version, which may be S). A version recovered before and proven on the
  surviving holders (the previous expectation) is carried into the next
  attempt until that attempt reports a safe version of its own: a restart
  begins with no safe version, and the host wiped before holds nothing of it.
* The persistent tier: the restore takes the newest step across tiers (the
  memory tier's only when it is at least the newest committed persistent
  step), so every resumption must be at least the newest persistent step
  committed before it, whatever its tier.
* The tier: a recovery with a wiped host cannot be ``local`` (that host
  reads from a peer); with an owner whose every holder was wiped it cannot
  come from memory at all; a ``persistent`` recovery must name a step whose
  persistent write started before it. Expected tier ``local`` admits
  ``peer`` (a copy that fails its checksum, a writer that lagged).
* Nothing must survive (no safe version, no persistent step): tier
  ``none``, step 0, a fresh start.

Design choice: a lower bound computed from the plan and the recorded
commits, compared with what the job did; the job's own choice (newer
versions held by chance, the order in which writers finished) is never
predicted. Alternative not taken: replaying the stores' state step by step
(every writer's commits and prunes) to predict the exact version restored,
which would reimplement the retention and recovery code under test and
share its mistakes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from capricorn_jax.experimental import placement_holders
from launch.train.fault_plan import RECOVERY_POINTS, Fault

TIERS = ("local", "peer", "persistent", "none")
MEMORY_TIERS = ("local", "peer")


@dataclasses.dataclass(frozen=True)
class DiskSnapshot:
    """The persistent steps committed on disk (Orbax's finalized step
    directories) when the watcher listed them; ``records``: the metrics lines
    written then (counted after the listing, so a record at index >=
    ``records`` was written after it); ``polls``: how many polls in a row
    saw this listing."""

    records: int
    steps: frozenset[int]
    polls: int = 1


@dataclasses.dataclass(frozen=True)
class Resumption:
    """Where one attempt of the job started from: a ``recovery`` event (its
    step and tier) or a restart from step 0 with none (tier ``none``);
    ``index``: its position in the records."""

    index: int
    step: int
    tier: str


@dataclasses.dataclass(frozen=True)
class Expectation:
    """The newest version that must survive a fault and the tier it must come
    from (``TIERS``); ``wiped``: hosts whose RAM store was lost; ``lost``:
    owners with no RAM copy left anywhere; ``why``: the reason, for messages."""

    step: int
    tier: str
    wiped: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "tier": self.tier}


Holders = Mapping[int, frozenset[int]]
"""{owner: hosts holding a good copy of a version}."""


def resumptions(records: Sequence[Mapping[str, Any]]) -> list[Resumption]:
    """Each resumption of the job, in order: every ``recovery`` event, and
    every step record that goes back (to a step at or before the last one
    logged) with no recovery since: the job started over from step 0."""
    out: list[Resumption] = []
    last = -1
    for i, r in enumerate(records):
        if r.get("event") == "recovery":
            out.append(Resumption(i, int(r["step"]), str(r["tier"])))
            last = int(r["step"]) - 1
        elif "event" not in r:
            if last >= 0 and r["step"] <= last:
                out.append(Resumption(i, int(r["step"]), "none"))
            last = int(r["step"])
    return out


def kill_groups(faults: Sequence[Fault], ends_attempt: Callable[[Fault], bool]
                ) -> list[tuple[Fault, ...]]:
    """The faults that end an attempt (``ends_attempt``), each with the
    recovery-point faults that strike the recoveries after it: one group per
    resumption of the job."""
    groups: list[list[Fault]] = []
    for f in faults:
        if f.point in RECOVERY_POINTS and groups:
            groups[-1].append(f)
        elif ends_attempt(f):
            groups.append([f])
    return [tuple(g) for g in groups]


def newest_persistent(disk: Iterable[DiskSnapshot], before: int) -> int:
    """The newest persistent step seen committed before record ``before``
    was written (-1: none)."""
    return max((max(s.steps) for s in disk if s.records <= before and s.steps), default=-1)


def _safe_in(records: Sequence[Mapping[str, Any]]) -> int:
    return max((int(r.get("replicated", -1)) for r in records
                if r.get("event") == "checkpoint"), default=-1)


def _survivors(holders: Holders, wiped: set[int], corrupt: set[int]) -> dict[int, frozenset[int]]:
    """Per owner, the holders whose copy is neither wiped nor possibly corrupt."""
    return {o: frozenset(h for h in hs if h not in wiped and not (h == o and o in corrupt))
            for o, hs in holders.items()}


def expectations(groups: Sequence[tuple[Fault, ...]], records: Sequence[Mapping[str, Any]],
                 hosts: int, replicas: int, disk: Sequence[DiskSnapshot] = ()
                 ) -> tuple[list[Expectation], list[Resumption]]:
    """One expectation per group (``kill_groups``), and the resumption each is
    compared with (paired in order; a group without one, at the end, has
    none: the caller names the mismatch)."""
    placement = {o: frozenset(hs) for o, hs in enumerate(placement_holders(hosts, replicas))}
    resumed = resumptions(records)
    out: list[Expectation] = []
    carried: tuple[int, Holders] | None = None  # a version proven on these holders
    start = 0
    for j, group in enumerate(groups):
        res = resumed[j] if j < len(resumed) else None
        end = res.index if res is not None else len(records)
        wiped = set(range(hosts)) if any(f.wipe_all for f in group) else {
            h for f in group if f.mode == "host" for h in f.hosts}
        corrupt = {h for f in group if f.corrupt and not f.wipe_all for h in f.hosts}
        candidates: list[tuple[int, Holders]] = []
        safe = _safe_in(records[start:end])
        if safe >= 0:
            candidates.append((safe, placement))
        if carried is not None:
            candidates.append(carried)
        memory, held = -1, None
        for version, holders in candidates:
            alive = _survivors(holders, wiped, corrupt)
            if all(alive.values()) and version > memory:
                memory, held = version, alive
        lost = tuple(sorted(o for o, hs in placement.items() if hs <= wiped))
        persistent = newest_persistent(disk, end)
        if memory >= 0 and memory >= persistent:
            tier = "peer" if wiped and not lost else "local"
            why = (f"version {memory} was on every holder and a holder of each owner survived"
                   + (f" the wipe of hosts {sorted(wiped)}" if wiped else ""))
            expected = Expectation(memory, tier, tuple(sorted(wiped)), lost, why)
        elif persistent >= 0:
            why = (f"persistent step {persistent} was committed on disk"
                   + (f"; no RAM version of hosts {list(lost)} survived" if lost else
                      "" if memory < 0 else f" (newer than RAM's {memory})"))
            expected = Expectation(persistent, "persistent", tuple(sorted(wiped)), lost, why)
        else:
            expected = Expectation(0, "none", tuple(sorted(wiped)), lost,
                                   "no version was safe in RAM nor committed on disk")
        out.append(expected)
        carried = None
        if res is not None and held is not None and memory <= res.step and \
                res.tier in MEMORY_TIERS:
            carried = (memory, held)  # the recovery drops only versions newer than its own
        start = end + 1 if res is not None else end
    return out, resumed[:len(groups)]


def judge(expected: Expectation, res: Resumption, records: Sequence[Mapping[str, Any]]
          ) -> list[str]:
    """The problems of one resumption against its expectation (empty: it is
    right). ``records``: the job's metrics (the persistent writes started
    before the resumption)."""
    out = []
    what = (f"restart from step {res.step} with no recovery" if res.tier == "none"
            else f"recovery to {res.step} via {res.tier}")
    if res.step < expected.step:
        why = f": {expected.why}" if expected.why else ""
        out.append(f"{what}: older than version {expected.step}, which had to survive "
                   f"(tier {expected.tier}{why})")
    if expected.lost and res.tier in MEMORY_TIERS:
        out.append(f"{what}: no RAM copy of the versions of hosts {list(expected.lost)} "
                   f"survived (a memory recovery cannot have them)")
    elif expected.wiped and res.tier == "local":
        out.append(f"{what}: hosts {list(expected.wiped)} lost their RAM stores and must "
                   f"read from a peer")
    if res.tier == "persistent":
        started = {int(r["step"]) for r in records[:res.index] if r.get("event") == "persist"}
        if res.step not in started:
            out.append(f"{what}: no persistent write of step {res.step} started before it "
                       f"(started: {sorted(started)})")
    return out


def disk_problems(disk: Sequence[DiskSnapshot], max_to_keep: int) -> list[str]:
    """A committed persistent step may leave the disk only once ``max_to_keep``
    newer steps are committed (Orbax's retention, counting committed steps
    only): each listing seen twice in a row (a listing racing a finalize's
    rename and deletion is not believed alone) against every step seen
    before it."""
    out: list[str] = []
    seen: set[int] = set()
    reported: set[int] = set()
    for snap in disk:
        if snap.polls >= 2:
            for gone in sorted(seen - snap.steps - reported):
                newer = sorted(s for s in snap.steps if s > gone)
                if len(newer) < max_to_keep:
                    reported.add(gone)
                    out.append(f"persistent step {gone} left the disk while {len(newer)} "
                               f"newer committed steps were on it ({newer}; max_to_keep "
                               f"{max_to_keep})")
        seen |= snap.steps
    return out


def quiet_expectation(fault: Fault, records: Sequence[Mapping[str, Any]],
                      disk: Sequence[DiskSnapshot], persistent_fault: bool) -> Expectation:
    """A fault that ends no attempt: what must survive it. A fault of the
    persistent tier (``persistent_fault``): the newest persistent step
    committed before its version (it must stay on disk until newer ones are
    committed, ``disk_problems``); any other: the memory tier's safe version
    reported up to the fault's step (the job goes on from its own state)."""
    upto = next((i for i, r in enumerate(records)
                 if "event" not in r and r["step"] > fault.step), len(records))
    if persistent_fault:
        version = fault.step + 1
        before = [s for snap in disk if snap.records <= upto for s in snap.steps if s < version]
        step = max(before, default=-1)
        return (Expectation(step, "persistent", why="committed before the failed write")
                if step >= 0 else Expectation(0, "none", why="nothing committed on disk"))
    safe = _safe_in(records[:upto])
    return (Expectation(safe, "local", why="the safe version before the fault") if safe >= 0
            else Expectation(0, "none", why="no version was safe before the fault"))
