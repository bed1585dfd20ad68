"""The paper-scale projection: what each strategy costs per step on the
papers' clusters and on the model table's GPT-MoE configs, steady and
dynamic load, simulated (``python -m launch.plan --projection``).

Scenarios: the ``gemini_paper`` and ``moevement_paper`` presets (their
clusters and models, inputs listed in ``presets``), and every ``gpt_moe_*``
config of ``models.config`` on ``GPT_MOE_CLUSTER`` (an assumed A100 cluster,
``presets.table_profile``'s FLOP-derived profile). Each runs ``STRATEGIES``
and ``none`` over the synthetic steady and dynamic traces (``traces``,
``TRACE_SEED``). The validation's error (``results/planner/validation.json``,
where present) is carried beside the numbers: the projection is only as good
as the model validated there.

Design choice: a fixed grid with few steps per cell, so it runs in seconds
and a reader reruns it; alternative not taken: a flag per axis (``launch.plan``
already takes one scenario's flags).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from launch.planner import presets, traces
from launch.planner.simulate import STRATEGIES as SIMULATED
from launch.planner.simulate import Scenario, simulate

STRATEGIES = tuple(n for n in SIMULATED if n != "none")
TRACES = ("steady", "dynamic")
TRACE_SEED = 0
DEFAULT_STEPS = 60
FIRST_N = 10
"""gemini's profiled steps here (of DEFAULT_STEPS; the library's
``DEFAULT_FIRST_N`` would leave too few scheduled steps in a short projection)."""
PEC_K = 2
"""PEC's K here, fixed (``pec_dynamic=False``), as the validated bench runs
it: with the library's dynamic K the planner's PLT prediction over these
traces raises K to every expert each version, and pec costs what inmem does."""
GPT_MOE_CLUSTER = {"hosts": 4, "devices_per_host": 8, "link_gbps": 100.0}
"""Assumed for the model table's configs: 4 hosts x 8 A100, 100 Gbit/s each."""
VALIDATION = Path("results/planner/validation.json")


def scenarios() -> list[tuple[str, Scenario, tuple[str, ...]]]:
    """(label, scenario, input notes) of every projected configuration."""
    import dataclasses

    from models.config import CONFIGS

    out = []
    for name in ("gemini_paper", "moevement_paper"):
        preset = presets.PRESETS[name]()
        out.append((name, preset.scenario, preset.notes))
    for name in CONFIGS:
        if name.startswith("gpt_moe_"):
            sc, notes = presets.table_profile(name, **GPT_MOE_CLUSTER)  # type: ignore[arg-type]
            out.append((name, sc, notes))
    return [(label, dataclasses.replace(
        sc, options=dataclasses.replace(sc.options, first_n=FIRST_N, pec_dynamic=False,
                                        pec_k=min(PEC_K, sc.model.num_experts))), notes)
        for label, sc, notes in out]


