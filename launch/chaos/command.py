r"""Randomized fault trials: ``python -m launch.chaos --trials=N --seed=S --json=PATH``.

Each trial draws a topology (2 hosts x 2 devices, 4 x 1, 4 x 1 with three
replicas), an in-memory strategy (inmem, gemini, capricorn, pec), with or
without a persistent tier, and a fault schedule for ``launch.train
--fault_plan``: one or two faults, each killing one host or two at once at a
random step and point (after a step, while a step runs, halfway through
writing replicas, while the persistent tier writes, while the job recovers),
as a process (its RAM store survives) or a machine (its store is wiped), at
times with a corrupted chunk, every RAM store lost, or a replica writer that
stalls. The trial then checks the run against an uninterrupted reference run
of the same topology (``--ckpt=none``: a checkpoint does not change training):

* the job ends by itself (exit 0) within ``--trial_timeout_s``, every planned
  fault struck, every step 0..N-1 was logged;
* full checkpoints: the loss of every logged step, before and after every
  recovery, is bit-identical to the reference's (so no torn or mixed version
  was restored); PEC: bit-identical before the first restore point, finite
  after it, and each recovery reports its portion of lost tokens (PLT);
* each recovery resumed from a version no older than the newest one the job
  had reported safe (committed on every holder of every owner) before the
  fault, and no newer than the fault's step allows; after every RAM store
  was lost, from the persistent tier (or from step 0 without one).

A progress line per trial, a table and a summary at the end; the JSON
(contract in DESIGN.md) has one object per trial with what was drawn, what
happened and the problems found. Exit code 1 if a trial failed.

Design choice: a trial is a real ``launch.train`` job (real processes, real
kills by the supervisor's injector), and the decisions (``draw_trial``,
``check_trial``) are pure functions of a seeded generator and the metrics, so
a failed trial is replayed by its seed. Alternative not taken: a fault
injector inside the workers, which could not kill a process from outside at
a point the process does not choose.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import app, flags

from capricorn_jax.experimental import send_rounds
from launch.chaos.config import (  # noqa: F401 (re-exported)
    CHANNEL_CLASSES,
    FAULT_CLASSES,
    NETWORK_CLASSES,
    ChaosConfig,
    Topology,
    parse_topology,
)
from launch.cli_flags import FlagError
from launch.train.fault_plan import (
    CORRUPT_FRAME,
    DISK_FULL_FINALIZE,
    NETWORK_FAULTS,
    PARTITION,
    PAUSE,
    PAUSING_POINTS,
    PERSIST_FAULTS,
    RECOVERY_POINTS,
    SLOW_LINK,
    STALL_CHANNEL,
    TIMED,
    Fault,
)

FLAGS = flags.FLAGS

# launch.cli_flags groups (and their flags) that chaos takes: each trial's job
# is a launch.train job of --model and --steps (12 by default), behind the
# links, on the accelerator.
SHARED_FLAGS = {"model": ("model",), "data": ("steps", "workdir"), "links": None,
                "accelerator": None}
CHAOS_DEFAULTS = {"steps": 12}


def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """The command's flags, defined when run as a command (or by a test on a
    fresh ``fv``): importing this module for its logic defines none."""
    from launch import cli_flags

    cli_flags.define(fv, SHARED_FLAGS, CHAOS_DEFAULTS)
    flags.adopt_module_key_flags(cli_flags, flag_values=fv)
    flags.DEFINE_integer("trials", 10, "Trials to run.", flag_values=fv)
    flags.DEFINE_integer("only_trial", -1,
                         "Replay this trial index of the seed's draw alone (-1: all trials).",
                         flag_values=fv)
    # Not launch.train's --seed (the job's parameters and data): the seed of
    # the draws (DESIGN.md's contract); the trials' jobs use seed 0.
    flags.DEFINE_integer("seed", 0, "Seed of the trial draws (trial i uses seed * 1000 + i).",
                         flag_values=fv)
    flags.DEFINE_string("json", None, "Write the trials and the summary here as JSON.",
                        flag_values=fv)
    flags.DEFINE_list("topologies", ["2x2", "4x1", "4x1r3"],
                      "Topologies drawn from: HxD (H hosts x D devices, 2 replicas) or HxDrM.",
                      flag_values=fv)
    flags.DEFINE_list("strategies", ["inmem", "gemini", "capricorn", "pec"],
                      "Strategies drawn from (in-memory ones).", flag_values=fv)
    flags.DEFINE_list("faults", [],
                      "Fault classes drawn (empty: all): only trials whose last fault is of "
                      "one of them; classes: " + ", ".join(FAULT_CLASSES) + ".",
                      flag_values=fv)
    flags.DEFINE_float("trial_timeout_s", 900.0, "A trial's job must end within this.",
                       flag_values=fv)
    flags.DEFINE_boolean("keep_going", True, "Run every trial even after a failure.",
                         flag_values=fv)
    flags.DEFINE_boolean("fast_compile", True,
                         "Compile the jobs' steps with LLVM's backend optimizations off and "
                         "share a JAX compilation cache between the jobs (the trials test "
                         "recovery, not speed; the reference runs use the same setting, so "
                         "losses still compare bit for bit).", flag_values=fv)
    return fv


POINTS = ("after_step", "mid_step", "mid_replication", "mid_persist", "persist_error",
          "persist_hang", DISK_FULL_FINALIZE, PAUSE, CORRUPT_FRAME, PARTITION, SLOW_LINK,
          STALL_CHANNEL)
"""The points drawn (``recovery`` too, as a second fault); the network faults
only where the trials run on shaped links (``--link_gbps``)."""
PERSIST_EVERY = 4
PERSIST_HANG_TIMEOUT_S = 10.0
"""--persist_timeout_s of a trial with a persist_hang fault: the other hosts
drop the hung step after 2x this, the hung host's Orbax thread after 4x."""
PEC_K = 2
PAUSE_PEER_TIMEOUT_S = 8.0
"""--peer_timeout_s of a trial with a pause or a partition: one of
SHORT_PAUSE_S is outlasted (the job goes on), one of LONG_PAUSE_S ends the
attempt; a slow link of either length is outlasted."""
SHORT_PAUSE_S, LONG_PAUSE_S = 3.0, 20.0
STALL_REPLICATION_TIMEOUT_S = 2.0
"""--replication_timeout_s of a trial with a stall_channel fault: the chunk
channel's bound is 4x this (8 s), so a stall of SHORT_PAUSE_S is waited out
(slow, not lost) and one of LONG_PAUSE_S loses the channel, which reconnects."""
QUIET = (CORRUPT_FRAME, STALL_CHANNEL, DISK_FULL_FINALIZE, *PERSIST_FAULTS)
"""Faults that kill no host and end no attempt, whatever their length."""


