"""The emulated-accelerator sweep: overhead against R, the checkpoint's share of the idle link.

    python -m launch.experiments.emulated_sweep run --out=results/emulated/sweep \
        [--r=0.25,0.5,0.75,1.0,1.5] [--workloads=dynamic,steady] [--topologies=2x2,4x1] \
        [--reps=3] [--steps=8] [--dry_run]
    python -m launch.experiments.emulated_sweep plot results/emulated/sweep/*.json \
        --png=results/emulated/sweep.png

``run`` runs one ``launch.bench --accelerator=emulated`` per point of the grid
(topology x workload x R), each with every strategy of ``--strategies`` in
interleaved repetitions, and writes its JSON as
``OUT/bench_{topology}_{workload}_r{R}.json``. R is set by the link rate:
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

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from absl import app, flags

from launch.cluster.netns import own_mtu

FLAGS = flags.FLAGS

STRATEGIES = "none,inmem,gemini,capricorn,pec,capricorn_pec,orbax_async"


def define_flags() -> None:
    flags.DEFINE_string("out", "results/emulated/sweep", "Folder for the points' JSONs.")
    flags.DEFINE_list("r", ["0.25", "0.5", "0.75", "1.0", "1.5"], "Target R values.")
    flags.DEFINE_list("workloads", ["dynamic", "steady"], "Workloads (bench --workload).")
    flags.DEFINE_list("topologies", ["2x2", "4x1"], "HOSTSxDEVICES per point.")
    flags.DEFINE_string("strategies", STRATEGIES, "bench --strategies.")
    flags.DEFINE_integer("reps", 3, "bench --reps (interleaved repetitions).")
    flags.DEFINE_integer("steps", 8, "bench --steps (timed steps per block).")
    flags.DEFINE_integer("shift_every", 4, "bench --shift_every (dynamic workload).")
    flags.DEFINE_list("r_per_gbps", ["2x2=0.077", "4x1=0.037"],
                      "R at 1 Gbit/s per topology (TOPOLOGY=VALUE), from an earlier run.")
    flags.DEFINE_float("budget_above_r", 1.0, "Points with a larger target R run with a budget.")
    flags.DEFINE_float("ckpt_budget", 0.0, "bench --ckpt_budget for those points (seconds).")
    flags.DEFINE_string("accelerator_profile", "", "bench --accelerator_profile ('' = default).")
    flags.DEFINE_float("link_burst_kb", 0.0, "bench --link_burst_kb (0 = bench's default).")
    flags.DEFINE_integer("link_mtu", 0, "bench --link_mtu (0 = the kernel's 1500).")
    flags.DEFINE_enum("traffic_class", "fifo", ["fifo", "priority"],
                      "bench --traffic_class for every point (priority: the JSON's name ends "
                      "in _priority).")
    flags.DEFINE_integer("point_timeout_s", 3600, "A point's bench is killed after this long.")
    flags.DEFINE_bool("dry_run", False, "Print the commands only.")
    flags.DEFINE_string("png", "results/emulated/sweep.png", "plot: the PNG to write.")
    flags.DEFINE_list("ratios", ["median"],
                      "plot: one panel per workload and ratio: median (median step over "
                      "none's), steady_ratio or long_run_ratio (the bench JSON's).")


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


def bench_argv(point: dict, out: Path) -> list[str]:
    argv = [sys.executable, "-m", "launch.bench", "--accelerator=emulated",
            f"--strategies={FLAGS.strategies}", f"--hosts={point['hosts']}",
            f"--devices_per_host={point['devices']}", f"--workload={point['workload']}",
            f"--shift_every={FLAGS.shift_every}", f"--steps={FLAGS.steps}",
            f"--reps={FLAGS.reps}", "--bandwidth_mib=0", f"--link_gbps={point['link_gbps']}",
            f"--traffic_class={FLAGS.traffic_class}",
            f"--json={out / point_name(point, FLAGS.traffic_class, FLAGS.link_mtu)}"]
    if FLAGS.accelerator_profile:
        argv.append(f"--accelerator_profile={FLAGS.accelerator_profile}")
    if FLAGS.link_burst_kb:
        argv.append(f"--link_burst_kb={FLAGS.link_burst_kb:g}")
    if FLAGS.link_mtu:
        argv.append(f"--link_mtu={FLAGS.link_mtu}")
    if point["budget"]:
        argv.append(f"--ckpt_budget={FLAGS.ckpt_budget}")
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
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    # One colour per strategy (the same in every panel and topology), the
    # topology by line and marker, a traffic class dotted, jumbo frames dash-dotted.
    strategies = sorted({key.split(" ")[0] for _, _, lines in panels for key in lines})
    colour = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(strategies)}
    titles = {"median": "median step / none's", "steady_ratio": "steady steps: median / none's",
              "long_run_ratio": "long run: mean step / none's"}
    for ax, (ratio, workload, lines) in zip(axes[0], panels, strict=True):
        for key, pts in sorted(lines.items()):
            style = (":^" if " priority" in key else "-.v" if " mtu" in key
                     else "-o" if key.split(" ")[1] == "2x2" else "--s")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=key, markersize=4,
                    color=colour[key.split(" ")[0]])
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=f"{workload} workload (emulated accelerator)",
               xlabel="R: version link time / idle link time per step",
               ylabel=titles.get(ratio, ratio))
        ax.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def run_sweep() -> int:
    r_per = {}
    for item in FLAGS.r_per_gbps:
        topo, _, value = item.partition("=")
        r_per[topo] = float(value)
    grid = points([float(r) for r in FLAGS.r], FLAGS.workloads, FLAGS.topologies, r_per,
                  FLAGS.budget_above_r)
    out = Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for i, point in enumerate(grid, 1):
        argv = bench_argv(point, out)
        print(f"[{i}/{len(grid)}] {point['topology']} {point['workload']} R~{point['r_target']} "
              f"({point['link_gbps']} Gbit/s{', budget on' if point['budget'] else ''})",
              flush=True)
        if FLAGS.dry_run:
            print("  " + " ".join(argv[1:]))
            continue
        start = time.monotonic()
        name = point_name(point, FLAGS.traffic_class, FLAGS.link_mtu)
        log = out / name.replace(".json", ".log")
        with log.open("w") as f:
            try:
                rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=FLAGS.point_timeout_s).returncode
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
        sys.exit(run_sweep())
    if len(argv) >= 3 and argv[1] == "plot":
        plot([json.loads(Path(p).read_text()) for p in argv[2:]], Path(FLAGS.png), FLAGS.ratios)
        print(f"wrote {FLAGS.png}")
        return
    sys.exit("usage: python -m launch.experiments.emulated_sweep run [flags] | "
             "plot BENCH.json [BENCH.json ...] [--png=F]")


if __name__ == "__main__":
    define_flags()
    app.run(main)
