"""GPT-style decoder (Flax Linen) with expert-parallel MoE feed-forward layers.

Expert parallelism: the experts of every MoE layer are sharded over the
``expert`` axis of a (``data``, ``expert``) mesh, the tokens over both axes.
The MoE layer runs under ``jax.shard_map``: each device routes its own tokens
(one capacity group per device), scatters them into per-expert buffers, and an
``all_to_all`` over ``expert`` sends each buffer to the device owning the
expert; a second ``all_to_all`` brings the outputs back for the combine. When
the expert axis spans processes these all-to-alls cross hosts. Without a mesh
the same layer runs on one device with ``num_groups`` capacity groups, which
is numerically the expert-parallel layer (tested).

Choice: Linen rather than NNX, because the train step is a pure function of a
params pytree (what the checkpoint tier snapshots and restores leaf by leaf);
and ``shard_map`` with explicit collectives rather than letting GSPMD infer the
all-to-all from sharding annotations, because the checkpoint scheduler needs to
know, and the profiler to time, exactly where the collectives sit.

Load dependence: the capacity of every MoE layer is a static call argument
(``capacity_factors``). With ``dispatch="bucketed"`` the trainer picks each
step, per layer, the smallest bucket that fits the load seen on the previous
step (models.capacity), so a layer's expert compute and all-to-all volume
follow its load; each bucket tuple is one compiled variant, cached by jit.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from capricorn_jax import collective_boundary, layer_boundary
from models.config import ModelConfig, capacity
from models.emulation import layers as emulated
from models.emulation.profile import LayerTimes
from models.routing import combine, dispatch, route
from models.routing_bias import apply as apply_bias

DATA = "data"
EXPERT = "expert"
BATCH_AXES = (DATA, EXPERT)
EXPERT_PARAMS = ("w_in", "w_out")


class MoEStats(NamedTuple):
    """Per-step routing statistics, summed or reduced over all devices.

    Attributes:
      tokens_per_expert: [moe_layers, E] int32, kept assignments per expert.
      dropped: [moe_layers] int32, assignments dropped for capacity.
      max_routed: [moe_layers] int32, the largest number of assignments routed
        to one expert in one group (before dropping): what the capacity needed.
      aux_loss: [] float32, load-balancing loss averaged over MoE layers.
      z_loss: [] float32, router z-loss averaged over MoE layers.
    """

    tokens_per_expert: jax.Array
    dropped: jax.Array
    max_routed: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array


def _experts(buf: jax.Array, w_in: jax.Array, w_out: jax.Array) -> jax.Array:
    """[G, E, C, d] tokens through E experts -> [G, E, C, d]."""
    h = nn.gelu(jnp.einsum("gecd,edf->gecf", buf, w_in))
    return jnp.einsum("gecf,efd->gecd", h, w_out)


def _emulated_experts(buf, w_in, w_out, times: LayerTimes, balanced: float):
    """The emulated experts (models.emulation.layers): the wait at this step's
    load, and the weights applied to one slot per expert so they get gradients."""
    buf = emulated.experts(buf, times, balanced)
    return buf + emulated.TOUCH * _experts(buf[..., :1, :], w_in, w_out)


def _logits(x, router, bias, top_k):
    """Router logits, under the step's routing bias (models.routing_bias) if any."""
    logits = x @ router
    return logits if bias is None else apply_bias(logits, bias, top_k)


