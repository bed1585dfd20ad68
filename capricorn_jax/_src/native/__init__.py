"""Native XLA FFI handlers of the library, built with the host's C++ compiler at first use.

``build(source, stem, what)`` compiles one C++ source against
``jax.ffi.include_dir()`` into a shared library kept outside the repository
(``$CAPRICORN_NATIVE_CACHE``, else ``~/.cache/capricorn_jax``), named by the
hash of the source and the jax version, written to a temporary name and
renamed into place (processes of one job never load a half-written file).

Design choice: sources shipped with the package and built where they run.
Alternative not taken: prebuilt binaries in the wheel, which would tie the
wheel to one platform and one jaxlib ABI.
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


class NativeBuildError(RuntimeError):
    """A native handler could not be built (no C++ compiler, or it failed)."""


def cache_dir() -> Path:
    """Where built libraries are kept (outside the repository)."""
    base = os.environ.get("CAPRICORN_NATIVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "capricorn_jax")
    return Path(base)


def library_path(source: Path, stem: str) -> Path:
    """The built library's path: named by the hash of the source and the jax version."""
    digest = hashlib.sha256(source.read_bytes() + jax.__version__.encode()).hexdigest()[:16]
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
        or the compile failed (its stderr in the message).
    """
    path = library_path(source, stem)
    if path.exists():
        return path
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise NativeBuildError(f"{what} needs a C++ compiler: {cxx!r} is not on PATH (install "
                               f"g++, or set CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-w",
           f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"building {what} failed ({' '.join(cmd)}):\n"
                               f"{done.stderr.strip()[-2000:]}")
    os.replace(tmp, path)
    return path


class Library:
    """A library built from ``source`` and loaded once per process, thread-safe.

    Args:
      source, stem, what: as ``build``.
      fallback: what runs instead, logged once with the build error.
      configure: called once with the loaded library (argument types, FFI
        registrations) before any caller gets it.
    """

    def __init__(self, source: Path, stem: str, what: str, fallback: str,
                 configure: Callable[[ctypes.CDLL], None]) -> None:
        self.source, self.stem, self.what, self.fallback = source, stem, what, fallback
        self.configure = configure
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._error: NativeBuildError | None = None

    def load(self) -> ctypes.CDLL:
        """The library, built if needed.

        Raises:
          NativeBuildError: it could not be built (the first error, every call).
        """
        with self._lock:
            if self._lib is not None:
                return self._lib
            if self._error is not None:
                raise self._error
            try:
                lib = ctypes.cdll.LoadLibrary(str(build(self.source, self.stem, self.what)))
            except NativeBuildError as e:
                self._error = e
                log.warning("%s: %s", self.fallback, e)
                raise
            self.configure(lib)
            self._lib = lib
            return lib

    def available(self) -> bool:
        """Whether it is loaded (building it on first call)."""
        try:
            self.load()
        except NativeBuildError:
            return False
        return True
