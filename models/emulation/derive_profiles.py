"""Derives the shipped accelerator profiles (``profiles/*.json``) from FLOPs.

    python -m models.emulation.derive_profiles   # rewrites profiles/*.json

Both profiles apportion a step's time to layers by their FLOPs (forward 2
FLOPs per multiply-add, backward twice the forward):
- ``h200_gpt_moe_125m_8e``: the project's one H200 measurement (BUILD_NOTES
  "One GPU", 2026-11-29): gpt_moe_125m_8e at global batch 16 on one GPU (all
  8 experts local, capacity factor 1.25, fixed dispatch) ran a 110 ms step
  (``none``); the step's FLOPs (experts counted at their padded capacity) are
  spread over that time. No all-to-all ran there (one GPU): its bytes per
  routed token are the model's (d_model x 4 bytes, float32 activations).
- ``a100_gpt_moe_350m_16e``: one GPU's shard of GPT-MoE-350M-16E with expert
  parallelism 8 (MoC-System trained it on A800s with EP 8-16): 2 of the 16
  experts and 8 sequences of 1024 tokens per GPU (global batch 64), bf16 at an
  assumed model-FLOPs utilization of 40% of the A100's 312 TFLOP/s dense bf16
  peak (an assumption: MoE training reports 20-45%); all-to-all bytes per
  routed token d_model x 2 (bf16).
"""

from __future__ import annotations

import json

from models.config import get_config
from models.emulation.profile import PROFILE_DIR


def _flops_per_token(cfg):
    """Forward FLOPs per token: attention, dense FFN, one token through one expert."""
    d, s = cfg.d_model, cfg.seq_len
    attention = 2 * 4 * d * d + 2 * 2 * s * d
    dense_ffn = 2 * 2 * d * cfg.d_ff
    expert = 2 * 2 * d * cfg.d_expert
    return attention, dense_ffn, expert


def _layers(cfg, tokens, expert_slots_per_expert_balanced, local_experts, seconds_per_flop,
            a2a_bytes):
    attention, dense_ffn, expert = _flops_per_token(cfg)
    out = []
    for i in range(cfg.n_layers):
        if cfg.is_moe(i):
            dense = tokens * attention * seconds_per_flop * 1e3
            experts = (local_experts * expert_slots_per_expert_balanced * expert
                       * seconds_per_flop * 1e3)
            out.append({"kind": "moe", "dense_fwd_ms": round(dense, 4),
                        "dense_bwd_ms": round(2 * dense, 4), "expert_fwd_ms": round(experts, 4),
                        "expert_bwd_ms": round(2 * experts, 4),
                        "a2a_bytes_per_routed_token": a2a_bytes})
        else:
            dense = tokens * (attention + dense_ffn) * seconds_per_flop * 1e3
            out.append({"kind": "dense", "dense_fwd_ms": round(dense, 4),
                        "dense_bwd_ms": round(2 * dense, 4), "expert_fwd_ms": 0.0,
                        "expert_bwd_ms": 0.0, "a2a_bytes_per_routed_token": 0.0})
    return out


def h200() -> dict:
    cfg = get_config("gpt_moe_125m_8e")
    tokens = 16 * cfg.seq_len
    balanced = tokens * cfg.top_k / cfg.num_experts  # per expert
    capacity = cfg.capacity_factor * balanced
    attention, dense_ffn, expert = _flops_per_token(cfg)
    n_moe = len(cfg.moe_layers)
    fwd = ((cfg.n_layers - n_moe) * tokens * (attention + dense_ffn)
           + n_moe * (tokens * attention + cfg.num_experts * capacity * expert))
    seconds_per_flop = 0.110 / (3 * fwd)
    layers = _layers(cfg, tokens, balanced, cfg.num_experts, seconds_per_flop, cfg.d_model * 4)
    # The measured step ran padded to capacity (factor 1.25): at balanced load
    # the experts' share is 1/1.25 of that; the 110 ms holds at the capacity.
    return {
        "name": "h200_gpt_moe_125m_8e", "accelerator": "NVIDIA H200 (one GPU)",
        "model": "gpt_moe_125m_8e", "tokens_per_device": tokens,
        "derivation": (
            "Measured step of gpt_moe_125m_8e, global batch 16 x 1024 tokens, one H200, "
            "fixed dispatch at capacity factor 1.25, no checkpoint: 110 ms (BUILD_NOTES 'One "
            "GPU', 2026-11-29). Spread over layers by forward FLOPs (attention 8d^2+4sd, dense "
            "FFN 4 d d_ff, one expert 4 d d_expert per token; experts at their padded "
            "capacity), backward = 2x forward; expert times given at balanced load (capacity "
            f"/ 1.25). Effective rate {1 / seconds_per_flop / 1e12:.1f} TFLOP/s. All-to-all "
            "bytes per routed token: d_model x 4 (float32)."),
        "layers": layers,
    }


def a100() -> dict:
    cfg = get_config("gpt_moe_350m_16e")
    ep, global_batch = 8, 64
    tokens = global_batch // ep * cfg.seq_len  # per GPU
    local_experts = cfg.num_experts // ep
    mfu, peak = 0.40, 312e12
    seconds_per_flop = 1.0 / (mfu * peak)
    # Each local expert receives, at balance, tokens*top_k/E from each of the ep peers.
    per_expert = tokens * cfg.top_k / cfg.num_experts * ep
    layers = _layers(cfg, tokens, per_expert, local_experts, seconds_per_flop, cfg.d_model * 2)
    return {
        "name": "a100_gpt_moe_350m_16e", "accelerator": "NVIDIA A100 80GB (one GPU of EP 8)",
        "model": "gpt_moe_350m_16e", "tokens_per_device": tokens,
        "derivation": (
            "From FLOPs: one GPU's shard of GPT-MoE-350M-16E (d_model 1024, 24 layers, MoE "
            "every other layer, top-2) under expert parallelism 8 (MoC-System ran it on A800s "
            "with EP 8-16): 2 local experts, 8 sequences x 1024 tokens per GPU (global batch "
            "64). bf16 at an assumed 40% model-FLOPs utilization of the A100's 312 TFLOP/s "
            "dense peak (124.8 TFLOP/s; MoE training reports 20-45%). Forward FLOPs: attention "
            "8d^2+4sd, dense FFN 4 d d_ff, one expert 4 d d_expert per token; backward = 2x "
            "forward; expert times at balanced load (each local expert gets tokens*top_k/E from "
            "each of the 8 EP peers). All-to-all bytes per routed token: d_model x 2 (bf16)."),
        "layers": layers,
    }


def main() -> None:
    for profile in (h200(), a100()):
        path = PROFILE_DIR / f"{profile['name']}.json"
        path.write_text(json.dumps(profile, indent=1) + "\n")
        step = sum(sum(layer[k] for k in ("dense_fwd_ms", "dense_bwd_ms", "expert_fwd_ms",
                                          "expert_bwd_ms")) for layer in profile["layers"])
        print(f"{path.name}: {len(profile['layers'])} layers, {step:.1f} ms at balanced load")


if __name__ == "__main__":
    main()