THREADED, BUDGET = "--chunk_path=threaded", "--ckpt_budget=0"
"""Job variants a trial may draw (``Trial.variant``): inmem / pec over the
chunk channel (2 replicas), and the cost budget (versions skipped while a
host's writers are busy; the scheduled strategies' versions spread over
steps)."""
BUDGET_POINTS = frozenset({"after_step", "mid_step", "recovery", "mid_serve", PAUSE, PARTITION,
                           SLOW_LINK, CORRUPT_FRAME, STALL_CHANNEL})
"""Faults that strike whether or not their version was skipped (the others
strike inside a version's replication or persistent write)."""


def _outlasted(f: Fault) -> bool:
    """A pause or partition shorter than the trial's peer timeout, or a slow
    link: no attempt ends."""
    return f.point == SLOW_LINK or (f.point in (PAUSE, PARTITION)
                                    and f.pause_s < PAUSE_PEER_TIMEOUT_S)


@dataclasses.dataclass(frozen=True)
class Trial:
    """What one trial runs (drawn by ``draw_trial``)."""

    index: int
    seed: int
    topology: Topology
    strategy: str
    persist_every: int
    faults: tuple[Fault, ...]
    stall: tuple[int, int] | None  # (host, step): its replica writer stalls 3 s
    variant: tuple[str, ...] = ()  # job flags drawn beside the faults (``VARIANTS``)

    @property
    def pec(self) -> bool:
        return self.strategy == "pec"

    def flags(self, steps: int, model: str) -> list[str]:
        t = self.topology
        out = [f"--hosts={t.hosts}", f"--devices_per_host={t.devices_per_host}",
               f"--model={model}", f"--steps={steps}", f"--ckpt={self.strategy}",
               f"--replicas={t.replicas}", "--eval_sequences=0", f"--log_every={steps}",
               "--fault_plan=" + json.dumps([f.to_json() for f in self.faults])]
        if self.persist_every:
            out.append(f"--persist_every={self.persist_every}")
        if any(f.point == "persist_hang" for f in self.faults):
            out.append(f"--persist_timeout_s={PERSIST_HANG_TIMEOUT_S}")
        if any(f.point in TIMED for f in self.faults):
            out.append(f"--peer_timeout_s={PAUSE_PEER_TIMEOUT_S:g}")
        if any(f.point == STALL_CHANNEL for f in self.faults):
            out.append(f"--replication_timeout_s={STALL_REPLICATION_TIMEOUT_S:g}")
        if self.pec:
            out += [f"--pec_k={PEC_K}", "--nopec_dynamic"]
        if self.stall is not None:
            out += [f"--stall_host={self.stall[0]}", f"--stall_at_step={self.stall[1]}",
                    "--stall_seconds=3"]
        return out + list(self.variant)

    def describe(self) -> str:
        faults = "; ".join(_describe(f) for f in self.faults)
        stall = "" if self.stall is None else f"; stall host {self.stall[0]}@{self.stall[1]}"
        variant = "".join(f" {v.lstrip('-')}" for v in self.variant)
        return (f"{self.topology.name} {self.strategy}{variant} persist={self.persist_every} "
                f"[{faults}{stall}]")


