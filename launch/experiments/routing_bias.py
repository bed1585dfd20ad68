"""How large are the tiny model's load shifts, with and without the routing bias?

    python -m launch.experiments.routing_bias --model=tiny --steps=60 --shift_every=10

Trains ``--model`` in this process on ``--devices`` forced CPU devices (an
expert-parallel mesh as launch.train builds it, its expert axis their gcd with
the experts; bucketed dispatch as the bench runs) on the dynamic workload,
once per ``--biases`` value (``none`` and the named schedules of
``models.routing_bias``), same seed, same data. Per step
and MoE layer it reads the real ``tokens_per_expert`` (kept assignments) and
prints:

- ``max/mean``: the busiest expert's kept tokens over the mean expert's;
- ``scale``: the busiest expert's kept tokens over the balanced share
  (tokens x top_k / experts), what ``models.emulation.layers.expert_scale``
  computes on the device that holds that expert (it receives every source's
  tokens for it), so the emulated step's layer waits this scale times the
  profile's balanced expert fwd+bwd time (``--accelerator_profile``'s
  ``on_layers``);
- per shift period (domain): the means of both, the implied expert wait, and
  how much the wait moved from the period before ("a shift moves layer L's
  expert wait by X ms").

No emulation runs here (the model computes): the wait is implied from the
measured loads and the profile, which is all the emulated step does with them.
``--json`` gets per bias the per-step records and the per-period rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Sequence

from absl import app, flags

FLAGS = flags.FLAGS


# launch.cli_flags groups (and their flags) the command takes, same meaning as
# in launch.train (this one trains in its own process, on --devices).
SHARED_FLAGS = {"model": ("model",), "data": ("steps", "seed", "shift_every"),
                "accelerator": ("accelerator_profile",), "output": ("json",),
                "process": ("devices",)}
ROUTING_BIAS_DEFAULTS = {"steps": 60, "shift_every": 10}
"""Its own defaults of those flags (the measurement in BUILD_NOTES.md)."""


def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """The command's flags (defined only when run as a command, or by a test on
    a fresh ``fv``)."""
    from launch import cli_flags

    cli_flags.define(fv, SHARED_FLAGS, ROUTING_BIAS_DEFAULTS)
    flags.adopt_module_key_flags(cli_flags, flag_values=fv)
    flags.DEFINE_list("biases", ["none", "cong24"], "Routing bias values to compare.",
                      flag_values=fv)
    return fv


@dataclasses.dataclass(frozen=True)
class StepLoad:
    """One step's loads: per MoE layer, max/mean and the emulation's scale."""

    step: int
    domain: str
    ratio: tuple[float, ...]
    scale: tuple[float, ...]


def loads(tokens_per_expert, tokens: int, top_k: int) -> tuple[list[float], list[float]]:
    """Per MoE layer (rows of ``tokens_per_expert``): (max/mean, max/balanced share)."""
    import numpy as np

    tpe = np.asarray(tokens_per_expert, dtype=np.float64)
    balanced = tokens * top_k / tpe.shape[1]
    return ([float(r.max() / max(r.mean(), 1e-9)) for r in tpe],
            [float(r.max() / balanced) for r in tpe])


def run(model: str, steps: int, shift_every: int, bias: str, seed: int = 0,
        corpus=None) -> list[StepLoad]:
    """Trains ``steps`` steps of the dynamic workload with routing bias ``bias``
    (``none`` or a schedule name) on this process's devices; the loads per step."""
    import jax

    from launch.data import Corpus, DataIterator, DataOptions
    from launch.trainer import OptimizerOptions, Trainer, make_mesh
    from models import routing_bias
    from models.config import get_config

    cfg = get_config(model, dispatch="bucketed")
    devices = jax.devices()
    options = DataOptions(seq_len=cfg.seq_len, batch_per_host=cfg.global_batch,
                          workload="dynamic", shift_every=shift_every, seed=seed)
    corpus = corpus if corpus is not None else Corpus.load(options.max_bytes_per_domain)
    data = DataIterator(options, 0, 1, corpus)
    table = None if bias == routing_bias.NONE else routing_bias.build(
        bias, num_experts=cfg.num_experts, top_k=cfg.top_k, n_moe=len(cfg.moe_layers),
        n_domains=len(corpus.names), shift_every=shift_every, seed=seed)
    trainer = Trainer(cfg, make_mesh(math.gcd(cfg.num_experts, len(devices)), devices),
                      OptimizerOptions(total_steps=steps), routing_bias=table)
    state, factors = trainer.init_state(seed), None
    out = []
    for step in range(steps):
        domain = data.domain
        batch = trainer.global_batch(data.next_batch())
        factors = factors or (cfg.capacity_factor,) * len(cfg.moe_layers)
        state, metrics = trainer.step_fn(factors)(state, batch)
        ratio, scale = loads(metrics["tokens_per_expert"], cfg.global_batch * cfg.seq_len,
                             cfg.top_k)
        out.append(StepLoad(step, domain, tuple(ratio), tuple(scale)))
        factors = trainer.next_factors(metrics)
    return out


