"""Names for the project's own tools; may change.

The launchers, the planner and the tests reach a few internal names that are
not part of the stable API in ``capricorn_jax``: they are re-exported here, by
audience, so that nothing outside the library imports ``capricorn_jax._src``:

* ``planning``: the decisions the planner and the bench replay (placement,
  retention, PEC selection, profiling policy and cache, the partitioner);
* ``store``: the RAM store's administration and the pinned copy path;
* ``testing``: fault injection (``FaultHooks``);
* ``profiling``: what the profiling driver runs inside (``LayerProfile``,
  ``DynamicityDetector``, ``make_profiled_step``, ``CollectiveProbe``,
  ``StepOutcome``);
* ``strategies``: the strategy registry (``register``, ``spec``, ``specs``,
  ``StrategySpec``, ``BuildArgs``): the launchers add the baselines there;
* ``measuring``: transports and schedules measured directly, and
  ``ChannelReplication`` (a benchmark control, not in the stable face);
* ``multihost``: small cross-host agreements, the distributed client, the job's secret.

Every name is also importable from ``capricorn_jax.experimental`` itself.
Design choice: one explicit package of unstable names rather than widening the
public API (whose names are a promise) or letting tools import private modules
(which ties them to the package layout).
"""

from __future__ import annotations

from capricorn_jax.experimental.measuring import (
    ChannelReplication,
    InStepSender,
    NativeBuildError,
    Transport,
    WindowMarks,
    build_native,
    hlo_schedule,
    scheduled_step,
    xla_flags,
)
from capricorn_jax.experimental.multihost import (
    SECRET_NAME,
    allgather_floats,
    allgather_json,
    distributed_client,
    job_address,
    start_job_secret,
)
from capricorn_jax.experimental.planning import (
    CACHE_GRANULARITIES,
    CAPACITY_CACHE,
    DEFAULT_FIRST_N,
    DRIFT_METRICS,
    PLAN_PROFILES,
    SCHEDULE_MARGIN,
    TRAILER_BYTES,
    TRIGGERS,
    CacheOptions,
    DynamicK,
    LinkModel,
    PltTracker,
    ProfileCache,
    Schedule,
    Segment,
    Window,
    average_windows,
    even_partition,
    make_plan,
    moe_durations,
    partition,
    placement_holders,
    scale_windows,
    schedule_at_risk,
    send_rounds,
    shortest_windows,
    should_profile,
    version_mask,
    version_needs,
    versions_to_keep,
    whole_versions,
    windows_from_profile,
)
from capricorn_jax.experimental.profiling import (
    CollectiveProbe,
    DynamicityDetector,
    LayerProfile,
    StepOutcome,
    make_profiled_step,
)
from capricorn_jax.experimental.store import (
    HostStore,
    committed_steps,
    mount_point,
    pinned,
    remove_unused,
    store_in_use,
    tree_bytes,
)
from capricorn_jax.experimental.strategies import (
    BuildArgs,
    StrategySpec,
    register,
    spec,
    specs,
    unregister,
)
from capricorn_jax.experimental.testing import FaultHooks

__all__ = [
    "allgather_floats",
    "allgather_json",
    "average_windows",
    "build_native",
    "BuildArgs",
    "CACHE_GRANULARITIES",
    "CacheOptions",
    "CAPACITY_CACHE",
    "ChannelReplication",
    "CollectiveProbe",
    "committed_steps",
    "DEFAULT_FIRST_N",
    "distributed_client",
    "job_address",
    "DRIFT_METRICS",
    "DynamicityDetector",
    "DynamicK",
    "even_partition",
    "FaultHooks",
    "hlo_schedule",
    "HostStore",
    "InStepSender",
    "LayerProfile",
    "LinkModel",
    "make_plan",
    "make_profiled_step",
    "moe_durations",
    "mount_point",
    "NativeBuildError",
    "partition",
    "pinned",
    "placement_holders",
    "PLAN_PROFILES",
    "PltTracker",
    "ProfileCache",
    "register",
    "remove_unused",
    "scale_windows",
    "Schedule",
    "schedule_at_risk",
    "SCHEDULE_MARGIN",
    "scheduled_step",
    "SECRET_NAME",
    "Segment",
    "send_rounds",
    "shortest_windows",
    "should_profile",
    "spec",
    "specs",
    "start_job_secret",
    "StepOutcome",
    "store_in_use",
    "StrategySpec",
    "TRAILER_BYTES",
    "Transport",
    "tree_bytes",
    "TRIGGERS",
    "unregister",
    "version_mask",
    "version_needs",
    "versions_to_keep",
    "whole_versions",
    "Window",
    "WindowMarks",
    "windows_from_profile",
    "xla_flags",
]