def _describe(f: Fault) -> str:
    who = "+".join(str(h) for h in f.hosts)
    where = f.point if f.point in RECOVERY_POINTS else f"{f.point}@{f.step}"
    extra = "".join([" wipe_all" if f.wipe_all else "", " corrupt" if f.corrupt else "",
                     f" {f.pause_s:g}s" if f.point in (*TIMED, STALL_CHANNEL) else ""])
    return f"host {who} {where} {f.mode}{extra}"


_MAX_DRAWS = 10_000


def fault_classes(faults: Sequence[Fault]) -> list[str]:
    """Each fault's class (``FAULT_CLASSES``), in order."""
    out = []
    for i, f in enumerate(faults):
        if f.point == "mid_serve":
            out.append("kill_mid_serve")
        elif f.point == "recovery" and i and faults[i - 1].point == "recovery":
            out.append("double_kill")
        else:
            out.append(f.point)
    return out


def _on_channel(strategy: str, topo: Topology, persist: int) -> bool:
    """Whether a trial's versions can move on the chunk channel from its first
    step (the faults of the channel can strike): capricorn's, or inmem's and
    pec's with ``THREADED`` (2 replicas; pec not with a persistent tier,
    which launch.train refuses)."""
    return strategy == "capricorn" or (strategy in ("inmem", "pec") and topo.replicas == 2
                                       and not (strategy == "pec" and persist))


def draw_trial(index: int, seed: int, topologies: list[Topology], strategies: list[str],
               steps: int, shaped: bool = False, classes: Sequence[str] = ()) -> Trial:
    """Trial ``index`` of a soak: every choice from one generator seeded by
    (seed, index), so the trial is replayed by its seed; ``shaped``: the
    trials run on shaped links (the network faults can be drawn);
    ``classes`` (``--faults``): only trials whose last fault is of one of
    them: the class is drawn first, evenly, then trials from the same
    generator until one's last fault is of it)."""
    rng = random.Random(seed * 1000 + index)
    target = rng.choice(list(classes)) if classes else None
    for _ in range(_MAX_DRAWS):
        trial = _draw(rng, index, seed, topologies, strategies, steps, shaped)
        if target is None or (trial.faults and fault_classes(trial.faults)[-1] == target):
            return trial
    raise ValueError(f"no trial with a last fault of class {target} in {_MAX_DRAWS} draws "
                     f"(strategies {strategies}, shaped links: {shaped})")


