"""The in-graph step compiled for a CUDA target with no GPU attached (the jax
CUDA plugin's compile-only topology, an sm_90 target): its schedule checked.
Skipped where the plugin is not installed (``pip install jax[cuda12]``) or
XLA_FLAGS lack the overlap flags (they must be set before JAX starts)."""

import importlib.util
import os

import jax
import numpy as np
import pytest

from capricorn_jax._src.scheduling import hlo_schedule as hs
from capricorn_jax._src.scheduling.xla_flags import OVERLAP_FLAGS, parse_xla_flags
from launch.gpu_bench import _scheduled, h100_target


def _has_cuda_plugin() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


pytestmark = pytest.mark.skipif(not _has_cuda_plugin(),
                                reason="the jax CUDA plugin is not installed")


@pytest.fixture(scope="module")
def devices():
    flags = parse_xla_flags(os.environ.get("XLA_FLAGS", ""))
    if any(flags.get(k) != v for k, v in OVERLAP_FLAGS.items()):
        pytest.skip("XLA_FLAGS lack the overlap flags (set before JAX starts)")
    from jax.experimental import topologies

    topo = topologies.get_topology_desc("1x2x2", platform="cuda", target_config=h100_target(),
                                        topology="1x2x2")
    return list(topo.devices)


@pytest.mark.slow  # two compiles for the CUDA target
@pytest.mark.parametrize("tie", [True, False])
def test_windows_overlap_their_layers_only_with_the_reception_tie(devices, tie, monkeypatch):
    from capricorn_jax._src.scheduling import executor

    init = executor.InStepSender.__init__
    monkeypatch.setattr(executor.InStepSender, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "tie_receptions": tie}))
    traced, schedule, boundaries = _scheduled(devices, jax, np)
    compiled = traced.lower(lowering_platforms=("cuda",)).compile()
    checks = hs.check_windows(compiled.as_text(), hs.window_specs(schedule, boundaries),
                              hs.layer_order(boundaries))
    report = hs.summary(checks)
    assert report["permutes"] == 12 and report["asynchronous"] == 6
    if tie:
        assert report["ok"] and report["overlapped"] == 6, report
    else:  # measured: XLA:GPU defers the windows' permutes, start and done together
        assert report["overlapped"] == 0 and not report["ok"]
    assert hs.memory_report(compiled)["peak_bytes"] > 0
