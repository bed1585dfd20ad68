"""The names of ``capricorn_jax.experimental.planning``, read by type
checkers and, on first use of a name, by ``capricorn_jax._faces`` (the docstring:
the module's ``.py``)."""

from __future__ import annotations

from capricorn_jax._src.memory.tier.retention import versions_to_keep, whole_versions
from capricorn_jax._src.memory.wire.packing import TRAILER_BYTES, make_plan
from capricorn_jax._src.memory.wire.placement import holders as placement_holders
from capricorn_jax._src.memory.wire.placement import send_rounds
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
from capricorn_jax._src.scheduling.plan.partition_search import SCHEDULE_MARGIN, even_partition
from capricorn_jax._src.scheduling.plan.partitioner import (
    LinkModel,
    Schedule,
    Window,
    partition,
    scale_windows,
    windows_from_profile,
)
from capricorn_jax._src.scheduling.plan.policies import (
    average_windows,
    schedule_at_risk,
    shortest_windows,
)
from capricorn_jax._src.strategies.planners import PLAN_PROFILES

__all__ = [
    "average_windows",
    "CACHE_GRANULARITIES",
    "CacheOptions",
    "CAPACITY_CACHE",
    "DEFAULT_FIRST_N",
    "DRIFT_METRICS",
    "DynamicK",
    "even_partition",
    "LinkModel",
    "make_plan",
    "moe_durations",
    "partition",
    "placement_holders",
    "PLAN_PROFILES",
    "PltTracker",
    "ProfileCache",
    "scale_windows",
    "Schedule",
    "SCHEDULE_MARGIN",
    "schedule_at_risk",
    "Segment",
    "send_rounds",
    "shortest_windows",
    "should_profile",
    "TRAILER_BYTES",
    "TRIGGERS",
    "version_mask",
    "version_needs",
    "versions_to_keep",
    "whole_versions",
    "Window",
    "windows_from_profile",
]
