"""How well each schedule's windows held its chunks, from runs' own measurements.

    python -m launch.experiments.window_spills W1 [W2 ...] [--tolerance_ms=1] [--json=F]

Each Wi is the WORKDIR of a ``launch.train --ckpt=gemini|capricorn`` run on the
threaded chunk path: every checkpoint event of a version moved in its step
carries ``windows``, per window with chunks the idle time the step gave it
(between the marks of the boundaries opening and closing it, less the
profile's all-to-all estimate), the link time of its chunks, and the spill
(``scheduling.transfers.window_spills``). The table gives, per run and per
schedule in force (the steps between two ``repartition`` events), the steps
that moved a version, the share of them in which some window spilled by more
than the tolerance, the spill per step (sum over windows, ms: median, mean,
max), and the profiles the strategy asked for because of spills (capricorn's
``requested`` detector events). Host 0's measurements (its metrics file).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_float("tolerance_ms", 1.0, "A step spilled when a window spilled more (ms).")
    flags.DEFINE_string("json", None, "Also write the rows here.")


def _events(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{workdir}: no metrics.jsonl (a launch.train WORKDIR?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def spill_rows(events: list[dict], tolerance_s: float) -> list[dict]:
    """One row per schedule in force (see the module docstring)."""
    rows: list[dict] = []
    current: dict | None = None
    strategy = next((e["strategy"] for e in events if e.get("event") == "repartition"), "?")
    requests = [e["step"] for e in events if e.get("event") == "detector" and e.get("requested")]
    for e in events:
        if e.get("event") == "repartition":
            current = {"strategy": strategy, "planned_after_step": e["step"], "spills": [],
                       "windows": 0, "spilled_windows": 0}
            rows.append(current)
        elif e.get("event") == "checkpoint" and isinstance(e.get("windows"), list):
            if current is None or not e["windows"]:
                continue
            current["spills"].append(sum(w["spill_s"] for w in e["windows"]))
            current["windows"] += len(e["windows"])
            current["spilled_windows"] += sum(w["spill_s"] > tolerance_s for w in e["windows"])
    out = []
    for i, row in enumerate(rows):
        spills = row.pop("spills")
        if not spills:
            continue
        end = rows[i + 1]["planned_after_step"] if i + 1 < len(rows) else None
        out.append({
            **row, "steps_moved": len(spills),
            "steps_spilled": sum(s > tolerance_s for s in spills),
            "spill_ms_median": statistics.median(spills) * 1e3,
            "spill_ms_mean": statistics.fmean(spills) * 1e3,
            "spill_ms_max": max(spills) * 1e3,
            "profile_requests": [s for s in requests if s > row["planned_after_step"]
                                 and (end is None or s <= end)],
        })
    return out


def markdown(runs: dict[str, list[dict]], tolerance_ms: float) -> str:
    lines = [f"| run | strategy | schedule planned after step | steps moved | steps with a "
             f"window spilling > {tolerance_ms:g} ms | spill per step, ms (median / mean / max)"
             f" | windows spilled / filled | profiles asked for (after step) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, rows in runs.items():
        for r in rows:
            share = r["steps_spilled"] / r["steps_moved"]
            lines.append(
                f"| {name} | {r['strategy']} | {r['planned_after_step']} | {r['steps_moved']} | "
                f"{r['steps_spilled']} ({share:.0%}) | {r['spill_ms_median']:.1f} / "
                f"{r['spill_ms_mean']:.1f} / {r['spill_ms_max']:.1f} | "
                f"{r['spilled_windows']} / {r['windows']} | "
                f"{', '.join(map(str, r['profile_requests'])) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        print("window_spills: error: give one or more launch.train WORKDIRs", file=sys.stderr)
        sys.exit(2)
    runs = {}
    for arg in argv[1:]:
        try:
            runs[Path(arg).name] = spill_rows(_events(Path(arg)), FLAGS.tolerance_ms / 1e3)
        except FileNotFoundError as e:
            print(f"window_spills: error: {e}", file=sys.stderr)
            sys.exit(2)
        if not runs[Path(arg).name]:
            print(f"window_spills: error: {arg}: no version moved on the threaded path with "
                  f"window measurements", file=sys.stderr)
            sys.exit(2)
    print(markdown(runs, FLAGS.tolerance_ms))
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    define_flags()
    app.run(main)