def _moe_local(x, router, w_in, w_out, bias=None, *, top_k, cap, num_groups, times=None):
    """The MoE layer on one device with ``num_groups`` capacity groups."""
    b, s, d = x.shape
    num_experts = w_in.shape[0]
    xg = x.reshape(num_groups, b * s // num_groups, d)
    logits = jax.vmap(lambda g: _logits(g, router, bias, top_k))(xg)
    r = jax.vmap(functools.partial(route, top_k=top_k, capacity=cap))(logits)
    buf = jax.vmap(functools.partial(dispatch, num_experts=num_experts, capacity=cap))(xg, r)
    if times is None:
        y = _experts(buf, w_in, w_out)
    else:  # [G, E, C, d]: the groups are the sources of one device's experts
        y = _emulated_experts(buf, w_in, w_out, times, b * s * top_k / num_experts)
    y = jax.vmap(combine)(y, r).reshape(b, s, d)
    stats = (
        jnp.sum(r.tokens_per_expert, axis=0),
        jnp.sum(r.dropped),
        jnp.max(r.routed_per_expert),
        jnp.mean(r.aux_loss),
        jnp.mean(r.z_loss),
    )
    return y, stats


def _all_to_all(x, name: str, phase: str, axes: tuple[str, ...]):
    """The tiled all-to-all over ``expert``, its edges marked for probes."""
    x = collective_boundary(x, name, f"{phase}.begin", axes)
    x = jax.lax.all_to_all(x, EXPERT, 0, 0, tiled=True)
    return collective_boundary(x, name, f"{phase}.end", axes)


def _moe_shard(x, router, w_in, w_out, bias=None, *, top_k, cap, num_experts, expert_shards,
               name, axes, times=None):
    """shard_map body: one device's tokens, its E/expert_shards experts."""
    b, s, d = x.shape
    xt = x.reshape(b * s, d)
    r = route(_logits(xt, router, bias, top_k), top_k, cap)
    buf = dispatch(xt, r, num_experts, cap).reshape(
        expert_shards, num_experts // expert_shards, cap, d
    )
    buf = _all_to_all(buf, name, "dispatch", axes)  # [source, E_local, C, d]
    if times is None:
        y = _experts(buf, w_in, w_out)
    else:  # each local expert's balanced share: top_k/E of every source's tokens
        y = _emulated_experts(buf, w_in, w_out, times, expert_shards * b * s * top_k / num_experts)
    y = _all_to_all(y, name, "combine", axes)  # [expert shard, E_local, C, d]
    out = combine(y.reshape(num_experts, cap, d), r).reshape(b, s, d)
    stats = (
        jax.lax.psum(r.tokens_per_expert, BATCH_AXES),
        jax.lax.psum(r.dropped, BATCH_AXES),
        jax.lax.pmax(jnp.max(r.routed_per_expert), BATCH_AXES),
        jax.lax.pmean(r.aux_loss, BATCH_AXES),
        jax.lax.pmean(r.z_loss, BATCH_AXES),
    )
    return out, stats


class MoEFeedForward(nn.Module):
    """Top-k routed experts; expert-parallel under ``mesh``, local without."""

    cfg: ModelConfig
    mesh: Mesh | None = None
    num_groups: int = 1
    times: LayerTimes | None = None

    @nn.compact
    def __call__(self, x: jax.Array, capacity_factor: float,
                 bias: jax.Array | None = None) -> tuple[jax.Array, tuple]:
        cfg = self.cfg
        d, e, f = cfg.d_model, cfg.num_experts, cfg.d_expert
        init = nn.initializers.normal(0.02)
        router = self.param("router", init, (d, e))
        w_in = self.param("w_in", init, (e, d, f))
        w_out = self.param("w_out", init, (e, f, d))
        b, s, _ = x.shape
        if self.mesh is None:
            cap = capacity(cfg, b * s // self.num_groups, capacity_factor)
            return _moe_local(x, router, w_in, w_out, bias, top_k=cfg.top_k, cap=cap,
                              num_groups=self.num_groups, times=self.times)
        devices = self.mesh.size
        cap = capacity(cfg, b * s // devices, capacity_factor)
        assert self.scope is not None  # bound: flax calls compact methods on bound modules only
        body = functools.partial(
            _moe_shard, top_k=cfg.top_k, cap=cap, num_experts=e,
            expert_shards=self.mesh.shape[EXPERT],
            # The enclosing block's name (the profiler's boundary name), e.g. "block1".
            name=self.scope.path[-2] if len(self.scope.path) > 1 else self.name,
            axes=tuple(self.mesh.axis_names),
            times=self.times,
        )
        tokens = P(BATCH_AXES)
        experts = P(EXPERT)
        args: tuple[jax.Array, ...] = (x, router, w_in, w_out)
        specs: tuple[P, ...] = (tokens, P(), experts, experts)
        if bias is not None:  # replicated: every device biases its own tokens alike
            args, specs = (*args, bias), (*specs, P())
        return jax.shard_map(
            body, mesh=self.mesh, in_specs=specs,
            out_specs=(tokens, (P(), P(), P(), P(), P())),
        )(*args)


class Attention(nn.Module):
    cfg: ModelConfig
    emulated: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        h = self.cfg.n_heads
        init = nn.initializers.normal(0.02)
        if self.emulated:  # the weights on one position per sequence (models.emulation.layers)
            qkv = nn.Dense(3 * d, use_bias=False, kernel_init=init, name="qkv")(x[:, :1])
            out = nn.Dense(d, use_bias=False, kernel_init=init, name="out")(qkv[..., :d])
            return emulated.TOUCH * jnp.broadcast_to(out, x.shape)
        qkv = nn.Dense(3 * d, use_bias=False, kernel_init=init, name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(b, s, 3 * h, d // h), 3, axis=2)
        mask = nn.make_causal_mask(jnp.ones((b, s), jnp.int32))
        out = nn.dot_product_attention(q, k, v, mask=mask)
        return nn.Dense(d, use_bias=False, kernel_init=init, name="out")(out.reshape(b, s, d))


class Block(nn.Module):
    cfg: ModelConfig
    moe: bool
    mesh: Mesh | None = None
    num_groups: int = 1
    times: LayerTimes | None = None  # emulated accelerator: this layer's profile

    @nn.compact
    def __call__(self, x, capacity_factor, deterministic, bias=None):
        cfg = self.cfg
        emulate = self.times is not None
        drop = nn.Dropout(cfg.dropout, deterministic=deterministic)
        x = x + drop(Attention(cfg, emulate, name="attn")(nn.LayerNorm(name="ln1")(x)))
        if emulate:  # the dense part's time: attention (+ the dense FFN below)
            x = emulated.dense(x, self.times, self.mesh, P(BATCH_AXES))
        h = nn.LayerNorm(name="ln2")(x)
        stats = None
        if self.moe:
            h, stats = MoEFeedForward(cfg, self.mesh, self.num_groups, self.times, name="moe")(
                h, capacity_factor, bias
            )
        else:
            init = nn.initializers.normal(0.02)
            rows = h[:, :1] if emulate else h
            f = nn.gelu(nn.Dense(cfg.d_ff, use_bias=False, kernel_init=init, name="fc_in")(rows))
            f = nn.Dense(cfg.d_model, use_bias=False, kernel_init=init, name="fc_out")(f)
            h = emulated.TOUCH * jnp.broadcast_to(f, h.shape) if emulate else f
        return x + drop(h), stats


class GPTMoE(nn.Module):
    """Decoder-only LM over bytes with MoE feed-forward layers.

    Attributes:
      cfg: the model config.
      mesh: a (data, expert) mesh for expert parallelism, or None for one device.
      num_groups: capacity groups when ``mesh`` is None (set it to the device
        count to reproduce the expert-parallel layer exactly).
      emulation: an emulated accelerator (``models.emulation``): every layer's
        heavy compute becomes a wait of its profile's duration; None computes.
    """

    cfg: ModelConfig
    mesh: Mesh | None = None
    num_groups: int = 1
    emulation: emulated.Emulation | None = None

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        capacity_factors: tuple[float, ...] | None = None,
        deterministic: bool = True,
        router_bias: jax.Array | None = None,
    ) -> tuple[jax.Array, MoEStats]:
        """Runs the model.

        Args:
          tokens: [B, S] int32 byte ids.
          capacity_factors: one per MoE layer (static); None = cfg.capacity_factor.
          deterministic: False enables dropout (needs a "dropout" rng).
          router_bias: [moe_layers, num_experts] float32, the step's target
            load per expert relative to the mean (models.routing_bias.apply
            biases the router logits to it); None routes on the router alone.

        Returns:
          logits [B, S, vocab] float32 and the MoEStats of the step.
        """
        cfg = self.cfg
        n_moe = len(cfg.moe_layers)
        if capacity_factors is None:
            capacity_factors = (cfg.capacity_factor,) * n_moe
        if len(capacity_factors) != n_moe:
            raise ValueError(f"capacity_factors has {len(capacity_factors)} entries for {n_moe} "
                             f"MoE layers")
        init = nn.initializers.normal(0.02)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, name="embed")
        pos = self.param("pos", init, (cfg.seq_len, cfg.d_model))
        x = embed(tokens) + pos[: tokens.shape[1]]
        collected: list[Any] = []
        for i in range(cfg.n_layers):
            factor = capacity_factors[len(collected)] if cfg.is_moe(i) else 0.0
            times = None if self.emulation is None else self.emulation.layers[i]
            bias = None if router_bias is None or not cfg.is_moe(i) else router_bias[len(collected)]
            x, stats = Block(cfg, cfg.is_moe(i), self.mesh, self.num_groups, times,
                             name=f"block{i}")(x, factor, deterministic, bias)
            if stats is not None:
                collected.append(stats)
            x = layer_boundary(x, f"block{i}")
        x = nn.LayerNorm(name="ln_f")(x)
        logits = embed.attend(x).astype(jnp.float32)
        tpe, dropped, max_routed, aux, z = (jnp.stack(v) for v in zip(*collected, strict=True))
        return logits, MoEStats(tpe, dropped, max_routed, jnp.mean(aux), jnp.mean(z))


def param_partition_specs(params: Any) -> Any:
    """PartitionSpecs for a params pytree: experts over ``expert``, rest replicated."""

    def spec(path, leaf):
        names = {getattr(k, "key", None) for k in path}
        return P(EXPERT) if names & set(EXPERT_PARAMS) else P()

    return jax.tree_util.tree_map_with_path(spec, params)


def all_to_all_buffers(cfg: ModelConfig, tokens_per_group: int,
                       factors: Sequence[float]) -> dict[str, list[jax.ShapeDtypeStruct]]:
    """The per-device all-to-all buffers of each MoE block, for the layer
    profiler's collective estimate (``capricorn_jax.experimental.make_profiled_step``).

    Each MoE layer sends a [num_experts, capacity, d_model] buffer out
    (dispatch) and one back (combine), in the activation dtype (float32);
    the capacity follows the layer's capacity factor and the tokens of one
    device (``tokens_per_group``). The model knows these shapes, the library
    does not: it takes them as an argument.
    """
    out: dict[str, list[jax.ShapeDtypeStruct]] = {}
    for layer, factor in zip(cfg.moe_layers, factors, strict=True):
        cap = capacity(cfg, tokens_per_group, factor)
        buf = jax.ShapeDtypeStruct((cfg.num_experts, cap, cfg.d_model), jnp.float32)
        out[f"block{layer}"] = [buf, buf]
    return out
