"""Native XLA FFI handlers of the library, built with the host's C++ compiler at first use.

``build(source, stem, what)`` compiles one C++ source against
``jax.ffi.include_dir()`` into a shared library kept outside the repository
(``$CAPRICORN_NATIVE_CACHE``, else ``~/.cache/capricorn_jax``), named by the
hash of the source and the jax version, written to a temporary name and
renamed into place (processes of one job never load a half-written file).

Design choice: sources shipped with the package and built where they run.
Alternative not taken: prebuilt binaries in the wheel, which would tie the
wheel to one platform and one jaxlib ABI.

The build has warnings on and as errors (``CXX_FLAGS``; the jax FFI headers are
system headers, their warnings not ours). Every failure to build or load a
library (no compiler, a compile that fails or runs past
``BUILD_TIMEOUT_S``, a cache that cannot be written, a library that will
not load or lacks a symbol) is a ``NativeBuildError``: the caller's Python
path runs instead, and the log says once which one runs.
``CAPRICORN_REQUIRE_NATIVE=1`` makes such a failure a
``NativeRequiredError`` instead (CI sets it, so the tests run the loops
production runs). Alternative not taken: catching only a missing compiler,
which let a read-only cache or a broken library crash the caller. The cost
of -Werror: a compiler that warns where the tested ones do not falls back
to Python (said in the log), rather than running code nobody read the
warning of.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax

log = logging.getLogger(__name__)

PERF_MINUS_MONOTONIC = time.perf_counter() - time.monotonic_ns() / 1e9
"""``time.perf_counter()`` less the native code's clock (``CLOCK_MONOTONIC``,
``time.monotonic_ns``) in seconds, taken once: what turns a native stamp
into the perf_counter seconds the Python side keeps (one clock on Linux,
so ~0; kept apart anyway, and one value for every conversion)."""


CXX_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17", "-Wall", "-Wextra", "-Werror")
"""The compiler's flags for every native library (the include path apart)."""
BUILD_TIMEOUT_S = 300.0
"""The most one compile may take; past it the build failed."""
REQUIRE_ENV = "CAPRICORN_REQUIRE_NATIVE"
"""Set to 1: a native library that cannot be built or loaded is an error."""


class NativeBuildError(RuntimeError):
    """A native handler could not be built or loaded (no C++ compiler, a
    failed or overlong compile, an unwritable cache, a library that will not
    load)."""


class NativeRequiredError(RuntimeError):
    """A native library failed where ``CAPRICORN_REQUIRE_NATIVE=1`` asks for it."""


def native_required() -> bool:
    """Whether ``CAPRICORN_REQUIRE_NATIVE`` asks for the native loops."""
    return os.environ.get(REQUIRE_ENV, "").strip() not in ("", "0")


def compile_command(source: Path, output: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The compile of ``source`` into ``output`` (``CXX_FLAGS``, then ``extra``)."""
    return [os.environ.get("CXX", "g++"), *CXX_FLAGS, *extra, "-isystem", jax.ffi.include_dir(),
            str(source), "-o", output]


def cache_dir() -> Path:
    """Where built libraries are kept (outside the repository)."""
    base = os.environ.get("CAPRICORN_NATIVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "capricorn_jax")
    return Path(base)


def library_path(source: Path, stem: str) -> Path:
    """The built library's path: named by the hash of the source and the jax version."""
    digest = hashlib.sha256(source.read_bytes() + jax.__version__.encode()
                            + " ".join(CXX_FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / f"{stem}_{digest}.so"


def build(source: Path, stem: str, what: str) -> Path:
    """Builds ``source`` unless its library is in the cache; returns the path.

    Args:
      source: the C++ file.
      stem: the library's name before its hash.
      what: what the library is for, named by the errors (e.g. "the emulated
        accelerator's native wait").

    Raises:
      NativeBuildError: no ``g++`` on PATH (``$CXX`` names another compiler),
        the compile failed (its stderr in the message) or ran past
        ``BUILD_TIMEOUT_S``, or the cache could not be written.
    """
    try:
        path = library_path(source, stem)
        if path.exists():
            return path
        cxx = os.environ.get("CXX", "g++")
        if shutil.which(cxx) is None:
            raise NativeBuildError(f"{what} needs a C++ compiler: {cxx!r} is not on PATH "
                                   f"(install g++, or set CXX)")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
    except OSError as e:
        raise NativeBuildError(f"building {what}: the build cache {cache_dir()} cannot be "
                               f"used ({type(e).__name__}: {e})") from e
    cmd = compile_command(source, tmp)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise NativeBuildError(f"building {what} failed ({' '.join(cmd)}):\n"
                                   f"{done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    except subprocess.TimeoutExpired as e:
        raise NativeBuildError(f"building {what} ran past {BUILD_TIMEOUT_S:g}s") from e
    except OSError as e:
        raise NativeBuildError(f"building {what} failed ({type(e).__name__}: {e})") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


class Library:
    """A library built from ``source`` and loaded once per process, thread-safe.

    Args:
      source, stem, what: as ``build``; ``source`` may be a callable that
        gives the path (called at the first load, its failures the build's).
      fallback: what runs instead, logged once with the build error.
      configure: called once with the loaded library (argument types, FFI
        registrations) before any caller gets it.
      override_env: an environment variable that, set, names a library to
        load instead of building one (the sanitizer build of the tests).
    """

    def __init__(self, source: Path | Callable[[], Path], stem: str, what: str, fallback: str,
                 configure: Callable[[ctypes.CDLL], None],
                 override_env: str | None = None) -> None:
        self.source, self.stem, self.what, self.fallback = source, stem, what, fallback
        self.configure, self.override_env = configure, override_env
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._error: NativeBuildError | None = None

    def load(self) -> ctypes.CDLL:
        """The library, built if needed.

        Raises:
          NativeBuildError: it could not be built or loaded (the first error,
            every call).
          NativeRequiredError: the same, with ``CAPRICORN_REQUIRE_NATIVE=1``.
        """
        with self._lock:
            if self._lib is None and self._error is None:
                try:
                    self._lib = self._open()
                    log.info("%s: native (%s)", self.what, self._lib._name)
                except Exception as e:  # noqa: BLE001 - every failure: the Python path runs
                    error = e if isinstance(e, NativeBuildError) else NativeBuildError(
                        f"{self.what} could not be loaded ({type(e).__name__}: {e})")
                    self._error = error
                    if not native_required():
                        log.warning("%s: %s", self.fallback, error)
            if self._lib is not None:
                return self._lib
            assert self._error is not None
            if native_required():
                raise NativeRequiredError(f"{self.what}: {REQUIRE_ENV}=1 and the native library "
                                          f"failed: {self._error}") from self._error
            raise self._error

    def _open(self) -> ctypes.CDLL:
        override = os.environ.get(self.override_env) if self.override_env else None
        if override:
            path = Path(override)
        else:
            source = self.source if isinstance(self.source, Path) else self.source()
            path = build(source, self.stem, self.what)
        try:
            lib = ctypes.cdll.LoadLibrary(str(path))
        except OSError as e:
            raise NativeBuildError(f"{self.what}: {path} will not load ({e})") from e
        self.configure(lib)
        return lib

    def available(self) -> bool:
        """Whether it is loaded (building it on first call); with
        ``CAPRICORN_REQUIRE_NATIVE=1`` a failure raises instead."""
        try:
            self.load()
        except NativeBuildError:
            return False
        return True
