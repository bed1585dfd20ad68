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
    names = []
    for package, path in (("launch", ROOT / "launch"),
                          ("launch.experiments", ROOT / "launch" / "experiments")):
        names += [f"{package}.{m.name}" for m in pkgutil.iter_modules([str(path)])
                  if m.name != "experiments"]
    return sorted(names)


def test_every_launch_module_imports_beside_every_other():
    modules = _launch_modules()
    assert "launch.train" in modules and "launch.experiments.emulated_sweep" in modules
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    # Both orders: a clash is reported by whichever module defines second.
    for order in (modules, modules[::-1]):
        done = subprocess.run([sys.executable, "-c", code, *order], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
