"""Predicted against measured: the planner's overhead per strategy beside a
bench run's (``launch.bench --json`` output).

A bench JSON holds per strategy ``median_step_s`` and ``ratio`` (the median
of all timed steps over ``none``'s), and with the emulated accelerator
``mean_step_s`` and ``p95_step_s``. The measured overhead is ``ratio - 1``
(median) and, where given, mean and p95 step over ``none``'s mean minus 1; the
planner's are its median / mean / p95 overheads of the same strategy. The
error is the difference, in points of ``none``'s step (the issue's 10% bar).

Design choice: the planner's scenario comes from the caller (a profile, a
cluster and a trace that describe the benched run), the JSON only supplies the
measurements; alternative not taken: guessing the scenario from the JSON's
config block, whose fields differ between bench versions.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from capricorn_jax import experimental as ex


def measured(path: str | Path) -> dict[str, dict[str, float | None]]:
    """{strategy: {"median", "mean", "p95"}} overheads of a bench JSON (None: not given).

    Raises:
      ValueError: naming the file when it has no ``strategies`` or no ``none``.
    """
    doc = json.loads(Path(path).read_text())
    strategies = doc.get("strategies")
    if not isinstance(strategies, dict) or "none" not in strategies:
        raise ValueError(f"{path}: not a bench JSON with a 'none' strategy "
                         f"(keys: {sorted(doc)})")
    base = strategies["none"]
    out = {}
    for name, row in strategies.items():
        ratio = row.get("ratio")
        if ratio is None and row.get("median_step_s") and base.get("median_step_s"):
            ratio = row["median_step_s"] / base["median_step_s"]
        entry: dict[str, float | None] = {"median": None if ratio is None else ratio - 1}
        for key, field in (("mean", "mean_step_s"), ("p95", "p95_step_s")):
            ok = row.get(field) is not None and base.get(field)
            entry[key] = row[field] / base[field] - 1 if ok else None
        out[name] = entry
    return out


def compare(measures: Mapping[str, Mapping[str, float | None]],
            predicted: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per strategy in both: measured and predicted overheads, error."""
    rows = []
    for name in predicted:
        if name not in measures:
            continue
        m, p = measures[name], predicted[name]
        row: dict[str, Any] = {"strategy": name}
        for key in ("median", "mean", "p95"):
            row[f"measured_{key}"] = m[key]
            row[f"predicted_{key}"] = p[f"overhead_{key}"]
            row[f"error_{key}"] = None if m[key] is None else p[f"overhead_{key}"] - m[key]
        rows.append(row)
    return rows


# ---------------------------------------------------------------- the bench's own scenario
BENCH_DEFAULTS = {"pec_k": 2, "profile_first_n": ex.DEFAULT_FIRST_N, "warmup": 3,
                  "a2a_steps": 2}
"""``launch.bench``'s defaults for what the JSON's config block lacks (read
from its ``command`` when given there); ``--profile_first_n``'s is the
library's ``DEFAULT_FIRST_N``."""

VARIANTS = (("blocking", "one_way"), ("fifo", "one_way"), ("fair", "one_way"),
            ("blocking", "exchange"))
"""(link discipline, link rate) of the model variants reported; the first is
the validated model: the version's bytes leave at the one-way rate (the
bench's own R uses that rate) and the step does not overlap them
(``blocking``: fifo link and ``Cluster.ckpt_blocks_step``; measured: the
overhead is the version's whole link time); the others are shown beside it
(``fifo``/``fair``: the step's compute overlaps the checkpoint)."""


def _command_flags(command: str) -> dict[str, str]:
    out = {}
    for token in command.split():
        if token.startswith("--") and "=" in token:
            key, value = token[2:].split("=", 1)
            out[key] = value
    return out


def _flag(doc: dict[str, Any], name: str) -> int:
    config = doc.get("config", {})
    if name in config:
        return int(config[name])
    return int(_command_flags(doc.get("command", "")).get(name, BENCH_DEFAULTS[name]))


