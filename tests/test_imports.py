"""Every launcher module can be imported beside every other in one process.

A test (or another launcher) imports a command's module for its logic; absl
flags are process-global, so a module that defined its flags at import time
clashed with another command's flag of the same name (``--model``, ``--seed``)
depending on which tests pytest-xdist happened to put in one worker.
"""

import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _launch_modules() -> list[str]:
    """Every module of launch/, its command packages' and sub-packages' included
    (not their ``__main__``, which runs the command)."""
    return sorted(m.name for m in pkgutil.walk_packages([str(ROOT / "launch")], "launch.")
                  if not m.name.endswith("__main__"))


def test_every_launch_module_imports_beside_every_other():
    modules = _launch_modules()
    assert {"launch.train", "launch.train.config", "launch.bench.runner", "launch.chaos.config",
            "launch.experiments.emulated_sweep", "launch.cluster.netns"} <= set(modules)
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    # Both orders: a clash is reported by whichever module defines second.
    for order in (modules, modules[::-1]):
        done = subprocess.run([sys.executable, "-c", code, *order], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