def projection(steps: int | None = None,
               validation: Path | None = VALIDATION) -> dict[str, Any]:
    """Every scenario x trace x strategy: overheads over ``none``'s step."""
    steps = steps or DEFAULT_STEPS
    t0 = time.perf_counter()
    rows = []
    inputs = {}
    for label, sc, notes in scenarios():
        inputs[label] = list(notes)
        for kind in TRACES:
            shares = traces.synthetic(kind, steps, len(sc.profile.moe_layers),
                                      sc.model.num_experts, TRACE_SEED)
            none = simulate(sc, "none", shares)
            base = none["median_step_s"]
            for name in STRATEGIES:
                r = simulate(sc, name, shares)
                rows.append({
                    "scenario": label, "model": sc.model.name, "trace": kind,
                    "cluster": f"{sc.cluster.hosts}x{sc.cluster.devices_per_host}, "
                               f"{sc.cluster.link_gbps:g} Gbit/s",
                    "strategy": name, "none_step_s": base,
                    "overhead_median": r["median_step_s"] / base - 1,
                    "overhead_mean": r["mean_step_s"] / none["mean_step_s"] - 1,
                    "overhead_p95": r["p95_step_s"] / none["p95_step_s"] - 1,
                    "versions_taken": r["versions_taken"],
                    "versions_skipped": r["versions_skipped"],
                    "ram_per_host_gb": r["ram_per_host_gb"], "ettr": r["ettr"],
                    "lost_per_failure_s": r["lost_per_failure_s"]})
    doc: dict[str, Any] = {"simulated": True, "steps": steps, "trace_seed": TRACE_SEED,
                           "first_n": FIRST_N, "pec_k": PEC_K, "pec_dynamic": False,
                           "gpt_moe_cluster": GPT_MOE_CLUSTER,
                           "command": "python -m launch.plan --projection", "rows": rows,
                           "inputs": inputs}
    if validation is not None and validation.is_file():
        v = json.loads(validation.read_text())
        doc["validation"] = {"file": str(validation), "model": v.get("model"),
                             "max_abs_error": v.get("max_abs_error"),
                             "mean_abs_error": v.get("mean_abs_error"),
                             "within_10_points": v.get("within_10_points"),
                             "rows": v.get("rows")}
    doc["wall_s"] = round(time.perf_counter() - t0, 2)
    return doc


def table(doc: dict[str, Any]) -> str:
    """Markdown: one row per scenario and trace, a column per strategy
    (median overhead over none's step), labelled as simulated."""
    lines = [f"Simulated (`{doc['command']}`, {doc['steps']} steps per cell, median step "
             "over none's):"]
    v = doc.get("validation")
    if v:
        lines.append(f"validation ({v['file']}, model {v['model']}): mean |error| "
                     f"{100 * v['mean_abs_error']:.1f} points, max {100 * v['max_abs_error']:.1f}"
                     f", {v['within_10_points']}/{v['rows']} rows within 10 points")
    lines += ["", "| scenario | cluster | trace | none step (s) | " + " | ".join(STRATEGIES)
              + " |", "|---|---|---|---|" + "---|" * len(STRATEGIES)]
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    for r in doc["rows"]:
        cell = cells.setdefault((r["scenario"], r["trace"]), {"row": r})
        skipped = f" ({r['versions_skipped']} skipped)" if r["versions_skipped"] else ""
        cell[r["strategy"]] = f"{100 * r['overhead_median']:+.1f}%{skipped}"
    for (scenario, kind), cell in cells.items():
        r = cell["row"]
        lines.append(f"| {scenario} | {r['cluster']} | {kind} | {r['none_step_s']:.3g} | "
                     + " | ".join(cell.get(n, "-") for n in STRATEGIES) + " |")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str | Path) -> None:
    """Grouped bars: median overhead per scenario (dynamic trace solid,
    steady hatched), one bar per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios_ = list(dict.fromkeys(r["scenario"] for r in doc["rows"]))
    fig, axes = plt.subplots(1, len(TRACES), figsize=(12, 4), sharey=True)
    width = 0.8 / len(STRATEGIES)
    for ax, kind in zip(axes, TRACES, strict=True):
        for i, name in enumerate(STRATEGIES):
            values = [next((100 * r["overhead_median"] for r in doc["rows"]
                            if r["scenario"] == s and r["trace"] == kind
                            and r["strategy"] == name), 0.0) for s in scenarios_]
            ax.bar([j + (i - len(STRATEGIES) / 2 + 0.5) * width for j in range(len(scenarios_))],
                   values, width, label=name)
        ax.set_xticks(range(len(scenarios_)), scenarios_, rotation=25, ha="right", fontsize=8)
        ax.set_title(f"{kind} load (simulated)")
        ax.set_yscale("symlog", linthresh=1.0)
    axes[0].set_ylabel("median step overhead over none, %")
    axes[-1].legend(fontsize=8)
    v = doc.get("validation")
    if v:
        fig.suptitle(f"launch.plan --projection (simulated; validation mean |error| "
                     f"{100 * v['mean_abs_error']:.1f} points)", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
