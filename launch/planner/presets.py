"""The papers' clusters as planner inputs, and a model-table profile.

Every input of a preset is listed in its ``assumed`` notes: published ones
(the paper's own numbers) and assumed ones (what the papers' public material
does not give), so a reader sees which numbers carry the prediction.

* ``gemini_paper`` (Gemini, SOSP 2023): 16 hosts x 8 A100, 400 Gbit/s per
  host, GPT-2 100B, a ~65 s iteration of which the link is idle ~10 s, ~87 GB
  of checkpoint per host per iteration. Gemini reports no throughput
  overhead; the planner predicts none: 87 GB at 50 GB/s is 1.74 s of link,
  within the 8 s that the margin (``SCHEDULE_MARGIN``) leaves of 10 s of windows.
* ``moevement_paper`` (MoEvement, NSDI 2026): 80 Gbit/s per host,
  DeepSeek-MoE 16B (64 routed experts, top-6, 28 layers, d_model 2048).
  MoEvement reports per-iteration Gemini slowing training about 2.5x.

``profile_from_flops`` builds a profile (``models.emulation.profile``'s
class, the emulated accelerator's) from parameter counts and an
accelerator's throughput (6 FLOPs per parameter and token, a third of them
forward), for the GPT-MoE shapes of ``models.config`` and the presets.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from launch.planner.inputs import GBIT, Cluster, ModelSpec, StrategyOptions
from launch.planner.simulate import Scenario
from models.emulation.profile import AcceleratorProfile, LayerTimes

BYTES_PER_PARAM = 16
"""Mixed-precision Adam state per parameter: bf16 weight and gradient (2 + 2),
fp32 master weight (4), Adam's two moments (4 + 4)."""


@dataclasses.dataclass(frozen=True)
class Preset:
    scenario: Scenario
    trace: str
    notes: tuple[str, ...]
    paper: dict[str, Any]


def profile_from_flops(name: str, *, layers: int, moe_every: int, dense_params: float,
                       expert_params: float, tokens_per_step: int, devices: int,
                       experts_per_device: float, num_experts: int, top_k: int,
                       a2a_bytes_per_token: float, tflops: float, mfu: float,
                       first_dense: bool = False) -> AcceleratorProfile:
    """A profile from FLOPs: per layer, forward = 2 x params x tokens / (devices
    x tflops x mfu) spread over the devices, backward twice that; an expert's
    time per token on the busiest expert = 2 x expert_params x experts per
    device / (tflops x mfu) (its device runs its experts in turn), given at
    the balanced share (tokens x top_k / num_experts), as profiles give it."""
    rate = tflops * 1e12 * mfu
    balanced = tokens_per_step * top_k / num_experts
    out = []
    for i in range(layers):
        moe = (i % moe_every == moe_every - 1) and not (first_dense and i == 0)
        dense_ms = 2 * dense_params * tokens_per_step / (devices * rate) * 1e3
        expert_ms = 2 * expert_params * experts_per_device / rate * balanced * 1e3 if moe else 0.0
        out.append(LayerTimes("moe" if moe else "dense", dense_ms, 2 * dense_ms, expert_ms,
                              2 * expert_ms, a2a_bytes_per_token if moe else 0.0))
    return AcceleratorProfile(
        name=name, accelerator=f"{tflops:g} TFLOP/s at {mfu:g} MFU", model=name,
        tokens_per_device=tokens_per_step // devices,
        derivation="From FLOPs (launch.planner.presets.profile_from_flops): 2 FLOPs per "
                   "parameter and token forward, backward twice that",
        layers=tuple(out))


def gemini_paper() -> Preset:
    layers, tokens = 80, 1 << 20
    hosts = 16
    rate = 400 * GBIT
    idle_s, busy_s = 10.0, 55.0
    # Each segment: compute (link idle), then the layer's share of the link's busy time.
    bytes_per_segment = busy_s / (2 * layers) * rate
    routed_per_host = tokens / hosts
    profile = AcceleratorProfile(
        name="gemini_paper", accelerator="A100", model="gpt2_100b",
        tokens_per_device=tokens // (hosts * 8),
        derivation="Gemini's iteration: the idle 10 s and the 55 s of training traffic "
                   "split evenly over the layers' segments",
        layers=tuple(LayerTimes("dense", idle_s / (3 * layers) * 1e3,
                                2 * idle_s / (3 * layers) * 1e3, 0.0, 0.0,
                                bytes_per_segment / routed_per_host) for _ in range(layers)))
    model = ModelSpec("gpt2_100b", 87e9, 0.0, 2, 1, tokens)
    scenario = Scenario(Cluster(hosts, 8, 400, host_ram_gb=1152), profile, model,
                        StrategyOptions(replicas=2))
    notes = (
        "published (Gemini): 16 hosts x 8 A100, 400 Gbit/s per host, GPT-2 100B, "
        "~65 s iteration, ~10 s idle link, ~87 GB checkpoint per host per iteration, m=2",
        "assumed: 80 layers; the idle 10 s split evenly over the 160 layer segments "
        "(forward 1/3, backward 2/3); the 55 s of training traffic split evenly likewise",
        "assumed: the model is dense (no expert load): its trace moves nothing",
        "assumed: host RAM 1152 GB (p4d.24xlarge), chunk alpha 50 us, "
        f"margin {scenario.options.margin} (library)",
    )
    return Preset(scenario, "steady", notes, {"gemini_slowdown": 1.0})


