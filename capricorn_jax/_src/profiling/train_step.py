"""The train step as the library sees it: ``TrainStep`` and the state types.

``TrainStep`` is what the library asks of the caller's trainer: the mesh and
shardings of the train state, the jitted step for a capacity tuple (with
boundary hooks, or wrapped by instrumentation), and the traced step with a
sender that moves checkpoint chunks inside it. The profiler, the in-step
executor and the scheduled strategies use nothing else, and write nothing on
the trainer: what they cache (profiled variants, all-to-all timings,
scheduled steps) they keep themselves.

Design choice: the protocol lives on the lowest floor that uses it (the
profiler instruments the step; the scheduler and the strategies, above, run
it), so no floor reaches upward for a type. Alternative not taken (the
previous state): ``strategies.base``, which made ``profiling`` and
``scheduling`` import the floor above them. ``strategies.base`` re-exports
the names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the protocol's types; JAX is not imported to read them
    import jax
    from jax.sharding import Mesh, NamedSharding

State = Any
"""A train state pytree of global arrays (e.g. {"step", "params", "opt_state", "rng"})."""
Metrics = dict[str, Any]
"""A step's metrics; the library reads ``"tokens_per_expert"`` ([moe_layers, experts])."""
StepFn = Callable[[State, "jax.Array"], tuple[State, Metrics]]


class TrainStep(Protocol):
    """The caller's trainer, as the library uses it.

    Attributes:
      mesh: the device mesh of the train state and the batch.
      state_shardings: a NamedSharding per leaf of the train state.
      batch_sharding: the batch's sharding (leading dimension over the mesh).
      replicated: a fully replicated NamedSharding on ``mesh``.
      boundaries: the model's ``layer_boundary`` names, in forward order.
      moe_layers: the indices ``i`` of the boundaries ``block{i}`` that close
        an MoE layer, in order (the rows of ``tokens_per_expert``).
    """

    mesh: Mesh
    state_shardings: Any
    batch_sharding: NamedSharding
    replicated: NamedSharding

    @property
    def boundaries(self) -> list[str]: ...

    @property
    def moe_layers(self) -> tuple[int, ...]: ...

    def step_fn(self, factors: tuple[float, ...], hooks: tuple = (),
                wrap: Callable[[StepFn], StepFn] | None = None) -> StepFn:
        """The jitted step for a capacity tuple (state donated), compiled once
        per (factors, hooks, wrap); ``hooks`` are boundary hooks attached
        inside the traced step, ``wrap`` instruments the traced body."""
        ...

    def has_step(self, factors: tuple[float, ...], hooks: tuple = (),
                 wrap: Callable[[StepFn], StepFn] | None = None) -> bool:
        """Whether ``step_fn(factors, hooks, wrap)`` is compiled already."""
        ...

    def step_with_sender(self, state: State, batch: jax.Array, factors: tuple[float, ...],
                         sender: Any, *sender_args: jax.Array) -> tuple[State, Metrics, Any]:
        """The traced (unjitted) step with an in-step sender: the caller calls
        ``ctx = sender.begin(state, *sender_args)`` before the forward pass,
        attaches ``sender.hooks(ctx, carriers, received)`` as boundary hooks
        around the loss, differentiates with respect to ``ctx.carriers`` too,
        and returns ``sender.finish(ctx, received, carrier_cotangents)`` as the
        third output (see ``scheduling.in_graph.executor``)."""
        ...
