"""Does an MoE layer's time follow its expert load? (bucketed vs fixed dispatch)

    python -m launch.experiments.moe_load --model=small --devices=4 --repeats=20 \
        --json=/tmp/moe_load.json

What it measures: one expert-parallel ``MoEFeedForward`` layer of ``--model``
on a (data=1, expert=N) mesh of N forced CPU devices, with the config's
global_batch x seq_len tokens sharded over the batch axes (one capacity group
per device). For each skew level it times the jitted forward+backward
(``jax.grad`` of the sum of the outputs w.r.t. params and inputs) at the
capacity factor ``bucketed`` dispatch picks for that load
(models.capacity.choose_capacity_factors) and at the ``fixed`` factor.

How the load is set: the router is 0 except ``router[e, e] = 1`` for e < E,
and the first E input features of each token are a routing code (4 on its
first choice, 3 on its second, 0 elsewhere; the other features are N(0, 1)).
Skew p = the fraction of tokens of every group that have expert 0 among their
top-k choices (exactly round(p*T) per group); their other choices, and all
choices of the remaining tokens, are distinct random experts among 1..E-1.
``uniform`` = k/E, i.e. uniformly random choices. The load reported is the
layer's own ``max_routed`` stat (most assignments on one expert in one group).

Timing: each compiled variant is run once before timing (compile + warm-up);
then ``--repeats`` rounds, each running every (skew, mode) once, to
block_until_ready, in an order rotated every round; median, p10-p90 and min in
ms. ``ratio`` is the median over rounds of bucketed/fixed time of the same
round (robust to the host's speed changing between rounds; on a shared 2-core
VM plain matmul throughput was seen to swing 28-65 GFLOP/s within seconds).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined only when run as a command: a test or
    another launcher importing this module for its logic must not define
    flags of the same names twice."""
    flags.DEFINE_string("model", "small", "Model config (models.config.CONFIGS).")
    flags.DEFINE_integer("devices", 4, "CPU devices to force; the expert axis spans all of them.")
    flags.DEFINE_integer("repeats", 20, "Timed runs per mode and skew.")
    flags.DEFINE_list("skews", ["uniform", "0.4", "0.6", "0.8", "1.0"],
                      "Fraction of each group's tokens routed to expert 0 ('uniform' = k/E).")
    flags.DEFINE_integer("seed", 0, "Seed of the params and activations.")
    flags.DEFINE_string("json", None, "Write the result to this JSON file.")


