"""What the profiling driver runs inside: the layer profile, the dynamicity
detector, the instrumented step, the all-to-all probe and a step's outcome.

A training loop drives ``capricorn_jax.ProfilingDriver`` and never builds
these; the planner, the bench and the tests do. (0.19 had them in the stable
API; CHANGELOG 0.20.0 says why they moved.)

Unstable: see ``capricorn_jax.experimental``."""

from capricorn_jax._faces import attach as _attach

# The names are in the stub beside this file (profiling.pyi), imported on first use.
__getattr__, __dir__, __all__ = _attach(__name__, __file__)
