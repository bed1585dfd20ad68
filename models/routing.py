"""Top-k routing with expert capacity, and the index-based dispatch/combine.

One *group* is the set of tokens that share a capacity budget: the tokens of
one device in the expert-parallel layer, or one of ``num_groups`` slices on a
single device. Within a group, expert ``e`` accepts at most ``capacity`` token
assignments; first choices of all tokens take slots before any second choice
(GShard's priority), in token order; the rest are dropped and counted.

Design choice: dispatch scatters each kept assignment into an
``[experts * capacity + 1, d]`` buffer by index (the extra row collects the
dropped ones) and combine gathers them back. The GShard alternative, an
einsum with a one-hot ``[tokens, experts, capacity]`` dispatch tensor, costs
tokens*experts*capacity*d flops and memory, which dwarfs the experts' own work
at the sizes run on CPU here.

Gate values: top-1 uses the softmax probability (Switch); top-2 renormalizes
the two chosen probabilities to sum to one (GShard). A kept assignment's combine
weight is its gate value; a dropped one's is zero.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    """The routing decision of one group of T tokens over E experts.

    Attributes:
      expert_index: [T, k] int32, the chosen experts.
      gates: [T, k] float32, the gate values of the choices.
      slot: [T, k] int32, the position in the expert's buffer (meaningful
        where ``kept``).
      kept: [T, k] bool, whether the assignment fit the capacity.
      combine_weights: [T, k] float32, ``gates`` where kept, else 0.
      tokens_per_expert: [E] int32, kept assignments per expert.
      routed_per_expert: [E] int32, assignments per expert before dropping.
      dropped: [] int32, assignments dropped for lack of capacity.
      aux_loss: [] float32, Switch load-balancing loss E * sum_e f_e * P_e.
      z_loss: [] float32, mean squared log-partition of the router logits.
    """

    expert_index: jax.Array
    gates: jax.Array
    slot: jax.Array
    kept: jax.Array
    combine_weights: jax.Array
    tokens_per_expert: jax.Array
    routed_per_expert: jax.Array
    dropped: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array


def route(logits: jax.Array, top_k: int, capacity: int) -> Routing:
    """Routes T tokens to their top-k of E experts, at most ``capacity`` each.

    Args:
      logits: [T, E] router logits of one group.
      top_k: 1 or 2.
      capacity: slots per expert in this group.

    Returns:
      The Routing of the group.
    """
    num_tokens, num_experts = logits.shape
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    gates, expert_index = jax.lax.top_k(probs, top_k)
    if top_k > 1:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    # Priority: all first choices (in token order), then all second choices.
    flat_expert = expert_index.T.reshape(-1)  # [k*T], choice-major
    onehot = jax.nn.one_hot(flat_expert, num_experts, dtype=jnp.int32)
    position = jnp.cumsum(onehot, axis=0) - 1
    flat_slot = jnp.sum(position * onehot, axis=-1)
    slot = flat_slot.reshape(top_k, num_tokens).T
    kept = slot < capacity
    routed = jnp.sum(onehot, axis=0)
    kept_per_expert = jnp.sum(onehot * kept.T.reshape(-1, 1), axis=0)
    dropped = top_k * num_tokens - jnp.sum(kept_per_expert)
    top1_fraction = jnp.mean(jax.nn.one_hot(expert_index[:, 0], num_experts), axis=0)
    aux_loss = num_experts * jnp.sum(top1_fraction * jnp.mean(probs, axis=0))
    z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return Routing(
        expert_index=expert_index.astype(jnp.int32),
        gates=gates,
        slot=slot.astype(jnp.int32),
        kept=kept,
        combine_weights=jnp.where(kept, gates, 0.0),
        tokens_per_expert=kept_per_expert.astype(jnp.int32),
        routed_per_expert=routed.astype(jnp.int32),
        dropped=dropped.astype(jnp.int32),
        aux_loss=aux_loss,
        z_loss=z_loss,
    )


def _buffer_index(r: Routing, num_experts: int, capacity: int) -> jax.Array:
    """[T, k] row of each assignment in the flat buffer; dropped -> last row."""
    return jnp.where(r.kept, r.expert_index * capacity + r.slot, num_experts * capacity)


def dispatch(x: jax.Array, r: Routing, num_experts: int, capacity: int) -> jax.Array:
    """Scatters the tokens of a group into per-expert buffers.

    Args:
      x: [T, d] tokens.
      r: their Routing.

    Returns:
      [E, capacity, d]; empty slots are zero.
    """
    num_tokens, top_k = r.expert_index.shape
    index = _buffer_index(r, num_experts, capacity).reshape(-1)
    values = jnp.broadcast_to(x[:, None, :], (num_tokens, top_k, x.shape[-1])).reshape(
        num_tokens * top_k, -1
    )
    buf = jnp.zeros((num_experts * capacity + 1, x.shape[-1]), x.dtype).at[index].add(values)
    return buf[:-1].reshape(num_experts, capacity, x.shape[-1])


def combine(y: jax.Array, r: Routing) -> jax.Array:
    """Gathers expert outputs back to their tokens, weighted by the gates.

    Args:
      y: [E, capacity, d] expert outputs of the group.
      r: the group's Routing.

    Returns:
      [T, d]: sum over the token's kept choices of gate * expert output.
    """
    num_experts, cap, d = y.shape
    flat = jnp.concatenate([y.reshape(num_experts * cap, d), jnp.zeros((1, d), y.dtype)])
    gathered = flat[_buffer_index(r, num_experts, cap)]  # [T, k, d]
    return jnp.sum(gathered * r.combine_weights[..., None].astype(y.dtype), axis=1)
