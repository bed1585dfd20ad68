"""Named model configurations and their parameter counts.

``tiny`` is for tests (a step in well under a second on 2 CPU cores with 2
hosts x 2 devices), ``small`` for CPU benchmarks, and the ``gpt_moe_*`` shapes
follow the GPT-MoE models of the Capricorn / MoC-System evaluations (GPT-125M
to 1.3B backbones, 8 to 64 experts, an MoE layer every other layer); they are
for GPU runs and for planning (their sizes are what a checkpoint must move).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

DISPATCH_MODES = ("fixed", "bucketed")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and routing options of a GPT-MoE model.

    Attributes:
      name: the config's name.
      vocab_size: 256 for the byte-level corpus.
      seq_len: tokens per sequence.
      d_model, n_heads, n_layers: the decoder's width, heads and depth.
      d_ff: hidden width of a dense feed-forward layer.
      num_experts: experts per MoE layer.
      d_expert: hidden width of one expert.
      top_k: experts per token (1: Switch, 2: GShard).
      moe_every: 1 = every layer is MoE, 2 = every other layer (odd ones).
      capacity_factor: expert capacity as a multiple of the even share
        tokens*top_k/experts, per dispatch group; the capacity of ``fixed``
        dispatch and the first step of ``bucketed`` dispatch.
      capacity_buckets: the capacity factors ``bucketed`` dispatch chooses from,
        each step, to fit the load observed on the previous step.
      dispatch: "fixed" (GShard/Switch, one static capacity) or "bucketed"
        (capacity per layer follows the observed load; load-dependent layer
        time and all-to-all volume, one compiled variant per bucket tuple).
      aux_loss_coef: weight of the Switch load-balancing loss.
      z_loss_coef: weight of the router z-loss (0 disables it).
      dropout: residual dropout rate (uses the train state's RNG key).
      global_batch: sequences per step over all hosts.
      routing_bias: "none", or the ``models.routing_bias`` schedule whose
        target loads the router is biased to in training steps (the launchers'
        ``--routing_bias``, resolved; needs the dynamic workload's rotation).
    """

    name: str
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 128
    num_experts: int = 8
    d_expert: int = 128
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float = 2.0
    capacity_buckets: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0, 4.0)
    dispatch: str = "fixed"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 1e-3
    dropout: float = 0.0
    global_batch: int = 16
    routing_bias: str = "none"

    def __post_init__(self) -> None:
        if self.top_k not in (1, 2):
            raise ValueError(f"top_k must be 1 or 2, got {self.top_k}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.moe_every not in (1, 2):
            raise ValueError(f"moe_every must be 1 or 2, got {self.moe_every}")
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {self.dispatch!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} not divisible by n_heads={self.n_heads}")
        if self.capacity_factor <= 0 or not self.capacity_buckets:
            raise ValueError("capacity_factor must be > 0 and capacity_buckets non-empty")
        if tuple(sorted(self.capacity_buckets)) != tuple(self.capacity_buckets):
            raise ValueError(f"capacity_buckets must be ascending, got {self.capacity_buckets}")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers (all, or the odd ones when moe_every=2)."""
        return tuple(i for i in range(self.n_layers) if i % self.moe_every == self.moe_every - 1)

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers


def capacity(cfg: ModelConfig, tokens_per_group: int, factor: float) -> int:
    """Expert capacity (slots per expert per group) for a capacity factor."""
    return max(1, math.ceil(factor * tokens_per_group * cfg.top_k / cfg.num_experts))


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts by kind; equals the Flax model's (tested).

    Returns:
      {"expert": ..., "non_expert": ..., "total": ...}.
    """
    d = cfg.d_model
    layer_norm = 2 * d
    attention = 4 * d * d
    dense_ffn = 2 * d * cfg.d_ff
    experts_per_layer = cfg.num_experts * 2 * d * cfg.d_expert
    router = d * cfg.num_experts
    n_moe = len(cfg.moe_layers)
    n_dense = cfg.n_layers - n_moe
    non_expert = (
        cfg.vocab_size * d  # token embedding, tied with the output head
        + cfg.seq_len * d  # learned positions
        + cfg.n_layers * (2 * layer_norm + attention)
        + n_dense * dense_ffn
        + n_moe * router
        + layer_norm  # final
    )
    expert = n_moe * experts_per_layer
    return {"expert": expert, "non_expert": non_expert, "total": expert + non_expert}


def _paper(name: str, d: int, layers: int, heads: int, experts: int) -> ModelConfig:
    return ModelConfig(
        name=name, seq_len=1024, d_model=d, n_heads=heads, n_layers=layers, d_ff=4 * d,
        num_experts=experts, d_expert=4 * d, top_k=2, moe_every=2, capacity_factor=1.25,
        dispatch="bucketed", dropout=0.1, global_batch=64,
    )


CONFIGS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig(name="tiny", dropout=0.1),
        ModelConfig(
            name="small", seq_len=128, d_model=256, n_heads=8, n_layers=4, d_ff=512,
            num_experts=8, d_expert=512, top_k=2, moe_every=2, dispatch="bucketed",
            dropout=0.1, global_batch=16,
        ),
        _paper("gpt_moe_125m_8e", 768, 12, 12, 8),
        _paper("gpt_moe_350m_16e", 1024, 24, 16, 16),
        _paper("gpt_moe_760m_32e", 1536, 24, 16, 32),
        _paper("gpt_moe_1p3b_64e", 2048, 24, 16, 64),
    )
}


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """The named config, with fields replaced by ``overrides``.

    Raises:
      KeyError: naming the unknown config and the known ones.
    """
    if name not in CONFIGS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(CONFIGS)}")
    return dataclasses.replace(CONFIGS[name], **overrides)
