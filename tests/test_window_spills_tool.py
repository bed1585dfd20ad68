"""launch.experiments.window_spills: rows per schedule from a run's events."""

from __future__ import annotations

import json
import subprocess
import sys

from launch.experiments.window_spills import spill_rows
from tests.helpers import ROOT


def _ckpt(step, *spills, late=0.0):
    return {"event": "checkpoint", "step": step,
            "windows": [{"window": f"w{i}", "planned_s": 0.008, "observed_s": 0.01 - s,
                         "chunks_s": 0.01, "spill_s": s, "late_s": late if i == 0 else 0.0}
                        for i, s in enumerate(spills)]}


EVENTS = [
    {"event": "repartition", "step": 2, "strategy": "capricorn"},
    _ckpt(3, 0.0, 0.002), _ckpt(4, 0.0005, 0.0), _ckpt(5, 0.001, 0.004, late=0.003),
    {"event": "detector", "step": 5, "requested": True},
    {"event": "repartition", "step": 6, "strategy": "capricorn"},
    _ckpt(7, 0.0, 0.0), _ckpt(8, 0.0, 0.0015),
    {"event": "checkpoint", "step": 9},  # unscheduled: no windows
]


def test_rows_per_schedule_count_the_spilled_steps_and_the_requests():
    first, second = spill_rows(EVENTS, 0.001)
    assert (first["planned_after_step"], first["steps_moved"], first["steps_spilled"]) == (2, 3, 2)
    assert first["spilled_windows"] == 3 and first["windows"] == 6
    assert first["spill_ms_max"] == 7.0 and abs(first["spill_ms_mean"] - 9.5 / 3) < 1e-9
    assert first["spill_ms_median"] == 2.0
    assert first["profile_requests"] == [5]
    # idle / measured window (planned / 0.8 = 10 ms) = 1 - spill / 10 ms per window:
    # 1.0, 0.8, 0.95, 1.0, 0.9, 0.6
    assert abs(first["window_ratio_median"] - 0.925) < 1e-9
    assert abs(first["window_ratio_p5"] - 0.6) < 1e-9
    assert (second["steps_moved"], second["steps_spilled"], second["profile_requests"]) == (
        2, 1, [])


def test_the_command_prints_the_table_and_refuses_a_run_without_measurements(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(e) for e in EVENTS))
    out = subprocess.run([sys.executable, "-m", "launch.experiments.window_spills", str(run)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| run | capricorn | 2 | 3 | 2 (67%) | 2.0 / 3.2 / 7.0 | 3 / 6 | 0.60, 0.9" in out.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text(json.dumps({"event": "checkpoint", "step": 1}))
    out = subprocess.run([sys.executable, "-m", "launch.experiments.window_spills", str(empty)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no version moved on the threaded path" in out.stderr
