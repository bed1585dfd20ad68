"""How well each schedule's windows held its chunks, from runs' own measurements.

    python -m launch.experiments.window_spills W1 [W2 ...] [--tolerance_ms=1] [--json=F]

Each Wi is the WORKDIR of a ``launch.train --ckpt=gemini|capricorn`` run on the
threaded chunk path: every checkpoint event of a version moved in its step
carries ``windows``, per window with chunks the idle time the step gave it
(between the marks of the boundaries opening and closing it, less the
profile's all-to-all estimate), the link time of its chunks (modelled), the
spill (that link time beyond the idle time) and, measured, how late after
the window's closing mark its last byte left
(``scheduling.transfers.window_spills``). A window overflows by the larger of
its spill and its lateness. The table gives, per run and per schedule in
force (the steps between two ``repartition`` events), the steps that moved a
version, the share of them in which some window overflowed by more than the
tolerance, the overflow per step (sum over windows, ms: median, mean, max),
the profiles the strategy asked for because of overflows (capricorn's
``requested`` detector events), and the safety margin the windows needed:
each filled window's observed idle time over the window its profile
measured (planned / ``--margin``), as its 5th percentile and median (a
margin at the 5th percentile would have held in 95% of the windows). Host
0's measurements (its metrics file).
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
    flags.DEFINE_float("margin", 0.8, "The runs' safety margin (ScheduledTransfers' default).")


def _events(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{workdir}: no metrics.jsonl (a launch.train WORKDIR?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def spill_rows(events: list[dict], tolerance_s: float, margin: float = 0.8) -> list[dict]:
    """One row per schedule in force (see the module docstring)."""
    rows: list[dict] = []
    current: dict | None = None
    strategy = next((e["strategy"] for e in events if e.get("event") == "repartition"), "?")
    requests = [e["step"] for e in events if e.get("event") == "detector" and e.get("requested")]
    for e in events:
        if e.get("event") == "repartition":
            current = {"strategy": strategy, "planned_after_step": e["step"], "spills": [],
                       "windows": 0, "spilled_windows": 0, "ratios": []}
            rows.append(current)
        elif e.get("event") == "checkpoint" and isinstance(e.get("windows"), list):
            if current is None or not e["windows"]:
                continue
            over = [max(w["spill_s"], w.get("late_s", 0.0)) for w in e["windows"]]
            current["spills"].append(sum(over))
            current["windows"] += len(over)
            current["spilled_windows"] += sum(o > tolerance_s for o in over)
            current["ratios"] += [w["observed_s"] * margin / w["planned_s"]
                                  for w in e["windows"] if w["planned_s"] > 0]
    out = []
    for i, row in enumerate(rows):
        spills, ratios = row.pop("spills"), row.pop("ratios")
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
            "window_ratio_p5": _quantile(ratios, 0.05) if ratios else None,
            "window_ratio_median": statistics.median(ratios) if ratios else None,
        })
    return out


def markdown(runs: dict[str, list[dict]], tolerance_ms: float) -> str:
    lines = [f"| run | strategy | schedule planned after step | steps moved | steps with a "
             f"window overflowing > {tolerance_ms:g} ms | overflow per step, ms (median / mean / "
             f"max) | windows overflowed / filled | idle / measured window (p5, median) | "
             f"profiles asked for (after step) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, rows in runs.items():
        for r in rows:
            share = r["steps_spilled"] / r["steps_moved"]
            lines.append(
                f"| {name} | {r['strategy']} | {r['planned_after_step']} | {r['steps_moved']} | "
                f"{r['steps_spilled']} ({share:.0%}) | {r['spill_ms_median']:.1f} / "
                f"{r['spill_ms_mean']:.1f} / {r['spill_ms_max']:.1f} | "
                f"{r['spilled_windows']} / {r['windows']} | {_ratios(r)} | "
                f"{', '.join(map(str, r['profile_requests'])) or '-'} |")
    return "\n".join(lines)


def _ratios(row: dict) -> str:
    if row["window_ratio_p5"] is None:
        return "-"
    return f"{row['window_ratio_p5']:.2f}, {row['window_ratio_median']:.2f}"


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        print("window_spills: error: give one or more launch.train WORKDIRs", file=sys.stderr)
        sys.exit(2)
    runs = {}
    for arg in argv[1:]:
        try:
            runs[Path(arg).name] = spill_rows(_events(Path(arg)), FLAGS.tolerance_ms / 1e3,
                                              FLAGS.margin)
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
