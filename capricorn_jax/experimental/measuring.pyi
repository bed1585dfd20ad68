"""The names of ``capricorn_jax.experimental.measuring``, read by type
checkers and, on first use of a name, by ``capricorn_jax._faces`` (the docstring:
the module's ``.py``)."""

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
