"""The in-graph step compiled for a CUDA target with no GPU attached (the jax
CUDA plugin's compile-only topology, an sm_90 target): its schedule checked.
Skipped where the plugin is not installed (``pip install jax[cuda12]``). Each
compile runs in a process of its own, whose XLA flags the library sets before
JAX starts (``xla_flags.set_overlap_flags``), as a GPU run does."""

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.helpers import child_env


def _has_cuda_plugin() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


pytestmark = pytest.mark.skipif(not _has_cuda_plugin(),
                                reason="the jax CUDA plugin is not installed")

SCRIPT = """
import json, sys
from capricorn_jax.experimental import hlo_schedule as hs, xla_flags
assert xla_flags.set_overlap_flags() == []
import jax, numpy as np
from jax.experimental import topologies
from capricorn_jax._src.scheduling.in_graph import executor
from launch.gpu_bench import _scheduled, h100_target
tie = sys.argv[1] == "tie"
init = executor.InStepSender.__init__
executor.InStepSender.__init__ = lambda s, *a, **k: init(s, *a, **{**k, "tie_receptions": tie})
topo = topologies.get_topology_desc("1x2x2", platform="cuda", target_config=h100_target(),
                                    topology="1x2x2")
traced, schedule, boundaries = _scheduled(list(topo.devices), jax, np)
compiled = traced.lower(lowering_platforms=("cuda",)).compile()
checks = hs.check_windows(compiled.as_text(), hs.window_specs(schedule, boundaries),
                          hs.layer_order(boundaries))
print(json.dumps({**hs.summary(checks), "memory": hs.memory_report(compiled)}))
"""


@pytest.mark.slow  # a compile for the CUDA target
@pytest.mark.parametrize("tie", [True, False])
def test_windows_overlap_their_layers_only_with_the_reception_tie(tie):
    env = child_env(JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the library's own, as on a GPU machine
    done = subprocess.run([sys.executable, "-c", SCRIPT, "tie" if tie else "none"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["permutes"] == 12 and report["asynchronous"] == 6
    if tie:
        assert report["ok"] and report["overlapped"] == 6, report
    else:  # measured: XLA:GPU defers the windows' permutes, start and done together
        assert report["overlapped"] == 0 and not report["ok"]
    assert report["memory"]["peak_bytes"] > 0
