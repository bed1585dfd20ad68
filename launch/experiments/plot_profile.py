"""Plots a run's layer profiles: per-segment durations over the steps.

    python -m launch.experiments.plot_profile --metrics=WORKDIR/metrics.jsonl --out=profile.png

Reads the ``profile`` events (one per profiled step), the ``detector`` events
(speculative policy) and the per-step lines of a ``launch.train`` metrics file.
Panels, sharing the step axis:

1. each segment's duration (ms, log scale) at the profiled steps; a profile
   whose step ran its variant for the first time (compile, cold first run) is
   drawn as a hollow marker and not joined to the line;
2. the step time (ms), profiled steps marked, and each MoE layer's capacity
   factor (right axis), which drives the MoE layers' time under bucketed
   dispatch;
3. when the detector ran, its drift score per MoE layer (and ``--threshold``).

Vertical lines: red dashed where the detector activated (it asked for the
next step to be profiled; the line is at that next step), grey where the
workload's domain changed (``domain`` field of the step lines, labelled).
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict

from absl import app, flags

from launch.metrics import read_metrics

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """The command's flags, defined only when run as a command: a test or
    another launcher importing this module for its logic must not define
    flags of the same names twice."""
    flags.DEFINE_string("metrics", None, "A launch.train metrics.jsonl.", flag_values=fv)
    flags.DEFINE_string("out", "profile.png", "PNG to write.", flag_values=fv)
    flags.DEFINE_string("title", "", "Figure title; default: the metrics path.", flag_values=fv)
    flags.DEFINE_float("threshold", -1.0,
                       "Drift threshold to draw on the detector panel (< 0: none).", flag_values=fv)
    return fv


def load(path: str) -> dict:
    """The parts of a metrics file the plot needs."""
    records = read_metrics(path)
    steps = {}
    for r in records:
        if "event" not in r:
            steps[r["step"]] = r  # after a recovery the re-run step wins
    profiles = {r["step"]: r for r in records if r.get("event") == "profile"}
    detector = {r["step"]: r for r in records if r.get("event") == "detector"}
    return {"steps": steps, "profiles": profiles, "detector": detector}


def domain_shifts(steps: dict) -> list[tuple[int, str]]:
    """[(first step, domain)] of each run of equal domains."""
    out, last = [], None
    for s in sorted(steps):
        domain = steps[s].get("domain")
        if domain is not None and domain != last:
            out.append((s, domain))
            last = domain
    return out


def activations(detector: dict, steps: dict) -> list[int]:
    """Steps profiled because the detector asked after the step before."""
    last = max(steps, default=-1)
    return sorted(s + 1 for s, d in detector.items() if d.get("profile_next") and s < last)


def plot(data: dict, out: str, title: str, threshold: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, profiles, detector = data["steps"], data["profiles"], data["detector"]
    has_detector = bool(detector)
    rows = 3 if has_detector else 2
    fig, axes = plt.subplots(rows, 1, figsize=(13, 3.2 * rows + 1.2), sharex=True,
                             gridspec_kw={"height_ratios": [2.2, 1.2] + [1.0] * (rows - 2)})
    ax_seg, ax_step = axes[0], axes[1]

    # 1. Segment durations.
    series: dict[str, list[tuple[int, float, bool]]] = defaultdict(list)
    order: list[str] = []
    for s in sorted(profiles):
        for seg in profiles[s]["layers"]:
            key = f"{seg['name']} {seg['direction']}"
            if key not in series:
                order.append(key)
            series[key].append((s, max(seg["duration_s"], 1e-6) * 1e3,
                                bool(profiles[s].get("compiled"))))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # Per-MoE-layer series (capacity, drift) get colours apart from the segments'.
    moe_colors = ["tab:brown", "tab:olive", "tab:cyan", "darkgoldenrod", "slategrey"]
    for i, key in enumerate(order):
        color = colors[i % len(colors)]
        warm = [(s, v) for s, v, first in series[key] if not first]
        cold = [(s, v) for s, v, first in series[key] if first]
        if warm:
            sx, sy = zip(*warm, strict=True)
            style = "-" if len(warm) > 1 else ""
            ax_seg.plot(sx, sy, style, marker=".", ms=4, lw=1, color=color, label=key)
        if cold:
            sx, sy = zip(*cold, strict=True)
            ax_seg.plot(sx, sy, "o", mfc="none", ms=6, color=color,
                        label=None if warm else key)
    ax_seg.set_yscale("log")
    ax_seg.set_ylabel("segment duration (ms)")
    ax_seg.grid(True, which="both", alpha=0.25)
    if order:
        ax_seg.plot([], [], "o", mfc="none", color="grey", label="first run (compile)")
        ax_seg.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    else:
        ax_seg.text(0.5, 0.5, "no profile events", transform=ax_seg.transAxes, ha="center")

    # 2. Step time and capacity factors.
    xs = sorted(steps)
    times = [steps[s]["step_time_s"] * 1e3 for s in xs]
    warm = [(s, t) for s, t in zip(xs, times, strict=True) if not steps[s].get("compiled")]
    if warm:
        wx, wy = zip(*warm, strict=True)
        ax_step.plot(wx, wy, "-", lw=0.8, color="black", label="step time")
        top = sorted(wy)[int(0.98 * (len(wy) - 1))] * 1.3  # compile steps go off the chart
        ax_step.set_ylim(0, top)
    prof = [(s, steps[s]["step_time_s"] * 1e3) for s in xs if steps[s].get("profiled")]
    if prof and len(prof) < len(xs):  # with every step profiled the dots say nothing
        px, py = zip(*prof, strict=True)
        ax_step.plot(px, py, "o", ms=3, color="tab:red", label="profiled step")
    ax_step.set_ylabel("step time (ms)")
    ax_step.grid(True, alpha=0.25)
    cap = ax_step.twinx()
    factors = [steps[s].get("capacity_factors") for s in xs]
    if factors and factors[0] is not None:
        for layer in range(len(factors[0])):
            cap.step(xs, [f[layer] for f in factors], where="post", lw=1.2, alpha=0.6,
                     color=moe_colors[layer % len(moe_colors)],
                     label=f"capacity factor, MoE {layer}")
        cap.set_ylabel("capacity factor")
    handles = ax_step.get_legend_handles_labels()
    more = cap.get_legend_handles_labels()
    ax_step.legend(handles[0] + more[0], handles[1] + more[1], loc="upper left",
                   bbox_to_anchor=(1.06, 1.0), fontsize=8, frameon=False)

    # 3. Drift scores.
    if has_detector:
        ax_det = axes[2]
        ds = sorted(detector)
        n = len(detector[ds[0]]["scores"])
        for layer in range(n):
            ys = [detector[s]["scores"][layer] for s in ds]
            ys = [math.nan if v is None else v for v in ys]
            ax_det.plot(ds, ys, lw=1, color=moe_colors[layer % len(moe_colors)],
                        label=f"drift, MoE {layer}")
        if threshold is not None and threshold >= 0:
            ax_det.axhline(threshold, color="tab:red", lw=0.8, ls=":", label="threshold")
        ax_det.set_ylabel("drift score")
        ax_det.set_ylim(bottom=0)
        ax_det.grid(True, alpha=0.25)
        ax_det.legend(loc="upper left", bbox_to_anchor=(1.06, 1.0), fontsize=8, frameon=False)

    # Vertical lines on every panel.
    acts = activations(detector, steps)
    shifts = domain_shifts(steps)
    act_alpha = 0.6 if len(acts) <= 40 else 0.3  # many activations: keep the data visible
    for ax in axes:
        for s in acts:
            ax.axvline(s, color="tab:red", ls="--", lw=0.7, alpha=act_alpha)
        for s, _ in shifts[1:]:
            ax.axvline(s, color="dimgrey", lw=1.6, alpha=0.7)
    for s, domain in shifts:
        ax_seg.annotate(domain, (s, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(3, -12), textcoords="offset points", fontsize=8,
                        color="dimgrey")
    if acts:
        ax_seg.plot([], [], color="tab:red", ls="--", lw=0.7, label="detector activation")
        ax_seg.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if len(shifts) > 1:
        ax_step.plot([], [], color="dimgrey", lw=1.6, label="domain shift")
        h, lab = ax_step.get_legend_handles_labels()
        h2, lab2 = cap.get_legend_handles_labels()
        ax_step.legend(h + h2, lab + lab2, loc="upper left", bbox_to_anchor=(1.06, 1.0),
                       fontsize=8, frameon=False)
    axes[-1].set_xlabel("step")
    n_prof = len(profiles)
    fig.suptitle(f"{title}\n{n_prof} profiled of {len(steps)} steps"
                 + (f", {len(acts)} detector activations" if has_detector else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"plot_profile: error: unexpected arguments {argv[1:]}", file=sys.stderr)
        sys.exit(2)
    if not FLAGS.metrics:
        print("plot_profile: error: --metrics is required", file=sys.stderr)
        sys.exit(2)
    try:
        data = load(FLAGS.metrics)
    except OSError as e:
        print(f"plot_profile: error: --metrics: cannot read {FLAGS.metrics!r}: {e.strerror}",
              file=sys.stderr)
        sys.exit(2)
    if not data["steps"]:
        print(f"plot_profile: error: --metrics: no step lines in {FLAGS.metrics!r}",
              file=sys.stderr)
        sys.exit(2)
    threshold = FLAGS.threshold if FLAGS.threshold >= 0 else None
    plot(data, FLAGS.out, FLAGS.title or FLAGS.metrics, threshold)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
