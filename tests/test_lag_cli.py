"""The lag alarm in a real run: a safe version that stops advancing is reported.

Two hosts, one device each, the tiny model, inmem. Host 1's replica writer
stalls at version 2 (``--stall_host``): host 1 then drops the replicas of
every version of host 0 that arrives while it is stuck, so no version after
1 is on every holder and the safe version freezes while training goes on.
"""

import json
import re

import pytest

from tests.helpers import assert_no_orphans, run_train

COMMON = ("--hosts=2", "--devices_per_host=1", "--model=tiny", "--eval_sequences=0",
          "--log_every=4", "--ckpt=inmem", "--max_version_lag=3", "--stall_host=1",
          "--stall_at_step=2")

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _records(workdir):
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_a_frozen_safe_version_is_reported_and_the_job_goes_on_under_on_lag_warn(
        tmp_path, cache):
    workdir = tmp_path / "w"
    proc = run_train(*COMMON, "--steps=60", "--stall_seconds=4", f"--workdir={workdir}",
                     f"--store_root={tmp_path / 's'}", timeout=600, env=cache)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    records = _records(workdir)
    (event,) = [r for r in records if r.get("event") == "lag"]
    assert event["reason"] == "busy_writers", event
    assert event["lag_steps"] == 4 and event["step"] - event["safe_step"] == 4, event
    assert event["safe_step"] <= 2, event
    steps = [r for r in records if "event" not in r]
    assert all({"safe_step", "version_lag_steps", "version_lag_s"} <= set(r) for r in steps)
    assert max(r["version_lag_steps"] for r in steps) > 3
    assert steps[-1]["version_lag_steps"] <= 3  # the writer came back: it advanced again
    # Every host warns with its own counters; host 1's own replica writer dropped them.
    warned = re.findall(r"WARNING: lag: host (\d): the newest safe version is 4 steps", out)
    assert sorted(warned) == ["0", "1"], out[-4000:]
    assert re.search(r"host 1: .*busy writers: \d+ version\(s\) skipped or their replicas "
                     r"dropped", out), out[-4000:]
    assert "Traceback" not in out
    assert_no_orphans(str(workdir))


@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_on_lag_fail_ends_the_job_with_the_reason_and_no_traceback(tmp_path, cache):
    workdir = tmp_path / "w"
    proc = run_train(*COMMON, "--steps=40", "--stall_seconds=120", "--on_lag=fail",
                     f"--workdir={workdir}", f"--store_root={tmp_path / 's'}", timeout=600,
                     env=cache)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out[-4000:]
    # One error line per host, no traceback, and no host aborted by a store gone first.
    assert not [w for w in ("Traceback", "stack trace", "FATAL", "Fatal Python error") if w in out]
    assert re.search(r"\[host 0\] ERROR: host 0: lag: the newest safe version is 4 steps "
                     r"\([\d.]+ s\) old \(--max_version_lag=3\): version \d, training at step "
                     r"\d+; busy writers: .*--on_lag=fail ends the job", out), out[-4000:]
    assert "train: job failed with exit code 4" in proc.stderr
    records = _records(workdir)
    (event,) = [r for r in records if r.get("event") == "lag"]
    assert event["reason"] == "busy_writers"
    # It ended at the save that passed the bound, not at --steps.
    assert max(r["step"] for r in records if "event" not in r) == event["step"] - 1 < 39
    assert_no_orphans(str(workdir))
