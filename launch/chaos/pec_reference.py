"""launch.chaos's reference of a PEC trial: the same job taking the same roll-backs.

A PEC restore composes the state: the non-expert state from the restore
point, each expert from the newest version at or before it that held it
(``capricorn_jax``'s PEC recovery), so after the first restore a PEC trial's
losses differ from the uninterrupted run's by design and ``checks`` only
asks them to be finite. This module gives such a trial a reference that
restores the same versions: a second run of the same job (same flags,
strategy, seed and data) without the faults, whose fault plan holds one
deliberate roll-back (fault plan point ``rollback``, ``launch.train.rollback``)
per resumption of the faulted job (``rollbacks``). Each roll-back stops
every host once it trained the step that made the version the faulted job
resumed from (the step after it for a strategy that moves a version inside
the next step; when it resumed there already, after its next step), ends
the attempt with every store holding that version and restarts the hosts,
which recover through the ordinary recovery. A faulted recovery from the
persistent tier is mirrored (every RAM store lost: the persistent tier
serves, its steps composed its own way); a recovery in which some hosts read
from a peer is mirrored (those hosts' stores lost) only when another
resumption follows it, because such a recovery makes every expert's next
copy new (``PltTracker.forget_copies``) and a later restore composes alike
only if the reference did the same; the last roll-back otherwise reads every
host's own intact store, so the restore the final state rests on is checked
against a fault-free local read (a peer-served restore's bytes against the
local ones). Training is deterministic on CPU, so ``compare`` then asks:

* every resumption of the reference is the faulted job's: the same step and,
  for a PEC recovery, the same versions read and the same source version of
  each expert (``expert_source_steps``);
* after each resumption, every step both runs logged has the same loss, bit
  for bit;
* the final train state is the same bit for bit: the ``state_digest`` events
  (one CRC32 per leaf, ``launch.train.digest``) are equal; a leaf that differs
  is named.

A recovery that read other bytes than a fault-free roll-back to the same
version would (a torn or mixed copy, a wrong expert source, a wrong data
position) fails the trial even where its losses stay finite.

The versions a job takes can differ between two runs by timing alone (a
version skipped under ``--ckpt_budget``, a replica dropped by a busy or
stalled writer, a lost or corrupted frame): the PEC tracker then records
other copies, and a restore of the same version composes other experts. So
a reference whose resumptions differ from the faulted job's is a problem
only when neither run's ``checkpoint`` events before the first difference
show such an event; otherwise the trial records ``match: null`` and why
(``pec_reference`` in the trial's JSON), and the comparison is not made.

Design choice: a reference that recovers through a restart and the ordinary
recovery, from its own intact stores where that keeps the runs comparable,
so that what it does differently is that nothing failed. Alternatives not
taken: a reference that always restores from its local stores (after a
recovery that read from a peer, a later restore of a reference that lost
nothing composes other experts and could not be compared); one that always
mirrors the faulted tiers (it would run the same serve path as the faulted
job, so a wrong byte served by a peer would go unseen); and recomputing the
composed state offline from the stores, which would reimplement the PEC
restore under test.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from launch.chaos import oracle
from launch.train.fault_plan import ROLLBACK, Fault

IRREGULAR = ("skipped", "dropped_replicas", "under_replicated", "corrupt", "channel_lost")
"""``checkpoint`` event fields that say a version was not taken, or not kept,
everywhere (timing: the two runs may differ in them)."""

Records = Sequence[Mapping[str, Any]]


def rollbacks(records: Records, hosts: int, replicas: int, steps: int,
              in_step: bool = False) -> tuple[Fault, ...]:
    """The reference's fault plan: one roll-back per resumption of the faulted
    job (its ``recovery`` events, and restarts from step 0), in order (module
    docstring). A ``persistent`` recovery loses every RAM store; one whose
    hosts read from a peer loses those hosts' stores when another resumption
    follows it (and they are fewer than ``replicas``); the last roll-back
    reads every host's own store. ``in_step``: the strategy moves a version
    inside the next step (the scheduled ones), so a roll-back to it stops
    after that step (within the job's ``steps``)."""
    out: list[Fault] = []
    resumed = 0  # the step the reference resumed at, before the next roll-back
    every = oracle.resumptions(records)
    for n, res in enumerate(every):
        step = min(max(res.step - 1 + in_step, resumed, 0), steps - 1)
        lose: tuple[int, ...] = ()
        if res.tier != "persistent" and n < len(every) - 1:
            peers = tuple(h for h, t in enumerate(records[res.index].get("tiers", ()))
                          if t == "peer")
            lose = peers if len(peers) < replicas else ()
        out.append(Fault(tuple(range(hosts)), step, ROLLBACK, version=res.step, lose=lose,
                         wipe_all=res.tier == "persistent"))
        resumed = res.step
    return tuple(out)


def reference_flags(trial_flags: Sequence[str], plan: Sequence[Fault]) -> list[str]:
    """The faulted job's flags with ``plan`` as its fault plan."""
    import json

    return [f for f in trial_flags if not f.startswith("--fault_plan=")] + [
        "--fault_plan=" + json.dumps([f.to_json() for f in plan])]


def composition(records: Records, index: int) -> dict[str, Any]:
    """What a resumption restored: its step and, for a PEC recovery, the
    versions it read and each expert's source version (and training step,
    from the persistent tier). Not its tier: the bytes of a version are the
    same whoever serves them."""
    r = records[index]
    if r.get("event") != "recovery":
        return {"restart": r["step"]}
    return {"step": r["step"], **{k: r[k] for k in (
        "versions", "expert_source_steps", "expert_data_steps") if k in r}}


def segments(records: Records) -> list[dict[int, float]]:
    """Step -> loss before the first resumption, then after each one."""
    cuts = [res.index for res in oracle.resumptions(records)]
    out: list[dict[int, float]] = [{}]
    for i, r in enumerate(records):
        if cuts and i == cuts[0]:
            cuts.pop(0)
            out.append({})
        if "event" not in r:
            out[-1][r["step"]] = r["loss"]
    return out


def state_digest(records: Records) -> dict[str, str] | None:
    """The leaves' digests of the last ``state_digest`` event, or None."""
    found = [r for r in records if r.get("event") == "state_digest"]
    return dict(found[-1]["leaves"]) if found else None


def digest_problems(faulted: Mapping[str, str], reference: Mapping[str, str],
                    what: str = "the PEC reference's") -> list[str]:
    """The final states' difference, naming the leaves that differ."""
    differ = sorted(k for k in faulted.keys() | reference.keys()
                    if faulted.get(k) != reference.get(k))
    if not differ:
        return []
    shown = ", ".join(f"{k} ({faulted.get(k, 'absent')} != {reference.get(k, 'absent')})"
                      for k in differ[:4])
    more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
    return [f"final state differs from {what} in {len(differ)} of "
            f"{len(faulted.keys() | reference.keys())} leaves: {shown}{more}"]


def irregular(records: Records, before: int | None = None) -> list[str]:
    """The versions a run did not take or keep everywhere (``IRREGULAR``), in
    its records before index ``before`` (None: all)."""
    out = []
    for r in records[:before]:
        if r.get("event") == "checkpoint":
            marks = [k for k in IRREGULAR if r.get(k)]
            if marks:
                out.append(f"version {r['step']}: {', '.join(marks)}")
    return out


def compare(faulted: Records, reference: Records) -> tuple[list[str], dict[str, Any]]:
    """The problems of a faulted PEC job against its reference (module
    docstring) and the trial's ``pec_reference`` entry (without its
    roll-backs): ``match`` True, False, or None with ``why`` when timing
    made the runs take different versions."""
    mine, theirs = oracle.resumptions(faulted), oracle.resumptions(reference)
    info: dict[str, Any] = {"resumed_from": [r.step for r in theirs]}
    for i in range(max(len(mine), len(theirs))):
        a = composition(faulted, mine[i].index) if i < len(mine) else None
        b = composition(reference, theirs[i].index) if i < len(theirs) else None
        if a == b:
            continue
        why = f"resumption {i + 1}: the faulted job restored {a}, the PEC reference {b}"
        timing = (irregular(faulted, mine[i].index if a else None)
                  + irregular(reference, theirs[i].index if b else None))
        if timing:
            return [], {**info, "match": None,
                        "why": f"{why}; the runs took different versions by timing "
                               f"({'; '.join(timing[:3])})"}
        return [f"PEC reference: {why}"], {**info, "match": False}
    problems = []
    for n, (a_losses, b_losses) in enumerate(zip(segments(faulted), segments(reference),
                                                 strict=False)):
        for step in sorted(a_losses.keys() & b_losses.keys()):
            if a_losses[step] != b_losses[step]:
                problems.append(f"step {step} (after resumption {n}): loss {a_losses[step]!r} "
                                f"!= PEC reference {b_losses[step]!r}")
    a_digest, b_digest = state_digest(faulted), state_digest(reference)
    if a_digest is None or b_digest is None:
        problems.append(f"no state_digest event in the "
                        f"{'faulted job' if a_digest is None else 'PEC reference'}'s metrics")
    else:
        problems += digest_problems(a_digest, b_digest)
    return [f"PEC reference: {p}" for p in problems], {**info, "match": not problems}
