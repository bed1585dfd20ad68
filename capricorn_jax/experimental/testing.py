"""Fault injection for tests and the chaos harness (``FaultHooks``).

Unstable: see ``capricorn_jax.experimental``."""

from __future__ import annotations

from capricorn_jax._src.memory.tier.hooks import FaultHooks

__all__ = [
    "FaultHooks",
]
