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

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


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
