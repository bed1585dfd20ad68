"""The layer-boundary hook: the one call a model makes for capricorn_jax.

A model calls ``layer_boundary(x, name)`` on the activation that flows from one
layer into the next. With no hook attached it returns ``x`` unchanged and adds
nothing to the compiled program. The profiler (per-layer host callbacks) and the
transfer executor (checkpoint chunks sent at a boundary) attach hooks here.

Design choice: hooks are attached at *trace time* through a context manager,
not stored on the model. A jitted function whose body enters
``boundary_hooks(...)`` compiles an instrumented variant; the same model jitted
without it compiles the plain variant, and ``jax.jit`` caches each one. The
alternative, a flag threaded through every module's ``__call__``, would make
every model change its signature; a global switch flipped between calls would
silently reuse whichever variant was traced first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

BoundaryHook = Callable[[Any, str], Any]
"""A hook receives the boundary's activation (a pytree of arrays) and its name,
and returns an activation of the same structure, shapes and dtypes."""

_local = threading.local()


def _stack() -> list[BoundaryHook]:
    if not hasattr(_local, "hooks"):
        _local.hooks = []
    return _local.hooks


def layer_boundary(x: Any, name: str) -> Any:
    """Marks the boundary after layer ``name``; applies the attached hooks.

    Args:
      x: the activation leaving the layer (an array or pytree of arrays).
      name: a stable name for the boundary, unique within one model.

    Returns:
      ``x`` itself when no hook is attached, else what the hooks return, in the
      order they were attached.
    """
    for hook in tuple(_stack()):
        x = hook(x, name)
    return x


@contextlib.contextmanager
def boundary_hooks(*hooks: BoundaryHook) -> Iterator[None]:
    """Attaches ``hooks`` to every ``layer_boundary`` traced inside the block."""
    stack = _stack()
    depth = len(stack)
    stack.extend(hooks)
    try:
        yield
    finally:
        del stack[depth:]


def collective_boundary(x: Any, name: str, phase: str, axes: tuple[str, ...]) -> Any:
    """Marks an edge of a collective phase inside a ``shard_map`` body.

    A model calls it on the buffer entering a collective (``phase`` e.g.
    "dispatch.begin") and on the one leaving it ("dispatch.end"). Hooks that
    have a ``collective(x, name, phase, axes)`` method see it (the
    interference probe: per-device timestamps around the MoE all-to-alls);
    plain boundary hooks do not. With no such hook it returns ``x`` unchanged.

    Args:
      x: the per-device buffer (an array or pytree of arrays).
      name: the layer's stable name.
      phase: "<collective>.begin" or "<collective>.end".
      axes: the ``shard_map``'s mesh axes (for the device index).
    """
    for hook in tuple(_stack()):
        collective = getattr(hook, "collective", None)
        if collective is not None:
            x = collective(x, name, phase, axes)
    return x


def active_hooks() -> tuple[BoundaryHook, ...]:
    """The hooks attached in this thread, outermost first."""
    return tuple(_stack())
