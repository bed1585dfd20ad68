"""The emulated model's layer compute: waits in place of the matmuls.

Under ``--accelerator=emulated`` each block of ``models.gpt.GPTMoE`` keeps its
parameters, its layer norms, its router, its dispatch and combine and its real
all-to-alls, and replaces its heavy compute with a native wait
(``native.compute``) of the profile's duration:
- the dense part (attention, and the dense FFN of a dense layer) waits the
  profile's ``dense_fwd_ms`` after the attention, ``dense_bwd_ms`` in backward;
- the experts wait, between the dispatch and the combine all-to-alls, the
  profile's balanced time scaled by this step's real load: the busiest local
  expert's received tokens over the balanced share (``expert_scale``).

Time dilation (launch.bench's ``--time_scale=k``): every wait k times the
profile's (``Emulation.of``), while the links run k times slower: the step's
emulated and link-bound parts last k times longer, with the same bytes.

What the emulated step still computes, so that training stays deterministic,
recovery is checked bit for bit and the optimizer updates every byte of the
state: embeddings, layer norms, routing, dispatch, combine, logits and loss
over every token; the attention, dense-FFN and expert weights applied to ONE
token position per sequence (per expert buffer), added back with a small
weight, so every parameter gets a gradient at a cost of ~1/seq_len of the
real matmuls.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from models.emulation import native
from models.emulation.profile import AcceleratorProfile, LayerTimes

#: The weight of the one-token path added back into the activations.
TOUCH = 1e-3


@dataclasses.dataclass(frozen=True)
class Emulation:
    """The emulated accelerator for one model: the profile grouped onto its layers.

    Attributes:
      profile: the profile's name (for records).
      layers: one LayerTimes per model layer (``AcceleratorProfile.for_model``).
    """

    profile: str
    layers: tuple[LayerTimes, ...]

    @classmethod
    def of(cls, profile: AcceleratorProfile, moe: tuple[bool, ...],
           time_scale: float = 1.0) -> Emulation:
        """The profile on a model whose layer i is MoE where ``moe[i]``; a dense
        layer of the model takes its group's expert time as dense time (it has
        no experts to wait in), so the step's total is kept. ``time_scale``
        (``--time_scale``, >= 1): every wait that many times longer."""
        if not (math.isfinite(time_scale) and time_scale >= 1):
            raise ValueError(f"time_scale must be a finite number >= 1, got {time_scale}")
        native.register()
        layers = profile.on_layers(moe)
        if time_scale != 1:
            layers = tuple(t.dilated(time_scale) for t in layers)
        return cls(profile.name, layers)

    @classmethod
    def for_config(cls, profile: AcceleratorProfile, cfg, time_scale: float = 1.0) -> Emulation:
        """The profile on a ``models.config.ModelConfig`` (``time_scale``: as ``of``)."""
        return cls.of(profile, tuple(cfg.is_moe(i) for i in range(cfg.n_layers)), time_scale)

    def step_ms(self, scales: dict[int, float] | None = None) -> float:
        """The emulated compute of one step (expert parts at ``scales``, default 1)."""
        scales = scales or {}
        return sum(t.dense_fwd_ms + t.dense_bwd_ms
                   + scales.get(i, 1.0) * (t.expert_fwd_ms + t.expert_bwd_ms)
                   for i, t in enumerate(self.layers))


def dense(x: jax.Array, times: LayerTimes, mesh: Mesh | None = None,
          spec: P | None = None) -> jax.Array:
    """The layer's dense compute: ``x`` after the dense wait (forward and backward).

    Under a ``mesh`` every device waits on its own shard of ``x`` (sharded as
    ``spec``), as an accelerator computes its shard: the wait runs inside a
    ``shard_map``. Outside one, XLA's partitioner cannot split the native call
    and gathers its operand onto every device: an all-gather of the whole
    activation over the hosts' link before every dense wait, forward and
    backward (found 2026-12-04 in the compiled 2x2 step: 4 all-gathers of
    262 KB per device per step, link traffic inside what was counted as the
    link's idle time).
    """
    fwd, bwd = jnp.float32(times.dense_fwd_ms), jnp.float32(times.dense_bwd_ms)
    if mesh is None:
        return native.compute(x, fwd, bwd)
    return jax.shard_map(lambda y: native.compute(y, fwd, bwd), mesh=mesh,
                         in_specs=(spec,), out_specs=spec)(x)


def expert_scale(buf: jax.Array, balanced: float) -> jax.Array:
    """The busiest local expert's tokens over the balanced share (float32 scalar).

    ``buf`` is the received dispatch buffer [sources, local experts, capacity,
    d]; a slot holds a token when any of its features is non-zero (a routed,
    layer-normed token is never exactly zero; an empty slot always is).
    """
    held = jnp.any(buf != 0, axis=-1)  # [S, E_local, C]
    per_expert = jnp.sum(held, axis=(0, 2)).astype(jnp.float32)
    return jax.lax.stop_gradient(jnp.max(per_expert) / jnp.float32(balanced))


def experts(buf: jax.Array, times: LayerTimes, balanced: float) -> jax.Array:
    """The experts' compute: ``buf`` after the expert wait at this step's load."""
    scale = expert_scale(buf, balanced)
    return native.compute(buf, jnp.float32(times.expert_fwd_ms) * scale,
                          jnp.float32(times.expert_bwd_ms) * scale)
