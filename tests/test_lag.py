"""The lag alarm's decision (launch.train.lag) and its inputs, without a cluster.

The decision is a pure function of the saves' samples: a table of histories
(one per cause the counters can show) and a property over random ones; the
watcher's lines, alarm and recovery; the counters it reads (the channel
keeper's, the checkpointer's, mapped by ``lag_alarm.counters``); the flags.
The end-to-end runs are tests/test_lag_cli.py.
"""

import dataclasses

import pytest
from absl import flags
from hypothesis import given
from hypothesis import strategies as st

from capricorn_jax._src.memory.tier.reports import DropCounts
from capricorn_jax._src.scheduling.threaded.versions import VersionDropped
from capricorn_jax._src.strategies.channel_loss import ChannelKeeper
from launch.train import command as train
from launch.train import config, lag_alarm
from launch.train.lag import REASONS, Counters, LagWatch, Sample, assess

NONE = Counters()


def _history(frozen_at, steps, per_step=NONE, start=0, before=NONE, **now):
    """The job's start, saves that commit up to ``frozen_at`` (the safe
    version trailing by 2), then saves to ``steps`` with the safe version
    frozen at ``frozen_at``, the counters growing by ``per_step`` each save
    after it (``before``: their values at the freeze); ``now``: the last
    sample's readings (channel_down, busy_hosts)."""
    out = [Sample(start, 0.0, -1, Counters())]
    c = before
    for step in range(start + 1, steps + 1):
        if step > frozen_at:
            c = dataclasses.replace(
                c, **{f: getattr(c, f) + getattr(per_step, f)
                      for f in ("corrupt", "lost", "timeouts", "reconnects", "on_link", "busy")},
                busy_hosts=per_step.busy_hosts)
        safe = min(step - 2, frozen_at)
        out.append(Sample(step, float(step), safe if safe >= 1 else -1, c))
    out[-1] = dataclasses.replace(out[-1], counters=dataclasses.replace(out[-1].counters, **now))
    return out


