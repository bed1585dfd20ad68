"""Names for the project's measurement tools; may change.

The launcher's experiment scripts (``launch.experiments``) and its flags reach
a few internal names that are not part of the stable API in ``capricorn_jax``:
they are re-exported here, so that nothing outside the library imports
``capricorn_jax._src``. Design choice: one explicit module of unstable names
rather than widening the public API (whose names are a promise) or letting
tools import private modules (which ties them to the package layout).
"""

from __future__ import annotations

from typing import Any

from capricorn_jax._src.memory import pinned
from capricorn_jax._src.memory.store import HostStore
from capricorn_jax._src.multihost.agree import allgather_floats, allgather_json
from capricorn_jax._src.profiling.cache import CACHE_GRANULARITIES, CacheOptions, ProfileCache
from capricorn_jax._src.profiling.detector import METRICS as DRIFT_METRICS
from capricorn_jax._src.profiling.policy import CAPACITY_CACHE, TRIGGERS
from capricorn_jax._src.profiling.profiler import measure_overhead
from capricorn_jax._src.scheduling import hlo_schedule, timeline, xla_flags


def distributed_client() -> Any:
    """The jax.distributed key-value client of this process (None before
    ``jax.distributed.initialize``). JAX keeps it private; measurement tools
    use it to coordinate their processes outside any collective."""
    from jax._src import distributed

    return distributed.global_state.client


__all__ = [
    "CACHE_GRANULARITIES",
    "CAPACITY_CACHE",
    "CacheOptions",
    "DRIFT_METRICS",
    "TRIGGERS",
    "HostStore",
    "ProfileCache",
    "allgather_floats",
    "allgather_json",
    "distributed_client",
    "hlo_schedule",
    "measure_overhead",
    "pinned",
    "timeline",
    "xla_flags",
]
