"""The measurement scripts run end to end and report what they measured."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, child_env

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # every test here starts processes


def _run(module, *flags, timeout=300):
    env = child_env()
    return subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_bandwidth_reports_every_copy(tmp_path):
    out = tmp_path / "bw.json"
    proc = _run("launch.experiments.bandwidth", "--mib=4", "--repeats=2", f"--tmpfs={tmp_path}",
                f"--json={out}", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    copies = result["copies"]
    assert set(copies) == {"host memcpy", "host -> device", "device -> host",
                           "tmpfs write + read", "store ingest", "store restore"}
    assert all(r["best_gb_s"] >= r["median_gb_s"] > 0 for r in copies.values())
    assert (result["memcpy_gbps"], result["store_ingest_gbps"], result["restore_gbps"]) == (
        copies["host memcpy"]["median_gb_s"], copies["store ingest"]["median_gb_s"],
        copies["store restore"]["median_gb_s"])
    assert "| store ingest |" in proc.stdout and "| store restore |" in proc.stdout
    assert list(tmp_path.iterdir()) == [out]  # its scratch file is gone
    assert _run("launch.experiments.bandwidth", "--mib=0", timeout=60).returncode == 2
