"""The names of ``capricorn_jax.experimental.strategies``, read by type
checkers and, on first use of a name, by ``capricorn_jax._faces`` (the docstring:
the module's ``.py``)."""

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
