"""launch.chaos's draw: what one trial runs, from a seeded generator (pure).

``draw_trial`` draws a trial's topology, in-memory strategy, persistent
interval and ``max_to_keep``, fault plan, stalled replica writer and job
variants (``Trial``), every choice from one generator seeded by (seed,
index), so a failed trial is replayed by its seed. A persistent trial keeps
one persistent step (``--max_to_keep=1``) half of the time, and always with
a disk fault at finalize: Orbax then deletes a step within the trial's 12
steps (the second persistent write deletes the first), and a full disk may
strike the finalize of the write that deletes (version 8, the final one, 12,
showing the job goes on).

Design choice: the draw apart from the command that runs the jobs and from
the checks (``checks``, ``oracle``), so the tests replay and check draws
without processes. Alternative not taken: longer trials (more steps) to reach
Orbax's default ``max_to_keep`` of 3, which would triple every persistent
trial's time for the same deletion.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence

from capricorn_jax.experimental import send_rounds
from launch.chaos.config import Topology, moves_on_channel_from_start
from launch.strategies import spec
from launch.train.fault_plan import (
    CORRUPT_FRAME,
    DISK_FULL_FINALIZE,
    NETWORK_FAULTS,
    PARTITION,
    PAUSE,
    PERSIST_FAULTS,
    RECOVERY_POINTS,
    SLOW_LINK,
    STALL_CHANNEL,
    TIMED,
    Fault,
)

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
MAX_TO_KEEP, DELETING = 3, 1
"""--max_to_keep of a persistent trial: launch.train's default, or one (the
second persistent write deletes the first: Orbax's retention within the
trial, ``Trial.max_to_keep``)."""


def outlasted(f: Fault) -> bool:
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
    max_to_keep: int = MAX_TO_KEEP  # persistent steps Orbax keeps (with a persistent tier)

    @property
    def pec(self) -> bool:
        return spec(self.strategy).pec

    @property
    def commits_next_save(self) -> bool:
        """Whether the job commits version t at save t + 1, not at save t: the
        scheduled strategies (version t moves inside step t + 1) and inmem /
        pec over the chunk channel (``THREADED``: ``ChannelReplication``
        commits the deferred version at the next save). A roll-back to such
        a version must let that step run (``pec_reference.rollbacks``'s
        ``in_step``)."""
        s = spec(self.strategy)
        path = "threaded" if THREADED in self.variant else "auto"
        return s.scheduled or s.uses_channel(path, "cpu")

    def flags(self, steps: int, model: str) -> list[str]:
        t = self.topology
        out = [f"--hosts={t.hosts}", f"--devices_per_host={t.devices_per_host}",
               f"--model={model}", f"--steps={steps}", f"--ckpt={self.strategy}",
               f"--replicas={t.replicas}", "--eval_sequences=0", f"--log_every={steps}",
               "--fault_plan=" + json.dumps([f.to_json() for f in self.faults])]
        if self.persist_every:
            out += [f"--persist_every={self.persist_every}", f"--max_to_keep={self.max_to_keep}"]
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
        faults = "; ".join(describe_fault(f) for f in self.faults)
        stall = "" if self.stall is None else f"; stall host {self.stall[0]}@{self.stall[1]}"
        variant = "".join(f" {v.lstrip('-')}" for v in self.variant)
        keep = (f" keep={self.max_to_keep}" if self.persist_every
                and self.max_to_keep != MAX_TO_KEEP else "")
        return (f"{self.topology.name} {self.strategy}{variant} persist={self.persist_every}"
                f"{keep} [{faults}{stall}]")


def describe_fault(f: Fault) -> str:
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
    if spec(strategy).scheduled:
        return moves_on_channel_from_start(strategy)
    return (moves_on_channel_from_start(strategy) and topo.replicas == 2
            and not (spec(strategy).pec and persist))


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
    choices = [s for s in strategies if topo.replicas == 2 or not spec(s).scheduled]
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
            # A later write shows the job goes on: before the last step, or
            # for a full disk the final version's (the write that deletes the
            # step before it when the trial keeps one).
            last = steps - PERSIST_EVERY - (point != DISK_FULL_FINALIZE)
            writes = [s for s in range(low, last) if (s + 1) % persist == 0]
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
        # A stall of a victim's replica writer at or before the version a
        # mid_replication fault pauses in delays that fault by the stall (3 s:
        # ~10 steps of tiny), past the steps of the faults after it, which then
        # never strike (found by the soak, seed 66 trial 4): such a pair is
        # not drawn with a fault after it. (Drawn, then dropped: the seed's
        # other choices stay as they were.)
        if any(f.point == "mid_replication" and stall[0] in f.hosts and stall[1] <= f.step + 1
               for f in faults[:-1]):
            stall = None
    variant = []
    channel_fault = any(f.point in (CORRUPT_FRAME, STALL_CHANNEL) for f in faults)
    if not spec(strategy).scheduled and _on_channel(strategy, topo, persist) and (
            channel_fault or rng.random() < 0.4):
        variant.append(THREADED)
    if all(f.point in BUDGET_POINTS for f in faults) and stall is None and rng.random() < 0.25:
        variant.append(BUDGET)
    # Drawn last, so the other choices of a seed stay as they were before it.
    keep = MAX_TO_KEEP
    if persist and (any(f.point == DISK_FULL_FINALIZE for f in faults) or rng.random() < 0.5):
        keep = DELETING
    return Trial(index, seed * 1000 + index, topo, strategy, persist, tuple(faults), stall,
                 tuple(variant), keep)


def writer_lags(trial: Trial, fault: Fault) -> bool:
    """Whether a mid-replication fault strikes a host whose replica writer was
    stalled at or before the version it pauses in: it writes that version
    halfway only when the stall ends, while training goes on, so the kill (and
    the newest version every owner committed) may be any number of steps later.

    Both count versions: the fault at step s pauses in version s + 1 (the
    version its step saves), and the stall is at a version (seed 32, trial 15:
    the stall at version 9 held the pause in version 9 until step 12)."""
    return (fault.point == "mid_replication" and trial.stall is not None
            and trial.stall[0] in fault.hosts and trial.stall[1] <= fault.step + 1)