MOEVEMENT_TOKENS = 192 * 1024
"""moevement_paper's tokens per step (assumed; see its notes)."""


def moevement_paper() -> Preset:
    hosts, devices = 4, 8
    layers, d_model, experts, top_k = 28, 2048, 64, 6
    expert = 3 * d_model * 1408
    attention, shared = 4 * d_model * d_model, 2 * expert
    total = 16.4e9
    expert_total = (layers - 1) * experts * expert
    profile = profile_from_flops(
        "moevement_paper", layers=layers, moe_every=1, dense_params=attention + shared,
        expert_params=expert, tokens_per_step=MOEVEMENT_TOKENS, devices=hosts * devices,
        experts_per_device=experts / (hosts * devices), num_experts=experts, top_k=top_k,
        a2a_bytes_per_token=0.0, tflops=312, mfu=0.35, first_dense=True)
    model = ModelSpec("deepseek_moe_16b", total * BYTES_PER_PARAM / hosts,
                      expert_total / total, experts, top_k, MOEVEMENT_TOKENS)
    scenario = Scenario(Cluster(hosts, devices, 80, host_ram_gb=900), profile, model,
                        StrategyOptions(replicas=2))
    notes = (
        "published (MoEvement): 80 Gbit/s per host, DeepSeek-MoE 16B: 16.4B parameters, "
        "28 layers (the first dense), 64 routed experts (d_ff 1408) + 2 shared, top-6, "
        "d_model 2048",
        "assumed: 4 hosts x 8 A100 (312 TFLOP/s bf16) at 35% MFU",
        f"assumed (calibrated): {MOEVEMENT_TOKENS} tokens per step; the slowdown follows "
        "the ratio of a version's link time (65.6 GB at 10 GB/s) to the iteration, and "
        "the summaries give no batch size",
        f"assumed: {BYTES_PER_PARAM} bytes of train state per parameter (mixed-precision Adam)",
        "assumed: expert parallelism inside a host (all-to-alls on NVLink, not on the "
        "inter-host link); the data-parallel gradient traffic is not modelled",
        "assumed: host RAM 900 GB, chunk alpha 50 us, "
        f"margin {scenario.options.margin} (library)",
    )
    return Preset(scenario, "steady", notes, {"gemini_slowdown": 2.5})


def table_profile(config_name: str, hosts: int, devices_per_host: int, link_gbps: float,
                  *, tflops: float = 312, mfu: float = 0.35,
                  sequences: int | None = None) -> tuple[Scenario, tuple[str, ...]]:
    """A scenario for a GPT-MoE config of ``models.config`` (FLOP-derived profile)."""
    from models.config import get_config, param_count

    cfg = get_config(config_name)
    counts = param_count(cfg)
    d = cfg.d_model
    tokens = (sequences or cfg.global_batch) * cfg.seq_len
    expert = 2 * d * cfg.d_expert
    devices = hosts * devices_per_host
    profile = profile_from_flops(
        config_name, layers=cfg.n_layers, moe_every=cfg.moe_every,
        dense_params=4 * d * d + (2 * d * cfg.d_ff if cfg.moe_every == 2 else 0) / 2,
        expert_params=expert, tokens_per_step=tokens, devices=devices,
        experts_per_device=max(1.0, cfg.num_experts / devices),
        num_experts=cfg.num_experts, top_k=cfg.top_k,
        a2a_bytes_per_token=2 * d * 2 * (1 - 1 / hosts), tflops=tflops, mfu=mfu)
    model = ModelSpec(config_name, counts["total"] * BYTES_PER_PARAM / hosts,
                      counts["expert"] / counts["total"], cfg.num_experts, cfg.top_k, tokens)
    notes = (f"{config_name} from models.config; {hosts}x{devices_per_host} at {tflops} "
             f"TFLOP/s x {mfu} MFU; {link_gbps} Gbit/s; {tokens} tokens per step; "
             f"all-to-all 2 x d_model bf16 x 2 per routed token",)
    return Scenario(Cluster(hosts, devices_per_host, link_gbps), profile, model), notes


PRESETS = {"gemini_paper": gemini_paper, "moevement_paper": moevement_paper}
