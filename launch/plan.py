"""``python -m launch.plan``: what in-memory checkpointing costs on a cluster.

Simulates N steps of a cluster (``launch.planner``) for each strategy and
prints per strategy the step overhead (median, mean, p95 over the plain
step at each step's load), versions taken and skipped, RAM per host, and the
training time lost per failure with the effective training-time ratio at
``--mtbf_h``. Examples::

    python -m launch.plan                                  # moevement_paper, steady
    python -m launch.plan --preset=gemini_paper --json=plan.json --plot=plan.png
    python -m launch.plan --preset=none --model=gpt_moe_1p3b_64e --hosts=8 \\
        --devices_per_host=8 --link_gbps=100 --trace=dynamic
    python -m launch.plan --validate=A.json,B.json   # predicted vs measured (emulated runs)
    python -m launch.plan --projection               # paper-scale: presets x traces

Flags are defined on a FlagValues of this module's own (``make_flags``), so
importing it defines no global flag. The cluster, model, steps and checkpoint
flags are ``launch.cli_flags``' (one meaning in every command; here unset
means the preset's value); the planner's own are named for what they are
(``--trace_seed``, not the job's ``--seed``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from absl import app, flags

from launch.planner import presets, traces, validate
from launch.planner.inputs import FailureModel
from launch.planner.simulate import STRATEGIES, Scenario, simulate
from models.emulation import profile as accelerator_profile

SHARED_FLAGS = {"cluster": ("hosts", "devices_per_host"), "links": ("link_gbps",),
                "model": ("model",), "data": ("steps",),
                "checkpoint": ("replicas", "pec_k", "ckpt_budget"),
                "accelerator": ("accelerator_profile",), "output": ("json",)}
"""The ``launch.cli_flags`` flags the planner takes, with their meaning there
(a simulated job's hosts, model, steps, ...)."""
PLAN_DEFAULTS = {"hosts": None, "devices_per_host": None, "link_gbps": None, "model": None,
                 "steps": 200, "replicas": None, "pec_k": None, "ckpt_budget": None,
                 "accelerator_profile": ""}
"""Unset (None, ''): the preset's value; given, it replaces the preset's."""


def make_flags() -> flags.FlagValues:
    """The planner's flags on a FlagValues of their own."""
    return define_flags(flags.FlagValues())


def define_flags(fv: flags.FlagValues) -> flags.FlagValues:
    """Defines the planner's flags into ``fv``: the shared ones (``SHARED_FLAGS``
    with ``PLAN_DEFAULTS``) and its own."""
    from launch import cli_flags

    cli_flags.define(fv, SHARED_FLAGS, PLAN_DEFAULTS)
    flags.DEFINE_string("preset", "moevement_paper",
                        f"one of {sorted(presets.PRESETS)} or 'none' (build from the flags: "
                        f"--model, --hosts, --devices_per_host and --link_gbps)",
                        flag_values=fv)
    flags.DEFINE_list("strategies", list(STRATEGIES), "strategies to simulate", flag_values=fv)
    flags.DEFINE_string("trace", None, "steady | dynamic | PATH of a metrics.jsonl "
                        "(default: the preset's)", flag_values=fv)
    flags.DEFINE_integer("trace_seed", 0, "seed of a synthetic trace", flag_values=fv)
    flags.DEFINE_float("host_ram_gb", None, "host RAM, GB", flag_values=fv)
    flags.DEFINE_float("state_gb_per_host", None, "override: train state per host, GB",
                       flag_values=fv)
    flags.DEFINE_float("mtbf_h", 24.0, "mean time between failures, hours", flag_values=fv)
    flags.DEFINE_string("plot", None, "write a plot here (matplotlib)", flag_values=fv)
    flags.DEFINE_list("validate", [], "emulated bench JSON(s): derive each run's cluster "
                      "from its JSON, simulate it, print predicted against measured overhead "
                      "per strategy and write --validation_json (no other simulation)",
                      flag_values=fv)
    flags.DEFINE_string("validation_json", "results/planner/validation.json",
                        "--validate writes its report here", flag_values=fv)
    flags.DEFINE_bool("projection", False, "the paper-scale projection (launch.planner."
                      "projection): presets x traces x strategies; writes --projection_json "
                      "and --projection_png", flag_values=fv)
    flags.DEFINE_string("projection_json", "results/planner/projection.json",
                        "--projection writes its table here", flag_values=fv)
    flags.DEFINE_string("projection_png", "results/planner/projection.png",
                        "--projection writes its plot here", flag_values=fv)
    return fv


def scenario_from(fv: flags.FlagValues) -> tuple[Scenario, str, tuple[str, ...]]:
    """The scenario, the default trace kind and the notes listing the inputs."""
    if fv.preset == "none":
        if not (fv.model and fv.hosts and fv.devices_per_host and fv.link_gbps):
            raise app.UsageError("--preset=none needs --model, --hosts, --devices_per_host "
                                 "and --link_gbps")
        sc, notes = presets.table_profile(fv.model, fv.hosts, fv.devices_per_host, fv.link_gbps)
        kind = "dynamic"
    elif fv.preset in presets.PRESETS:
        preset = presets.PRESETS[fv.preset]()
        sc, notes, kind = preset.scenario, preset.notes, preset.trace
    else:
        raise app.UsageError(f"--preset={fv.preset!r}: one of {sorted(presets.PRESETS)} or none")
    cluster = sc.cluster
    for name in ("hosts", "devices_per_host", "link_gbps", "host_ram_gb"):
        if fv[name].value is not None and fv.preset != "none":
            cluster = dataclasses.replace(cluster, **{name: fv[name].value})  # type: ignore[arg-type]
            notes += (f"--{name}={fv[name].value} replaces the preset's",)
    model = sc.model
    if fv.state_gb_per_host is not None:
        model = dataclasses.replace(model, state_bytes_per_host=fv.state_gb_per_host * 1e9)
    profile = sc.profile
    if fv.accelerator_profile:
        profile = accelerator_profile.load(fv.accelerator_profile)
        notes += (f"profile {profile.name} from {fv.accelerator_profile}",)
    options = sc.options
    for flag, name in (("replicas", "replicas"), ("pec_k", "pec_k"), ("ckpt_budget", "budget_s")):
        if fv[flag].value is not None:
            options = dataclasses.replace(options, **{name: fv[flag].value})  # type: ignore[arg-type]
    failure = FailureModel(mtbf_h=fv.mtbf_h)
    return Scenario(cluster, profile, model, options, failure), kind, notes


def load_trace(fv: flags.FlagValues, sc: Scenario, kind: str) -> Any:
    trace = fv.trace or kind
    layers, experts = len(sc.profile.moe_layers), sc.model.num_experts
    if trace in traces.KINDS:
        return traces.synthetic(trace, fv.steps, layers, experts, fv.trace_seed)
    return traces.fit_shape(traces.from_metrics(trace), fv.steps, layers, experts)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def table(results: dict[str, dict[str, Any]]) -> str:
    head = (f"{'strategy':14} {'step_s':>8} {'median':>8} {'mean':>8} {'p95':>8} "
            f"{'taken':>6} {'skip':>5} {'RAM/host GB':>11} {'lost/fail s':>11} {'ETTR':>6}")
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        lines.append(f"{name:14} {r['mean_step_s']:8.3f} {_pct(r['overhead_median']):>8} "
                     f"{_pct(r['overhead_mean']):>8} {_pct(r['overhead_p95']):>8} "
                     f"{r['versions_taken']:6d} {r['versions_skipped']:5d} "
                     f"{r['ram_per_host_gb']:11.1f} {r['lost_per_failure_s']:11.0f} "
                     f"{r['ettr']:6.3f}")
    return "\n".join(lines)


def validation_table(doc: dict[str, Any]) -> str:
    """Predicted against measured median overhead (points of none's step)."""
    lines = [f"{'run':34} {'strategy':14} {'measured [95% boot]':>22} {'predicted':>9} "
             f"{'error':>7}  model {doc['model']}"]
    for run in doc["runs"]:
        for r in run["rows"]:
            noise = f"{_pct(r['measured'])} [{_pct(r['measured_lo'])},{_pct(r['measured_hi'])}]"
            lines.append(f"{Path(run['file']).name:34} {r['strategy']:14} {noise:>22} "
                         f"{_pct(r['predicted']):>9} {_pct(r['error']):>7}")
    lines.append(f"max |error| {_pct(doc['max_abs_error'])}, mean {_pct(doc['mean_abs_error'])}"
                 f", within 10 points: {doc['within_10_points']}/{doc['rows']}")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, key in enumerate(("overhead_median", "overhead_mean", "overhead_p95")):
        ax.bar([j + 0.27 * (i - 1) for j in range(len(names))],
               [100 * results[n][key] for n in names], 0.27, label=key.split("_")[1])
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("step overhead, % (simulated)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _write(path: str, doc: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1, default=float) + "\n")


def run(fv: flags.FlagValues) -> dict[str, Any]:
    doc: dict[str, Any]
    if fv.validate:
        doc = validate.validation_doc(fv.validate)
        doc["command"] = "python -m launch.plan --validate=" + ",".join(fv.validate)
        print(validation_table(doc))
        for run_doc in doc["runs"]:
            for r in run_doc["rows"]:
                for cause in r.get("causes", []):
                    print(f"  {Path(run_doc['file']).name} {r['strategy']}: {cause}")
        _write(fv.validation_json, doc)
        return doc
    if fv.projection:
        from launch.planner import projection

        doc = projection.projection(steps=fv.steps if fv["steps"].present else None)
        print(projection.table(doc))
        _write(fv.projection_json, doc)
        projection.plot(doc, fv.projection_png)
        return doc
    unknown = [s for s in fv.strategies if s not in STRATEGIES]
    if unknown:
        raise app.UsageError(f"--strategies: unknown {unknown}; known {list(STRATEGIES)}")
    sc, kind, notes = scenario_from(fv)
    shares = load_trace(fv, sc, kind)
    t0 = time.perf_counter()
    results = {}
    for name in fv.strategies:
        r = simulate(sc, name, shares)
        r.pop("_run")
        results[name] = r
    title = (f"{fv.preset} ({sc.model.name}, {sc.cluster.hosts}x{sc.cluster.devices_per_host}, "
             f"{sc.cluster.link_gbps:g} Gbit/s, trace {fv.trace or kind}, {fv.steps} steps)")
    print(f"simulated: {title}")
    print(table(results))
    print("inputs:\n  " + "\n  ".join(notes))
    doc = {
        "simulated": True, "preset": fv.preset, "trace": fv.trace or kind, "steps": fv.steps,
        "seed": fv.trace_seed, "cluster": dataclasses.asdict(sc.cluster),
        "model": dataclasses.asdict(sc.model), "options": dataclasses.asdict(sc.options),
        "failure": dataclasses.asdict(sc.failure), "profile": sc.profile.name,
        "inputs": list(notes), "strategies": results,
        "wall_s": round(time.perf_counter() - t0, 2), "command": " ".join(sys.argv),
    }
    if fv.json:
        _write(fv.json, doc)
    if fv.plot:
        plot(results, fv.plot, title)
    return doc


def main(argv: list[str]) -> None:
    fv = make_flags()
    try:
        rest = fv(argv)
    except flags.Error as e:
        raise app.UsageError(str(e)) from e
    if len(rest) > 1:
        raise app.UsageError(f"unexpected arguments {rest[1:]}")
    run(fv)


if __name__ == "__main__":
    try:
        main(sys.argv)
    except (app.UsageError, ValueError) as e:
        sys.exit(f"launch.plan: {e}")
