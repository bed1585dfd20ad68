"""capricorn_jax: in-memory, load-aware checkpointing for MoE training in JAX.

The public API, in five groups: what a user calls. Everything else lives under
``capricorn_jax._src`` (one subpackage per concept; docs/design.md's folder map)
and may change without notice; names that the project's own measurement tools
need are in ``capricorn_jax.experimental``, with no stability promise.
"""

from capricorn_jax._faces import attach as _attach

# The names are in the stub beside this file (__init__.pyi), imported on first use.
__getattr__, __dir__, __all__ = _attach(__name__, __file__)
