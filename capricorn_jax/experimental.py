"""Names for the project's measurement tools; may change.

``ChannelReplication`` (a benchmark control: the memory tier's replica over
the chunk channel after the step) is here, not in the stable face.

The launcher's experiment scripts (``launch.experiments``) and its flags reach
a few internal names that are not part of the stable API in ``capricorn_jax``:
they are re-exported here, so that nothing outside the library imports
``capricorn_jax._src``. Design choice: one explicit module of unstable names
rather than widening the public API (whose names are a promise) or letting
tools import private modules (which ties them to the package layout).
"""

from __future__ import annotations

# The planner (``launch.plan``) replays the library's own decisions over a
# simulated cluster (placement, retention, PEC selection, profiling policy,
# partitioner): those names are here too.
from capricorn_jax._src.memory import pinned
from capricorn_jax._src.memory.hooks import FaultHooks
from capricorn_jax._src.memory.packing import TRAILER_BYTES, make_plan
from capricorn_jax._src.memory.placement import holders as placement_holders
from capricorn_jax._src.memory.placement import send_rounds
from capricorn_jax._src.memory.retention import versions_to_keep, whole_versions
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
from capricorn_jax._src.native import NativeBuildError
from capricorn_jax._src.native import build as build_native
from capricorn_jax._src.partial.plans import version_needs
from capricorn_jax._src.partial.selection import DynamicK, version_mask
from capricorn_jax._src.partial.tracker import PltTracker
from capricorn_jax._src.profiling.cache import CACHE_GRANULARITIES, CacheOptions, ProfileCache
from capricorn_jax._src.profiling.detector import METRICS as DRIFT_METRICS
from capricorn_jax._src.profiling.layer_profile import Segment, moe_durations
from capricorn_jax._src.profiling.policy import (
    CAPACITY_CACHE,
    TRIGGERS,
    should_profile,
)
from capricorn_jax._src.profiling.profiler import mark as profile_mark
from capricorn_jax._src.profiling.profiler import measure_overhead
from capricorn_jax._src.scheduling import hlo_schedule, timeline, xla_flags
from capricorn_jax._src.scheduling.executor import InStepSender, scheduled_step
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
from capricorn_jax._src.scheduling.window_marks import WindowMarks
from capricorn_jax._src.strategies.channel_replication import ChannelReplication
from capricorn_jax._src.strategies.scheduled import PLAN_PROFILES

__all__ = [
    "allgather_floats",
    "allgather_json",
    "average_windows",
    "build_native",
    "CACHE_GRANULARITIES",
    "CacheOptions",
    "CAPACITY_CACHE",
    "ChannelReplication",
    "committed_steps",
    "distributed_client",
    "DRIFT_METRICS",
    "DynamicK",
    "FaultHooks",
    "hlo_schedule",
    "HostStore",
    "InStepSender",
    "LinkModel",
    "make_plan",
    "measure_overhead",
    "moe_durations",
    "NativeBuildError",
    "mount_point",
    "partition",
    "pinned",
    "placement_holders",
    "PLAN_PROFILES",
    "PltTracker",
    "profile_mark",
    "ProfileCache",
    "remove_unused",
    "scale_windows",
    "Schedule",
    "schedule_at_risk",
    "scheduled_step",
    "Segment",
    "send_rounds",
    "shortest_windows",
    "should_profile",
    "store_in_use",
    "timeline",
    "TRAILER_BYTES",
    "Transport",
    "tree_bytes",
    "TRIGGERS",
    "version_mask",
    "version_needs",
    "versions_to_keep",
    "whole_versions",
    "Window",
    "WindowMarks",
    "windows_from_profile",
    "xla_flags",
]
