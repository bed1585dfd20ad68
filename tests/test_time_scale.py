"""launch.bench's time dilation, ``--time_scale=k``.

Under k the emulated accelerator's waits are k times the profile's and every
shaped link runs at 1/k of its rate (its latency k times, its bucket the same
bytes), so a step lasts k times longer with the same bytes on the link: what
does not stretch with k is fixed-time work (CPU, the GIL, the kernel's
per-packet work).
"""

import functools
import json
import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest
from absl import flags

from launch import accelerator
from launch.bench import command as bench
from launch.bench import config as bench_config
from launch.cluster.netns import LinkOptions
from launch.errors import FlagError
from launch.tiers import memory_options
from models.config import get_config
from models.emulation.layers import Emulation
from models.emulation.layers import dense as emulated_dense
from models.emulation.profile import LayerTimes, load
from tests.helpers import ROOT, child_env

FIELDS = ("dense_fwd_ms", "dense_bwd_ms", "expert_fwd_ms", "expert_bwd_ms")


def _bench(tmp_path, *argv):
    fv = bench.define_flags(flags.FlagValues())
    fv(["bench", f"--workdir={tmp_path}", *argv])
    return bench_config.BenchConfig.from_flags(fv)


@pytest.mark.parametrize("argv, message", [
    (["--accelerator=emulated", "--time_scale=0.5"], "--time_scale must be a number >= 1"),
    (["--accelerator=emulated", "--time_scale=0"], "--time_scale must be a number >= 1"),
    (["--accelerator=emulated", "--time_scale=nan"], "--time_scale must be a number >= 1"),
    (["--accelerator=emulated", "--time_scale=inf"], "--time_scale must be a number >= 1"),
    (["--time_scale=2"], "--time_scale=2 needs --accelerator=emulated"),
    (["--time_scale=1.5", "--link_gbps=1"], "--time_scale=1.5 needs --accelerator=emulated"),
])
def test_a_bad_time_scale_is_refused_naming_the_flag(tmp_path, argv, message):
    with pytest.raises(FlagError, match=message):
        _bench(tmp_path, *argv)


def test_the_default_time_scale_is_one_and_changes_nothing(tmp_path):
    cfg = _bench(tmp_path, "--link_gbps=0.154")  # k = 1 needs no emulated accelerator
    assert cfg.setup.time_scale == 1.0 and cfg.setup.link == LinkOptions(gbps=0.154)
    assert "time scale 1" in bench.header(cfg)
    with pytest.raises(FlagError, match="--time_scale=3 needs --accelerator=emulated"):
        accelerator.AcceleratorConfig(accelerator="none", time_scale=3.0)


@pytest.mark.parametrize("k", [1.0, 2.0, 4.0, 2.5])
def test_each_emulated_wait_is_k_times_the_profiles(k):
    profile, cfg = load("a100_gpt_moe_350m_16e"), get_config("tiny")
    base = Emulation.for_config(profile, cfg)
    dilated = accelerator.emulation("emulated", "", cfg, k)
    assert dilated.profile == base.profile and len(dilated.layers) == len(base.layers)
    for slow, plain in zip(dilated.layers, base.layers, strict=True):
        for field in FIELDS:
            assert getattr(slow, field) == getattr(plain, field) * k, field
        assert slow.a2a_bytes_per_routed_token == plain.a2a_bytes_per_routed_token
        assert slow.kind == plain.kind
    assert dilated.step_ms() == pytest.approx(k * base.step_ms())
    assert dilated.step_ms({1: 1.5}) == pytest.approx(k * base.step_ms({1: 1.5}))
    with pytest.raises(ValueError, match="time_scale must be a finite number >= 1"):
        Emulation.of(profile, (True, True), 0.5)


def test_the_native_wait_of_a_dilated_layer_lasts_k_times_longer():
    """The dilated times reach the native wait: a layer's forward wait of 30 ms
    at k = 3 holds the step at least 90 ms (a lower bound: the host may be busy)."""
    times = LayerTimes(kind="dense", dense_fwd_ms=30.0, dense_bwd_ms=0.0)
    x = jnp.ones((4,), jnp.float32)
    for k in (1.0, 3.0):
        step = jax.jit(functools.partial(emulated_dense, times=times.dilated(k)))
        step(x).block_until_ready()  # compiled
        start = time.perf_counter()
        step(x).block_until_ready()
        assert time.perf_counter() - start >= 0.030 * k * 0.999, k


