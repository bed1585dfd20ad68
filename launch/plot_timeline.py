"""Draws a timeline trace (``launch.timeline``'s JSON) as a PNG.

    python -m launch.plot_timeline --trace=WORKDIR/timeline.json --out=timeline.png

One row per lane (compute, all-to-all, checkpoint link) and host; chunks that
outlast their window (``overflow``) are red, the tail (after the step) grey.
``launch.train --timeline`` writes both the JSON and this PNG.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """The command's flags, defined only when run as a command: a test or
    another launcher importing this module for its logic must not define
    flags of the same names twice."""
    flags.DEFINE_string("trace", None, "A timeline JSON written by launch.train --timeline.",
                        flag_values=fv)
    flags.DEFINE_string("out", "timeline.png", "PNG to write.", flag_values=fv)
    return fv


_COLORS = {"compute": "tab:blue", "all-to-all": "tab:orange", "checkpoint link": "tab:green"}


def _color(event: dict) -> str:
    if event["args"].get("overflow"):
        return "tab:red"
    if str(event["args"].get("window", "")).startswith("tail"):
        return "tab:gray"
    return _COLORS[event["cat"]]


def render(doc: dict, out: str | Path) -> Path:
    """Writes ``doc``'s slices as a Gantt chart PNG to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slices = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    rows = sorted({(e["pid"], e["tid"], e["cat"]) for e in slices})
    index = {(pid, tid): i for i, (pid, tid, _) in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * len(rows)))
    for e in slices:
        y = index[(e["pid"], e["tid"])]
        ax.broken_barh([(e["ts"] / 1e3, max(e["dur"] / 1e3, 1e-3))], (y - 0.4, 0.8),
                       facecolors=_color(e), edgecolors="black", linewidths=0.3)
        if e["cat"] == "compute" and e["dur"] > 0.03 * doc["metadata"]["span_s"] * 1e6:
            ax.text((e["ts"] + e["dur"] / 2) / 1e3, y, e["name"], ha="center", va="center",
                    fontsize=7)
    ax.set_yticks(range(len(rows)), [f"host {p}: {c}" for p, _, c in rows])
    ax.set_xlabel("ms since the step's start mark")
    meta = doc["metadata"]
    over = ", ".join(o["window"] for o in meta.get("overflows", [])) or "none"
    ax.set_title(f"{meta.get('title', '')} step {meta['step']}: windows overflowed: {over}; "
                 f"tail {meta.get('tail_bytes')} bytes", fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> None:
    if len(argv) > 1 or not FLAGS.trace:
        print("plot_timeline: error: --trace is required (no positional arguments)",
              file=sys.stderr)
        sys.exit(2)
    print(render(json.loads(Path(FLAGS.trace).read_text()), FLAGS.out))


if __name__ == "__main__":
    define_flags()
    app.run(main)
