"""The strategy registry, for tools that add a strategy (``register``) or
read every strategy's traits (``specs``).

Unstable: see ``capricorn_jax.experimental``."""

from __future__ import annotations

from capricorn_jax._src.strategies.registry import (
    PLANNERS,
    BuildArgs,
    StrategySpec,
    build,
    register,
    spec,
    specs,
    unregister,
)

__all__ = [
    "BuildArgs",
    "PLANNERS",
    "StrategySpec",
    "build",
    "register",
    "spec",
    "specs",
    "unregister",
]
