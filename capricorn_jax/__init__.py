"""capricorn_jax: in-memory, load-aware checkpointing for MoE training in JAX.

The public API. Everything else lives under ``capricorn_jax._src`` and may
change without notice.
"""

from capricorn_jax._src.boundary import BoundaryHook, active_hooks, boundary_hooks, layer_boundary
from capricorn_jax._src.inmemory import InMemoryCheckpointer, SaveReport
from capricorn_jax._src.options import InMemoryOptions
from capricorn_jax._src.placement import holders as replica_holders
from capricorn_jax._src.recovery import Recovered, recover
from capricorn_jax._src.store import ChecksumError, HostStore

__all__ = [
    "BoundaryHook",
    "ChecksumError",
    "HostStore",
    "InMemoryCheckpointer",
    "InMemoryOptions",
    "Recovered",
    "SaveReport",
    "active_hooks",
    "boundary_hooks",
    "layer_boundary",
    "recover",
    "replica_holders",
]
