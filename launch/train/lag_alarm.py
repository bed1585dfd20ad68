"""The lag alarm in launch.train's loop: counters in, lines, events and the error out.

After each save the loop hands ``LagAlarm.observe`` the step and the save's
``checkpoint`` events; it reads this host's counters (the checkpointer's
``drop_counts`` and ``busy_hosts``, the chunk channel keeper's ``counts``,
when the strategy has one), asks ``launch.train.lag`` how old the safe
version is and why, and:

* returns the per-step record's fields (``safe_step``, ``version_lag_steps``,
  ``version_lag_s``);
* on host 0, logs a line when the lag reaches 8, 16, 32, ... steps, and one
  when it is back (under 8 steps, within the bound) after a line or alarm;
* past ``--max_version_lag``: writes the ``lag`` event (host 0) and, with
  ``--on_lag=warn``, a warning on every host (each names its own counters);
  with ``--on_lag=fail``, ``check`` then raises ``VersionLagError`` on every
  host at the same save (the decision reads only steps and the agreed safe
  version), which ``exit_on_lag`` turns into one error line per host and
  exit code ``LAG_EXIT_CODE``, not a traceback.

Design choice: the wiring apart from the pure decision (``lag``) and from
the loop (``command``), which calls it in three lines. Alternative not taken:
the alarm inside the strategies, which see their own counters but not the
training loop's step, clock or flags, and would each need it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from absl import logging

from launch.metrics import MetricsWriter
from launch.train import lag as lag_lib

LAG_EXIT_CODE = 4
"""A worker's exit code when ``--on_lag=fail`` ended it."""
_EXIT_BARRIER = "launch/lag_exit"
_EXIT_KEY = "launch/lag_exit/{host}"


class VersionLagError(RuntimeError):
    """The safe version is older than ``--max_version_lag`` steps (``--on_lag=fail``)."""

    def __init__(self, lag: lag_lib.Lag) -> None:
        super().__init__(f"lag: {lag.message()}; --on_lag=fail ends the job")
        self.lag = lag


def counters(ckpt: Any, strategy: Any) -> lag_lib.Counters:
    """This host's ``lag.Counters``: the checkpointer's drops by cause and the
    hosts with busy writers, and the chunk channel keeper's counts (the
    strategies that move versions on the channel have a ``keeper``)."""
    drops = ckpt.drop_counts()
    keeper = getattr(strategy, "keeper", None)
    timeouts = reconnects = skips = abandoned = 0
    if keeper is not None:
        c = keeper.counts
        timeouts, reconnects, skips = c.timeouts, c.reconnects, c.skips
        abandoned = len(keeper.lost_versions)
    return lag_lib.Counters(
        corrupt=drops.corrupt, lost=drops.lost + skips + abandoned, timeouts=timeouts,
        reconnects=reconnects, on_link=max(drops.skipped - skips, 0),
        busy=drops.budget + drops.own_busy + drops.replicas_busy,
        channel_down=bool(ckpt.channel_lost_anywhere()), busy_hosts=ckpt.busy_hosts())


class LagAlarm:
    """The alarm of one host's training loop (module docstring).

    Args:
      ckpt: the host's ``InMemoryCheckpointer``.
      strategy: the --ckpt strategy (its ``keeper``, if any).
      metrics: the metrics writer (host 0's writes; a no-op elsewhere).
      host: this host.
      max_lag, on_lag: ``--max_version_lag``, ``--on_lag``.
      start: the step the loop starts from.
      clock: the monotonic clock (tests pass their own).
    """

    def __init__(self, ckpt: Any, strategy: Any, metrics: MetricsWriter, host: int,
                 max_lag: int, on_lag: str, start: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ckpt, self.strategy, self.metrics, self.host = ckpt, strategy, metrics, host
        self.on_lag, self.clock = on_lag, clock
        self.watch = lag_lib.LagWatch(max_lag, lag_lib.Sample(start, clock(), -1,
                                                              counters(ckpt, strategy)))
        self._safe = -1
        self._failed: lag_lib.Lag | None = None

    def observe(self, step: int, events: list[dict]) -> dict[str, Any]:
        """After the save of version ``step`` (its ``checkpoint`` events):
        the per-step record's fields; lines and the ``lag`` event as due."""
        for event in events:
            if "replicated" in event:
                self._safe = max(self._safe, int(event["replicated"]))
        notice = self.watch.observe(lag_lib.Sample(step, self.clock(), self._safe,
                                                   counters(self.ckpt, self.strategy)))
        lag = notice.lag
        if notice.recovered and self.host == 0:
            logging.info("lag: back: the newest safe version is version %d, %d steps (%.1f s) "
                         "old", lag.safe_step, lag.steps, lag.seconds)
        if notice.line and self.host == 0:
            logging.info("lag: %s", lag.message())
        if notice.alarm:
            self.metrics.write(lag.event())
            if self.on_lag == "fail":
                self._failed = lag
            else:
                logging.warning("lag: host %d: %s; training goes on (--on_lag=warn)", self.host,
                                lag.message())
        return {"safe_step": lag.safe_step, "version_lag_steps": lag.steps,
                "version_lag_s": round(lag.seconds, 3)}

    def check(self) -> None:
        """Raises ``VersionLagError`` when the last save's lag passed the bound
        under ``--on_lag=fail`` (after the loop logged the step)."""
        if self._failed is not None:
            raise VersionLagError(self._failed)


def exit_on_lag(error: VersionLagError, host: int, timeout_s: float = 30.0) -> None:
    """Ends a worker that ``--on_lag=fail`` stopped: its error line, then exit
    code ``LAG_EXIT_CODE`` (no traceback), host 0 last, as
    ``runtime.exit_in_order`` orders a clean exit: every host raised at the
    same save, so all meet at a barrier (bounded), the others leave at once,
    and host 0, whose process serves the job's key-value store, waits until
    they said so (a peer that polls a store already gone aborts inside
    jaxlib with a stack trace)."""
    logging.error("host %d: %s", host, error)
    sys.stdout.flush()
    sys.stderr.flush()
    from capricorn_jax.experimental import distributed_client

    client = distributed_client()
    if client is not None:
        try:
            client.wait_at_barrier(_EXIT_BARRIER, int(timeout_s * 1000))
            client.key_value_set(_EXIT_KEY.format(host=host), "leaving")
            if host == 0:
                import jax

                for other in range(1, jax.process_count()):
                    client.blocking_key_value_get(_EXIT_KEY.format(host=other),
                                                  int(timeout_s * 1000))
                time.sleep(0.5)
        except Exception as e:  # noqa: BLE001 - a host that never came: leave anyway
            logging.warning("host %d: leaving without every host's word (%s)", host, e)
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(LAG_EXIT_CODE)
