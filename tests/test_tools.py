"""The measurement scripts run end to end and report what they measured."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, assert_no_orphans, child_env

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


@pytest.mark.soak
def test_pec_accuracy_compares_runs(tmp_path):
    out = tmp_path / "acc.json"
    proc = _run("launch.experiments.pec_accuracy", "--model=tiny", "--steps=8", "--fail_every=4",
                "--runs=no_failure,pec2_sequential", f"--workdir={tmp_path / 'w'}",
                f"--json={out}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert runs["no_failure"]["restores"] == 0 and runs["no_failure"]["plt"] is None
    pec = runs["pec2_sequential"]
    # Lost after step 4: resumes from version 5, or 4 if 5 was still being written.
    assert len(pec["restore_steps"]) == 1 and pec["restore_steps"][0] in (4, 5)
    assert 0.0 < pec["plt"] < 1.0
    assert pec["val_loss"] > 0 and "| pec2_sequential |" in proc.stdout
    assert_no_orphans(str(tmp_path / "w"))


@pytest.mark.soak
def test_orbax_rss_reports_memory_and_blocking(tmp_path):
    out = tmp_path / "rss.json"
    proc = _run("launch.experiments.orbax_rss", "--mib=8", "--devices=2",
                f"--store_root={tmp_path}", f"--workdir={tmp_path / 'w'}", f"--json={out}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["phase"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"capricorn memory", "capricorn persistent", "orbax", "timing"}
    assert all(rows[p]["peak_mib"] >= rows[p]["rss_before_mib"] > 0
               for p in ("capricorn memory", "capricorn persistent", "orbax"))
    assert rows["timing"]["save_blocked_s"] > 0 and rows["timing"]["d2h_s"] > 0
    assert "held the training thread" in proc.stdout