def _draw(rng: random.Random, index: int, seed: int, topologies: list[Topology],
          strategies: list[str], steps: int, shaped: bool) -> Trial:
    topo = rng.choice(topologies)
    choices = [s for s in strategies if topo.replicas == 2 or s in ("inmem", "pec")]
    if not choices:
        raise ValueError(f"no strategy of {strategies} runs on {topo.name} (the scheduled "
                         f"ones need 2 replicas)")
    strategy = rng.choice(choices)
    persist = rng.choice([0, PERSIST_EVERY])
    faults: list[Fault] = []
    low = 1
    for n in range(2 if rng.random() < 0.4 else 1):
        if n == 1 and rng.random() < 0.5:  # a host lost while the job recovers
            lost = faults[0] if faults else None
            if (lost is not None and lost.mode == "host" and not lost.wipe_all
                    and len(lost.hosts) == 1 and topo.replicas == 2 and rng.random() < 0.5):
                # ... the one that serves the lost store's replica, in the serve round
                server = send_rounds(topo.hosts, topo.replicas)[0][lost.hosts[0]]
                faults.append(Fault((server,), -1, "mid_serve", "process"))
            else:
                faults.append(Fault((rng.randrange(topo.hosts),), -1, "recovery",
                                    rng.choice(["process", "host"])))
                if rng.random() < 0.3:  # double_kill: the next recovery is struck too
                    faults.append(Fault((rng.randrange(topo.hosts),), -1, "recovery",
                                        rng.choice(["process", "host"])))
            break
        points = [p for p in POINTS
                  if (persist or p not in ("mid_persist", DISK_FULL_FINALIZE, *PERSIST_FAULTS))
                  and (p not in (CORRUPT_FRAME, STALL_CHANNEL)
                       or _on_channel(strategy, topo, persist))
                  and (shaped or p not in NETWORK_FAULTS)]
        point = rng.choice(points)
        if point == CORRUPT_FRAME:  # no kill: the plan's last fault
            # The victim is the host that sends to host 0 (whose metrics the
            # oracle reads): host 0 receives the corrupted frame. Strategies
            # whose versions move on the chunk channel from the start:
            # capricorn from its first schedule on (gemini profiles longer
            # than a trial), inmem and pec over it (``THREADED``).
            victim = next(h for h, d in send_rounds(topo.hosts, topo.replicas)[0].items()
                          if d == 0)
            if low <= steps - 4:
                faults.append(Fault((victim,), rng.randrange(max(low, 2), steps - 3),
                                    CORRUPT_FRAME))
            break
        if point == STALL_CHANNEL:  # no kill: the plan's last fault, on the channel
            # Early enough that the versions after the loss move again
            # within the trial (lost at the next save, agreed at the one
            # after, reconnected there).
            if low <= steps - 6:
                faults.append(Fault((rng.randrange(topo.hosts),),
                                    rng.randrange(max(low, 2), steps - 5), STALL_CHANNEL,
                                    pause_s=rng.choice([SHORT_PAUSE_S, LONG_PAUSE_S])))
            break
        if point in TIMED:  # no kill: the plan's last fault, on one host
            if low <= steps - 3:
                faults.append(Fault((rng.randrange(topo.hosts),), rng.randrange(low, steps - 2),
                                    point, pause_s=rng.choice([SHORT_PAUSE_S, LONG_PAUSE_S])))
            break
        if point in (*PERSIST_FAULTS, DISK_FULL_FINALIZE):  # no kill: the plan's last
            writes = [s for s in range(low, steps - 1 - PERSIST_EVERY)
                      if (s + 1) % persist == 0]  # a later write shows the job goes on
            if writes:  # a full disk strikes the primary's finalize: host 0
                victim = 0 if point == DISK_FULL_FINALIZE else rng.randrange(topo.hosts)
                faults.append(Fault((victim,), rng.choice(writes), point))
            break
        if point == "mid_persist":
            writes = [s for s in range(low, steps - 1) if (s + 1) % persist == 0]
            if not writes:
                break
            step = rng.choice(writes)
        else:
            if low > steps - 3:
                break
            step = rng.randrange(low, steps - 2)
        two = rng.random() < (0.5 if topo.replicas >= 3 else 0.2)
        victims = tuple(sorted(rng.sample(range(topo.hosts), 2 if two else 1)))
        mode = "host" if rng.random() < 0.4 else "process"
        wipe_all = bool(persist) and rng.random() < 0.1
        corrupt = mode == "process" and not wipe_all and rng.random() < 0.2
        faults.append(Fault(victims, step, point, mode, corrupt, wipe_all))
        low = step + 1
    stall = None
    if rng.random() < 0.15:
        stall = (rng.randrange(topo.hosts), rng.randrange(1, steps - 1))
    variant = []
    channel_fault = any(f.point in (CORRUPT_FRAME, STALL_CHANNEL) for f in faults)
    if strategy != "capricorn" and _on_channel(strategy, topo, persist) and (
            channel_fault or rng.random() < 0.4):
        variant.append(THREADED)
    if all(f.point in BUDGET_POINTS for f in faults) and stall is None and rng.random() < 0.25:
        variant.append(BUDGET)
    return Trial(index, seed * 1000 + index, topo, strategy, persist, tuple(faults), stall,
                 tuple(variant))


