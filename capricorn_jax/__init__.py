"""capricorn_jax: in-memory, load-aware checkpointing for MoE training in JAX.

The public API. Everything else lives under ``capricorn_jax._src`` and may
change without notice.
"""

from capricorn_jax._src.boundary import BoundaryHook, active_hooks, boundary_hooks, layer_boundary

__all__ = [
    "BoundaryHook",
    "active_hooks",
    "boundary_hooks",
    "layer_boundary",
]