@pytest.mark.parametrize("k", [2.0, 4.0, 3.0])
def test_the_shaped_links_rate_is_divided_by_k(tmp_path, k):
    cfg = _bench(tmp_path, "--accelerator=emulated", "--link_gbps=0.154",
                 "--link_latency_ms=1.5", f"--time_scale={k}")
    link, plain = cfg.setup.link, LinkOptions(gbps=0.154, latency_ms=1.5)
    assert cfg.setup.time_scale == k
    assert link.gbps == 0.154 / k and link.latency_ms == 1.5 * k
    # The bucket holds the same bytes (the default: one frame), frames as asked.
    assert link.burst_bytes() == plain.burst_bytes() == 1514 and link.mtu == 0
    # An explicit bucket, and jumbo frames' default bucket (one 9014-byte frame).
    big = bench_config.dilated_link(LinkOptions(gbps=8.0, mtu=9000), k)
    assert big.gbps == 8.0 / k and big.burst_bytes() == 9014 and big.mtu == 9000
    given = bench_config.dilated_link(LinkOptions(gbps=0.2, burst_kb=20), k)
    assert given.burst_kb == 20 and given.gbps == 0.2 / k
    # Unshaped loopback stays unshaped; k = 1 leaves the link as asked.
    assert bench_config.dilated_link(LinkOptions(), k) == LinkOptions()
    assert bench_config.dilated_link(plain, 1.0) is plain
    assert f"time scale {k:g}" in bench.header(cfg)


def test_the_tiers_wall_clock_bounds_scale_with_k():
    def options(k, budget):
        return memory_options(store_root="/tmp/x", job="j", replicas=2, chunk_bytes=1 << 20,
                              replication_timeout_s=30.0, budget_s=budget, pec=None,
                              traffic_class="fifo", time_scale=k)
    plain, slow = options(1.0, 0.25), options(4.0, 0.25)
    assert slow.replication_timeout_s == 4 * plain.replication_timeout_s == 120.0
    assert slow.writer_timeout_s == 4 * plain.writer_timeout_s
    assert slow.max_wait_s == 4 * plain.max_wait_s == 1.0
    assert options(4.0, -1.0).max_wait_s is None  # no budget stays none


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="shaped links need root and iproute2 (ip, tc)")


def _run_point(tmp_path, k: float) -> dict:
    out = tmp_path / f"k{k:g}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "launch.bench", "--strategies=none,inmem",
         "--accelerator=emulated", "--hosts=2", "--devices_per_host=2", "--steps=6",
         "--reps=1", "--warmup=2", "--link_gbps=0.154", "--bandwidth_mib=0",
         "--link_probe_mib=4", f"--time_scale={k:g}", f"--store_root={tmp_path / 'shm'}",
         f"--workdir={tmp_path / f'w{k:g}'}", f"--json={out}"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"time scale {k:g}" in proc.stdout.splitlines()[0]  # the console's header line
    return json.loads(out.read_text())


@pytest.mark.soak  # CI: tests/test_bench.py's long-run contract runs it too
@pytest.mark.multiprocess
@needs_root
def test_a_dilated_run_keeps_the_bytes_and_halves_the_measured_link(tmp_path):
    """The same tiny shaped emulated bench at k = 1 and k = 2, compared as measured.

    R (``link_idle_share``) is the version's bytes over the link rate the
    bench measured (its link probe), over none's measured idle link time per
    step (its steady step less its all-to-all time). Its numerator is exact
    by construction (tc's rate / k, the same bytes): the measured rate halves
    within 5% (a 4 MiB probe, so that the bucket's free burst after the
    probe's fixed-time gaps weighs little), so the version's link time
    doubles. Its denominator holds the step's fixed-time work (the hosts'
    CPU work: XLA's host compute, the runtime, gloo), which does not stretch
    with k: R grows with k by that work's share of the idle time (at most k
    times, where the step is all fixed work). Measured on 2 cores beside other
    jobs: R 0.43 -> 0.50 (none's step 337 -> 597 ms), with the tests' XLA
    flags 0.29 -> 0.37 (511 -> 839 ms), and under a load average of 10 (the
    k = 1 run the more loaded) 0.21 -> 0.43 (737 -> 646 ms: the step all CPU
    work, the waits, which hold no core, hidden under it). So R is held to
    [0.95, 2.5] of k = 1's (2, and room for the load moving between the two
    runs), not to 5%: how far it moves is what the k = 1, 2, 4 points
    measure. The waits' own dilation is the unit tests' above (exact times,
    and the native wait's duration).
    """
    one, two = _run_point(tmp_path, 1.0), _run_point(tmp_path, 2.0)
    assert (one["time_scale"], two["time_scale"]) == (1.0, 2.0)
    assert two["link"]["requested_gbps"] == pytest.approx(0.154 / 2)
    rows1, rows2 = one["strategies"], two["strategies"]
    assert rows1["inmem"]["ckpt_bytes_per_step"] == rows2["inmem"]["ckpt_bytes_per_step"] > 0
    rate = one["link"]["one_way_gbps"] / two["link"]["one_way_gbps"]
    assert rate == pytest.approx(2.0, rel=0.05)
    r1, r2 = one["link_idle_share"], two["link_idle_share"]
    assert r1 and r2 and 0.95 * r1 <= r2 <= 2.5 * r1
