"""Train state, optimizer and the jitted expert-parallel train step.

The train state is a plain dict pytree, what the checkpoint tiers snapshot:
``{"step": int32[], "params": ..., "opt_state": ..., "rng": uint32[2]}``
(the RNG as raw key data, so it stores like any other array). The step is
jitted with NamedShardings over the (data, expert) mesh, donates the state,
and is compiled once per capacity-factor tuple (bucketed dispatch).

With a routing bias (``models.routing_bias``, ``--routing_bias``) the step
reads its row of the bias table from the traced ``state["step"]``: the table
is a constant of the program, so no step compiles anew for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from capricorn_jax import BoundaryHook, boundary_hooks
from models.config import ModelConfig
from models.gpt import BATCH_AXES, DATA, EXPERT, GPTMoE, all_to_all_buffers, param_partition_specs
from models.routing_bias import RoutingBias

State = dict[str, Any]
StepBody = Callable[[State, jax.Array], tuple[State, dict]]
"""The traced (unjitted) step: (state, batch) -> (new state, metrics)."""


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """AdamW with linear warmup and cosine decay."""

    learning_rate: float = 3e-3
    warmup_steps: int = 10
    total_steps: int = 1000
    weight_decay: float = 0.01
    clip_norm: float = 1.0


def make_optimizer(opts: OptimizerOptions) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, opts.learning_rate, max(1, opts.warmup_steps),
        max(opts.total_steps, opts.warmup_steps + 1), opts.learning_rate * 0.1,
    )
    return optax.chain(
        optax.clip_by_global_norm(opts.clip_norm),
        optax.adamw(schedule, weight_decay=opts.weight_decay),
    )


def make_mesh(expert_parallel: int, devices: list | None = None) -> Mesh:
    """A (data, expert) mesh; expert is the fast axis, so it spans hosts first
    when it is larger than a host's device count."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) % expert_parallel:
        raise ValueError(f"{len(devices)} devices not divisible by "
                         f"expert_parallel={expert_parallel}")
    grid = np.array(devices).reshape(len(devices) // expert_parallel, expert_parallel)
    return Mesh(grid, (DATA, EXPERT))


class Trainer:
    """Builds, shards and steps the train state of a GPT-MoE on a mesh.

    It is the ``capricorn_jax.TrainStep`` the library's profiler, in-step
    executor and scheduled strategies use: ``mesh``, the shardings,
    ``boundaries``, ``moe_layers``, ``step_fn``, ``has_step`` and
    ``step_with_sender``.
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh, opt: OptimizerOptions, emulation=None,
                 routing_bias: RoutingBias | None = None):
        if cfg.num_experts % mesh.shape[EXPERT]:
            raise ValueError(
                f"num_experts={cfg.num_experts} not divisible by the expert axis "
                f"({mesh.shape[EXPERT]})"
            )
        if cfg.global_batch % mesh.size:
            raise ValueError(f"global_batch={cfg.global_batch} not divisible by {mesh.size} "
                             f"devices")
        self.cfg, self.mesh = cfg, mesh
        self.emulation = emulation  # models.emulation.layers.Emulation, or None
        self.routing_bias = routing_bias  # added to the router logits of training steps
        if routing_bias is not None and routing_bias.table.shape[1:] != (
                len(cfg.moe_layers), cfg.num_experts):
            raise ValueError(f"routing bias table {routing_bias.table.shape} does not fit "
                             f"{len(cfg.moe_layers)} MoE layers of {cfg.num_experts} experts")
        self.model = GPTMoE(cfg, mesh, emulation=emulation)
        self.optimizer = make_optimizer(opt)
        self.batch_sharding = NamedSharding(mesh, P(BATCH_AXES))
        self.replicated = NamedSharding(mesh, P())
        abstract = jax.eval_shape(self._init, jnp.zeros((), jnp.uint32))
        self.state_shardings = self._shardings(abstract)
        self.abstract_state = abstract
        self._init_jit = jax.jit(self._init, out_shardings=self.state_shardings)
        self._steps: dict[tuple, Callable] = {}

    def with_own_steps(self) -> Trainer:
        """This trainer with a step cache of its own (the model, mesh,
        optimizer and shardings shared): its step variants are traced and
        compiled anew, as in a run that never saw this trainer's. The bench
        gives each strategy one, so that every strategy compiles in its timed
        steps whatever it would compile in its own run, ``none`` too (with one
        cache, the strategies that run the plain step compiled each new
        capacity bucket's program for whoever met it next)."""
        import copy

        view = copy.copy(self)
        view._steps = {}
        return view

    @property
    def tokens_per_group(self) -> int:
        """Tokens of one device in one step (one capacity group)."""
        return self.cfg.global_batch * self.cfg.seq_len // self.mesh.size

    @property
    def boundaries(self) -> list[str]:
        """The model's layer-boundary names, in forward order."""
        return [f"block{i}" for i in range(self.cfg.n_layers)]

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The indices of the MoE blocks (the rows of tokens_per_expert)."""
        return tuple(self.cfg.moe_layers)

    def next_factors(self, metrics: dict[str, Any]) -> tuple[float, ...]:
        """The capacity tuple of the step after the one that returned
        ``metrics`` (the model's rule, from its ``max_routed``): what the
        profiling driver's cache and capacity trigger key on."""
        from models.capacity import choose_capacity_factors

        routed = [int(v) for v in np.asarray(metrics["max_routed"])]
        return choose_capacity_factors(self.cfg, routed, self.tokens_per_group)

    def all_to_alls(self, factors: tuple[float, ...]) -> dict[str, list[jax.ShapeDtypeStruct]]:
        """Per MoE block, the per-device all-to-all buffers of a step at these
        capacity factors (the profiler's collective estimate)."""
        return all_to_all_buffers(self.cfg, self.tokens_per_group, factors)

    def gradient_reductions(self) -> list[jax.ShapeDtypeStruct]:
        """The per-device gradient buffers the step all-reduces over every
        device: the parameters every device holds in full (their sharding is
        replicated), i.e. all but the experts' (the profiler's estimate of the
        step's closing collective). Expert parameters are reduced only over
        the data axis; with one data row, never."""
        params = self.abstract_state["params"]
        specs = self.state_shardings["params"]
        return [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
                for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(specs),
                                          strict=True)
                if all(axis is None for axis in sharding.spec)]

    def _init(self, seed: jax.Array) -> State:
        key = jax.random.key(seed)
        init_key, state_key = jax.random.split(key)
        tokens = jnp.zeros((self.mesh.size, self.cfg.seq_len), jnp.int32)
        params = GPTMoE(self.cfg, None, self.mesh.size).init(init_key, tokens)["params"]
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": self.optimizer.init(params),
            "rng": jax.random.key_data(state_key),
        }

    def _shardings(self, abstract: State) -> State:
        param_specs = param_partition_specs(abstract["params"])

        def opt_spec(path, leaf):
            # Optimizer moments mirror the params' tree below their own prefix.
            names = {getattr(k, "key", None) for k in path}
            expert = bool(names & {"w_in", "w_out"}) and getattr(leaf, "ndim", 0) == 3
            return NamedSharding(self.mesh, P(EXPERT) if expert else P())

        return {
            "step": self.replicated,
            "params": jax.tree.map(lambda s: NamedSharding(self.mesh, s), param_specs),
            "opt_state": jax.tree_util.tree_map_with_path(opt_spec, abstract["opt_state"]),
            "rng": self.replicated,
        }

    def init_state(self, seed: int) -> State:
        return self._init_jit(jnp.uint32(seed))

    def _loss(self, params, batch, rng, factors, step):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        bias = None if self.routing_bias is None else self.routing_bias.at(step)
        logits, stats = self.model.apply(
            {"params": params}, inputs, factors, deterministic=self.cfg.dropout == 0.0,
            rngs={"dropout": rng}, router_bias=bias,
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        total = ce + self.cfg.aux_loss_coef * stats.aux_loss + self.cfg.z_loss_coef * stats.z_loss
        return total, (ce, stats)

    def _step(self, state: State, batch: jax.Array, factors: tuple[float, ...]):
        new_state, metrics, _ = self.step_with_sender(state, batch, factors, None)
        return new_state, metrics

    def step_with_sender(self, state: State, batch: jax.Array, factors: tuple[float, ...],
                         sender: Any, *sender_args: jax.Array) -> tuple[State, dict, Any]:
        """The traced step; with a ``sender`` (capricorn_jax's in-step transfer
        executor) its boundary hooks move checkpoint chunks during the forward
        and backward pass, and the third output is what the sender returns
        (None without a sender)."""
        rng, dropout_rng = jax.random.split(jax.random.wrap_key_data(state["rng"]))
        extra = None
        if sender is None:
            grads, (ce, stats) = jax.grad(self._loss, has_aux=True)(
                state["params"], batch, dropout_rng, factors, state["step"]
            )
        else:
            ctx = sender.begin(state, *sender_args)

            def loss(params: Any, carriers: Any) -> tuple[jax.Array, tuple[Any, list]]:
                received: list = []
                with boundary_hooks(*sender.hooks(ctx, carriers, received)):
                    total, aux = self._loss(params, batch, dropout_rng, factors, state["step"])
                return total, (aux, received)

            (grads, carrier_cts), ((ce, stats), received) = jax.grad(
                loss, argnums=(0, 1), has_aux=True)(state["params"], ctx.carriers)
            extra = sender.finish(ctx, received, carrier_cts)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        new_state = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "rng": jax.random.key_data(rng),
        }
        metrics = {
            "loss": ce,
            "aux_loss": stats.aux_loss,
            "tokens_per_expert": stats.tokens_per_expert,
            "dropped": stats.dropped,
            "max_routed": stats.max_routed,
        }
        return new_state, metrics, extra

    def step_fn(
        self,
        factors: tuple[float, ...],
        hooks: tuple[BoundaryHook, ...] = (),
        wrap: Callable[[StepBody], StepBody] | None = None,
    ) -> Callable[[State, jax.Array], tuple[State, dict]]:
        """The jitted step for one capacity-factor tuple (compiled once, cached).

        Args:
          factors: the capacity factor of each MoE layer (static).
          hooks: boundary hooks attached inside the traced step; with hooks the
            step is an instrumented variant, cached apart from the plain one.
          wrap: optional instrumentation of the whole traced step (e.g. marks
            at its start and end), applied inside the jit around the hooked
            body; it must return (state, metrics) of the same structure.

        Returns:
          (state, batch) -> (new state, metrics), jitted with the state's
          shardings, the state donated.
        """
        factors = tuple(float(f) for f in factors)
        key = (factors, tuple(hooks), wrap)
        if key not in self._steps:
            def body(s: State, b: jax.Array) -> tuple[State, dict]:
                with boundary_hooks(*hooks):
                    return self._step(s, b, factors)

            self._steps[key] = jax.jit(
                body if wrap is None else wrap(body),
                in_shardings=(self.state_shardings, self.batch_sharding),
                out_shardings=(self.state_shardings, self.replicated),
                donate_argnums=(0,),
            )
        return self._steps[key]

    def has_step(self, factors: tuple[float, ...], hooks: tuple[BoundaryHook, ...] = (),
                 wrap: Callable[[StepBody], StepBody] | None = None) -> bool:
        """Whether the step for these capacity factors (plain, or with ``hooks``
        and ``wrap``) is compiled already."""
        return (tuple(float(f) for f in factors), tuple(hooks), wrap) in self._steps

    def global_batch(self, local_batch: np.ndarray) -> jax.Array:
        """This process's rows -> the global batch array over the mesh."""
        return jax.make_array_from_process_local_data(self.batch_sharding, local_batch)

    def eval_loss_fn(self) -> Callable[[State, jax.Array], jax.Array]:
        """Jitted cross-entropy of the model on a batch, no dropout, fixed capacity,
        no routing bias (the bias shapes the training load, not the evaluation)."""

        def loss(state, batch):
            logits, _ = self.model.apply({"params": state["params"]}, batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        return jax.jit(loss, in_shardings=(self.state_shardings, self.batch_sharding),
                       out_shardings=self.replicated)
