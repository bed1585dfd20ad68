"""The transports and schedules the bench and the GPU check measure directly, and the
benchmark control ``ChannelReplication`` (a replica over the chunk channel after the step).

Unstable: see ``capricorn_jax.experimental``."""

from __future__ import annotations

from capricorn_jax._src.memory.wire.transport import Transport
from capricorn_jax._src.native import NativeBuildError
from capricorn_jax._src.native import build as build_native
from capricorn_jax._src.scheduling.in_graph import hlo_schedule, xla_flags
from capricorn_jax._src.scheduling.in_graph.executor import InStepSender, scheduled_step
from capricorn_jax._src.scheduling.threaded.window_marks import WindowMarks
from capricorn_jax._src.strategies.channel_replication import ChannelReplication

__all__ = [
    "build_native",
    "ChannelReplication",
    "hlo_schedule",
    "InStepSender",
    "NativeBuildError",
    "scheduled_step",
    "Transport",
    "WindowMarks",
    "xla_flags",
]
