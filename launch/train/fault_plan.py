"""Fault injection's configuration: a plan of faults, from the flags.

``FaultConfig`` holds the fault flags (--fault_plan, or the single-fault
--kill_* flags, a stalled replica writer) and checks them against the job
(hosts, steps, strategy, replicas, persistent interval); ``Fault`` is one
fault of a plan, ``parse_fault_plan`` reads --fault_plan. launch.train's
supervisor (``launch.train.faults``) and launch.chaos's trials both read plans as
these values. Split from ``launch.train.config`` (which builds a ``FaultConfig``
in ``from_flags``) because the plan is a concept of its own that chaos uses
without a training configuration. Alternative not taken: the fault fields
inside the checkpoint options, which a user would then see.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar
from pathlib import Path

from launch.errors import FlagError
from launch.strategies import IN_MEMORY, uses_channel

# Where a fault strikes. The pausing points are exact (the victim waits there
# for its SIGKILL); at the others the victim says it got there and goes on, so
# the kill lands somewhere inside the step / the persistent write.
FAULT_POINTS = ("after_step", "mid_step", "mid_replication", "mid_persist", "recovery",
                "mid_serve", "persist_error", "persist_hang", "disk_full_finalize", "pause",
                "corrupt_frame", "partition", "slow_link", "stall_channel", "rollback")
PAUSING_POINTS = frozenset({"after_step", "mid_replication", "recovery", "mid_serve",
                            "rollback"})
# Points of the next recovery (a fault's ``step`` is ignored): ``recovery``
# kills the victims at its start; ``mid_serve`` kills a host as it is about to
# serve a peer's payload in the recovery's serve round (it follows a fault
# that lost a host's store, so the recovery has something to serve).
RECOVERY_POINTS = frozenset({"recovery", "mid_serve"})
# Faults that kill no host: the victim's persistent write of version step + 1
# fails with an I/O error, or hangs, after the hosts' pre-check. The job goes
# on (that step dropped on every host), so such a fault ends no attempt and
# must be a plan's last.
PERSIST_FAULTS = frozenset({"persist_error", "persist_hang"})
# Neither does a full disk when the primary (host 0) finalizes Orbax's step
# for version step + 1 (after every host wrote its files): the rename that
# commits it fails with ENOSPC, the step is not committed (its temporary
# directory removed), the job goes on and a later persistent step is written.
DISK_FULL_FINALIZE = "disk_full_finalize"
# A fault that kills no host either: the launcher stops the victims (SIGSTOP)
# once they finished the step, for ``pause_s`` seconds, then lets them go on
# (SIGCONT). Shorter than --peer_timeout_s, the job goes on (slow is not dead);
# longer, jax.distributed declares them dead, the job ends and restarts, and
# the hosts recover. Either way the plan's last fault.
PAUSE = "pause"
# A fault that kills no host either: the victim's chunk channel flips one byte
# of its first frame of the first version >= ``step`` it moves on the channel,
# after the frame's checksum (a byte corrupted in transit). The receiving
# peer's check fails: that peer takes no such version (a ``checkpoint`` event
# with "corrupt"), the channel and training go on. inmem on the in-graph
# exchange: the victim's first chunk of that version is corrupted after its
# sums, in the collectives' transit; the peer's replica writer stores no such
# replica (a warning), so the version is never committed. The plan's last fault.
CORRUPT_FRAME = "corrupt_frame"
# A fault that kills no host either: the victim's chunk channel sends nothing
# for ``pause_s`` seconds before its first frame of the first version >=
# ``step`` (a connection that hangs; ``FaultHooks.stall_channel_at``). Past the
# channel's timeout (4x the in-memory tier's replication timeout) the hosts
# declare the channel lost, skip versions together and
# reconnect with backoff (``strategies.channel_loss``); training goes on with
# no restart. The plan's last fault; a strategy on the channel (gemini,
# capricorn, capricorn_pec; inmem and pec with --chunk_path=threaded). Under
# PEC the versions lost are rolled back in every host's tracker.
STALL_CHANNEL = "stall_channel"
CORRUPT_FRAME_STRATEGIES = IN_MEMORY
"""corrupt_frame: every in-memory strategy, on the path its versions take
(the registry's ``uses_channel``): the chunk channel, or the in-graph
exchange's collectives."""
# Faults of the network (shaped links only, ``--link_gbps``), kill no host: once
# the victims finished the step, the launcher cuts their links (``partition``:
# the veth down at the switch, both ways) or slows them ``SLOW_LINK_FACTOR``
# times (``slow_link``: the tbf rate, both ways) for ``pause_s`` seconds, then
# restores them. A partition shorter than --peer_timeout_s, and any slow link,
# the job outlasts (slow is not dead); a longer partition ends the attempt
# (jax.distributed declares the victims dead) and the hosts recover. The
# plan's last fault.
PARTITION, SLOW_LINK = "partition", "slow_link"
NETWORK_FAULTS = frozenset({PARTITION, SLOW_LINK})
SLOW_LINK_FACTOR = 10.0
TIMED = frozenset({PAUSE, *NETWORK_FAULTS})
"""Faults that last ``pause_s`` seconds, then end."""
LASTING = frozenset({*TIMED, STALL_CHANNEL})
"""Faults with a length (``pause_s``)."""
NO_KILL = frozenset({*PERSIST_FAULTS, DISK_FULL_FINALIZE, CORRUPT_FRAME, STALL_CHANNEL,
                     *TIMED})
"""Faults that end no attempt: a plan's last."""
# Not a fault but a deliberate roll-back (launch.chaos's reference of a PEC
# trial takes the roll-backs its faulted job took): every host (``hosts``:
# all of them) stops after ``step``; once each one's store holds ``version``
# (``launch.train.rollback``) the launcher ends the attempt, drops every
# stored version newer than ``version`` (RAM stores and persistent steps),
# wipes the RAM stores of the hosts in ``lose`` (a peer serves them) or, with
# ``wipe_all``, every one (the persistent tier serves), and restarts: the
# hosts recover through the ordinary recovery, from ``version`` (0: every
# store emptied, the job starts over at step 0).
ROLLBACK = "rollback"


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault of a plan: ``hosts`` SIGKILLed together at ``point`` of ``step``.

    Attributes:
      hosts: the hosts killed (together).
      step: the training step the point belongs to (after_step, mid_step,
        mid_replication: that step; mid_persist, persist_error, persist_hang:
        the persistent write of the version after it; recovery: ignored, the
        next recovery).
      point: one of ``FAULT_POINTS``.
      mode: "process" (the RAM store survives) or "host" (the victims' stores
        are wiped: machine loss).
      corrupt: flip a byte of each victim's newest own version (RAM bit rot).
      wipe_all: every host's RAM store is lost (the persistent tier, if any,
        is what remains).
      pause_s: points ``pause``, ``partition``, ``slow_link``,
        ``stall_channel``: how long the fault lasts (the victims stopped, cut
        off, slowed, or their chunk channel hung), in seconds.
      version: point ``rollback``: the version every host rolls back to.
      lose: point ``rollback``: the hosts whose RAM store is lost at the
        roll-back (a peer serves their shards).
    """

    hosts: tuple[int, ...]
    step: int
    point: str = "after_step"
    mode: str = "process"
    corrupt: bool = False
    wipe_all: bool = False
    pause_s: float = 0.0
    version: int = -1
    lose: tuple[int, ...] = ()

    def to_json(self) -> dict:
        out = {"hosts": list(self.hosts), "step": self.step, "point": self.point,
               "mode": self.mode, "corrupt": self.corrupt, "wipe_all": self.wipe_all}
        if self.point == ROLLBACK:
            return {**out, "version": self.version, "lose": list(self.lose)}
        return {**out, "pause_s": self.pause_s} if self.point in LASTING else out


def parse_fault_plan(text: str) -> tuple[Fault, ...]:
    """A ``--fault_plan``: JSON (or ``@PATH`` of a JSON file), a list of objects
    with the fields of ``Fault``; raises FlagError naming the bad entry."""
    import json

    if not text:
        return ()
    try:
        raw = json.loads(Path(text[1:]).read_text() if text.startswith("@") else text)
    except (OSError, ValueError) as e:
        raise FlagError(f"--fault_plan: not a JSON list of faults ({e})") from None
    if not isinstance(raw, list):
        raise FlagError(f"--fault_plan: not a JSON list of faults: {text[:80]!r}")
    plan = []
    for i, entry in enumerate(raw):
        try:
            if not isinstance(entry, dict) or set(entry) - set(Fault.__dataclass_fields__):
                raise TypeError(f"fields must be among {sorted(Fault.__dataclass_fields__)}")
            fault = Fault(**{**entry, "hosts": tuple(int(h) for h in entry["hosts"]),
                             "step": int(entry.get("step", -1)),
                             "lose": tuple(int(h) for h in entry.get("lose", ()))})
        except (TypeError, KeyError, ValueError) as e:
            raise FlagError(f"--fault_plan: fault {i} ({entry!r}): {e}") from None
        plan.append(fault)
    return tuple(plan)


def _check_rollback(i: int, fault: Fault, hosts: int, strategy: str, replicas: int,
                    persist_every: int) -> None:
    """A ``rollback`` entry: every host, to a version its step saved or an
    older one, from a tier the job has."""
    what = f"--fault_plan fault {i}: rollback"
    if sorted(fault.hosts) != list(range(hosts)):
        raise FlagError(f"{what} stops every host: hosts must be {list(range(hosts))}")
    if not 0 <= fault.version <= fault.step + 1:
        raise FlagError(f"{what} to version {fault.version} after step {fault.step}: the "
                        f"version must be in [0, {fault.step + 1}] (0: every store emptied, "
                        f"a fresh start)")
    if strategy not in IN_MEMORY or fault.mode != "process" or fault.corrupt:
        raise FlagError(f"{what} restores through the memory tier: --ckpt in "
                        f"{', '.join(IN_MEMORY)}, mode 'process', no corrupt")
    if not set(fault.lose) <= set(fault.hosts) or len(set(fault.lose)) != len(fault.lose):
        raise FlagError(f"{what}: lose {list(fault.lose)} must be distinct hosts")
    if fault.lose and (fault.wipe_all or len(fault.lose) >= replicas):
        raise FlagError(f"{what}: losing the stores of hosts {list(fault.lose)} leaves a "
                        f"copy of each only below {replicas} replicas and without wipe_all")
    if fault.wipe_all and not persist_every:
        raise FlagError(f"{what} with wipe_all restores from the persistent tier: it needs "
                        f"--persist_every")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """Fault injection: the fault plan (hosts killed, when, where, how), a
    stalled replica writer; ``fault_at`` is set by the supervisor.

    The plan is ``--fault_plan`` or, from the single-fault flags, --kill_host
    at --kill_at_step (again every --kill_every) at --kill_point, with
    --kill_mode and --corrupt_store. Each fault ends one attempt of the job;
    all hosts restart and recover before the next fault is armed.
    """

    kill_host: int
    kill_at_step: int
    kill_every: int
    kill_mode: str
    kill_point: str
    corrupt_store: bool
    stall_host: int
    stall_at_step: int
    stall_seconds: float
    fault_at: str = ""
    fault_plan: str = ""
    hosts: InitVar[int]
    steps: InitVar[int]
    strategy: InitVar[str]
    replicas: InitVar[int]
    persist_every: InitVar[int] = 0
    shaped: InitVar[bool] = False
    chunk_path: InitVar[str] = "auto"
    platform: InitVar[str] = "cpu"

    def __post_init__(self, hosts: int, steps: int, strategy: str, replicas: int,
                      persist_every: int, shaped: bool, chunk_path: str, platform: str) -> None:
        if self.kill_every < 0 or (self.kill_every and self.kill_host < 0):
            raise FlagError(f"--kill_every={self.kill_every} needs --kill_host and must be >= 0")
        if self.fault_plan and self.kill_host >= 0:
            raise FlagError("--fault_plan and --kill_host both describe the faults: give one")
        if self.kill_host >= 0:
            if self.kill_host >= hosts:
                raise FlagError(f"--kill_host={self.kill_host} is not a host (--hosts={hosts})")
            if not 0 <= self.kill_at_step < steps:
                raise FlagError(f"--kill_at_step={self.kill_at_step} must be in [0, --steps)")
        plan = self.plan(steps)
        for i, fault in enumerate(plan):
            self._check(i, fault, hosts, steps, strategy, replicas, persist_every,
                        uses_channel(strategy, chunk_path, platform), chunk_path, platform)
            if fault.point == "mid_serve" and not (
                    i and (plan[i - 1].mode == "host" or plan[i - 1].wipe_all) and
                    strategy in IN_MEMORY and replicas >= 2):
                raise FlagError(f"--fault_plan fault {i}: mid_serve kills a host serving a "
                                f"peer's payload in a recovery: it follows a fault with mode "
                                f"'host' (a lost store to serve), with --ckpt in "
                                f"{', '.join(IN_MEMORY)} and --replicas >= 2")
            if fault.point in NETWORK_FAULTS and not shaped:
                raise FlagError(f"--fault_plan fault {i}: {fault.point} acts on the hosts' "
                                f"shaped links: it needs --link_gbps > 0")
            if fault.point == ROLLBACK:
                _check_rollback(i, fault, hosts, strategy, replicas, persist_every)

    def _check(self, i: int, fault: Fault, hosts: int, steps: int, strategy: str,
               replicas: int, persist_every: int, channel: bool, chunk_path: str = "auto",
               platform: str = "cpu") -> None:
        what = f"--fault_plan fault {i}" if self.fault_plan else "--kill_point"
        if fault.point not in FAULT_POINTS:
            raise FlagError(f"{what}: point {fault.point!r} is not one of {FAULT_POINTS}")
        if fault.mode not in ("process", "host"):
            raise FlagError(f"{what}: mode {fault.mode!r} is not 'process' or 'host'")
        if not fault.hosts or len(set(fault.hosts)) != len(fault.hosts) or not all(
                0 <= h < hosts for h in fault.hosts):
            raise FlagError(f"{what}: hosts {list(fault.hosts)} must be distinct hosts of "
                            f"--hosts={hosts}")
        if fault.point not in RECOVERY_POINTS and not 0 <= fault.step < steps:
            raise FlagError(f"{what}: step {fault.step} must be in [0, --steps={steps})")
        if fault.point == "mid_replication" and strategy not in IN_MEMORY:
            raise FlagError(f"{what}: mid_replication pauses the in-memory tier's "
                            f"replication: it needs --ckpt in {', '.join(IN_MEMORY)}")
        if fault.point == "mid_replication" and replicas < 2:
            raise FlagError(f"{what}: mid_replication needs --replicas >= 2")
        if fault.point in NO_KILL and i != len(self.plan(steps)) - 1:
            raise FlagError(f"{what}: {fault.point} kills no host and ends no attempt: it "
                            f"must be the plan's last fault")
        if (fault.point in LASTING) != (fault.pause_s > 0):
            raise FlagError(f"{what}: a pause needs point 'pause' and pause_s > 0 (got point "
                            f"{fault.point!r}, pause_s {fault.pause_s:g})"
                            if fault.point not in LASTING - {PAUSE} else
                            f"{what}: {fault.point} needs pause_s > 0 (how long it lasts)")
        if fault.point in (CORRUPT_FRAME, *LASTING) and (
                fault.mode != "process" or fault.corrupt or fault.wipe_all):
            raise FlagError(f"{what}: {fault.point} damages no store: mode 'process', no "
                            f"corrupt, no wipe_all")
        if fault.point == CORRUPT_FRAME and (strategy not in CORRUPT_FRAME_STRATEGIES
                                             or len(fault.hosts) != 1):
            raise FlagError(f"{what}: corrupt_frame flips a byte in transit from one host: "
                            f"one host, and --ckpt in {', '.join(CORRUPT_FRAME_STRATEGIES)} "
                            f"(got {strategy}, hosts {list(fault.hosts)})")
        if fault.point == STALL_CHANNEL and (len(fault.hosts) != 1 or not channel):
            on = [n for n in IN_MEMORY if uses_channel(n, chunk_path, platform)]
            raise FlagError(f"{what}: stall_channel hangs one host's chunk channel: one host, "
                            f"and a --ckpt whose versions take the channel with --chunk_path="
                            f"{chunk_path} on {platform} ({', '.join(on) or 'none'}) (got "
                            f"{strategy}, hosts {list(fault.hosts)})")
        if fault.point == DISK_FULL_FINALIZE and (fault.hosts != (0,) or fault.mode != "process"
                                                  or fault.corrupt or fault.wipe_all):
            raise FlagError(f"{what}: disk_full_finalize strikes the primary's Orbax finalize: "
                            f"hosts [0], mode 'process', no corrupt, no wipe_all")
        if fault.point in ("mid_persist", DISK_FULL_FINALIZE, *PERSIST_FAULTS) and not (
                persist_every and (fault.step + 1) % persist_every == 0):
            raise FlagError(f"{what}: {fault.point} at step {fault.step} needs --persist_every "
                            f"to write version {fault.step + 1} (--persist_every="
                            f"{persist_every})")

    def plan(self, steps: int) -> tuple[Fault, ...]:
        """The faults (and roll-backs), in the order the attempts meet them."""
        if self.fault_plan:
            return parse_fault_plan(self.fault_plan)
        if self.kill_host < 0:
            return ()
        return tuple(Fault((self.kill_host,), s, self.kill_point, self.kill_mode,
                           self.corrupt_store)
                     for s in range(self.kill_at_step, steps, self.kill_every or steps))

    def at(self) -> tuple[str, int] | None:
        """(point, step) where this worker announces itself to the injector, or None."""
        if not self.fault_at:
            return None
        point, step = self.fault_at.split(":")[:2]
        return point, int(step)

    @property
    def stall_channel_at(self) -> tuple[int, float] | None:
        """(version, seconds) of this worker's hung chunk channel (None: none);
        ``fault_at`` is then STALL_CHANNEL:STEP:SECONDS."""
        at = self.at()
        if at is None or at[0] != STALL_CHANNEL:
            return None
        return at[1], float(self.fault_at.split(":")[2])

    @property
    def pause_mid_replication_at(self) -> int:
        """The version whose replicas this worker stops halfway through (-1: none)."""
        at = self.at()
        return at[1] + 1 if at is not None and at[0] == "mid_replication" else -1

    @property
    def full_disk_at(self) -> int | None:
        """The version whose Orbax finalize fails with a full disk here (None: none)."""
        at = self.at()
        return at[1] + 1 if at is not None and at[0] == DISK_FULL_FINALIZE else None

    @property
    def flip_frame_at(self) -> int | None:
        """The version whose first chunk frame this worker's channel corrupts (None: none)."""
        at = self.at()
        return at[1] if at is not None and at[0] == CORRUPT_FRAME else None

    def stall(self, host: int) -> tuple[int, float] | None:
        """(step, seconds) of host ``host``'s replica-writer stall, or None."""
        if self.stall_host == host and self.stall_at_step >= 0:
            return self.stall_at_step, self.stall_seconds
        return None
