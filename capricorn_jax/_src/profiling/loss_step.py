"""A ``TrainStep`` made from the user's loss function: the contract filled in.

A MaxText-style training loop has a loss function whose model calls
``layer_boundary``, a way to apply gradients (flax's
``TrainState.apply_gradients``, or an optax optimizer over a dict state), a
mesh and the state's shardings. ``make_train_step`` builds from these the
object the profiler, the profiling driver and the scheduled strategies run
(``train_step.TrainStep``): the jitted step per set of boundary hooks, and
the traced step with an in-step sender.

It takes the loss, not the user's jitted step, because the in-graph path
needs the ``jax.grad`` itself: a chunk received in the backward pass arrives
as the cotangent of a zero "carrier" input of the step
(``scheduling.in_graph.executor``), so the step must differentiate with
respect to the carriers as well as the parameters, which an opaque jitted
step cannot be asked to do.

The boundaries are found by tracing the loss once (``jax.eval_shape``, no
compile) with a hook that records each ``layer_boundary`` name; the same
trace gives the shape of ``tokens_per_expert``, which checks ``moe_layers``.

Design choice: the loss signature ``loss_fn(params, state, batch) -> (loss,
aux)`` (``state`` for its RNG, step or ``apply_fn``; ``aux`` a dict of
metrics holding the expert load), one capacity (``factors`` is always
``()``: a model whose capacity changes per step writes the ``TrainStep``
itself). Alternative not taken: wrapping the user's jitted step and
re-tracing its jaxpr to insert the carriers; it would depend on where the
user called ``jax.grad`` inside a program we did not write.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from capricorn_jax._src.profiling.boundary import boundary_hooks
from capricorn_jax._src.profiling.train_step import Metrics, State, StepFn

LossFn = Callable[[Any, State, Any], tuple[jax.Array, Any]]
"""``loss_fn(params, state, batch) -> (loss, aux)``; ``aux`` a dict of metrics."""
TPE = "tokens_per_expert"

_BLOCK = re.compile(r"block(\d+)")


class LossTrainStep:
    """The ``TrainStep`` of a loss function (module docstring); built by
    ``make_train_step``. Calling it runs the plain jitted step:
    ``state, metrics = train(state, batch)`` (the state donated)."""

    def __init__(self, loss_fn: LossFn, apply: Callable[[State, Any], State], mesh: Mesh,
                 state_shardings: Any, batch_sharding: NamedSharding,
                 boundaries: Sequence[str], moe_layers: Sequence[int],
                 tokens_per_expert: str | Callable[[Any], jax.Array] | None) -> None:
        self.loss_fn, self.apply = loss_fn, apply
        self.mesh, self.state_shardings, self.batch_sharding = mesh, state_shardings, batch_sharding
        self.replicated = NamedSharding(mesh, P())
        self._boundaries, self._moe_layers = list(boundaries), tuple(moe_layers)
        self.tokens_per_expert = tokens_per_expert
        self._steps: dict[tuple, Callable] = {}

    @property
    def boundaries(self) -> list[str]:
        return list(self._boundaries)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self._moe_layers

    def __call__(self, state: State, batch: jax.Array) -> tuple[State, Metrics]:
        return self.step_fn(())(state, batch)

    def _metrics(self, loss: jax.Array, aux: Any) -> Metrics:
        metrics = {"loss": loss, **_as_dict(aux)}
        if callable(self.tokens_per_expert):
            metrics[TPE] = self.tokens_per_expert(aux)
        elif self.tokens_per_expert is not None:
            metrics[TPE] = metrics[self.tokens_per_expert]
        return metrics

    def step_with_sender(self, state: State, batch: jax.Array, factors: tuple[float, ...],
                         sender: Any, *sender_args: jax.Array) -> tuple[State, Metrics, Any]:
        """The traced step; with a ``sender`` (the in-step executor) the
        gradient is taken with respect to its carriers too (``TrainStep``)."""
        _no_factors(factors)
        params = params_of(state)
        if sender is None:
            grads, (loss, aux) = jax.grad(self._loss, has_aux=True)(params, state, batch)
            extra = None
        else:
            ctx = sender.begin(state, *sender_args)

            def loss(params: Any, carriers: Any) -> tuple[jax.Array, tuple[Any, list]]:
                received: list = []
                with boundary_hooks(*sender.hooks(ctx, carriers, received)):
                    total, aux = self.loss_fn(params, state, batch)
                return total, ((total, aux), received)

            (grads, carrier_cts), ((loss, aux), received) = jax.grad(
                loss, argnums=(0, 1), has_aux=True)(params, ctx.carriers)
            extra = sender.finish(ctx, received, carrier_cts)
        return self.apply(state, grads), self._metrics(loss, aux), extra

    def _loss(self, params: Any, state: State, batch: Any) -> tuple[jax.Array, Any]:
        total, aux = self.loss_fn(params, state, batch)
        return total, (total, aux)

    def step_fn(self, factors: tuple[float, ...], hooks: tuple = (),
                wrap: Callable[[StepFn], StepFn] | None = None) -> StepFn:
        """The jitted step (state donated), one program per (hooks, wrap)."""
        _no_factors(factors)
        key = (tuple(hooks), wrap)
        if key not in self._steps:
            def body(state: State, batch: jax.Array) -> tuple[State, Metrics]:
                with boundary_hooks(*hooks):
                    new_state, metrics, _ = self.step_with_sender(state, batch, (), None)
                return new_state, metrics

            self._steps[key] = jax.jit(
                body if wrap is None else wrap(body),
                in_shardings=(self.state_shardings, self.batch_sharding),
                out_shardings=(self.state_shardings, self.replicated), donate_argnums=(0,))
        return self._steps[key]

    def has_step(self, factors: tuple[float, ...], hooks: tuple = (),
                 wrap: Callable[[StepFn], StepFn] | None = None) -> bool:
        return not factors and (tuple(hooks), wrap) in self._steps


def make_train_step(loss_fn: LossFn, abstract_state: Any, example_batch: Any, *,
                    mesh: Mesh, batch_sharding: NamedSharding | None = None,
                    optimizer: Any = None,
                    apply_gradients: Callable[[State, Any], State] | None = None,
                    tokens_per_expert: str | Callable[[Any], jax.Array] | None = TPE,
                    moe_layers: Sequence[int] | None = None,
                    boundaries: Sequence[str] | None = None) -> LossTrainStep:
    """The ``TrainStep`` of ``loss_fn`` (module docstring).

    Args:
      loss_fn: ``loss_fn(params, state, batch) -> (loss, aux)``, ``aux`` a
        dict of metrics; its model calls ``layer_boundary`` between layers
        (unrolled: a boundary inside ``lax.scan`` is one name for all layers).
      abstract_state: the state's pytree of ``jax.ShapeDtypeStruct`` leaves,
        each with its ``sharding`` (what ``TwoTierCheckpointManager`` takes).
      example_batch: a batch (an array, or its ``jax.ShapeDtypeStruct``).
      mesh: the training mesh.
      batch_sharding: the batch's sharding; None: ``example_batch``'s.
      optimizer: an optax ``GradientTransformation`` for a dict state with
        ``"params"`` and ``"opt_state"`` (and ``"step"``, incremented).
      apply_gradients: ``(state, grads) -> new state`` instead; default
        (neither given): ``state.apply_gradients(grads=grads)`` (flax's
        ``TrainState``).
      tokens_per_expert: where the expert load ([moe_layers, experts], what
        the dynamicity detector and PEC read) is in ``aux``: its key, or a
        function of ``aux``; None: the model has no MoE layer.
      moe_layers: the ``i`` of the boundaries ``block{i}`` that close an
        MoE layer, one per row of the load; None: every ``block{i}``
        boundary, when there are as many as rows.
      boundaries: the ``layer_boundary`` names in forward order; None: found
        by tracing ``loss_fn`` once.

    Raises:
      ValueError: a boundary named twice, a load whose rows do not match
        ``moe_layers``, a state leaf without a sharding.
      TypeError: no way to apply the gradients was given for this state.
    """
    shardings = shardings_of(abstract_state, "abstract_state")
    if batch_sharding is None:
        batch_sharding = getattr(example_batch, "sharding", None)
    if not isinstance(batch_sharding, NamedSharding) or not isinstance(
            example_batch, jax.Array | jax.ShapeDtypeStruct):
        raise TypeError("the batch must be one array with a NamedSharding over the mesh (or give "
                        "batch_sharding=); a pytree batch needs the TrainStep contract itself "
                        "(docs/guide.md, section 3)")
    if optimizer is not None and apply_gradients is not None:
        raise TypeError("give optimizer= (a dict state) or apply_gradients=, not both")
    if apply_gradients is None:
        apply_gradients = _default_apply(abstract_state, optimizer)
    batch = jax.ShapeDtypeStruct(example_batch.shape, example_batch.dtype,
                                 sharding=batch_sharding)
    found, load = trace_boundaries(loss_fn, abstract_state, batch, tokens_per_expert)
    boundaries = found if boundaries is None else list(boundaries)
    layers = _moe_layers(boundaries, load, moe_layers)
    return LossTrainStep(loss_fn, apply_gradients, mesh, shardings, batch_sharding, boundaries,
                         layers, tokens_per_expert)


def trace_boundaries(loss_fn: LossFn, abstract_state: Any, batch: Any,
                     tokens_per_expert: str | Callable[[Any], Any] | None = TPE
                     ) -> tuple[list[str], jax.ShapeDtypeStruct | None]:
    """The ``layer_boundary`` names ``loss_fn`` meets, in order, and the shape
    of its expert load (None without one), from one abstract trace.

    Raises:
      ValueError: a name met twice (boundaries must name one layer each).
    """
    names: list[str] = []

    def record(x: Any, name: str) -> Any:
        names.append(name)
        return x

    def traced(state: State, batch: Any) -> Any:
        with boundary_hooks(record):
            _, aux = loss_fn(params_of(state), state, batch)
        if tokens_per_expert is None:
            return None
        if callable(tokens_per_expert):
            return tokens_per_expert(aux)
        got = _as_dict(aux)
        if tokens_per_expert not in got:
            raise ValueError(f"loss_fn's aux has no {tokens_per_expert!r} (keys: {sorted(got)}): "
                             f"give tokens_per_expert= (a key or a function of aux), or None for "
                             f"a model without MoE layers")
        return got[tokens_per_expert]

    load = jax.eval_shape(traced, abstract_state, batch)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"layer_boundary names met more than once in one trace: {twice}; each "
                         f"boundary names one layer (a layer_boundary inside lax.scan is traced "
                         f"once for every layer: unroll the layers, or give boundaries=)")
    return names, load


def _moe_layers(boundaries: Sequence[str], load: Any,
                moe_layers: Sequence[int] | None) -> tuple[int, ...]:
    blocks = [int(m.group(1)) for m in map(_BLOCK.fullmatch, boundaries) if m]
    if load is None:
        if moe_layers:
            raise ValueError(f"moe_layers={list(moe_layers)} but tokens_per_expert is None")
        return ()
    if len(load.shape) != 2:
        raise ValueError(f"tokens_per_expert must be [moe_layers, experts], got shape "
                         f"{tuple(load.shape)}")
    rows = load.shape[0]
    if moe_layers is None:
        if len(blocks) != rows:
            raise ValueError(f"tokens_per_expert has {rows} rows and the model has "
                             f"{len(blocks)} boundaries named block{{i}} ({boundaries}): give "
                             f"moe_layers= (the i of each MoE layer's block{{i}}, in row order)")
        return tuple(blocks)
    missing = [i for i in moe_layers if i not in blocks]
    if missing or len(moe_layers) != rows:
        raise ValueError(f"moe_layers={list(moe_layers)}: one per row of tokens_per_expert "
                         f"({rows}), each the i of a boundary block{{i}} (the model's: "
                         f"{boundaries})")
    return tuple(int(i) for i in moe_layers)


def params_of(state: State) -> Any:
    """The parameters of a flax ``TrainState`` (``.params``) or a dict state."""
    if isinstance(state, Mapping):
        return state["params"]
    return state.params


def shardings_of(abstract_state: Any, what: str) -> Any:
    """The sharding of each leaf of ``abstract_state``; a leaf without one is
    named by its path."""
    def sharding_of(path: Any, leaf: Any) -> Sharding:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, Sharding):
            raise ValueError(f"{what} leaf {jax.tree_util.keystr(path)} has no sharding: give "
                             f"each leaf jax.ShapeDtypeStruct(..., sharding=...)")
        return sharding

    return jax.tree_util.tree_map_with_path(sharding_of, abstract_state)


def _default_apply(abstract_state: Any, optimizer: Any) -> Callable[[State, Any], State]:
    if optimizer is not None:
        if not isinstance(abstract_state, Mapping) or not {"params", "opt_state"} <= set(
                abstract_state):
            raise TypeError("optimizer= updates a dict state with 'params' and 'opt_state'; for "
                            "another state give apply_gradients=(state, grads) -> state")
        return lambda state, grads: _optax_apply(optimizer, state, grads)
    if not hasattr(abstract_state, "apply_gradients"):
        raise TypeError("the state has no apply_gradients (flax's TrainState has): give "
                        "optimizer= (an optax transformation, for a dict state with 'params' "
                        "and 'opt_state') or apply_gradients=(state, grads) -> state")
    return lambda state, grads: state.apply_gradients(grads=grads)


def _optax_apply(optimizer: Any, state: Mapping[str, Any], grads: Any) -> dict[str, Any]:
    import optax

    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    new = {**state, "params": optax.apply_updates(state["params"], updates),
           "opt_state": opt_state}
    if "step" in state:
        new["step"] = state["step"] + 1
    return new


def _as_dict(aux: Any) -> dict[str, Any]:
    if aux is None:
        return {}
    if not isinstance(aux, Mapping):
        raise TypeError(f"loss_fn returns (loss, aux) with aux a dict of metrics, got "
                        f"{type(aux).__name__}")
    return dict(aux)


def _no_factors(factors: tuple[float, ...]) -> None:
    if tuple(factors):
        raise ValueError(f"a step made by make_train_step has one capacity (factors ()), got "
                         f"{tuple(factors)}; a per-step capacity needs the TrainStep contract "
                         f"itself")


__all__ = ["LossFn", "LossTrainStep", "make_train_step", "trace_boundaries"]
