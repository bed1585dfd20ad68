"""Names for the project's measurement tools; may change.

The launcher's experiment scripts (``launch.experiments``) and its flags reach
a few internal names that are not part of the stable API in ``capricorn_jax``:
they are re-exported here, so that nothing outside the library imports
``capricorn_jax._src``. Design choice: one explicit module of unstable names
rather than widening the public API (whose names are a promise) or letting
tools import private modules (which ties them to the package layout).
"""

from __future__ import annotations

from capricorn_jax._src.memory import pinned
from capricorn_jax._src.memory.hooks import FaultHooks
from capricorn_jax._src.memory.packing import TRAILER_BYTES, make_plan
from capricorn_jax._src.memory.placement import send_rounds
from capricorn_jax._src.memory.store import HostStore
from capricorn_jax._src.memory.store_lifecycle import (
    committed_steps,
    mount_point,
    remove_unused,
    store_in_use,
    tree_bytes,
)
from capricorn_jax._src.memory.transport import Transport
from capricorn_jax._src.multihost.agree import allgather_floats, allgather_json
from capricorn_jax._src.multihost.client import distributed_client
from capricorn_jax._src.profiling.cache import CACHE_GRANULARITIES, CacheOptions, ProfileCache
from capricorn_jax._src.profiling.detector import METRICS as DRIFT_METRICS
from capricorn_jax._src.profiling.layer_profile import Segment
from capricorn_jax._src.profiling.policy import CAPACITY_CACHE, TRIGGERS
from capricorn_jax._src.profiling.profiler import measure_overhead
from capricorn_jax._src.scheduling import hlo_schedule, timeline, xla_flags
from capricorn_jax._src.scheduling.executor import InStepSender, scheduled_step
from capricorn_jax._src.scheduling.partitioner import (
    LinkModel,
    Window,
    partition,
    scale_windows,
    windows_from_profile,
)

__all__ = [
    "CACHE_GRANULARITIES",
    "CAPACITY_CACHE",
    "CacheOptions",
    "DRIFT_METRICS",
    "FaultHooks",
    "HostStore",
    "InStepSender",
    "LinkModel",
    "ProfileCache",
    "Segment",
    "TRAILER_BYTES",
    "TRIGGERS",
    "Transport",
    "Window",
    "allgather_floats",
    "allgather_json",
    "committed_steps",
    "distributed_client",
    "hlo_schedule",
    "make_plan",
    "measure_overhead",
    "mount_point",
    "partition",
    "pinned",
    "remove_unused",
    "scale_windows",
    "scheduled_step",
    "send_rounds",
    "store_in_use",
    "timeline",
    "tree_bytes",
    "windows_from_profile",
    "xla_flags",
]
