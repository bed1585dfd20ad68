"""The names of ``capricorn_jax.experimental.profiling``, read by type
checkers and, on first use of a name, by ``capricorn_jax._faces`` (the docstring:
the module's ``.py``)."""

from __future__ import annotations

from capricorn_jax._src.profiling.detector import DynamicityDetector
from capricorn_jax._src.profiling.layer_profile import LayerProfile
from capricorn_jax._src.profiling.policy import StepOutcome
from capricorn_jax._src.profiling.probe import CollectiveProbe
from capricorn_jax._src.profiling.profiler import make_profiled_step

__all__ = [
    "CollectiveProbe",
    "DynamicityDetector",
    "LayerProfile",
    "StepOutcome",
    "make_profiled_step",
]
