"""Per-step capacity choice for ``bucketed`` (load-dependent) dispatch.

A pure decision on host-side data: the largest per-group expert load of each
MoE layer on the previous step -> the capacity factor of each layer for the
next step, from the config's buckets. Expert load has temporal locality (the
premise Capricorn's speculative profiling also rests on), so last step's load
is a good estimate of this step's; assignments over the chosen capacity are
dropped and counted like in fixed-capacity dispatch.

Alternative not taken: ``jax.lax.ragged_dot`` (dropless grouped matmul). On
CPU it costs the same whatever the group sizes (measured: 8 groups over 8192
rows take 170-190 ms whether 512 or 8192 rows are real), so a layer's time
would not follow its load; shapes that follow the load are needed here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from models.config import ModelConfig

HEADROOM = 1.1


def choose_capacity_factors(
    cfg: ModelConfig,
    max_routed: Sequence[int] | None,
    tokens_per_group: int,
    headroom: float = HEADROOM,
) -> tuple[float, ...]:
    """The capacity factor of each MoE layer for the next step.

    Args:
      cfg: the model config (its dispatch mode and buckets).
      max_routed: per MoE layer, the most assignments one expert got in one
        group on the previous step; None before the first step.
      tokens_per_group: tokens in one capacity group (one device's tokens).
      headroom: multiple of the observed load the capacity must cover.

    Returns:
      One factor per MoE layer: ``cfg.capacity_factor`` for fixed dispatch or
      the first step, else the smallest bucket whose capacity covers
      ``headroom * max_routed`` (the largest bucket when none does).
    """
    n_moe = len(cfg.moe_layers)
    if cfg.dispatch == "fixed" or max_routed is None:
        return (cfg.capacity_factor,) * n_moe
    if len(max_routed) != n_moe:
        raise ValueError(f"max_routed has {len(max_routed)} entries for {n_moe} MoE layers")
    even_share = tokens_per_group * cfg.top_k / cfg.num_experts
    factors = []
    for load in max_routed:
        needed = math.ceil(headroom * int(load))
        fitting = [b for b in cfg.capacity_buckets if math.ceil(b * even_share) >= needed]
        factors.append(fitting[0] if fitting else cfg.capacity_buckets[-1])
    return tuple(factors)
