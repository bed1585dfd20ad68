"""The names of ``capricorn_jax``, read by type
checkers and, on first use of a name, by ``capricorn_jax._faces`` (the docstring:
the module's ``.py``)."""

# ruff: noqa: I001 - the imports are grouped by concept, in the order of __all__.

# The model's one change: mark layer boundaries (profiling and the in-step
# transfers attach there); all-to-alls may be marked for the collective probe.
from capricorn_jax._src.profiling.boundary import (
    BoundaryHook,
    boundary_hooks,
    collective_boundary,
    layer_boundary,
)

# The memory tier: a version every step in host RAM and on m-1 peers.
from capricorn_jax._src.memory.tier.checkpointer import InMemoryCheckpointer
from capricorn_jax._src.memory.tier.options import LOW_PRIORITY_TOS, InMemoryOptions
from capricorn_jax._src.memory.tier.recovery import recover
from capricorn_jax._src.memory.tier.restore_info import RestoreInfo
from capricorn_jax._src.memory.tier.reports import SaveReport
from capricorn_jax._src.memory.tier.sizing import HostMemoryTooSmall, MemoryNeeds, memory_needs
from capricorn_jax._src.memory.store.store import ChecksumError
from capricorn_jax._src.partial.selection import PecOptions

# The persistent tier through Orbax: a handler, its args, a manager over both tiers.
from capricorn_jax._src.persistent.handler import CapricornHandler, CapricornRestore, CapricornSave
from capricorn_jax._src.persistent.manager import CheckpointManager, NoCheckpoint
from capricorn_jax._src.persistent.emergency_options import (
    LocalCheckpointOptions,
    PersistentCheckpointOptions,
    TwoTierOptions,
)
from capricorn_jax._src.strategies.two_tier import TwoTierCheckpointManager

# Strategies: what a training loop drives (save / finish / close / restore),
# and what the library asks of the caller's trainer.
from capricorn_jax._src.profiling.train_step import TrainStep
from capricorn_jax._src.profiling.loss_step import make_train_step
from capricorn_jax._src.strategies.base import Strategy
from capricorn_jax._src.strategies.inmemory import InMemoryStrategy
from capricorn_jax._src.strategies.scheduled import ScheduledStrategy

# Profiling: the one driver that decides which steps run instrumented, and its
# options (the policy, the dynamicity detector's). What it runs inside (the
# layer profile, the detector, the instrumented step, the all-to-all probe, a
# step's outcome) is in ``capricorn_jax.experimental.profiling``.
from capricorn_jax._src.profiling.detector import DetectorOptions
from capricorn_jax._src.profiling.policy import ProfilePolicy, ProfilingOptions
from capricorn_jax._src.strategies.driver import ProfilingDriver

__all__ = [
    # model hook
    "BoundaryHook",
    "boundary_hooks",
    "collective_boundary",
    "layer_boundary",
    # memory tier
    "ChecksumError",
    "HostMemoryTooSmall",
    "InMemoryCheckpointer",
    "InMemoryOptions",
    "LOW_PRIORITY_TOS",
    "PecOptions",
    "MemoryNeeds",
    "SaveReport",
    "memory_needs",
    "recover",
    # persistent tier (Orbax)
    "CapricornHandler",
    "CapricornRestore",
    "CapricornSave",
    "CheckpointManager",
    "NoCheckpoint",
    "LocalCheckpointOptions",
    "PersistentCheckpointOptions",
    "TwoTierCheckpointManager",
    "TwoTierOptions",
    "RestoreInfo",
    # strategies
    "InMemoryStrategy",
    "ScheduledStrategy",
    "Strategy",
    "TrainStep",
    "make_train_step",
    # profiling
    "DetectorOptions",
    "ProfilePolicy",
    "ProfilingDriver",
    "ProfilingOptions",
]
