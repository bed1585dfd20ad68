"""Tables the README publishes, generated: ``python -m launch.tables``.

``model_table()`` is the README's "Model configs" table, from
``models.param_count`` (which ``tests/test_configs.py`` checks against the
Flax model); ``tests/test_configs.py`` also checks that the README holds this
table verbatim, so a config change cannot leave a stale row behind.
Alternative not taken: a hand-kept table (its `small` row once showed a
config two changes old).
"""

from __future__ import annotations

import sys

from models.config import CONFIGS, param_count

MODEL_TABLE_HEADER = (
    "| config | layers | d_model | experts (top-k) | MoE layers | expert params | "
    "non-expert params | total |\n|---|---|---|---|---|---|---|---|")


def model_table() -> str:
    """The markdown table of every model config (counts from ``param_count``)."""
    rows = [MODEL_TABLE_HEADER]
    for name, cfg in CONFIGS.items():
        n = param_count(cfg)
        rows.append(f"| `{name}` | {cfg.n_layers} | {cfg.d_model} | {cfg.num_experts} "
                    f"(top-{cfg.top_k}) | {len(cfg.moe_layers)} | {n['expert']:,} | "
                    f"{n['non_expert']:,} | {n['total']:,} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit("usage: python -m launch.tables (prints the README's model table)")
    print(model_table())
