"""The CI subset of the fault soak: ``python -m launch.chaos`` end to end.

Two trials of 2 hosts x 1 device (one reference run, two faulted jobs), seed
chosen so one of them kills a host while the job recovers; the full soak is
documented in BUILD_NOTES (``--trials=N`` on every topology).
"""

import json
import subprocess
import sys

import pytest

from launch.chaos import draw_trial, parse_topology
from tests.helpers import ROOT, assert_no_orphans, child_env

pytestmark = pytest.mark.slow

SEED, STEPS = 5, 8
FLAGS = ("--trials=2", f"--seed={SEED}", "--topologies=2x1", f"--steps={STEPS}")


def test_chaos_runs_trials_checks_them_and_writes_the_json(tmp_path):
    trials = [draw_trial(i, SEED, [parse_topology("2x1")],
                         ["inmem", "gemini", "capricorn", "pec"], STEPS) for i in range(2)]
    points = [f.point for t in trials for f in t.faults]
    assert "recovery" in points  # the seed's draw: a failure during recovery is in the subset
    out = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, "-m", "launch.chaos", *FLAGS,
                           f"--workdir={tmp_path / 'w'}", f"--json={out}"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["passed"], report["failed"]) == (2, 0)
    for trial, result in zip(trials, report["trials"], strict=True):
        assert result["ok"] and result["problems"] == []
        assert result["strategy"] == trial.strategy and result["topology"] == "2x1"
        assert result["faults"] == [f.to_json() for f in trial.faults]
        assert len(result["resumed_from"]) == len(result["tier"]) >= 1
    assert "chaos: 2/2 trials passed" in proc.stdout
    assert proc.stdout.count("trial ") >= 2
    assert_no_orphans(str(tmp_path / "w"))
