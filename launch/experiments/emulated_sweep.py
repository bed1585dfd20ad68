"""The emulated-accelerator sweep: overhead against R, the checkpoint's share of the idle link.

    python -m launch.experiments.emulated_sweep run --out=results/emulated/sweep \
        [--r=0.25,0.5,0.75,1.0,1.5] [--workloads=dynamic,steady] [--topologies=2x2,4x1] \
        [--reps=3] [--steps=8] [--dry_run]
    python -m launch.experiments.emulated_sweep plot results/emulated/sweep/*.json \
        --png=results/emulated/sweep.png

``run`` runs one ``launch.bench --accelerator=emulated`` per point of the grid
(topology x workload x R), each with every strategy of ``--strategies`` in
interleaved repetitions, and writes its JSON as
``OUT/bench_{topology}_{workload}_r{R}.json`` (``_priority`` appended with
``--traffic_class=priority``, ``_mtu{N}`` with ``--link_mtu=N``). The flags it
passes on to every point's bench (``--strategies``, ``--reps``, ``--steps``,
``--shift_every``, the links' and the accelerator profile's) are launch.bench's,
with the sweep's own defaults (``SWEEP_DEFAULTS``). R is set by the link rate:
R = (bytes a host sends per version / link rate) / (none's idle link time per
step), so the rate for a target R is ``r_per_gbps / R`` where ``r_per_gbps``
(R at 1 Gbit/s, per topology) comes from an earlier run of the same model and
profile (``--r_per_gbps``). Each JSON records the R it measured
(``link_idle_share``); the plot and tables use the measured R, never the
target. Points above ``--budget_above_r`` run with the in-memory tier's cost
budget on (``--ckpt_budget``): there the interval between versions is meant to
grow instead of the step.

``plot`` draws, per workload, each strategy's median step over none's against
the measured R (one line per strategy and topology).

Design choice: one bench process per point, sequential, so no two points share
the two cores; a failed point is reported and the sweep goes on to the next
(its JSON is absent, the plot shows the gap). Alternative not taken: one bench
run whose hosts re-shape their links between points: tc changes mid-run would
leave the link probe and R stale.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import app, flags

from launch.cluster.netns import own_mtu

FLAGS = flags.FLAGS

STRATEGIES = ("none", "inmem", "gemini", "capricorn", "pec", "capricorn_pec", "orbax_async")

# launch.cli_flags groups (and their flags) the sweep takes: the ones it passes
# on to every point's launch.bench (same meaning as there), and its outputs.
SHARED_FLAGS = {"data": ("steps", "shift_every"), "checkpoint": ("ckpt_budget",),
                "links": ("link_burst_kb", "link_mtu", "traffic_class"),
                "accelerator": ("accelerator_profile",), "output": ("out", "png")}
BENCH_FLAGS = ("strategies", "reps")
"""launch.bench's own flags the sweep passes on to every point, as launch.bench
defines them."""
SWEEP_DEFAULTS = {"steps": 8, "shift_every": 4, "ckpt_budget": 0.0,
                  "out": "results/emulated/sweep", "png": "results/emulated/sweep.png",
                  "strategies": list(STRATEGIES), "reps": 3}
"""The sweep's own defaults of the flags above (the published sweeps' values);
its --ckpt_budget applies to the points above --budget_above_r only."""


def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """The command's flags, defined only when run as a command (or by a test on
    a fresh ``fv``): importing this module defines none."""
    from launch import cli_flags
    from launch.bench import command as bench

    cli_flags.define(fv, SHARED_FLAGS,
                     {k: v for k, v in SWEEP_DEFAULTS.items() if k not in BENCH_FLAGS})
    flags.adopt_module_key_flags(cli_flags, flag_values=fv)
    theirs = bench.define_flags(flags.FlagValues())
    for name in BENCH_FLAGS:
        flags.DEFINE_flag(theirs[name], flag_values=fv)
        fv.set_default(name, SWEEP_DEFAULTS[name])
    flags.DEFINE_list("r", ["0.25", "0.5", "0.75", "1.0", "1.5"], "Target R values.",
                      flag_values=fv)
    flags.DEFINE_list("workloads", ["dynamic", "steady"], "Workloads (bench --workload).",
                      flag_values=fv)
    flags.DEFINE_list("topologies", ["2x2", "4x1"], "HOSTSxDEVICES per point.", flag_values=fv)
    flags.DEFINE_list("r_per_gbps", ["2x2=0.077", "4x1=0.037"],
                      "R at 1 Gbit/s per topology (TOPOLOGY=VALUE), from an earlier run.",
                      flag_values=fv)
    flags.DEFINE_float("budget_above_r", 1.0,
                       "Points with a larger target R run with --ckpt_budget (the others "
                       "without a budget).", flag_values=fv)
    flags.DEFINE_integer("point_timeout_s", 3600, "A point's bench is killed after this long.",
                         flag_values=fv)
    flags.DEFINE_bool("dry_run", False, "Print the commands only.", flag_values=fv)
    flags.DEFINE_list("ratios", ["median"],
                      "plot: one panel per workload and ratio: median (median step over "
                      "none's), steady_ratio or long_run_ratio (the bench JSON's).",
                      flag_values=fv)
    return fv


@dataclasses.dataclass(frozen=True)
class PointFlags:
    """The launch.bench flags every point gets (the sweep's flags of the same
    names; the link rate, topology and workload are the point's)."""

    strategies: tuple[str, ...] = STRATEGIES
    steps: int = 8
    shift_every: int = 4
    reps: int = 3
    traffic_class: str = "fifo"
    accelerator_profile: str = ""
    link_burst_kb: float = 0.0
    link_mtu: int = 0
    ckpt_budget: float = 0.0

    @classmethod
    def from_flags(cls, fv: flags.FlagValues) -> PointFlags:
        values: dict[str, Any] = {f.name: fv[f.name].value for f in dataclasses.fields(cls)}
        return cls(**{**values, "strategies": tuple(values["strategies"])})


def parse_topology(text: str) -> tuple[int, int]:
    """``"2x2"`` -> (hosts, devices per host); names the bad text."""
    try:
        hosts, devices = (int(p) for p in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"topology {text!r}: expected HOSTSxDEVICES, e.g. 2x2") from None
    if hosts < 2 or devices < 1:
        raise ValueError(f"topology {text!r}: needs at least 2 hosts and 1 device per host")
    return hosts, devices


def link_gbps_for(r_target: float, r_per_gbps: float) -> float:
    """The link rate that puts R at ``r_target`` when R is ``r_per_gbps`` at 1 Gbit/s."""
    if r_target <= 0 or r_per_gbps <= 0:
        raise ValueError(f"R target {r_target} and R at 1 Gbit/s {r_per_gbps} must be > 0")
    return round(r_per_gbps / r_target, 4)


def points(r_values: Sequence[float], workloads: Sequence[str], topologies: Sequence[str],
           r_per_gbps: dict[str, float], budget_above_r: float) -> list[dict]:
    """The grid, in run order: topology, then workload, then R ascending."""
    out = []
    for topo in topologies:
        hosts, devices = parse_topology(topo)
        if topo not in r_per_gbps:
            raise ValueError(f"topology {topo}: no --r_per_gbps entry (have {sorted(r_per_gbps)})")
        for workload in workloads:
            for r in sorted(r_values):
                out.append({"topology": topo, "hosts": hosts, "devices": devices,
                            "workload": workload, "r_target": r,
                            "link_gbps": link_gbps_for(r, r_per_gbps[topo]),
                            "budget": r > budget_above_r})
    return out


def point_name(point: dict, traffic_class: str = "fifo", mtu: int = 0) -> str:
    """The point's JSON name; a link with a traffic class or a frame size of
    its own is named by them (FIFO with the kernel's frames, the paper's
    premise, is the plain name)."""
    tail = ("" if traffic_class == "fifo" else f"_{traffic_class}") + (f"_mtu{mtu}" if mtu else "")
    return f"bench_{point['topology']}_{point['workload']}_r{point['r_target']:g}{tail}.json"


def bench_argv(point: dict, out: Path, bench: PointFlags) -> list[str]:
    """The launch.bench command of ``point``, its JSON in ``out``."""
    argv = [sys.executable, "-m", "launch.bench", "--accelerator=emulated",
            f"--strategies={','.join(bench.strategies)}", f"--hosts={point['hosts']}",
            f"--devices_per_host={point['devices']}", f"--workload={point['workload']}",
            f"--shift_every={bench.shift_every}", f"--steps={bench.steps}",
            f"--reps={bench.reps}", "--bandwidth_mib=0", f"--link_gbps={point['link_gbps']}",
            f"--traffic_class={bench.traffic_class}",
            f"--json={out / point_name(point, bench.traffic_class, bench.link_mtu)}"]
    if bench.accelerator_profile:
        argv.append(f"--accelerator_profile={bench.accelerator_profile}")
    if bench.link_burst_kb:
        argv.append(f"--link_burst_kb={bench.link_burst_kb:g}")
    if bench.link_mtu:
        argv.append(f"--link_mtu={bench.link_mtu}")
    if point["budget"]:
        argv.append(f"--ckpt_budget={bench.ckpt_budget}")
    return argv


def series(docs: Sequence[dict], ratio: str = "median"
           ) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """workload -> "strategy topology" -> [(measured R, ratio)], by R; the
    ratio: "median" (median step over none's) or a bench JSON field
    (``steady_ratio``, ``long_run_ratio``; a row without it left out).

    A run without a measured R (unshaped link) or without ``none`` is left out."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for d in docs:
        r, rows, c = d.get("link_idle_share"), d["strategies"], d["config"]
        if r is None or "none" not in rows:
            continue
        base = rows["none"]["median_step_s"]
        for name, row in rows.items():
            if name == "none":
                continue
            key = f"{name} {c['hosts']}x{c['devices_per_host']}"
            if (d.get("link") or {}).get("traffic_class", "fifo") != "fifo":
                key += f" {d['link']['traffic_class']}"
            if mtu := own_mtu(d.get("link")):
                key += f" mtu{mtu}"
            value = row["median_step_s"] / base if ratio == "median" else row.get(ratio)
            if value is None:
                continue
            out.setdefault(c["workload"], {}).setdefault(key, []).append((float(r), value))
    for per_workload in out.values():
        for pts in per_workload.values():
            pts.sort()
    return out


def plot(docs: Sequence[dict], png: Path, ratios: Sequence[str] = ("median",)) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(ratio, workload, lines) for ratio in ratios
              for workload, lines in sorted(series(docs, ratio).items())]
    if not panels:
        raise ValueError("no sweep JSON with a measured R and a none row")
    fig, axes = plt.subplots(1, len(panels), figsize=(9 * len(panels), 5), squeeze=False)
    # One colour per strategy (the same in every panel and topology), the
    # topology by marker, a traffic class dotted, jumbo frames dash-dotted.
    strategies = sorted({key.split(" ")[0] for _, _, lines in panels for key in lines})
    colour = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(strategies)}
    titles = {"median": "median step / none's", "steady_ratio": "steady steps: median / none's",
              "long_run_ratio": "long run: mean step / none's"}
    for ax, (ratio, workload, lines) in zip(axes[0], panels, strict=True):
        for key, pts in sorted(lines.items()):
            two_by_two = key.split(" ")[1] == "2x2"  # the topology
            style = ((":" if " priority" in key else "-." if " mtu" in key
                      else "-" if two_by_two else "--") + ("o" if two_by_two else "s"))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=key, markersize=4,
                    color=colour[key.split(" ")[0]])
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=f"{workload} workload (emulated accelerator)",
               xlabel="R: version link time / idle link time per step",
               ylabel=titles.get(ratio, ratio))
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def r_per_gbps_of(items: Sequence[str]) -> dict[str, float]:
    """``["2x2=0.077", ...]`` (--r_per_gbps) -> {topology: R at 1 Gbit/s}."""
    r_per = {}
    for item in items:
        topo, _, value = item.partition("=")
        r_per[topo] = float(value)
    return r_per


def run_sweep(grid: Sequence[dict], out: Path, bench: PointFlags, dry_run: bool = False,
              point_timeout_s: float = 3600) -> int:
    """Runs (or, ``dry_run``, prints) each point's bench; 1 if any failed."""
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for i, point in enumerate(grid, 1):
        argv = bench_argv(point, out, bench)
        print(f"[{i}/{len(grid)}] {point['topology']} {point['workload']} R~{point['r_target']} "
              f"({point['link_gbps']} Gbit/s{', budget on' if point['budget'] else ''})",
              flush=True)
        if dry_run:
            print("  " + " ".join(argv[1:]))
            continue
        start = time.monotonic()
        name = point_name(point, bench.traffic_class, bench.link_mtu)
        log = out / name.replace(".json", ".log")
        with log.open("w") as f:
            try:
                rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=point_timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = -1
        took = time.monotonic() - start
        if rc != 0:
            failed.append(name)
            print(f"  FAILED (exit {rc}) after {took:.0f} s: see {log}", flush=True)
            continue
        log.unlink()
        doc = json.loads((out / name).read_text())
        print(f"  done in {took:.0f} s: measured R {doc.get('link_idle_share')}", flush=True)
    if failed:
        print(f"{len(failed)} of {len(grid)} points failed: {', '.join(failed)}")
    return 1 if failed else 0


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[1] == "run":
        grid = points([float(r) for r in FLAGS.r], FLAGS.workloads, FLAGS.topologies,
                      r_per_gbps_of(FLAGS.r_per_gbps), FLAGS.budget_above_r)
        sys.exit(run_sweep(grid, Path(FLAGS.out), PointFlags.from_flags(FLAGS),
                           dry_run=FLAGS.dry_run, point_timeout_s=FLAGS.point_timeout_s))
    if len(argv) >= 3 and argv[1] == "plot":
        plot([json.loads(Path(p).read_text()) for p in argv[2:]], Path(FLAGS.png), FLAGS.ratios)
        print(f"wrote {FLAGS.png}")
        return
    sys.exit("usage: python -m launch.experiments.emulated_sweep run [flags] | "
             "plot BENCH.json [BENCH.json ...] [--png=F]")


if __name__ == "__main__":
    define_flags()
    app.run(main)
