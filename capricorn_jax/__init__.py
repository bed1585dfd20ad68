"""capricorn_jax: in-memory, load-aware checkpointing for MoE training in JAX.

The public API. Everything else lives under ``capricorn_jax._src`` and may
change without notice.
"""

from capricorn_jax._src.profiling.boundary import (
    BoundaryHook,
    active_hooks,
    boundary_hooks,
    collective_boundary,
    layer_boundary,
)
from capricorn_jax._src.profiling.detector import (
    CostModel,
    Decision,
    DetectorOptions,
    DynamicityDetector,
    FirstNProfiler,
    IterationProfile,
    ProfilePolicy,
    drift_score,
    should_profile,
)
from capricorn_jax._src.memory.checkpointer import InMemoryCheckpointer, SaveReport
from capricorn_jax._src.memory.options import InMemoryOptions
from capricorn_jax._src.persistent.orbax_handler import (
    CapricornHandler,
    CapricornRestore,
    CapricornSave,
    CheckpointManager,
    RestoreInfo,
)
from capricorn_jax._src.partial.pec import DynamicK, PecOptions, PltTracker, pec_bytes, state_bytes
from capricorn_jax._src.memory.placement import holders as replica_holders
from capricorn_jax._src.profiling.profiler import (
    CollectiveProbe,
    LayerProfile,
    ProfiledStep,
    Segment,
    gpt_moe_all_to_alls,
    make_profiled_step,
    measure_overhead,
)
from capricorn_jax._src.memory.recovery import PecRestore, Recovered, recover
from capricorn_jax._src.memory.store import ChecksumError, HostStore

__all__ = [
    "BoundaryHook",
    "ChecksumError",
    "HostStore",
    "InMemoryCheckpointer",
    "InMemoryOptions",
    "CapricornHandler",
    "CapricornRestore",
    "CapricornSave",
    "CheckpointManager",
    "RestoreInfo",
    "DynamicK",
    "PecOptions",
    "PecRestore",
    "PltTracker",
    "pec_bytes",
    "state_bytes",
    "Recovered",
    "SaveReport",
    "recover",
    "replica_holders",
    "CostModel",
    "Decision",
    "DetectorOptions",
    "DynamicityDetector",
    "FirstNProfiler",
    "IterationProfile",
    "LayerProfile",
    "CollectiveProbe",
    "ProfilePolicy",
    "ProfiledStep",
    "Segment",
    "active_hooks",
    "boundary_hooks",
    "collective_boundary",
    "drift_score",
    "gpt_moe_all_to_alls",
    "layer_boundary",
    "make_profiled_step",
    "measure_overhead",
    "should_profile",
]
