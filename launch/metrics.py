"""WORKDIR/metrics.jsonl: one JSON object per line, written by host 0.

Per step: {"step", "loss", "step_time_s", "tokens_per_expert", ...};
events: {"event": NAME, "step", ...}. The schema is a contract other tools
read (DESIGN.md): fields are added, never renamed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends JSON lines to ``path`` (flushed each line); a no-op when disabled."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path = Path(path)
        self._file = open(self.path, "a", encoding="utf-8") if enabled else None  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A short report of a run: steps, first/last loss, median step time."""
    steps = [r for r in records if "event" not in r]
    if not steps:
        return {"steps": 0}
    times = sorted(r["step_time_s"] for r in steps[1:]) or [steps[0]["step_time_s"]]
    distinct = len({r["step"] for r in steps})
    return {
        "steps": distinct,
        "steps_rerun_after_recovery": len(steps) - distinct,
        "first_loss": steps[0]["loss"],
        "last_loss": steps[-1]["loss"],
        "median_step_time_s": times[len(times) // 2],
        "events": sorted({r["event"] for r in records if "event" in r}),
    }


def different_work(losses: dict[Any, dict[str, float]]) -> list[str]:
    """Steps at which strategies that replayed the same work logged different
    losses (a checkpoint must not change training): ``{step: {strategy: loss}}``
    -> one line per such step, in step order."""
    return [f"step {s}: " + ", ".join(f"{n} {v!r}" for n, v in by.items())
            for s, by in sorted(losses.items(), key=lambda kv: int(kv[0]))
            if len(set(by.values())) > 1]
