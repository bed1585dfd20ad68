"""The GPU script's dry run (``bash launch/gpu_bench.sh OUT --platform=cpu``):
every part runs at small sizes and the summary holds each field."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.gpu_bench import DRY_RUN_BIG_STRATEGIES, PARTS, STRATEGIES, h100_target
from tests.helpers import TEST_XLA_FLAGS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # about 100 s: six processes, two benches and three trainings
def test_dry_run_writes_every_field(tmp_path):
    # The test XLA flags (LLVM's optimizations off, as every test job), not the
    # forced device count of this process: each part sets its own devices.
    env = {**os.environ, "XLA_FLAGS": " ".join(TEST_XLA_FLAGS)}
    env.update(PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    run = subprocess.run(["bash", str(ROOT / "launch/gpu_bench.sh"), str(tmp_path / "out"),
                          "--platform=cpu"], env=env, capture_output=True, text=True,
                         timeout=400)
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert run.returncode == 0, (run.stdout[-2000:], summary)
    parts = summary["parts"]
    assert summary["platform"] == "cpu" and summary["ok"] is True
    assert list(parts) == list(PARTS) and all(p["ok"] for p in parts.values())
    arena = parts["arena"]
    assert arena["copy_path"] == summary["copy_path"] == "host_plain"
    assert arena["log_line"].startswith("checkpoint copy path: host_plain on cpu")
    assert arena["bytes_landed"] is True and arena["slot_address_aligned"] is True
    assert arena["dma_map"] == "unimplemented" and summary["registration_s_per_gb"] is None
    # CPU: the slot imports without a copy, but XLA:CPU does not alias a donated
    # external buffer (the GPU run answers the same question for pinned_host).
    assert arena["zero_copy"] == {"import_zero_copy": True, "output_aliases_slot": False,
                                  "bytes_landed": False}
    assert summary["pinned_d2h_gbps"] > 0
    for which, names in (("small", STRATEGIES.split(",")),
                         ("big", DRY_RUN_BIG_STRATEGIES.split(","))):
        steps = summary[f"step_s_{which}"]
        assert sorted(steps) == sorted(names) and all(s > 0 for s in steps.values())
        assert parts[f"bench_{which}"]["strategies"]["none"]["ratio"] == 1.0
    recoveries = parts["recovery"]["recoveries"]
    assert [r["step"] for r in recoveries["local"]] == [5]
    assert [r["step"] for r in recoveries["persistent"]] == [6]
    assert summary["recovery_arena_s"] > 0 and summary["recovery_persistent_s"] > 0
    cpu = parts["schedule"]["cpu"]
    assert summary["schedule_ok_cpu"] is True
    # 12 chunk permutes and the payload CRC's (the integrity rule), all placed
    assert (cpu["permutes"], cpu["asynchronous"], cpu["placed"]) == (13, 0, 13)
    mem = cpu["memory"]
    assert summary["scheduled_step_peak_bytes"] == mem["peak_bytes"] == (
        mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"])
    env_part = parts["env"]
    assert env_part["xla_flag_problems"] == []
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in env_part["xla_flags"].split()


def test_the_cuda_target_is_a_compute_capability_9_device():
    text = h100_target()
    assert "cuda_compute_capability { major: 9 }" in text
    assert 'platform_name: "CUDA"' in text
