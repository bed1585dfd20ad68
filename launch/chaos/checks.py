"""launch.chaos's checks of a finished trial (pure): ``check_trial``.

What a trial must show, from the job's metrics, the uninterrupted reference
run's losses, the faults the supervisor reported striking, and the
persistent steps a watcher saw on disk while the job ran:

* every planned fault struck, every step 0..N-1 was logged;
* full checkpoints: the loss of every logged step, before and after every
  recovery, is bit-identical to the reference's (no torn or mixed version
  was restored); PEC: bit-identical before the first restore point, finite
  after it, and each recovery reports its portion of lost tokens (PLT) (a PEC
  trial that passes these and restored is then run again as a reference that
  takes the same roll-backs, ``pec_reference``: the same losses and the same
  final state, bit for bit);
* each resumption (a recovery, or a restart from step 0) is no older than
  the version the oracle (``oracle``) computed must survive its fault, from
  the tier it must come from, and no newer than the fault's step allows;
* no committed persistent step left the disk before ``max_to_keep`` newer
  ones were committed; the faults that kill no host did what they do (a
  persistent step dropped and a later one written, a corrupted frame's
  version dropped, a stalled channel lost and back).

Design choice: one function over recorded data, so every rule is tested on
hand-written records (tests/test_chaos_logic.py, tests/test_chaos_oracle.py)
and a failed trial is re-checked from its kept WORKDIR. Alternative not
taken: checks inside the job (asserts in launch.train), which could not see
what a restart lost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launch.chaos import oracle
from launch.chaos.draw import (
    QUIET,
    STALL_REPLICATION_TIMEOUT_S,
    Trial,
    outlasted,
    writer_lags,
)
from launch.train.fault_plan import (
    CORRUPT_FRAME,
    DISK_FULL_FINALIZE,
    PAUSING_POINTS,
    PERSIST_FAULTS,
    RECOVERY_POINTS,
    STALL_CHANNEL,
    Fault,
)


def ends_attempt(fault: Fault) -> bool:
    """A fault that ends an attempt of the job (a kill, a pause or partition
    past the peer timeout); not one during a recovery (it strikes the
    attempt a kill began) nor one that kills no host."""
    return fault.point not in (*RECOVERY_POINTS, *QUIET) and not outlasted(fault)


def expected(trial: Trial, records: list[dict], disk: Sequence[oracle.DiskSnapshot] = ()
             ) -> tuple[list[oracle.Expectation], list[oracle.Resumption]]:
    """The oracle's expectation per fault that ends an attempt (in order), and
    the resumptions they pair with; a trial whose faults end none: one
    expectation for its last fault (what must survive it)."""
    groups = oracle.kill_groups(trial.faults, ends_attempt)
    if groups or not trial.faults:
        return oracle.expectations(groups, records, trial.topology.hosts,
                                   trial.topology.replicas, disk)
    last = trial.faults[-1]
    return [oracle.quiet_expectation(
        last, records, disk, last.point in (*PERSIST_FAULTS, DISK_FULL_FINALIZE))], []


def check_trial(trial: Trial, records: list[dict], reference: dict[int, float], steps: int,
                strikes: int, committed: set[int] | None = None,
                disk: Sequence[oracle.DiskSnapshot] | None = None
                ) -> tuple[list[str], dict[str, Any]]:
    """The problems of a finished trial (empty: it passed) and what happened.

    Args:
      records: the job's metrics.jsonl.
      reference: step -> loss of the uninterrupted run.
      strikes: the faults the supervisor reported striking.
      committed: the persistent steps on disk at the end (Orbax's finalized
        step directories), when the caller read them: a persistent-write
        fault then needs its step absent and a later one complete, not
        only started.
      disk: the watcher's listings of the persistent steps while the job ran
        (None: not watched): the newest committed persistent step before
        each recovery, and the steps deleted too early.
    """
    problems: list[str] = []
    # A pause past the peer timeout ends its attempt like a kill; a shorter
    # one ends nothing (and must cause no recovery).
    kills = [f for f in trial.faults if ends_attempt(f)]
    killing = len([f for f in trial.faults if f.point not in QUIET])
    if strikes != killing:
        problems.append(f"{strikes} of {killing} faults struck")
    problems += _persist_fault_problems(trial, records, committed)
    problems += _corrupt_frame_problems(trial, records)
    problems += _stall_channel_problems(trial, records)
    step_records = [r for r in records if "event" not in r]
    seen = {r["step"] for r in step_records}
    # A step trained and checkpointed whose line host 0 was killed before
    # writing (its save comes first): the recovery resumes after it. Only the
    # steps between the last line before a recovery and its version qualify.
    unlogged, last = set(), -1
    for r in records:
        if "event" not in r:
            last = r["step"]
        elif r.get("event") == "recovery":
            unlogged |= set(range(last + 1, r["step"])) - seen
            last = r["step"] - 1
    if seen | unlogged != set(range(steps)) or not seen <= set(range(steps)):
        problems.append(f"steps logged {sorted(seen)}, expected 0..{steps - 1}")
    recoveries = [r for r in records if r.get("event") == "recovery"]
    expected_recoveries = len(kills) + len([f for f in trial.faults
                                            if f.point in RECOVERY_POINTS])
    if any(outlasted(f) or f.point in (CORRUPT_FRAME, STALL_CHANNEL)
           for f in trial.faults) and \
            len(recoveries) > expected_recoveries:
        problems.append(f"{len(recoveries)} recoveries where the faults end "
                        f"{expected_recoveries} attempts (a pause or partition shorter than "
                        f"the peer timeout, a slow link or a corrupted frame must end none)")
    first_restore = min((r["step"] for r in recoveries), default=steps)
    for r in step_records:
        want = reference.get(r["step"])
        if trial.pec and r["step"] >= first_restore:
            if not math.isfinite(r["loss"]):
                problems.append(f"step {r['step']}: loss {r['loss']} after a PEC restore")
        elif r["loss"] != want:
            problems.append(f"step {r['step']}: loss {r['loss']!r} != reference {want!r}")
    if trial.pec:
        problems += [f"recovery to {r['step']}: no PLT reported" for r in recoveries
                     if "plt" not in r]
    # Each resumption against the oracle's expectation for its fault (in
    # order: a kill during recovery logs none, the next attempt's recovery
    # is the fault's), and against how far the fault's step lets it go.
    expectations, resumed = expected(trial, records, disk or ())
    every = oracle.resumptions(records)
    if kills and len(every) != len(kills):
        problems.append(f"{len(every)} resumptions (recoveries, or restarts from step 0 with "
                        f"none) where the faults end {len(kills)} attempts")
    for kill, must, res in zip(kills, expectations, resumed, strict=False):
        problems += oracle.judge(must, res, records)
        if res.tier != "none" and not writer_lags(trial, kill):
            # A pausing point stops the victim there; elsewhere it runs on
            # until the kill lands (a poll of the supervisor, about a step).
            reach = kill.step + (1 if kill.point in PAUSING_POINTS else 3)
            if res.step > reach:
                problems.append(f"recovery to {res.step}, after the fault at step "
                                f"{kill.step} ({kill.point})")
    if disk is not None and trial.persist_every:
        problems += oracle.disk_problems(disk, trial.max_to_keep)
    happened = {"resumed_from": [r["step"] for r in recoveries],
                "unlogged_steps": sorted(unlogged),
                "tier": [r["tier"] for r in recoveries],
                "recovery_s": [round(r["seconds"], 3) for r in recoveries],
                "plt": [r.get("plt") for r in recoveries if "plt" in r],
                **expected_json(expectations)}
    return problems, happened


def expected_json(expectations: Sequence[oracle.Expectation]) -> dict[str, Any]:
    """The JSON of a trial's expectations: ``expected_from`` (DESIGN.md's
    contract: the last one, the version the trial's final resumption must
    reach, or what must survive a fault that ends no attempt) and
    ``expected`` (one per fault that ends an attempt, in order)."""
    if not expectations:
        return {}
    return {"expected_from": expectations[-1].to_json(),
            "expected": [e.to_json() for e in expectations]}


def _persist_fault_problems(trial: Trial, records: list[dict],
                            committed: set[int] | None = None) -> list[str]:
    """A persist_error / persist_hang / disk_full_finalize fault: its version's
    persistent step is dropped (a persist_error event names it) and a later
    one is written."""
    out = []
    for f in trial.faults:
        if f.point not in (*PERSIST_FAULTS, DISK_FULL_FINALIZE):
            continue
        version = f.step + 1
        errors = {r.get("step") for r in records if r.get("event") == "persist_error"}
        if version not in errors:
            out.append(f"{f.point}: no persist_error for version {version}")
        if not any(r.get("event") == "persist" and r["step"] > version for r in records):
            out.append(f"{f.point}: no persistent step started after version {version}")
        elif committed is not None and not any(s > version for s in committed):
            out.append(f"{f.point}: no persistent step after version {version} complete on "
                       f"disk (committed: {sorted(committed)})")
        if committed is not None and version in committed:
            out.append(f"{f.point}: the failed step {version} is committed on disk")
    return out


def committed_steps(checkpoints: Path) -> set[int]:
    """The persistent steps Orbax finalized under ``checkpoints`` (its step
    directories; an unfinished one has another name)."""
    if not checkpoints.is_dir():
        return set()
    return {int(p.name) for p in checkpoints.iterdir() if p.is_dir() and p.name.isdigit()}


def _corrupt_frame_problems(trial: Trial, records: list[dict]) -> list[str]:
    """A corrupt_frame fault: host 0, the receiver, took no version of the
    corrupted frame (a ``checkpoint`` event with "corrupt" at or after the
    fault's step) and nothing else was dropped as corrupt."""
    out = []
    for f in trial.faults:
        if f.point != CORRUPT_FRAME:
            continue
        dropped = [r["step"] for r in records
                   if r.get("event") == "checkpoint" and r.get("corrupt")]
        if len(dropped) != 1 or dropped[0] < f.step:
            out.append(f"corrupt_frame at step {f.step}: versions dropped as corrupt "
                       f"{dropped}, expected one at or after it")
    return out


def _stall_channel_problems(trial: Trial, records: list[dict]) -> list[str]:
    """A stall_channel fault: one past the channel's bound loses it (host 0
    takes no version at some save at or after the fault's step: a
    ``checkpoint`` event with "channel_lost") and it comes back (a version
    after the last lost one is moved in a step or committed); a shorter one
    is waited out (no version lost)."""
    out = []
    for f in trial.faults:
        if f.point != STALL_CHANNEL:
            continue
        lost = [r["step"] for r in records
                if r.get("event") == "checkpoint" and r.get("channel_lost")]
        moved = [v for r in records if r.get("event") == "checkpoint"
                 for v in ([r["moved_in_step"]] if "moved_in_step" in r else [])
                 + r.get("newly_committed", [])]
        if f.pause_s <= 4 * STALL_REPLICATION_TIMEOUT_S:
            if lost:
                out.append(f"stall_channel of {f.pause_s:g}s at step {f.step} (within the "
                           f"channel's bound): versions lost {lost}, expected none")
        elif not lost or min(lost) < f.step:
            out.append(f"stall_channel of {f.pause_s:g}s at step {f.step}: versions lost "
                       f"{lost}, expected some at or after it")
        elif not any(v > max(lost) for v in moved):
            out.append(f"stall_channel at step {f.step}: no version moved after the lost "
                       f"ones {lost} (the channel did not come back)")
    return out

