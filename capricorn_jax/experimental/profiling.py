"""What the profiling driver runs inside: the layer profile, the dynamicity
detector, the instrumented step, the all-to-all probe and a step's outcome.

A training loop drives ``capricorn_jax.ProfilingDriver`` and never builds
these; the planner, the bench and the tests do. (0.19 had them in the stable
API; CHANGELOG 0.20.0 says why they moved.)

Unstable: see ``capricorn_jax.experimental``."""

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
