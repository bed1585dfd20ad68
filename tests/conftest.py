"""Test setup: 4 CPU devices and the test XLA flags, forced before JAX starts."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import TEST_XLA_FLAGS  # noqa: E402

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), *TEST_XLA_FLAGS,
     "--xla_force_host_platform_device_count=4"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One JAX compilation cache for the whole session, this process and every one it
# starts (only a multi-process job's process 0 writes it, as JAX does).
# Every program, however fast it compiles (JAX caches only those over 1 s by
# default; the tiny model's at optimization level 0 take less): measured on a
# 2-host job of 8 steps, 15.2 s -> 14.3 s with the cache warm.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="capricorn-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# Property and fuzz tests: CI runs the same examples every time (a failure
# there is the code's, reproducible, not a new draw's); locally each run draws
# anew (HYPOTHESIS_PROFILE=ci to replay CI's).
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])


def pytest_collection_modifyitems(config, items):
    """The slow (multi-process) tests first, each group in its own order: two
    workers that steal work end together, instead of one running a 2-minute
    test alone at the end of the phase."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="module")
def cache():
    """The environment that points a test's jobs at the session's JAX
    compilation cache (above), which programs compiled by other modules' jobs
    and by the other test phase are in."""
    return {"JAX_COMPILATION_CACHE_DIR": os.environ["JAX_COMPILATION_CACHE_DIR"]}
