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

# The planner (``launch.plan``) also replays the library's decisions over a
# simulated cluster: placement, retention, PEC selection, profiling policy,
# partitioner (the names after ``timeline`` in ``__all__``).
from capricorn_jax._src.memory.placement import holders as placement_holders
from capricorn_jax._src.memory.retention import versions_to_keep, whole_versions
from capricorn_jax._src.memory.store import HostStore
from capricorn_jax._src.multihost.agree import allgather_floats, allgather_json
from capricorn_jax._src.partial.plans import version_needs
from capricorn_jax._src.partial.selection import DynamicK, version_mask
from capricorn_jax._src.partial.tracker import PltTracker
from capricorn_jax._src.profiling.cache import CACHE_GRANULARITIES, CacheOptions, ProfileCache
from capricorn_jax._src.profiling.detector import METRICS as DRIFT_METRICS
from capricorn_jax._src.profiling.layer_profile import Segment, moe_durations
from capricorn_jax._src.profiling.policy import (
    CAPACITY_CACHE,
    DEFAULT_FIRST_N,
    TRIGGERS,
    should_profile,
)
from capricorn_jax._src.profiling.profiler import measure_overhead
from capricorn_jax._src.scheduling import hlo_schedule, timeline, xla_flags
from capricorn_jax._src.scheduling.partitioner import (
    LinkModel,
    Schedule,
    Window,
    partition,
    scale_windows,
    windows_from_profile,
)
from capricorn_jax._src.scheduling.transfers import (
    average_windows,
    schedule_at_risk,
    shortest_windows,
)
from capricorn_jax._src.strategies.scheduled import PLAN_PROFILES


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
    # the planner's
    "DEFAULT_FIRST_N",
    "DynamicK",
    "LinkModel",
    "PLAN_PROFILES",
    "PltTracker",
    "Schedule",
    "Segment",
    "Window",
    "average_windows",
    "moe_durations",
    "partition",
    "placement_holders",
    "scale_windows",
    "schedule_at_risk",
    "shortest_windows",
    "should_profile",
    "version_mask",
    "version_needs",
    "versions_to_keep",
    "whole_versions",
    "windows_from_profile",
]
