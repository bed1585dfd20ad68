"""Small cross-host agreements and the distributed client the launchers use.

Unstable: see ``capricorn_jax.experimental``."""

from __future__ import annotations

from capricorn_jax._src.multihost.agree import allgather_floats, allgather_json
from capricorn_jax._src.multihost.client import distributed_client

__all__ = [
    "allgather_floats",
    "allgather_json",
    "distributed_client",
]
