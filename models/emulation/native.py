"""The emulated accelerator's wait: a native XLA FFI call that holds no core and no GIL.

``wait(x, ms)`` returns ``x`` after ``ms`` milliseconds (a float32 scalar
computed inside the jitted step), as a custom call that XLA orders by its data
dependency on ``x``; ``compute(x, fwd_ms, bwd_ms)`` is the same with a backward
pass that waits ``bwd_ms`` on the cotangent, so a layer's forward and backward
compute both become waits in their places.

Design choice: a C++ handler (``wait.cc``) built with g++ at first use and
registered through ``jax.ffi``. Alternative not taken: a Python host callback
that sleeps (``io_callback``): it needs the GIL to start and to return, so
beside the checkpoint's Python threads (sender, writers) it measures GIL
contention, which an accelerator host does not have (measured by
``python -m launch.experiments.emulation_probe``; BUILD_NOTES). The library is
built once per source version into a cache directory outside the repository
(``$CAPRICORN_NATIVE_CACHE``, else ``~/.cache/capricorn_jax``), named by the
source's hash, written to a temporary name and renamed into place, so
concurrent processes of one job never load a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp

TARGET = "capricorn_emulated_wait"
_SOURCE = Path(__file__).with_name("wait.cc")
_LOCK = threading.Lock()
_REGISTERED = False


class NativeBuildError(RuntimeError):
    """The native wait could not be built (no C++ compiler, or it failed)."""


def cache_dir() -> Path:
    """Where built libraries are kept (outside the repository)."""
    base = os.environ.get("CAPRICORN_NATIVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "capricorn_jax")
    return Path(base)


def library_path() -> Path:
    """The built library's path: named by the hash of the source and the jaxlib version."""
    digest = hashlib.sha256(_SOURCE.read_bytes() + jax.__version__.encode()).hexdigest()[:16]
    return cache_dir() / f"emulated_wait_{digest}.so"


def build() -> Path:
    """Builds the library if it is not in the cache; returns its path.

    Raises:
      NativeBuildError: no ``g++`` on PATH (``$CXX`` names another compiler), or
        the compile failed (its stderr in the message).
    """
    path = library_path()
    if path.exists():
        return path
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise NativeBuildError(
            f"the emulated accelerator needs a C++ compiler to build its native wait: "
            f"{cxx!r} is not on PATH (install g++, or set CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-w",
           f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"building the native wait failed ({' '.join(cmd)}):\n"
                               f"{done.stderr.strip()[-2000:]}")
    os.replace(tmp, path)
    return path


def register() -> None:
    """Builds (if needed), loads and registers the wait with XLA, once per process."""
    global _REGISTERED
    with _LOCK:
        if _REGISTERED:
            return
        lib = ctypes.cdll.LoadLibrary(str(build()))
        jax.ffi.register_ffi_target(
            TARGET, jax.ffi.pycapsule(lib.CapricornEmulatedWait), platform="cpu")
        _REGISTERED = True


def wait(x: jax.Array, ms: jax.Array) -> jax.Array:
    """``x`` after ``ms`` milliseconds of a wait that holds no core (float32 scalar)."""
    register()
    ms = jnp.asarray(ms, jnp.float32).reshape(())
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype),
                            input_output_aliases={0: 0}, has_side_effect=False)
    out = call(x, ms)
    # Inside shard_map a custom call's result carries no manual axis type: give
    # it back the axes ``x`` varies over (a type-only cast, no collective).
    varying = tuple(sorted(jax.typeof(x).manual_axis_type.varying
                           - jax.typeof(out).manual_axis_type.varying))
    return jax.lax.pcast(out, varying, to="varying") if varying else out


@jax.custom_vjp
def compute(x: jax.Array, fwd_ms: jax.Array, bwd_ms: jax.Array) -> jax.Array:
    """A layer's emulated compute: ``x`` after ``fwd_ms``; its backward waits ``bwd_ms``."""
    return wait(x, fwd_ms)


def _compute_fwd(x, fwd_ms, bwd_ms):
    return wait(x, fwd_ms), (fwd_ms, bwd_ms)


def _compute_bwd(res, g):
    fwd_ms, bwd_ms = res
    return wait(g, bwd_ms), jnp.zeros_like(fwd_ms), jnp.zeros_like(bwd_ms)


compute.defvjp(_compute_fwd, _compute_bwd)

__all__ = ["NativeBuildError", "build", "compute", "register", "wait"]
