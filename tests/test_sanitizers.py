"""The native frame loops built under AddressSanitizer and
UndefinedBehaviorSanitizer, and the tests of what a peer can send run
against that build: the bounds tests, the fuzz targets, the native frame
tests and the stop rule's, in a child process with the ASan runtime
preloaded (``LD_PRELOAD=$(gcc -print-file-name=libasan.so)``: Python itself
is not instrumented) and ``CAPRICORN_FRAMES_LIBRARY`` naming the build. Any
sanitizer report fails the test (UBSan halts on its first; ASan exits
non-zero), and a read past an array's end is shown to be reported first,
so a build that is not instrumented cannot pass for one.

Design choice: a pytest test that builds its own library in a temporary
directory, so CI runs it with the other tests and a developer with
``pytest tests/test_sanitizers.py``. Alternative not taken: a step of its
own in ``.ci/run``, which a local run would skip. About 20-40 s on 2 cores
(the build, then the child's imports under ASan).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from capricorn_jax._src.native import compile_command, native_required
from capricorn_jax._src.native import frames as native_frames

SANITIZE = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all")
TESTS = ["tests/test_frame_bounds.py", "tests/test_frame_fuzz.py", "tests/test_native_frames.py",
         "tests/test_stop_rule.py"]
pytestmark = pytest.mark.slow  # a build and a child process: ~35 s
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "UndefinedBehaviorSanitizer")


def _runtime() -> str | None:
    """The ASan runtime's path, or None where the compiler has none."""
    try:
        done = subprocess.run([os.environ.get("CC", "gcc"), "-print-file-name=libasan.so"],
                              capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    path = done.stdout.strip()
    return path if done.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """(the sanitized library, the environment a child runs it in)."""
    runtime = _runtime()
    if runtime is None or not native_frames.available():
        if native_required():
            pytest.fail("CAPRICORN_REQUIRE_NATIVE=1 and no compiler with AddressSanitizer")
        pytest.skip("no C++ compiler with AddressSanitizer")
    out = tmp_path_factory.mktemp("asan") / "chunk_frames_asan.so"
    cmd = compile_command(native_frames._source(), str(out), SANITIZE)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    env = dict(os.environ, LD_PRELOAD=runtime, CAPRICORN_FRAMES_LIBRARY=str(out),
               CAPRICORN_REQUIRE_NATIVE="1", CAPRICORN_FUZZ_EXAMPLES="150",
               ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:"
                            "handle_segv=1:detect_odr_violation=0",
               UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
               JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1")
    return out, env


def _run(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=Path(__file__).parent.parent)


def test_the_sanitized_build_reports_a_read_past_an_array(sanitized):
    """The canary: the build is instrumented and the runtime live."""
    out, env = sanitized
    done = _run("""
        import numpy as np
        from capricorn_jax._src.native import frames
        data = np.zeros(1 << 16, np.uint8)
        frames.load().CapricornCrc32c(0, data.ctypes.data, data.size + 4096)
    """, env)
    reported = "ERROR: AddressSanitizer: heap-buffer-overflow" in done.stderr
    assert done.returncode != 0 and reported, done.stderr[-3000:]


def test_the_frame_tests_and_fuzz_targets_pass_under_asan_and_ubsan(sanitized):
    out, env = sanitized
    done = _run(f"""
        import sys, pytest
        from capricorn_jax._src.native import frames
        assert frames.load()._name == {str(out)!r}, frames.load()._name
        sys.exit(pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly",
                              "-o", "addopts=", *{TESTS!r}]))
    """, env)
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, output
    assert not any(report in done.stdout + done.stderr for report in REPORTS), output
    assert " passed" in done.stdout and "skipped" not in done.stdout.split("\n")[-2], output
