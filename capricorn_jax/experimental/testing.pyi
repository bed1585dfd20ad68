"""The names of ``capricorn_jax.experimental.testing``, read by type
checkers and, on first use of a name, by ``capricorn_jax._faces`` (the docstring:
the module's ``.py``)."""

from __future__ import annotations

from capricorn_jax._src.memory.tier.hooks import FaultHooks

__all__ = [
    "FaultHooks",
]
