"""A lost chunk channel: versions skipped on every host, reconnects with backoff, a bound.

A chunk channel (``scheduling.threaded.chunk_channel``) is lost when a send or a
receive on it failed or a version's ``wait`` ran past the channel's timeout
(a peer whose connection hangs, a link cut for longer than the timeout).
Slow is not dead: the job keeps training.

* The host that saw it says so in its status vector (``note_channel``); one
  status round later every host reads the same answer
  (``channel_lost_anywhere``), and from that save on, every host alike:
  abandons the versions in flight on the channel (none is committed: no
  host waits for them), takes no version at the save (``skip``: the status
  round still runs, the same collectives on every host), and at the saves
  the backoff names (the 1st, 2nd, 4th, 8th, ... save since the hosts
  agreed, ``attempt_due``) builds a new channel to the same peers under a
  new key. A host whose attempt failed says so in its next status vector,
  so every host tries again at the next due save.
* The first save whose round says no host is lost moves versions again.
* Bound: ``RECONNECT_ATTEMPTS`` attempts; if the channel is still lost at
  the save after the last one (the 33rd save after the hosts agreed, each
  failed attempt costing at most the channel's connect timeout) the save
  raises ``ConnectionError`` naming the peers.
* Named, not cycled silently: the attempt count starts over once versions
  move again, so a link always slower than the channel's bound (each new
  channel lost to a wait past the bound) or one that corrupts a frame of
  every version never reaches the bound. The keeper counts both
  (``ChannelCounts``: losses, those to the bound, reconnects, corrupt
  versions, and the runs of them with no version arriving in between) and
  warns when a run repeats (the 2nd, 4th, 8th, ... in a row); the training
  loop's lag alarm (``launch.train.lag``) reads the counts to say why the
  safe version stopped advancing.

Design choice: the agreement rides on the status round every save already
runs, so a lost channel costs no collective of its own and every host
decides from the same gathered vectors; the decision lags one round, so a
version started on a host that has not heard yet is abandoned at the next
save, never waited for. Alternative not taken: a reconnect inside the
sender thread on its own (each host would resume at a different version,
and a peer waiting for a version the other host abandoned would run into
its timeout).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from capricorn_jax._src.memory.tier.reports import SaveReport
from capricorn_jax._src.memory.tier.writer_door import TierWriter
from capricorn_jax._src.scheduling.threaded.chunk_channel import ChunkChannel
from capricorn_jax._src.scheduling.threaded.sender import ThreadedSender
from capricorn_jax._src.scheduling.threaded.versions import VersionDropped
from capricorn_jax._src.strategies.base import CheckpointEvent

log = logging.getLogger("capricorn_jax")

RECONNECT_ATTEMPTS = 6
"""Reconnect attempts before a lost channel ends the job (the last at the
32nd save since the hosts agreed it was lost)."""

_LOST = (OSError, TimeoutError, ConnectionError, RuntimeError)
"""What a wait on a lost channel raises (a corrupt frame is ``VersionDropped``, not a loss)."""


@dataclasses.dataclass
class ChannelCounts:
    """What one host's chunk channel went through since it was built
    (cumulative, except the two runs).

    ``losses``: times this host found its channel lost; ``timeouts``: of
    those, a version's wait ran past the channel's bound; ``reconnects``:
    attempts that connected; ``arrived``: versions whose peer payload arrived
    intact; ``corrupt``: versions whose peer payload failed its end-to-end
    check; ``lost_in_a_row``: losses since a version last arrived (a
    reconnect between them: the link is slower than the bound);
    ``corrupt_in_a_row``: corrupt versions since one last arrived intact.
    """

    losses: int = 0
    timeouts: int = 0
    skips: int = 0
    reconnects: int = 0
    arrived: int = 0
    corrupt: int = 0
    lost_in_a_row: int = 0
    corrupt_in_a_row: int = 0


def _repeats(n: int) -> bool:
    """Whether the ``n``-th in a row is worth a warning: 2, 4, 8, ..."""
    return n >= 2 and n & (n - 1) == 0


def described(error: BaseException) -> str:
    """``error`` and the chain of errors that caused it, each as ``Type: message``
    (a version's wait names the version; its cause, the receive or send that
    failed, says why)."""
    parts, seen = [], set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return ", caused by ".join(parts)


def attempt_due(saves_down: int) -> bool:
    """Whether the save ``saves_down`` saves after the hosts agreed the channel
    was lost (0: that save) tries to reconnect: saves 0, 1, 3, 7, 15, ...
    (the gaps double), ``RECONNECT_ATTEMPTS`` of them."""
    n = saves_down + 1
    return n & (n - 1) == 0 and n < 2 ** RECONNECT_ATTEMPTS


class ChannelKeeper:
    """The lost-channel rule of one strategy's sender (module docstring).

    Args:
      ckpt: the host's memory tier (its status round carries the flag).
      sender: the strategy's sender; its channel is replaced on a reconnect.
      connect: builds a new channel to the same peers for attempt ``n``
        (its own key: ``peer_channel(ckpt, job=...)``).
    """

    def __init__(self, ckpt: TierWriter, sender: ThreadedSender,
                 connect: Callable[[int], ChunkChannel]) -> None:
        self.ckpt, self.sender, self._connect = ckpt, sender, connect
        self.saves_down = 0  # saves since the hosts agreed the channel was lost (0: up)
        self.attempts = 0  # reconnect attempts since then
        self._attempt_failed = False
        self.lost_versions: list[int] = []  # versions abandoned with a lost channel
        self.reconnected_at: list[int] = []  # saves at which versions moved again
        self.counts = ChannelCounts()

    def lost_here(self) -> bool:
        """Whether this host's channel is lost (its sender failed, or its last
        reconnect attempt did)."""
        return self.sender.failure is not None or self._attempt_failed

    def note(self) -> None:
        """Puts this host's answer in the status vector of the next round."""
        self.ckpt.note_channel(self.lost_here())

    def wait(self, version: int) -> np.ndarray:
        """The sender's ``wait`` for ``version``; on a host that knows its
        channel is lost, nothing more will arrive: what is still missing
        bytes is abandoned first, so the wait raises at once instead of at
        its bound (a version that arrived whole is kept)."""
        if self.lost_here():
            self.sender.abandon(keep_arrived=True)
        counts = self.counts
        try:
            received = self.sender.wait(version)
        except VersionDropped as e:
            if not e.corrupt:  # started after its frames were dropped: not the link's doing
                raise
            counts.corrupt += 1
            counts.corrupt_in_a_row += 1
            if _repeats(counts.corrupt_in_a_row):
                log.warning("host %d: %d versions in a row from host %d failed their end-to-end "
                            "check (the last: %d): the link corrupts every version; none of them "
                            "is committed", self.ckpt.host, counts.corrupt_in_a_row,
                            self.sender.channel.source, version)
            raise
        counts.arrived += 1
        counts.lost_in_a_row = counts.corrupt_in_a_row = 0
        return received

    def is_loss(self, error: BaseException) -> bool:
        """Whether ``error``, raised by a version's ``wait``, means the channel
        is lost here (then noted for the next round)."""
        lost = isinstance(error, _LOST) and (self.lost_here()
                                             or isinstance(error, TimeoutError))
        if lost:
            counts = self.counts
            counts.losses += 1
            counts.lost_in_a_row += 1
            if isinstance(error, TimeoutError):
                counts.timeouts += 1
            if self.sender.failure is None:  # a wait past the timeout: the channel hangs
                self.sender.failure = error
            if _repeats(counts.lost_in_a_row) and counts.reconnects:
                log.warning("host %d: the chunk channel is lost again, %d times in a row with "
                            "no version arriving in between (%d to its %.0f s bound) although "
                            "each reconnect connected: the link is slower than the channel's "
                            "bound", self.ckpt.host, counts.lost_in_a_row, counts.timeouts,
                            self.sender.channel.timeout_s)
            log.warning("host %d: the chunk channel is lost (%s); every host skips "
                        "versions until it reconnects", self.ckpt.host, described(error))
            self.note()
        return lost

    def down(self, step: int) -> bool:
        """Whether the hosts agree the channel is lost (as of the last round),
        at save ``step``."""
        if self.ckpt.channel_lost_anywhere():
            return True
        if self.saves_down:
            log.info("host %d: the chunk channel is back at step %d after %d saves and %d "
                     "attempts; versions move again", self.ckpt.host, step, self.saves_down,
                     self.attempts)
            self.reconnected_at.append(step)
            self.saves_down = self.attempts = 0
        return False

    def while_down(self, step: int) -> list[int]:
        """At save ``step``, the hosts agreeing the channel is lost: abandons
        the versions in flight (returned, oldest first), and reconnects when
        the backoff says so; raises past the bound. The caller then takes
        no version at this save (every host alike)."""
        if self.saves_down >= 2 ** (RECONNECT_ATTEMPTS - 1):
            channel = self.sender.channel
            raise ConnectionError(
                f"host {self.ckpt.host}: the chunk channel (to host {channel.destination}, "
                f"from host {channel.source}) stayed lost through {self.attempts} reconnect "
                f"attempts over {self.saves_down} saves")
        lost = self.sender.abandon()
        self.lost_versions += lost
        if attempt_due(self.saves_down):
            self.attempts += 1
            try:
                channel = self._connect(self.attempts)
            except _LOST as e:
                self._attempt_failed = True
                log.warning("host %d: chunk channel reconnect attempt %d at step %d failed "
                            "(%s: %s)", self.ckpt.host, self.attempts, step,
                            type(e).__name__, e)
            else:
                self.sender.reconnect(channel)
                self._attempt_failed = False
                self.counts.reconnects += 1
                log.info("host %d: chunk channel reconnect attempt %d at step %d: connected",
                         self.ckpt.host, self.attempts, step)
        self.saves_down += 1
        self.note()
        return lost

    def skip_save(self, step: int, event: Callable[[int, SaveReport], CheckpointEvent],
                  tokens_per_expert: np.ndarray | None = None) -> list[CheckpointEvent]:
        """A save while the hosts agree the channel is lost (``while_down``),
        then version ``step`` not taken (the status round still runs): the
        ``checkpoint`` events (``event``: the strategy's) of the versions
        abandoned and of ``step``, each marked ``channel_lost``. The
        abandoned versions are named to the status round (PEC rolls them
        back on every host); ``tokens_per_expert``: the step's (read under
        PEC only: a whole-version tier takes none). An abandoned version's
        event is marked ``abandoned``: which versions were in flight differs
        between hosts, so a caller that acts collectively per version (the
        persistent tier's ``persist``) must not act on those (soak seed 70
        trial 11: hosts 2 and 3 offered an abandoned version 8 to the
        persistent tier, hosts 0 and 1 had none to offer, and the job hung
        in the pre-check's agreement against the next step's all-to-all)."""
        lost = self.while_down(step)
        self.counts.skips += 1
        self.ckpt.note_lost(lost)
        report = self.ckpt.skip(step, tokens_per_expert if self.ckpt.pec is not None else None)
        return [{**event(v, report), "channel_lost": True, **({"abandoned": True} if v != step
                                                                else {})}
                for v in (*lost, step)]