def _writer_lags(trial: Trial, fault: Fault) -> bool:
    """Whether a mid-replication fault strikes a host whose replica writer was
    stalled at or before the version it pauses in: it writes that version
    halfway only when the stall ends, while training goes on, so the kill (and
    the newest version every owner committed) may be any number of steps later.

    Both count versions: the fault at step s pauses in version s + 1 (the
    version its step saves), and the stall is at a version (seed 32, trial 15:
    the stall at version 9 held the pause in version 9 until step 12)."""
    return (fault.point == "mid_replication" and trial.stall is not None
            and trial.stall[0] in fault.hosts and trial.stall[1] <= fault.step + 1)


def check_trial(trial: Trial, records: list[dict], reference: dict[int, float], steps: int,
                strikes: int, committed: set[int] | None = None
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
    """
    problems: list[str] = []
    # A pause past the peer timeout ends its attempt like a kill; a shorter
    # one ends nothing (and must cause no recovery).
    kills = [f for f in trial.faults if f.point not in (*RECOVERY_POINTS, *QUIET)
             and not _outlasted(f)]
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
    if any(_outlasted(f) or f.point in (CORRUPT_FRAME, STALL_CHANNEL)
           for f in trial.faults) and \
            len(recoveries) > expected_recoveries:
        problems.append(f"{len(recoveries)} recoveries where the faults end "
                        f"{expected_recoveries} attempts (a pause or partition shorter than "
                        f"the peer timeout, a slow link or a corrupted frame must end none)")
    first_restore = min((r["step"] for r in recoveries), default=steps)
    for r in step_records:
        expected = reference.get(r["step"])
        if trial.pec and r["step"] >= first_restore:
            if not math.isfinite(r["loss"]):
                problems.append(f"step {r['step']}: loss {r['loss']} after a PEC restore")
        elif r["loss"] != expected:
            problems.append(f"step {r['step']}: loss {r['loss']!r} != reference {expected!r}")
    # Each recovery against the faults: the records are in order, so the safe
    # version reported before a fault is the newest one before its recovery. A
    # kill during recovery logs no recovery; a fault that struck before any
    # version existed neither (the job starts over), so recovery i goes with
    # fault i only when every other fault logged one.
    paired = len(recoveries) == len(kills)
    safe, n, last = -1, 0, -1
    for r in records:
        if "event" not in r:
            if r["step"] < last:  # the job started over (nothing to recover from)
                safe = -1
            last = r["step"]
        elif r.get("event") == "checkpoint":
            safe = max(safe, r.get("replicated", -1))
        elif r.get("event") == "recovery":
            last = r["step"]
            if trial.pec and "plt" not in r:
                problems.append(f"recovery to {r['step']}: no PLT reported")
            if paired and kills[n].wipe_all:
                if r["tier"] != "persistent":
                    problems.append(f"recovery to {r['step']} via {r['tier']} after every "
                                    f"RAM store was lost")
            elif r["tier"] != "persistent" and r["step"] < safe:
                problems.append(f"recovery to {r['step']}, older than the safe version {safe}")
            if paired and not _writer_lags(trial, kills[n]):
                # A pausing point stops the victim there; elsewhere it runs on
                # until the kill lands (a poll of the supervisor, about a step).
                reach = kills[n].step + (1 if kills[n].point in PAUSING_POINTS else 3)
                if r["step"] > reach:
                    problems.append(f"recovery to {r['step']}, after the fault at step "
                                    f"{kills[n].step} ({kills[n].point})")
            n += 1
            safe = min(safe, r["step"])  # the versions after it are abandoned
    happened = {"resumed_from": [r["step"] for r in recoveries],
                "unlogged_steps": sorted(unlogged),
                "tier": [r["tier"] for r in recoveries],
                "recovery_s": [round(r["seconds"], 3) for r in recoveries],
                "plt": [r.get("plt") for r in recoveries if "plt" in r]}
    return problems, happened


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


def _store_root(scratch: Path) -> Path:
    """The trials' RAM stores: on the RAM disk when there is one."""
    shm = Path("/dev/shm")
    return shm / f"capricorn-chaos-{scratch.name}" if shm.is_dir() else scratch / "shm"


def _run_train(flags_: list[str], workdir: Path, store: Path, timeout_s: float,
               fast_compile: bool, extra: Sequence[str] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if fast_compile:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""),
                                     "--xla_backend_optimization_level=0"]).strip()
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(workdir.parent / "jax_cache"))
    return subprocess.run(
        [sys.executable, "-m", "launch.train", *flags_, f"--workdir={workdir}",
         f"--store_root={store}", "--fresh", *extra],
        capture_output=True, text=True, timeout=timeout_s, env=env)


