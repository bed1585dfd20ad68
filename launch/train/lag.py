"""The lag alarm: how old the newest safe version is, and why it stopped advancing.

The in-memory tier's safe version (``SaveReport.safe_version``: the newest
version every holder of every owner holds) normally trails training by two
or three saves (the writers' latency, the status round's). When versions
stop committing (a link slower than the chunk channel's bound, a link that
corrupts every version, writers that cannot keep up, a channel that stays
lost) training goes on and the safe version freezes: a failure then loses
every step since. This module decides, from the history of one host's
saves, how old the safe version is (steps and seconds) and why it is not
advancing, naming the cause from the counters the tier and the channel keep:

* ``corrupt_frames``: versions dropped because a peer's payload failed its
  end-to-end check (a NIC or link that corrupts a frame of every version);
* ``slow_link``: the chunk channel lost to its own bound (a version's wait
  ran past it) again after a reconnect: the link is slower than the bound,
  and each new channel is lost like the last; or versions skipped because
  the previous one was still on the link (a scheduled strategy under a
  cost budget);
* ``lost_channel``: versions abandoned or dropped with the channel lost (a
  hung or cut connection), or the hosts agreeing it is lost now;
* ``busy_writers``: versions this host skipped or whose replicas it dropped
  because a writer was still busy (or the cost budget skipped them), or
  some host's writers busy at most saves since the safe version, the last
  among them (the agreed statuses: another host's stalled writer);
* ``unknown``: none of the above seen on this host (another host's line may
  name its cause: the counters are each host's own).

When several causes lost versions, the one that lost the most is named (ties:
the order above, corrupt first).

Whether the lag is past the bound depends only on steps and the safe
version, which every host reads from the same all-gathered statuses, so every
host decides alike at the same save (``--on_lag=fail`` ends all of them
there); the seconds and the reason are this host's.

Design choice: a pure function over a list of samples (``assess``) and a
small watcher (``LagWatch``) that keeps the samples since the safe version
and says when to print a line or write the ``lag`` event, both free of the
clock and of JAX, so a table of histories tests every reason. Alternative
not taken: the checks inside the training loop reading the strategy's and
checkpointer's state directly, which could only be tested by running jobs
that freeze the safe version each way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

REASONS = ("corrupt_frames", "slow_link", "lost_channel", "busy_writers", "unknown")
"""The causes ``assess`` names, in the order that breaks a tie."""

FIRST_LINE_AT = 8
"""The lag (steps) of the first console line; then one each time it doubles."""


@dataclasses.dataclass(frozen=True)
class Counters:
    """What kept versions from committing, as seen on one host: cumulative
    counts since the job (attempt) started, and two readings of now.

    Attributes:
      corrupt: versions dropped because a peer's payload failed its end-to-end
        check (on the chunk channel, or replicas of the in-graph exchange).
      lost: versions abandoned or dropped with the chunk channel lost.
      timeouts: channel losses whose cause was a version's wait running past
        the channel's bound.
      reconnects: reconnects of the chunk channel that connected.
      on_link: versions skipped because the previous one was still on the link.
      busy: versions not taken or replicas dropped because a writer was busy
        (this host), or skipped by the cost budget (some host's writers busy).
      channel_down: the hosts agree the channel is lost now.
      busy_hosts: hosts whose writers were busy at the last status round (the
        same on every host: it is read from the all-gathered statuses).
    """

    corrupt: int = 0
    lost: int = 0
    timeouts: int = 0
    reconnects: int = 0
    on_link: int = 0
    busy: int = 0
    channel_down: bool = False
    busy_hosts: tuple[int, ...] = ()

    def minus(self, before: Counters) -> Counters:
        """The counts since ``before`` (the readings of now kept)."""
        return dataclasses.replace(
            self, corrupt=self.corrupt - before.corrupt, lost=self.lost - before.lost,
            timeouts=self.timeouts - before.timeouts,
            reconnects=self.reconnects - before.reconnects, on_link=self.on_link - before.on_link,
            busy=self.busy - before.busy)


@dataclasses.dataclass(frozen=True)
class Sample:
    """One save as the training loop saw it.

    Attributes:
      step: the steps the state holds (the version this save was for).
      time_s: when (a monotonic clock).
      safe_step: the newest safe version as of this save (-1: none).
      counters: this host's counters then.
    """

    step: int
    time_s: float
    safe_step: int
    counters: Counters = Counters()


@dataclasses.dataclass(frozen=True)
class Lag:
    """The newest safe version's age at a save, and the cause if it is stuck.

    ``safe_step`` is the safe version, or the step the job (attempt) started
    from when nothing newer is safe; ``steps``/``seconds`` how long ago the
    state of ``safe_step`` was trained; ``over``: past the bound;
    ``reason`` (one of ``REASONS``) and ``detail`` (a sentence of the counts)
    say why versions since did not commit.
    """

    step: int
    safe_step: int
    steps: int
    seconds: float
    reason: str
    detail: str
    over: bool
    max_lag: int = 0

    def message(self) -> str:
        """The console line and error message of a lag past the bound."""
        bound = f" (--max_version_lag={self.max_lag})" if self.max_lag else ""
        return (f"the newest safe version is {self.steps} steps ({self.seconds:.1f} s) old"
                f"{bound}: version {self.safe_step}, training at step {self.step}; "
                f"{self.reason.replace('_', ' ')}: {self.detail}")

    def event(self) -> dict:
        """The ``lag`` event of metrics.jsonl."""
        return {"event": "lag", "step": self.step, "safe_step": self.safe_step,
                "reason": self.reason, "lag_steps": self.steps,
                "lag_s": round(self.seconds, 3), "max_version_lag": self.max_lag,
                "detail": self.detail}


def _baseline(history: Sequence[Sample], safe: int) -> Sample:
    """The sample whose state is the safe version: the newest at or before
    ``safe``; the first sample (the job's start) when none is."""
    base = history[0]
    for s in history:
        if s.step > safe:
            break
        base = s
    return base


def _cause(history: Sequence[Sample], base: Sample) -> tuple[str, str]:
    """(reason, detail) of the versions since ``base`` not committing."""
    now = history[-1]
    d = now.counters.minus(base.counters)
    since = f"since version {base.step}"
    counts = {"corrupt_frames": d.corrupt, "channel": d.lost, "slow_link": d.on_link,
              "busy_writers": d.busy}
    worst = max(counts, key=lambda k: counts[k])  # first of the ties: dict order
    after = [s for s in history if s.step > base.step]
    busy_rounds = sum(1 for s in after if s.counters.busy_hosts)
    if counts[worst] == 0:
        if now.counters.channel_down:
            return "lost_channel", (f"the hosts agree the chunk channel is lost; no version "
                                    f"was abandoned on this host {since}")
        if now.counters.busy_hosts and 2 * busy_rounds > len(after):
            hosts = sorted({h for s in after for h in s.counters.busy_hosts})
            return "busy_writers", (f"the writers of host(s) {hosts} were busy at "
                                    f"{busy_rounds} of the {len(after)} saves {since}, the "
                                    f"last among them (a writer that does not keep up: "
                                    f"under-replicated versions)")
        return "unknown", (f"no version was dropped, abandoned or skipped on this host {since}: "
                           f"they are not yet on every holder (another host's line may name "
                           f"its cause)")
    if worst == "corrupt_frames":
        return worst, (f"{d.corrupt} version(s) from a peer failed their end-to-end check "
                       f"{since} (a link or NIC that corrupts a frame of every version "
                       f"commits none)")
    if worst == "channel":
        if d.timeouts >= 2 and d.reconnects >= 1:
            return "slow_link", (f"the chunk channel ran past its bound {d.timeouts} times "
                                 f"and reconnected {d.reconnects} times {since}, {d.lost} "
                                 f"version(s) abandoned: the link is slower than the "
                                 f"channel's bound, each new channel is lost like the last")
        down = "; still lost" if now.counters.channel_down else ""
        return "lost_channel", (f"{d.lost} version(s) abandoned or dropped with the chunk "
                                f"channel lost {since} ({d.reconnects} reconnects){down}")
    if worst == "slow_link":
        return worst, (f"{d.on_link} version(s) skipped {since}, the previous one still on "
                       f"the link: the link does not carry a version within the cost budget")
    hosts = sorted({h for s in after for h in s.counters.busy_hosts})
    busy = f"; writers busy on host(s) {hosts}" if hosts else ""
    return "busy_writers", (f"{d.busy} version(s) skipped or their replicas dropped with a "
                            f"writer busy (or the cost budget) {since}{busy}")


def assess(history: Sequence[Sample], max_lag: int = 0) -> Lag:
    """The lag at the newest sample of ``history`` (oldest first; the first
    is the job's start: ``step`` the step it started from).

    Args:
      history: the samples, at least one; those older than the safe version
        may be left out (the first kept stands for the start).
      max_lag: the bound in steps (0: none); ``over`` when the lag is past it.
    """
    if not history:
        raise ValueError("assess needs at least the job's start sample")
    now = history[-1]
    safe = max(now.safe_step, history[0].step)
    base = _baseline(history, safe)
    steps = now.step - safe
    reason, detail = _cause(history, base) if steps > 0 else ("", "")
    return Lag(step=now.step, safe_step=safe, steps=steps,
               seconds=max(now.time_s - base.time_s, 0.0), reason=reason, detail=detail,
               over=max_lag > 0 and steps > max_lag, max_lag=max_lag)


@dataclasses.dataclass(frozen=True)
class Notice:
    """What the training loop does after a save: ``lag`` always (the
    per-step record's fields); ``line``: print ``lag.message()`` (the lag
    reached 8, 16, 32, ... steps); ``alarm``: the lag passed the bound, the
    first time in this stretch (the ``lag`` event, a warning, and with
    ``--on_lag=fail`` the end of the job); ``recovered``: the stretch ended,
    the lag back under 8 steps and within the bound after a line or an
    alarm."""

    lag: Lag
    line: bool = False
    alarm: bool = False
    recovered: bool = False


class LagWatch:
    """One host's samples since its safe version, and what to say when.

    A stretch starts at the first line or alarm and ends when the lag is
    back under ``FIRST_LINE_AT`` steps and within the bound; within it, a line
    each time the lag doubles and one alarm. (Not each time the safe version
    advances: one that advances every save but trails past a bound set below
    the tier's latency would alarm at every save.)

    Args:
      max_lag: ``--max_version_lag`` (0: no bound, lines only).
      start: the sample of the job's start (the step it starts from, its time).
    """

    def __init__(self, max_lag: int, start: Sample) -> None:
        self.max_lag = max_lag
        self.history: list[Sample] = [start]
        self._safe = max(start.safe_step, start.step)
        self._next_line = FIRST_LINE_AT
        self._alarmed = False

    def observe(self, sample: Sample) -> Notice:
        """Adds the sample of a save; what to say about it."""
        self.history.append(sample)
        lag = assess(self.history, self.max_lag)
        if lag.safe_step > self._safe:  # only the samples since the safe version count
            self._safe = lag.safe_step
            base = _baseline(self.history, lag.safe_step)
            self.history = [s for s in self.history if s.step >= base.step]
        recovered = False
        if lag.steps < FIRST_LINE_AT and not lag.over:  # within bounds: a stretch ends
            recovered = self._alarmed or self._next_line > FIRST_LINE_AT
            self._next_line, self._alarmed = FIRST_LINE_AT, False
        line = lag.steps >= self._next_line
        while self._next_line <= lag.steps:
            self._next_line *= 2
        alarm = lag.over and not self._alarmed
        self._alarmed = self._alarmed or lag.over
        return Notice(lag, line=line and not alarm, alarm=alarm, recovered=recovered)