def bench_scenario(doc: dict[str, Any], *, discipline: str = "fifo", rate: str = "exchange",
                   seed: int = 0) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The planner's scenario of an emulated bench run, from its JSON alone.

    Derived: the cluster (hosts, devices, replicas) and the bench's step order
    (a warm-up block of ``warmup + a2a_steps`` steps, then ``reps`` blocks of
    ``steps`` timed steps but the first, and ``a2a_steps`` probed ones); the
    link rate (the link probe's exchange or one-way rate, ``rate``); the
    compute from the run's accelerator profile (``AcceleratorProfile.paired``); the
    all-to-all bytes from none's measured all-to-all time at that rate; the
    version's bytes per host from the rows' ``ckpt_bytes_per_step`` (PEC's
    expert share from pec's at the run's K, ``--pec_k``, fixed as the bench
    fixes it); ``host_step_s`` from none's median step less the planner's
    plain step without it (none's calibration: the planner's none equals the
    measured one by construction). The load: balanced (the JSON does not
    record the per-step load; the run's extra expert time at its skew is
    then part of ``host_step_s``, spent with the link free).

    Returns:
      (scenario, shares, timed mask over the simulated steps, derived inputs).
    """
    import numpy as np

    from launch.planner import traces
    from launch.planner.inputs import GBIT, Cluster, ModelSpec, StrategyOptions
    from launch.planner.simulate import Scenario, plain_step_s
    from launch.planner.traces import tokens as to_tokens
    from launch.strategies import IN_MEMORY, spec
    from models.config import get_config
    from models.emulation.profile import DEFAULT_PROFILE, load

    c, link, rows = doc["config"], doc.get("link") or {}, doc["strategies"]
    if doc.get("accelerator") != "emulated" or not link.get("exchange_gbps"):
        raise ValueError(f"bench JSON {c}: needs --accelerator=emulated and a link probe")
    cfg = get_config(c["model"], **({"global_batch": c["global_batch"]}
                                    if c.get("global_batch") else {}))
    hosts = int(c["hosts"])
    gbps = float(link["exchange_gbps"] if rate == "exchange" else link["one_way_gbps"])
    tokens = cfg.global_batch * cfg.seq_len
    routed = tokens * cfg.top_k
    moe = tuple(cfg.is_moe(i) for i in range(cfg.n_layers))
    n_moe = sum(moe)
    a2a_total = float(rows["none"]["a2a_median_s"]) * gbps * GBIT
    per_token = a2a_total / (2 * n_moe * routed / hosts)
    emu = load(doc.get("accelerator_profile") or DEFAULT_PROFILE)
    profile = emu.paired(moe, a2a_bytes_per_routed_token=per_token)
    # ckpt_bytes_per_step sums the hosts' versions (the bench's R divides it).
    full = max(float(r.get("ckpt_bytes_per_step") or 0) for n, r in rows.items()
               if n in IN_MEMORY and not spec(n).pec) / hosts
    pec_k = _flag(doc, "pec_k")
    fraction = 0.0
    if "pec" in rows and full > 0 and pec_k < cfg.num_experts:
        kept = float(rows["pec"]["ckpt_bytes_per_step"]) / hosts / full
        fraction = min(1.0, max(0.0, (1 - kept) / (1 - pec_k / cfg.num_experts)))
    model = ModelSpec(cfg.name, full, fraction, cfg.num_experts, cfg.top_k, tokens)
    budget = float(c.get("ckpt_budget", -1))
    options = StrategyOptions(replicas=int(c["replicas"]), pec_k=pec_k, pec_dynamic=False,
                              first_n=_flag(doc, "profile_first_n"),
                              budget_s=None if budget < 0 else budget)
    warm = _flag(doc, "warmup") + _flag(doc, "a2a_steps")
    block, reps = int(c["steps"]) + _flag(doc, "a2a_steps"), int(c["reps"])
    timed = np.zeros(warm + reps * block, bool)
    for r in range(reps):
        timed[warm + r * block + 1: warm + r * block + int(c["steps"])] = True
    kind = c.get("workload") if c.get("workload") in traces.KINDS else "steady"
    # The JSON records no per-step load: balanced shares; the run's skew (its
    # capacity buckets) then sits in host_step_s with the host's own time.
    shares = np.full((len(timed), n_moe, cfg.num_experts), 1.0 / cfg.num_experts)
    del traces, seed
    cluster = Cluster(hosts, int(c["devices_per_host"]), gbps, alpha_s=0.0,
                      link_discipline="fifo" if discipline == "blocking" else discipline,
                      ckpt_blocks_step=discipline == "blocking")
    sc = Scenario(cluster, profile, model, options)
    tpe = to_tokens(shares, routed)
    plain = float(np.median([plain_step_s(sc, tpe[t]) for t in np.flatnonzero(timed)]))
    host = float(rows["none"]["median_step_s"]) - plain
    derived = {"link_gbps": gbps, "link_rate": rate, "link_discipline": discipline,
               "a2a_bytes_per_step": a2a_total, "version_bytes": full,
               "pec_expert_fraction": fraction, "pec_k": pec_k,
               "first_n": options.first_n, "margin": options.margin,
               "timed_steps": int(timed.sum()),
               "simulated_steps": len(timed), "host_step_s": max(0.0, host),
               "host_step_clamped": host < 0, "workload": kind,
               "profile": emu.name}
    sc = dataclasses.replace(sc, cluster=dataclasses.replace(cluster, host_step_s=max(0.0, host)))
    return sc, shares, timed, derived


def bootstrap(row: dict[str, Any], base: dict[str, Any], *, n: int = 2000,
              seed: int = 0) -> dict[str, float]:
    """The measured median overhead's noise: resampling each row's timed
    steps (``step_s``) with replacement, the 2.5/97.5 percentiles and the
    standard deviation of median(row) / median(none) - 1."""
    import numpy as np

    a, b = np.asarray(row["step_s"], float), np.asarray(base["step_s"], float)
    rng = np.random.default_rng(seed)
    ra = np.median(a[rng.integers(0, len(a), (n, len(a)))], axis=1)
    rb = np.median(b[rng.integers(0, len(b), (n, len(b)))], axis=1)
    ratio = ra / rb - 1
    lo, hi = np.percentile(ratio, [2.5, 97.5])
    return {"lo": float(lo), "hi": float(hi), "sd": float(ratio.std())}


def _causes(row: dict[str, Any], run: Any, timed: Any, predicted: float) -> list[str]:
    """The modelled causes of a miss (what the planner leaves out that the run had)."""
    out = []
    compiled = int(row.get("steps_compiled") or 0)
    if compiled:
        out.append(f"{compiled} of {row.get('steps_timed')} timed steps compiled a new program "
                   f"(median {row.get('compiled_median_s', 0):.2f} s); the planner models no "
                   "compile")
    profiled_bench = int(row.get("steps_profiled") or 0)
    profiled_plan = sum(1 for s in run.profiled if s < len(timed) and timed[s])
    if profiled_bench != profiled_plan:
        out.append(f"profiled timed steps: bench {profiled_bench}, planner {profiled_plan} "
                   "(the bench's trigger also fires on a new capacity bucket; the planner's "
                   "load is synthetic)")
    save_ms = (row.get("blocked_steady_ms") or row.get("blocked_ms") or {}).get("save")
    if save_ms:
        out.append(f"the training thread blocked {save_ms:.1f} ms/step in the save (host "
                   "work the planner counts as free)")
    steady = row.get("steady_ratio")
    if steady is not None and (compiled or profiled_bench):
        out.append(f"on the plain steps only (no compile, no profile: the bench's steady "
                   f"ratio) the run measured {100 * (steady - 1):+.1f}%, "
                   f"{100 * (predicted - steady + 1):+.1f} points from the prediction")
    return out


def validate_bench(path: str | Path, *, seed: int = 0) -> dict[str, Any]:
    """Predicted against measured median overhead per strategy for one bench JSON
    (every variant of ``VARIANTS``; the first is the validated model)."""
    import numpy as np

    from launch.planner.simulate import simulate
    from launch.strategies import IN_MEMORY

    doc = json.loads(Path(path).read_text())
    rows = doc["strategies"]
    names = [n for n in IN_MEMORY if n in rows]
    out: dict[str, Any] = {"file": str(path), "command": doc.get("command"),
                           "date": doc.get("date"), "link": doc.get("link"),
                           "link_idle_share": doc.get("link_idle_share"), "rows": []}
    predicted: dict[tuple[str, str], dict[str, Any]] = {}
    for discipline, rate in VARIANTS:
        sc, shares, timed, derived = bench_scenario(doc, discipline=discipline, rate=rate,
                                                    seed=seed)
        if (discipline, rate) == VARIANTS[0]:
            out["derived"] = derived
        base = simulate(sc, "none", shares)["_run"]
        none_med = float(np.median(np.asarray(base.step_s)[timed]))
        for name in names:
            run = simulate(sc, name, shares)["_run"]
            med = float(np.median(np.asarray(run.step_s)[timed]))
            predicted[(f"{discipline}/{rate}", name)] = {"overhead": med / none_med - 1,
                                                         "run": run, "timed": timed}
    key = "/".join(VARIANTS[0])
    for name in names:
        m = rows[name]["median_step_s"] / rows["none"]["median_step_s"] - 1
        p = predicted[(key, name)]
        error = p["overhead"] - m
        noise = bootstrap(rows[name], rows["none"], seed=seed)
        row = {"strategy": name, "measured": m, "measured_lo": noise["lo"],
               "measured_hi": noise["hi"], "measured_sd": noise["sd"],
               "predicted": p["overhead"], "error": error,
               "variants": {f"{d}/{r}": predicted[(f"{d}/{r}", name)]["overhead"]
                            for d, r in VARIANTS}}
        if abs(error) > 0.10:
            row["causes"] = _causes(rows[name], p["run"], p["timed"], p["overhead"])
            if noise["lo"] <= p["overhead"] <= noise["hi"]:
                row["causes"].append("the prediction lies inside the measurement's 95% "
                                     "bootstrap interval (the run's noise)")
        out["rows"].append(row)
    return out


def validation_doc(paths: list[str]) -> dict[str, Any]:
    """``results/planner/validation.json``: every bench JSON's rows (and the
    partition the planner replays, ``simulate.PARTITION``)."""
    from launch.planner.simulate import PARTITION

    runs = [validate_bench(p) for p in paths]
    errors = [abs(r["error"]) for run in runs for r in run["rows"]]
    return {"simulated": True, "model": "/".join(VARIANTS[0]), "partition": PARTITION.__name__,
            "variants": ["/".join(v) for v in VARIANTS], "runs": runs,
            "max_abs_error": max(errors) if errors else None,
            "mean_abs_error": sum(errors) / len(errors) if errors else None,
            "within_10_points": sum(e <= 0.10 for e in errors), "rows": len(errors)}
