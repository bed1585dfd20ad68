"""The emulated accelerator's wait: a native XLA FFI call that holds no core and no GIL.

``wait(x, ms)`` returns ``x`` after ``ms`` milliseconds (a float32 scalar
computed inside the jitted step), as a custom call that XLA orders by its data
dependency on ``x``; ``compute(x, fwd_ms, bwd_ms)`` is the same with a backward
pass that waits ``bwd_ms`` on the cotangent, so a layer's forward and backward
compute both become waits in their places.

Design choice: a C++ handler (``wait.cc``) built with g++ at first use and
registered through ``jax.ffi`` (the library's builder, shared with its
native window marks). Alternative not taken: a Python host callback
that sleeps (``io_callback``): it needs the GIL to start and to return, so
beside the checkpoint's Python threads (sender, writers) it measures GIL
contention, which an accelerator host does not have (measured by
``launch.experiments.emulation_probe`` at tag experiments-2026-12-05; BUILD_NOTES). The library is
built once per source version into a cache directory outside the repository
(``$CAPRICORN_NATIVE_CACHE``, else ``~/.cache/capricorn_jax``).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import jax
import jax.numpy as jnp

from capricorn_jax.experimental import NativeBuildError, build_native

TARGET = "capricorn_emulated_wait"
_SOURCE = Path(__file__).with_name("wait.cc")
_LOCK = threading.Lock()
_REGISTERED = False


def build() -> Path:
    """Builds the library if it is not in the cache (the library's native
    builder, ``capricorn_jax.experimental.build_native``); returns its path.

    Raises:
      NativeBuildError: no ``g++`` on PATH (``$CXX`` names another compiler), or
        the compile failed (its stderr in the message).
    """
    return build_native(_SOURCE, "emulated_wait", "the emulated accelerator's native wait")


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
