"""The CI subset of the fault soak: ``python -m launch.chaos`` end to end.

One trial of 2 hosts x 1 device (a reference run and the faulted job), seed
chosen for a capricorn job with a persistent tier whose host 1 is lost as a
machine while the persistent tier writes, and a replica writer that stalls;
the failure during recovery has its own test (test_strategies.py); the full
soak is documented in BUILD_NOTES (``--trials=N`` on every topology).
"""

import json
import subprocess
import sys

import pytest

from launch.chaos import draw_trial, parse_topology
from tests.helpers import ROOT, assert_no_orphans, child_env

pytestmark = pytest.mark.slow

SEED, STEPS = 5, 8
FLAGS = ("--trials=1", f"--seed={SEED}", "--topologies=2x1", f"--steps={STEPS}")


def test_chaos_runs_trials_checks_them_and_writes_the_json(tmp_path):
    trials = [draw_trial(0, SEED, [parse_topology("2x1")],
                         ["inmem", "gemini", "capricorn", "pec"], STEPS)]
    # The seed's draw (see the module doc).
    assert [(f.point, f.mode) for f in trials[0].faults] == [("mid_persist", "host")]
    assert trials[0].strategy == "capricorn" and trials[0].stall is not None
    out = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, "-m", "launch.chaos", *FLAGS,
                           f"--workdir={tmp_path / 'w'}", f"--json={out}"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["passed"], report["failed"]) == (1, 0)
    for trial, result in zip(trials, report["trials"], strict=True):
        assert result["ok"] and result["problems"] == []
        assert result["strategy"] == trial.strategy and result["topology"] == "2x1"
        assert result["faults"] == [f.to_json() for f in trial.faults]
        assert len(result["resumed_from"]) == len(result["tier"]) >= 1
    assert "chaos: 1/1 trials passed" in proc.stdout
    assert "trial 1/1 (seed 5000) 2x1 capricorn persist=4" in proc.stdout
    assert_no_orphans(str(tmp_path / "w"))