def routed_inputs(num_experts: int, top_k: int, d_model: int, groups: int, tokens: int,
                  skew: float, seed: int) -> Any:
    """[groups, tokens, d_model] float32 activations whose routing code sends
    exactly round(skew * tokens) tokens of each group to expert 0."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((groups, tokens, d_model)).astype(np.float32)
    others = np.argsort(rng.random((groups, tokens, num_experts - 1)), axis=-1) + 1
    hit = np.zeros((groups, tokens), bool)
    for g in range(groups):
        hit[g, rng.permutation(tokens)[: round(skew * tokens)]] = True
    choices = np.where(hit[..., None], np.concatenate([np.zeros_like(others[..., :1]),
                                                       others[..., :-1]], -1), others)
    code = np.zeros((groups, tokens, num_experts), np.float32)
    for j, value in enumerate((4.0, 3.0)[:top_k]):
        np.put_along_axis(code, choices[..., j : j + 1], value, axis=-1)
    x[..., :num_experts] = code
    return x


def _stats(ms: list[float]) -> dict[str, Any]:
    import numpy as np

    p10, p50, p90 = np.percentile(ms, [10, 50, 90])
    return {"median": float(p50), "p10": float(p10), "p90": float(p90),
            "min": float(min(ms)), "max": float(max(ms)), "samples": [round(t, 2) for t in ms]}


def measure(model: str, devices: int, repeats: int, skews: Sequence[str | float],
            seed: int = 0) -> dict[str, Any]:
    """Runs the measurement on the first ``devices`` JAX devices; see the module doc."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from launch.trainer import make_mesh
    from models.capacity import choose_capacity_factors
    from models.config import capacity, get_config
    from models.gpt import BATCH_AXES, MoEFeedForward, param_partition_specs

    cfg = get_config(model)
    e, k, d = cfg.num_experts, cfg.top_k, cfg.d_model
    if len(jax.devices()) < devices:
        raise ValueError(f"need {devices} devices, JAX has {len(jax.devices())}")
    if e % devices or cfg.global_batch % devices or d < e or repeats < 1:
        raise ValueError(f"{model}: num_experts={e} and global_batch={cfg.global_batch} must be "
                         f"divisible by --devices={devices}, d_model >= E, repeats >= 1")
    mesh = make_mesh(devices, jax.devices()[:devices])
    bucketed = dataclasses.replace(cfg, dispatch="bucketed")
    fixed = dataclasses.replace(cfg, dispatch="fixed")
    tpg = cfg.global_batch * cfg.seq_len // devices
    layer = MoEFeedForward(cfg, mesh)
    x_sharding = NamedSharding(mesh, P(BATCH_AXES))
    shape = (cfg.global_batch, cfg.seq_len, d)
    params = MoEFeedForward(cfg, None, devices).init(
        jax.random.key(seed), jnp.zeros(shape), cfg.capacity_factor)["params"]
    params["router"] = jnp.eye(d, e, dtype=jnp.float32)
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                 param_partition_specs(params)))

    @functools.cache
    def fns(factor: float) -> tuple[Any, Any]:
        def loss(p, x):
            return jnp.sum(layer.apply({"params": p}, x, factor)[0])
        fwd = jax.jit(lambda p, x: layer.apply({"params": p}, x, factor)[1])
        return fwd, jax.jit(jax.grad(loss, argnums=(0, 1)))

    def timed(factor: float, x: Any) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(fns(factor)[1](params, x))
        return (time.perf_counter() - t0) * 1e3

    rows: list[dict[str, Any]] = []
    inputs: list[jax.Array] = []
    for s in skews:
        try:
            skew = k / e if s == "uniform" else float(s)
        except ValueError:
            raise ValueError(f"skew {s!r} is neither a number nor 'uniform'") from None
        if not k / e <= skew <= 1:
            raise ValueError(f"skew {s} outside [k/E={k / e}, 1]")
        x = jax.device_put(routed_inputs(e, k, d, devices, tpg, skew, seed + 1).reshape(shape),
                           x_sharding)
        max_routed = int(fns(cfg.capacity_factor)[0](params, x)[2])
        n_moe = len(cfg.moe_layers)
        cf_b = choose_capacity_factors(bucketed, [max_routed] * n_moe, tpg)[0]
        cf_f = choose_capacity_factors(fixed, [max_routed] * n_moe, tpg)[0]
        for cf in (cf_b, cf_f):
            timed(cf, x)  # compile (once per factor) + warm-up
        drops = {cf: int(fns(cf)[0](params, x)[1]) for cf in (cf_b, cf_f)}
        inputs.append(x)
        rows.append({"skew": s, "skew_fraction": skew, "max_routed": max_routed,
                     "capacity_factor_bucketed": cf_b, "capacity_factor_fixed": cf_f,
                     "capacity_bucketed": capacity(cfg, tpg, cf_b),
                     "capacity_fixed": capacity(cfg, tpg, cf_f),
                     "dropped_bucketed": drops[cf_b], "dropped_fixed": drops[cf_f]})
    # Every repeat runs all (skew, mode) variants, in an order rotated by one each
    # time, so slow phases of a shared host hit all of them alike.
    variants = [(i, mode) for i in range(len(rows)) for mode in ("bucketed", "fixed")]
    ms: dict[tuple[int, str], list[float]] = {v: [] for v in variants}
    for rep in range(repeats):
        shift = rep % len(variants)
        for i, mode in variants[shift:] + variants[:shift]:
            ms[i, mode].append(timed(rows[i][f"capacity_factor_{mode}"], inputs[i]))
    for i, row in enumerate(rows):
        b, f = ms[i, "bucketed"], ms[i, "fixed"]
        row.update(bucketed_ms=_stats(b), fixed_ms=_stats(f),
                   ratio=statistics.median(x / y for x, y in zip(b, f, strict=True)),
                   ratio_of_medians=statistics.median(b) / statistics.median(f))
    return {"model": model, "devices": devices, "repeats": repeats, "tokens_per_group": tpg,
            "even_share": tpg * k / e, "top_k": k, "num_experts": e,
            "platform": jax.devices()[0].platform, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    """The result as a markdown table."""
    def ms(t: dict[str, float]) -> str:
        return f"{t['median']:.1f} ({t['p10']:.1f}-{t['p90']:.1f})"

    lines = [
        f"model={result['model']} devices={result['devices']} repeats={result['repeats']} "
        f"tokens/group={result['tokens_per_group']} even share={result['even_share']:g}",
        "",
        "| skew | max tokens on one expert/group | CF bucketed (cap) | bucketed ms median "
        "(p10-p90) | fixed ms median (p10-p90) [CF] | min ms b / f | ratio b/f | dropped b / f |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['skew']} ({r['skew_fraction']:.2f}) | {r['max_routed']} | "
            f"{r['capacity_factor_bucketed']:g} ({r['capacity_bucketed']}) | "
            f"{ms(r['bucketed_ms'])} | {ms(r['fixed_ms'])} [{r['capacity_factor_fixed']:g}] | "
            f"{r['bucketed_ms']['min']:.1f} / {r['fixed_ms']['min']:.1f} | "
            f"{r['ratio']:.2f} | {r['dropped_bucketed']} / {r['dropped_fixed']} |")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.devices < 1:
        raise app.UsageError(f"--devices must be >= 1, got {FLAGS.devices}")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={FLAGS.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        result = measure(FLAGS.model, FLAGS.devices, FLAGS.repeats, FLAGS.skews, FLAGS.seed)
        print(markdown(result))
        if FLAGS.json:
            with open(FLAGS.json, "w") as f:
                json.dump(result, f, indent=2)
    except (ValueError, KeyError, OSError) as err:
        print(f"moe_load: error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
