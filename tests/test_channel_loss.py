"""The lost-channel rule (strategies.channel_loss), one part alone.

The rule's inputs are the agreed status flag and this host's sender; here a
stand-in tier (the flag as a list the test sets) and a stand-in sender (the
versions in flight, a failure, the channel it moved to) stand around the
real ``ChannelKeeper``. The multi-process path, a hung channel in a real
training run, is tests/test_strategies.py's stall_channel test.
"""

import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capricorn_jax._src.strategies.channel_loss import (
    RECONNECT_ATTEMPTS,
    ChannelKeeper,
    attempt_due,
)


@given(st.integers(0, 200))
def test_attempts_come_at_doubling_gaps_and_stop_after_the_last(saves_down):
    due = [n for n in range(saves_down + 1) if attempt_due(n)]
    assert due == [n for n in (0, 1, 3, 7, 15, 31) if n <= saves_down]
    assert len([n for n in range(1000) if attempt_due(n)]) == RECONNECT_ATTEMPTS


class _Tier:
    host = 0

    def __init__(self):
        self.anywhere, self.noted = False, []

    def note_channel(self, lost):
        self.noted.append(lost)

    def channel_lost_anywhere(self):
        return self.anywhere


class _Channel:
    destination = source = 1


class _Sender:
    def __init__(self):
        self.failure, self.channel, self.inflight = None, _Channel(), [7]

    def abandon(self, keep_arrived=False):
        lost, self.inflight = self.inflight, []
        return lost

    def reconnect(self, channel):
        self.channel, self.failure = channel, None


def _keeper(connects):
    tier, sender = _Tier(), _Sender()

    def connect(attempt):
        result = connects[attempt - 1]
        if isinstance(result, Exception):
            raise result
        return result

    return tier, sender, ChannelKeeper(tier, sender, connect)


def test_a_timed_out_wait_is_a_loss_a_corrupt_or_other_error_is_not():
    tier, sender, keeper = _keeper([])
    assert not keeper.is_loss(ValueError("a bug"))
    assert not keeper.is_loss(RuntimeError("not the channel's"))
    assert tier.noted == []
    assert keeper.is_loss(TimeoutError("host 0: version 3: receiving from host 1 ..."))
    assert sender.failure is not None and tier.noted == [True]


def test_a_loss_warning_names_the_error_that_failed_the_channel(caplog):
    """A version's wait says which version failed; its cause (the receive
    that raised) says why: the warning names both (soak seed 66 trial 15
    lost a version to "receiving from host 1 failed", and the cause, the
    only clue, was not on the console)."""
    _, sender, keeper = _keeper([])
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError as cause:
            sender.failure = cause  # the receive loop's report (ThreadedSender._failed)
            raise RuntimeError("host 0: version 12: receiving from host 1 failed") from cause
    except RuntimeError as e:
        error = e
    with caplog.at_level("WARNING", logger="capricorn_jax"):
        assert keeper.is_loss(error)
    assert ("the chunk channel is lost (RuntimeError: host 0: version 12: receiving from host 1 "
            "failed, caused by ConnectionResetError: [Errno 104] Connection reset by peer)"
            in caplog.text)


def test_hosts_skip_until_an_attempt_connects_then_versions_move_again():
    fresh = _Channel()
    tier, sender, keeper = _keeper([TimeoutError("no connection"), fresh])
    sender.failure = OSError("reset")
    keeper.note()
    tier.anywhere = True  # the next round: every host reads it
    assert keeper.down(10)
    assert keeper.while_down(10) == [7]  # attempt 1 fails: still lost here
    assert tier.noted[-1] is True and sender.channel is not fresh
    assert keeper.down(11)
    assert keeper.while_down(11) == []  # attempt 2 connects
    assert sender.channel is fresh and sender.failure is None and tier.noted[-1] is False
    assert keeper.lost_versions == [7] and keeper.attempts == 2
    tier.anywhere = False  # the round after: no host lost
    assert not keeper.down(12)
    assert keeper.reconnected_at == [12] and keeper.saves_down == 0 and keeper.attempts == 0


def test_a_channel_lost_past_the_last_attempt_ends_the_job_naming_the_peers():
    tier, sender, keeper = _keeper([TimeoutError("no connection")] * RECONNECT_ATTEMPTS)
    tier.anywhere = True
    saves = 0
    with pytest.raises(ConnectionError, match=r"^host 0: the chunk channel \(to host 1, from "
                                              r"host 1\) stayed lost through 6 reconnect "
                                              r"attempts over 32 saves"):
        while True:
            keeper.while_down(saves)
            saves += 1
    assert saves == 2 ** (RECONNECT_ATTEMPTS - 1) and keeper.attempts == RECONNECT_ATTEMPTS


def test_a_save_while_down_marks_the_versions_it_abandoned_and_the_trainer_offers_none(
        monkeypatch):
    """Which versions were in flight differs between hosts, so their events
    are marked ``abandoned`` and launch.train offers none of them to the
    persistent tier, whose write is collective (soak seed 70 trial 11: hosts
    that offered an abandoned version waited in its pre-check for hosts that
    had none to offer); the save's own version, skipped on every host, is."""
    from launch.train import command

    class _Skipping(_Tier):
        pec = None

        def note_lost(self, versions):
            pass

        def skip(self, step, tokens_per_expert):
            return types.SimpleNamespace(step=step, skipped=True)

    tier, sender = _Skipping(), _Sender()
    tier.anywhere = True
    keeper = ChannelKeeper(tier, sender, lambda attempt: _Channel())
    events = keeper.skip_save(9, lambda v, report: {"version": v, "skipped": report.skipped})
    assert events == [{"version": 7, "skipped": True, "channel_lost": True, "abandoned": True},
                      {"version": 9, "skipped": True, "channel_lost": True}]

    class _Persistent:
        offered: list[int] = []

        def offer(self, version, state):
            self.offered.append(version)

    persistent, logged = _Persistent(), []
    monkeypatch.setattr(command, "_log_checkpoint", lambda m, h, e: logged.append(e))
    command._log_checkpoints(None, 0, events, persistent, state=None)
    assert persistent.offered == [9] and logged == events
