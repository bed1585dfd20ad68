"""launch.experiments.transfer_alt measures both transports and checks every byte it moves."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, assert_no_orphans, child_env

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # every test here starts processes


def _run(*flags, timeout=120):
    env = child_env()
    return subprocess.run([sys.executable, "-m", "launch.experiments.transfer_alt", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.soak  # the rejected transport's measurement; its deadline test stays in CI
def test_both_transports_measured_and_verified(tmp_path):
    out = tmp_path / "alt.json"
    proc = _run("--sizes_mb=0.25", "--repeats=2", "--window_s=0.2", "--timeout_s=100",
                f"--workdir={tmp_path / 'w'}", f"--json={out}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(r["transport"], r["pattern"]): r for r in report["results"]}
    assert set(rows) == {(t, p) for t in ("ppermute", "transfer") for p in ("one-way", "swap")}
    for row in rows.values():
        assert row["size_mb"] == 0.25 and row["samples"] == 2
        assert row["bytes_per_host"] == 2 * (1 << 18)  # two devices per host
        assert 0 < row["min_s"] <= row["median_s"]
        assert row["mb_per_s"] > 0 and row["max_mb_per_s"] >= row["mb_per_s"]
    checks = {c["transport"]: c for c in report["checks"]}
    assert set(checks) == {"ppermute", "transfer"}
    for c in checks.values():
        assert c["bytes_sent"] == c["bytes_received"] > 0
        assert 0 < c["bytes_verified"] <= c["bytes_received"] and c["checksums_match"]
    inter = {r["transport"]: r for r in report["interference"]}
    assert set(inter) == {"ppermute", "transfer"}
    for r in inter.values():
        assert len(r["slowdown"]) == 2 and all(s > 0 for s in r["slowdown"])
        assert r["transfers"] >= 3 and min(r["compute_calls_loaded"]) >= 1
    assert report["setup"]["transfer_server_start_s"] > 0
    assert "| 0.25 | transfer | one-way |" in proc.stdout
    assert_no_orphans(str(tmp_path / "w"))


def test_deadline_kills_hosts_and_reports_nothing(tmp_path):
    out = tmp_path / "alt.json"
    proc = _run("--sizes_mb=0.25", "--repeats=2", "--timeout_s=1", f"--workdir={tmp_path / 'w'}",
                f"--json={out}", timeout=60)
    assert proc.returncode != 0
    assert "no results reported" in proc.stderr and "timed out" in proc.stderr
    assert not out.exists() and "| ppermute |" not in proc.stdout
    assert_no_orphans(str(tmp_path / "w"))
    bad = _run("--sizes_mb=0", timeout=60)
    assert bad.returncode == 2 and "--sizes_mb" in bad.stderr
