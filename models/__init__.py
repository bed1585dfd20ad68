"""Flax GPT-style decoder with Mixture-of-Experts feed-forward layers."""

from models.config import CONFIGS, ModelConfig, get_config, param_count
from models.gpt import GPTMoE, MoEStats, param_partition_specs

__all__ = [
    "CONFIGS",
    "GPTMoE",
    "ModelConfig",
    "MoEStats",
    "get_config",
    "param_count",
    "param_partition_specs",
]
