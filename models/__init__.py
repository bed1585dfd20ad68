"""Flax GPT-style decoder with Mixture-of-Experts feed-forward layers.

The configs import with the package; the Flax model (``GPTMoE``, ``MoEStats``,
``param_partition_specs``) on first use, so a reader of the configs (a
launcher's supervisor checking its flags) does not import JAX and Flax.
"""

from typing import TYPE_CHECKING, Any

from models.config import CONFIGS, ModelConfig, get_config, param_count

if TYPE_CHECKING:
    from models.gpt import GPTMoE, MoEStats, param_partition_specs

_MODEL_NAMES = ("GPTMoE", "MoEStats", "param_partition_specs")

__all__ = [
    "CONFIGS",
    "GPTMoE",
    "ModelConfig",
    "MoEStats",
    "get_config",
    "param_count",
    "param_partition_specs",
]


def __getattr__(name: str) -> Any:
    if name in _MODEL_NAMES:
        from models import gpt

        return getattr(gpt, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