def expert_ms(model: str, profile: str = "") -> list[float]:
    """Per MoE layer of ``model``: the profile's balanced expert fwd+bwd (ms)."""
    from models.config import get_config
    from models.emulation.profile import DEFAULT_PROFILE, load

    cfg = get_config(model)
    times = load(profile or DEFAULT_PROFILE).on_layers(
        tuple(cfg.is_moe(i) for i in range(cfg.n_layers)))
    return [times[i].expert_fwd_ms + times[i].expert_bwd_ms for i in cfg.moe_layers]


def periods(records: Sequence[StepLoad], shift_every: int, balanced_ms: Sequence[float]
            ) -> list[dict]:
    """Per shift period: its domain, and per layer the mean max/mean, mean
    scale, the implied expert wait (ms) and its move from the period before."""
    out: list[dict] = []
    for start in range(0, len(records), shift_every):
        chunk = records[start:start + shift_every]
        layers = []
        for layer, ms in enumerate(balanced_ms):
            scale = statistics.fmean(r.scale[layer] for r in chunk)
            wait = scale * ms
            moved = wait - out[-1]["layers"][layer]["wait_ms"] if out else math.nan
            layers.append({"ratio": statistics.fmean(r.ratio[layer] for r in chunk),
                           "ratio_max": max(r.ratio[layer] for r in chunk),
                           "scale": scale, "wait_ms": wait, "moved_ms": moved})
        out.append({"period": start // shift_every, "domain": chunk[0].domain,
                    "layers": layers})
    return out


def table(name: str, rows: list[dict], moe_layers: Sequence[int]) -> str:
    """A markdown table of ``periods``' rows."""
    head = "| bias | period | domain | " + " | ".join(
        f"L{i} max/mean | L{i} wait ms (moved)" for i in moe_layers) + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(moe_layers))]
    for row in rows:
        cells = [f"{x['ratio']:.2f} (max {x['ratio_max']:.2f}) | {x['wait_ms']:.1f} "
                 f"({x['moved_ms']:+.1f})" for x in row["layers"]]
        lines.append(f"| {name} | {row['period']} | {row['domain']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    del argv
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={FLAGS.devices}").strip()
    from models.config import get_config

    balanced_ms = expert_ms(FLAGS.model, FLAGS.accelerator_profile)
    moe_layers = get_config(FLAGS.model).moe_layers
    print(f"balanced expert fwd+bwd per MoE layer {list(moe_layers)}: "
          + ", ".join(f"{ms:.1f} ms" for ms in balanced_ms))
    result = {}
    for bias in FLAGS.biases:
        records = run(FLAGS.model, FLAGS.steps, FLAGS.shift_every, bias, FLAGS.seed)
        rows = periods(records, FLAGS.shift_every, balanced_ms)
        print(table(bias, rows, moe_layers), flush=True)
        for layer, i in enumerate(moe_layers):
            moved = [abs(r["layers"][layer]["moved_ms"]) for r in rows[1:]]
            mean = statistics.fmean(r.ratio[layer] for r in records)
            print(f"{bias}: layer {i}: max/mean mean {mean:.2f}, a shift moves the expert "
                  f"wait by {min(moved):.1f}-{max(moved):.1f} ms "
                  f"(mean {statistics.fmean(moved):.1f})")
        result[bias] = {"steps": [dataclasses.asdict(r) for r in records], "periods": rows}
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before define_flags imports JAX (cli_flags)
    define_flags()
    app.run(main)