def _reference(topo: Topology, steps: int, model: str, scratch: Path, cache: dict,
               timeout_s: float, fast_compile: bool, extra: Sequence[str] = ()
               ) -> dict[int, float]:
    """Losses of the uninterrupted run of a topology (one run per topology)."""
    key = (topo.hosts, topo.devices_per_host)
    if key not in cache:
        work = scratch / f"ref-{topo.hosts}x{topo.devices_per_host}"
        proc = _run_train([f"--hosts={topo.hosts}", f"--devices_per_host={topo.devices_per_host}",
                           f"--model={model}", f"--steps={steps}", "--ckpt=none",
                           "--eval_sequences=0", f"--log_every={steps}"],
                          work, _store_root(scratch), timeout_s, fast_compile, extra)
        if proc.returncode != 0:
            raise RuntimeError(f"reference run {key} failed:\n{proc.stdout[-2000:]}"
                               f"{proc.stderr[-2000:]}")
        records = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
        cache[key] = {r["step"]: r["loss"] for r in records if "event" not in r}
    return cache[key]


def run_trial(trial: Trial, steps: int, model: str, scratch: Path, references: dict,
              timeout_s: float, fast_compile: bool = True, extra: Sequence[str] = ()
              ) -> dict[str, Any]:
    """Runs one trial and checks it; its JSON object. ``extra``: flags every job
    of the trial gets (the reference run's too), e.g. its shaped links."""
    start = time.monotonic()
    result: dict[str, Any] = {
        "trial": trial.index, "seed": trial.seed, "topology": trial.topology.name,
        "strategy": trial.strategy, "persist_every": trial.persist_every,
        "faults": [{**f.to_json(), "class": c}
                   for f, c in zip(trial.faults, fault_classes(trial.faults), strict=True)],
        "stall": None if trial.stall is None else list(trial.stall),
        "variant": list(trial.variant)}
    reference = _reference(trial.topology, steps, model, scratch, references, timeout_s,
                           fast_compile, extra)
    work, store = scratch / f"trial{trial.index}", _store_root(scratch)
    flags_ = trial.flags(steps, model)
    result["command"] = "python -m launch.train " + " ".join(
        f"'{f}'" if "[" in f else f for f in [*flags_, *extra])
    try:
        proc = _run_train(flags_, work, store, timeout_s, fast_compile, extra)
    except subprocess.TimeoutExpired as e:
        said = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        tail = " | ".join((said or "").strip().splitlines()[-8:])
        result.update(ok=False, problems=[f"job did not end within {timeout_s:.0f}s; its last "
                                          f"lines: {tail}"],
                      seconds=round(time.monotonic() - start, 1))
        return result
    records = []
    if (work / "metrics.jsonl").exists():
        records = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    strikes = sum(proc.stdout.count(f"fault: {what}") for what in (
        "SIGKILLed", "paused host", "cut off host", "slowed the link of host"))
    if proc.returncode != 0:
        problems = [f"job exited with {proc.returncode}: " + " | ".join(
            (proc.stdout + proc.stderr).strip().splitlines()[-6:])]
        happened: dict[str, Any] = {}
    else:
        problems, happened = check_trial(trial, records, reference, steps, strikes,
                                         committed_steps(work / "checkpoints"))
    result.update(happened, ok=not problems, problems=problems,
                  seconds=round(time.monotonic() - start, 1))
    if not problems:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _table(results: list[dict]) -> str:
    rows = [("trial", "ok", "topology", "strategy", "persist", "faults", "resumed", "tiers",
             "s")]
    for r in results:
        faults = "; ".join(_describe(Fault(tuple(f["hosts"]), f["step"], f["point"], f["mode"],
                                           f["corrupt"], f["wipe_all"])) for f in r["faults"])
        rows.append((str(r["trial"]), "ok" if r["ok"] else "FAIL", r["topology"], r["strategy"],
                     str(r["persist_every"]), faults,
                     ",".join(map(str, r.get("resumed_from", []))),
                     ",".join(r.get("tier", [])), f"{r['seconds']:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def main(argv: list[str]) -> int:
    del argv
    try:
        config = ChaosConfig.from_flags(FLAGS)
    except FlagError as e:
        raise app.UsageError(str(e)) from None
    return run(config)


def run(config: ChaosConfig) -> int:
    """The trials of ``config``, their table and summary; the exit code."""
    job_flags = config.job_flags()
    scratch = Path(config.workdir or tempfile.mkdtemp(prefix="capricorn-chaos-"))
    scratch.mkdir(parents=True, exist_ok=True)
    references: dict = {}
    results = []
    started = time.monotonic()
    try:
        indices = [config.only_trial] if config.only_trial >= 0 else range(config.trials)
        for i in indices:
            trial = draw_trial(i, config.seed, list(config.topologies), list(config.strategies),
                               config.steps, shaped=config.link.shaped, classes=config.faults)
            result = run_trial(trial, config.steps, config.model, scratch, references,
                               config.trial_timeout_s, config.fast_compile, job_flags)
            results.append(result)
            status = "ok" if result["ok"] else "FAIL: " + "; ".join(result["problems"])[:300]
            resumed = ",".join(f"{s} ({t})" for s, t in zip(
                result.get("resumed_from", []), result.get("tier", []), strict=True))
            label = (f"trial index {i} (replayed alone)" if config.only_trial >= 0
                     else f"trial {i + 1}/{config.trials}")
            print(f"{label} (seed {trial.seed}) {trial.describe()} -> "
                  f"resumed {resumed or '-'} in {result['seconds']:.0f}s: {status}", flush=True)
            if config.json:  # after every trial: a soak stopped early keeps what it ran
                _write_json(config.json, results, config.seed, config.steps, config.model)
            if not result["ok"] and not config.keep_going:
                break
    finally:
        if all(r["ok"] for r in results):
            shutil.rmtree(_store_root(scratch), ignore_errors=True)
            if config.workdir is None:
                shutil.rmtree(scratch, ignore_errors=True)
    passed = sum(r["ok"] for r in results)
    print(_table(results))
    print(f"chaos: {passed}/{len(results)} trials passed, {len(results) - passed} failed "
          f"(seed {config.seed}, {time.monotonic() - started:.0f}s)"
          + ("" if passed == len(results) else f"; failed runs kept under {scratch}"))
    if config.json:
        _write_json(config.json, results, config.seed, config.steps, config.model)
    return 0 if passed == len(results) else 1


def _write_json(path: str, results: list[dict], seed: int, steps: int, model: str) -> None:
    passed = sum(r["ok"] for r in results)
    Path(path).write_text(json.dumps(
        {"trials": results, "passed": passed, "failed": len(results) - passed, "seed": seed,
         "steps": steps, "model": model}, indent=1))


def _run() -> None:
    """The command (``python -m launch.chaos``, its ``__main__``)."""
    define_flags()
    app.run(lambda argv: sys.exit(main(argv)))