CASES = {
    # a NIC that corrupts a frame of every version: each is dropped
    "corrupt_frames": (_history(4, 20, Counters(corrupt=1)), "16 version(s) from a peer failed"),
    # a link slower than the bound: lost to a wait past it, reconnected, lost again
    "slow_link": (_history(4, 20, Counters(lost=1, timeouts=1, reconnects=1)),
                  "ran past its bound 16 times and reconnected 16 times"),
    # a scheduled strategy under a budget: the previous version still on the link
    "slow_link/on_link": (_history(4, 20, Counters(on_link=1)), "still on the link"),
    # a hung channel, lost once and still lost
    "lost_channel": (_history(4, 20, Counters(lost=1), channel_down=True, timeouts=1),
                     "abandoned or dropped with the chunk channel lost since version 4"),
    "lost_channel/agreed only": (_history(4, 20, channel_down=True),
                                 "the hosts agree the chunk channel is lost"),
    # this host's replica writer busy: each version's replicas dropped
    "busy_writers": (_history(4, 20, Counters(busy=1, busy_hosts=(1,))),
                     "16 version(s) skipped or their replicas dropped"),
    # another host's writer stalled: only the agreed statuses show it
    "busy_writers/another host": (_history(4, 20, Counters(busy_hosts=(1,))),
                                  "host(s) [1] were busy at 16 of the 16 saves since version 4"),
    "unknown": (_history(4, 20), "no version was dropped"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_frozen_safe_version_is_reported_past_the_bound_with_the_cause_from_the_counters(case):
    history, detail = CASES[case]
    lag = assess(history, max_lag=10)
    assert (lag.step, lag.safe_step, lag.steps, lag.seconds) == (20, 4, 16, 16.0)
    assert lag.over and lag.reason == case.split("/")[0] and detail in lag.detail, lag
    assert lag.reason in REASONS
    assert not assess(history, max_lag=16).over and not assess(history, max_lag=0).over
    event = lag.event()
    assert {k: event[k] for k in ("event", "step", "safe_step", "reason")} == {
        "event": "lag", "step": 20, "safe_step": 4, "reason": case.split("/")[0]}
    assert lag.message().startswith("the newest safe version is 16 steps (16.0 s) old "
                                    "(--max_version_lag=10): version 4, training at step 20; ")


def test_a_healthy_run_trails_by_its_latency_and_is_not_over():
    history = _history(100, 20)
    lag = assess(history, max_lag=3)
    assert (lag.safe_step, lag.steps, lag.over) == (18, 2, False)
    caught_up = assess([*history, Sample(20, 21.0, 20)], max_lag=3)
    assert (caught_up.steps, caught_up.reason, caught_up.detail) == (0, "", "")


def test_only_what_happened_since_the_safe_version_counts_and_the_biggest_cause_wins():
    # 50 corrupt versions before the safe version; since: 3 corrupt, 9 busy.
    history = _history(4, 20, Counters(busy=1), before=Counters(corrupt=50))
    history[-1] = dataclasses.replace(history[-1], counters=dataclasses.replace(
        history[-1].counters, corrupt=53, busy=9))
    assert assess(history, 5).reason == "busy_writers"
    # A tie goes to the order of REASONS: corrupt frames first.
    history[-1] = dataclasses.replace(history[-1], counters=dataclasses.replace(
        history[-1].counters, corrupt=59))
    assert assess(history, 5).reason == "corrupt_frames"


def test_a_channel_lost_once_and_back_is_a_lost_channel_not_a_slow_link():
    history = _history(4, 20, Counters(lost=1))
    last = history[-1].counters
    history[-1] = dataclasses.replace(history[-1], counters=dataclasses.replace(
        last, timeouts=1, reconnects=1))
    assert assess(history, 5).reason == "lost_channel"


def test_writers_busy_now_and_then_are_not_named_busy_but_busy_at_most_saves_are():
    history = _history(4, 20, Counters(busy_hosts=(1,)))
    for i in range(5, len(history), 2):  # busy at every other save: a normal write's latency
        history[i] = dataclasses.replace(history[i], counters=Counters())
    assert assess(history, 5).reason == "unknown"
    history[5] = dataclasses.replace(history[5], counters=Counters(busy_hosts=(0,)))
    assert assess(history, 5).reason == "busy_writers"  # 9 of 16, the last among them
    assert "host(s) [0, 1] were busy at 9 of the 16 saves" in assess(history, 5).detail


def test_nothing_safe_yet_counts_from_the_step_the_job_started_from():
    history = [Sample(30, 100.0, -1), Sample(31, 101.0, -1), Sample(35, 107.5, -1,
                                                                  Counters(corrupt=5))]
    lag = assess(history, max_lag=4)
    assert (lag.safe_step, lag.steps, lag.seconds, lag.over, lag.reason) == (
        30, 5, 7.5, True, "corrupt_frames")
    with pytest.raises(ValueError):
        assess([])


_COUNTS = st.builds(Counters, corrupt=st.integers(0, 3), lost=st.integers(0, 3),
                    timeouts=st.integers(0, 3), reconnects=st.integers(0, 2),
                    on_link=st.integers(0, 3), busy=st.integers(0, 3))


@given(st.lists(st.tuples(st.integers(1, 3), st.booleans(), _COUNTS), min_size=1, max_size=40),
       st.integers(0, 30))
def test_over_exactly_past_the_bound_and_the_reason_is_the_biggest_count_since(saves, max_lag):
    """Random saves (step gaps, whether the safe version caught up, counter
    growth): the lag is the steps since the safe version, over exactly past
    a non-zero bound, and a stuck run names the cause that grew the most."""
    history, step, safe, total = [Sample(0, 0.0, -1)], 0, -1, Counters()
    for gap, commits, grow in saves:
        step += gap
        total = dataclasses.replace(total, **{f: getattr(total, f) + getattr(grow, f)
                                              for f in ("corrupt", "lost", "timeouts",
                                                        "reconnects", "on_link", "busy")})
        safe = step - 1 if commits else safe
        history.append(Sample(step, float(step), safe, total))
    lag = assess(history, max_lag)
    assert lag.steps == step - max(safe, 0) >= 0
    assert lag.over == (max_lag > 0 and lag.steps > max_lag)
    if lag.steps == 0:
        assert lag.reason == ""
        return
    base = max((s for s in history if s.step <= max(safe, 0)), key=lambda s: s.step)
    d = total.minus(base.counters)
    counts = {"corrupt_frames": d.corrupt, "channel": d.lost, "slow_link": d.on_link,
              "busy_writers": d.busy}
    top = max(counts.values())
    if top == 0:
        assert lag.reason == "unknown"
    else:
        first = next(k for k, v in counts.items() if v == top)
        want = first if first != "channel" else (
            "slow_link" if d.timeouts >= 2 and d.reconnects >= 1 else "lost_channel")
        assert lag.reason == want
    assert lag.seconds == step - base.time_s


def test_the_watch_prints_lines_as_the_lag_doubles_alarms_once_and_says_when_it_advances():
    watch = LagWatch(12, Sample(0, 0.0, -1))
    notices = [watch.observe(Sample(s, float(s), 1 if s >= 3 else -1, Counters(corrupt=s)))
               for s in range(1, 40)]
    lines = [n.lag.step for n in notices if n.line]
    alarms = [n.lag.step for n in notices if n.alarm]
    assert lines == [9, 17, 33] and alarms == [14]  # lag 8, 16, 32; past 12 at lag 13
    assert all(n.lag.reason == "corrupt_frames" for n in notices[13:])
    back = watch.observe(Sample(40, 40.0, 38, Counters(corrupt=40)))
    assert back.recovered and not back.alarm and back.lag.steps == 2
    assert len(watch.history) <= 3  # only the samples since the safe version are kept
    # A second episode alarms again.
    again = [watch.observe(Sample(s, float(s), 38)) for s in range(41, 60)]
    assert [n.lag.step for n in again if n.alarm] == [51]


def test_a_bound_below_the_tiers_latency_alarms_once_not_at_every_save():
    """The threaded path trails by 3 saves: with --max_version_lag=2 the safe
    version advances every save and is always past the bound: one alarm."""
    watch = LagWatch(2, Sample(0, 0.0, -1))
    notices = [watch.observe(Sample(s, float(s), s - 3 if s > 3 else -1)) for s in range(1, 30)]
    assert [n.lag.step for n in notices if n.alarm] == [3]
    assert not any(n.line or n.recovered for n in notices)
    assert watch.observe(Sample(30, 30.0, 28)).recovered  # back within the bound


# ----- the counters it reads -----

class _Tier:
    host = 0

    def __init__(self):
        self.anywhere = False

    def note_channel(self, lost):
        pass

    def channel_lost_anywhere(self):
        return self.anywhere


class _Channel:
    destination = source = 1
    timeout_s = 8.0


class _SlowSender:
    """A link slower than the channel's bound: every wait runs past it."""

    def __init__(self, error):
        self.failure, self.channel, self.error = None, _Channel(), error

    def abandon(self):
        return []

    def wait(self, version):
        raise self.error

    def reconnect(self, channel):
        self.channel, self.failure = channel, None


def test_the_keeper_counts_a_link_always_slower_than_its_bound_and_names_it(caplog):
    """Lose, reconnect, lose: the attempts start over after each clean round
    (so the bound never ends it), but the keeper counts the losses to the
    bound and the reconnects, and says so on the second loss in a row."""
    tier, sender = _Tier(), _SlowSender(TimeoutError("version: receiving ran past 8 s"))
    keeper = ChannelKeeper(tier, sender, lambda attempt: _Channel())
    for step in range(0, 12, 3):
        with pytest.raises(TimeoutError) as e:
            keeper.wait(step)
        assert keeper.is_loss(e.value)
        tier.anywhere = True
        assert keeper.down(step + 1)
        keeper.while_down(step + 1)  # reconnects at once: the new channel connects
        tier.anywhere = False
        assert not keeper.down(step + 2)  # back: the attempt count starts over
    assert keeper.attempts == 0
    c = keeper.counts
    assert (c.losses, c.timeouts, c.reconnects, c.lost_in_a_row, c.arrived) == (4, 4, 4, 4, 0)
    assert "the link is slower than the channel's bound" in caplog.text


def test_the_keeper_counts_a_link_that_corrupts_every_version_and_names_it(caplog):
    sender = _SlowSender(VersionDropped(0, "a frame failed its check"))
    keeper = ChannelKeeper(_Tier(), sender, lambda attempt: _Channel())
    for version in range(4):
        with pytest.raises(VersionDropped):
            keeper.wait(version)
        assert not keeper.is_loss(VersionDropped(version, "corrupt"))
    assert (keeper.counts.corrupt, keeper.counts.corrupt_in_a_row, keeper.counts.losses) == (
        4, 4, 0)
    assert "4 versions in a row from host 1 failed their end-to-end check" in caplog.text


class _Ckpt:
    def __init__(self, drops, busy=(), down=False):
        self.drops, self.busy, self.down = drops, busy, down

    def drop_counts(self):
        return self.drops

    def busy_hosts(self):
        return self.busy

    def channel_lost_anywhere(self):
        return self.down


def test_the_alarm_reads_the_checkpointer_and_the_keeper_counters():
    drops = DropCounts(corrupt=2, lost=1, skipped=5, budget=1, own_busy=2, replicas_busy=3)
    keeper = ChannelKeeper(_Tier(), _SlowSender(TimeoutError()), lambda attempt: _Channel())
    keeper.counts.timeouts, keeper.counts.reconnects, keeper.counts.skips = 3, 2, 4
    keeper.lost_versions = [7, 9]

    class Strategy:
        pass

    with_keeper = Strategy()
    with_keeper.keeper = keeper
    got = lag_alarm.counters(_Ckpt(drops, (1,), True), with_keeper)
    assert got == Counters(corrupt=2, lost=1 + 4 + 2, timeouts=3, reconnects=2, on_link=1,
                           busy=6, channel_down=True, busy_hosts=(1,))
    assert lag_alarm.counters(_Ckpt(drops), Strategy()) == Counters(
        corrupt=2, lost=1, on_link=5, busy=6)


def test_the_alarm_writes_the_event_once_and_fails_after_the_step_under_on_lag_fail():
    written = []

    class Metrics:
        def write(self, record):
            written.append(record)

    ckpt, now = _Ckpt(DropCounts()), [0.0]
    alarm = lag_alarm.LagAlarm(ckpt, object(), Metrics(), 0, 3, "fail", 0, clock=lambda: now[0])
    for step in range(1, 6):
        now[0] = float(step)
        ckpt.drops = DropCounts(corrupt=step)
        fields = alarm.observe(step, [{"version": step, "replicated": 0 if step < 2 else 1}])
        if step < 5:
            alarm.check()
    assert fields == {"safe_step": 1, "version_lag_steps": 4, "version_lag_s": 4.0}
    assert [r["event"] for r in written] == ["lag"] and written[0]["reason"] == "corrupt_frames"
    with pytest.raises(lag_alarm.VersionLagError, match=r"^lag: the newest safe version is 4 "
                                                        r"steps .* corrupt frames: .*--on_lag="
                                                        r"fail ends the job$"):
        alarm.check()


# ----- the flags -----

def _config(tmp_path, *argv):
    fv = train.define_flags(flags.FlagValues())
    fv(["train", f"--workdir={tmp_path}", *argv])
    return config.from_flags(fv)


@pytest.mark.parametrize("argv, error", [
    (("--ckpt=inmem", "--max_version_lag=-3"),
     "--max_version_lag must be >= 0 steps (0: no bound), got -3"),
    (("--ckpt=inmem", "--max_version_lag=0", "--on_lag=fail"),
     "--on_lag=fail ends the job past --max_version_lag steps: it needs --max_version_lag > 0, "
     "got 0"),
    (("--ckpt=none", "--max_version_lag=5"),
     "--max_version_lag watches the in-memory tier's safe version: it needs --ckpt in"),
    (("--ckpt=orbax_async", "--on_lag=fail"),
     "--on_lag watches the in-memory tier's safe version"),
])
def test_lag_flags_are_checked_naming_the_bad_value(tmp_path, argv, error):
    with pytest.raises(config.FlagError) as e:
        _config(tmp_path, *argv)
    assert str(e.value).startswith(error), str(e.value)


def test_lag_flags_reach_the_config_and_a_bad_on_lag_is_refused_by_name(tmp_path):
    c = _config(tmp_path, "--ckpt=capricorn", "--max_version_lag=7", "--on_lag=fail").checkpoint
    assert (c.max_version_lag, c.on_lag) == (7, "fail")
    c = _config(tmp_path, "--ckpt=inmem").checkpoint
    assert (c.max_version_lag, c.on_lag) == (50, "warn")
    assert _config(tmp_path).checkpoint.on_lag == "warn"  # defaults are fine without a tier
    with pytest.raises(flags.IllegalFlagValueError, match="on_lag=sometimes"):
        _config(tmp_path, "--ckpt=inmem", "--on_lag=sometimes")


def test_the_checkpointer_counts_its_drops_by_cause_and_reports_busy_writers(tmp_path):
    """drop_counts: a peer's corrupt payload, a lost one, a skip at the
    caller's word, the cost budget's skips; busy_hosts: the hosts whose
    writers were busy at the last gathered status round (the writer is held
    on an event, so the schedule is exact)."""
    import threading

    import capricorn_jax
    from launch.trainer import OptimizerOptions, Trainer, make_mesh
    from models import get_config

    trainer = Trainer(get_config("tiny"), make_mesh(4), OptimizerOptions())
    opts = capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="j", replicas=1,
                                         max_wait_s=0.0)
    ckpt = capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1)
    release, entered, begin = threading.Event(), threading.Event(), ckpt.store.begin

    def held_begin(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        return begin(*args, **kwargs)

    ckpt.store.begin = held_begin
    state = trainer.init_state(0)
    assert ckpt.drop_counts() == DropCounts() and ckpt.busy_hosts() == ()
    ckpt.save(1, state, {"data": {}})
    assert entered.wait(60)
    ckpt.save(2, state, {"data": {}})  # its round: the writer holds 1
    assert ckpt.busy_hosts() == (0,)
    assert ckpt.save(3, state, {"data": {}}).skipped  # the budget: a writer was busy
    ckpt.drop(4)
    ckpt.drop(5, corrupt=False)
    ckpt.skip(6)
    release.set()
    ckpt.wait_until_finished(60)
    ckpt.confirm(60)
    assert ckpt.busy_hosts() == ()
    assert ckpt.drop_counts() == DropCounts(corrupt=1, lost=1, skipped=1, budget=1)
    ckpt.close()
