"""The decisions the planner (``launch.plan``) and the bench replay or inspect: placement,
retention, PEC selection, the profiling policy and cache, the partitioner and its windows,
and the constants the strategies plan with (the schedule margin, gemini's profiled steps).

Unstable: see ``capricorn_jax.experimental``."""

from capricorn_jax._faces import attach as _attach

# The names are in the stub beside this file (planning.pyi), imported on first use.
__getattr__, __dir__, __all__ = _attach(__name__, __file__)
