"""The in-graph path's XLA:GPU flags (scheduling/in_graph/xla_flags.py): merged into
XLA_FLAGS without overriding the user, problems named, and every name one
this jaxlib's XLA knows (an unknown flag aborts the backend's start)."""

import os
import subprocess
import sys

import pytest

from capricorn_jax._src.scheduling.in_graph import xla_flags


def test_missing_flags_are_added_and_the_users_settings_kept():
    new, problems = xla_flags.with_overlap_flags("--xla_force_host_platform_device_count=4")
    assert xla_flags.parse_xla_flags(new) == {
        "xla_force_host_platform_device_count": "4",
        "xla_gpu_enable_latency_hiding_scheduler": "true",
        "xla_gpu_enable_highest_priority_async_stream": "true",
        "xla_gpu_collective_permute_combine_threshold_bytes": "0"}
    assert problems == []
    new, problems = xla_flags.with_overlap_flags("--xla_gpu_enable_latency_hiding_scheduler=false")
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in new.split()
    assert problems == ["--xla_gpu_enable_latency_hiding_scheduler=false (want true)"]


@pytest.mark.parametrize("extra,problem", [
    ("--xla_gpu_disable_async_collectives=ALLREDUCE,COLLECTIVEPERMUTE", "synchronous"),
    ("--xla_gpu_disable_async_collectives=all", "synchronous"),
    ("--xla_gpu_disable_multi_streaming", "compute stream"),
])
def test_settings_that_serialize_the_permutes_are_named(extra, problem):
    _, problems = xla_flags.with_overlap_flags(extra)
    assert len(problems) == 1 and problem in problems[0]
    assert xla_flags.with_overlap_flags("--xla_gpu_disable_async_collectives=ALLREDUCE")[1] == []


def test_after_the_backend_started_it_only_reports():
    env = {"XLA_FLAGS": "--a=1"}
    problems = xla_flags.set_overlap_flags(env, started=True)
    assert env == {"XLA_FLAGS": "--a=1"} and len(problems) == 3
    assert all("backend started before" in p for p in problems)
    assert xla_flags.set_overlap_flags(env, started=False) == []
    assert xla_flags.overlap_problems(xla_flags.parse_xla_flags(env["XLA_FLAGS"])) == []
    with pytest.raises(ValueError, match="does not start with --"):
        xla_flags.parse_xla_flags("xla_gpu_enable_latency_hiding_scheduler=true")


def test_this_jaxlib_knows_every_flag_and_refuses_an_unknown_one():
    def start(flags):
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        return subprocess.run([sys.executable, "-c", "import jax; print(jax.devices())"],
                              env=env, capture_output=True, text=True, timeout=120)

    good, _ = xla_flags.with_overlap_flags("--xla_gpu_disable_async_collectives=ALLREDUCE")
    assert start(good).returncode == 0
    bad = start(good + " --xla_gpu_enable_latency_hiding_schedulr=true")
    assert bad.returncode != 0 and "latency_hiding_schedulr" in bad.stderr
