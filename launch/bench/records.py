"""What a bench run's per-step records say: where bytes met a collective,
what each collective cost, how far a load shift moves a window.

Pure functions of one strategy's row of the bench JSON (DESIGN.md contracts,
"Long-run accounting": per timed step ``windows``, ``collectives`` and
``expert_spans``, with ``record_steps`` the steps they belong to), for
``python -m launch.tables windows|shifts JSON``. Alternative not taken: the
analysis inside ``launch.bench.report``, which summarizes a run; these read
a saved one, and a reader asks them about a run long after it ran.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def window_collisions(row: dict) -> list[dict]:
    """Per window name (in first-seen order): the steps it carried bytes,
    its median planned and observed idle time, its bytes per step (planned,
    sent inside it, late: sent after it closed or still queued then, i.e.
    meeting the collective that closes it), and the share of its steps with
    late bytes. Windows without byte measurements (the in-graph path) count
    their late bytes as unknown (None)."""
    by_name: dict[str, list[dict]] = {}
    for step in row.get("windows") or ():
        for w in step:
            by_name.setdefault(w["name"], []).append(w)
    out = []
    for name, ws in by_name.items():
        measured = [w for w in ws if w.get("bytes_late") is not None]
        out.append({
            "name": name, "steps": len(ws),
            "planned_idle_s": statistics.median(w["planned_idle_s"] for w in ws),
            "observed_idle_s": statistics.median(w["observed_idle_s"] for w in ws),
            "bytes_planned": _mean([w.get("bytes_planned") or 0 for w in ws]),
            "bytes_sent": _mean([w["bytes_sent"] for w in measured]) if measured else None,
            "bytes_late": _mean([w["bytes_late"] for w in measured]) if measured else None,
            "late_share": (sum(w["bytes_late"] > 0 for w in measured) / len(measured)
                           if measured else None)})
    return out


def late_bytes_per_step(row: dict) -> float | None:
    """Mean bytes per timed step that met a collective (every window's late
    bytes, steps without a window record counting 0); None when no window
    was measured."""
    steps = row.get("windows")
    if not steps or not any(w.get("bytes_late") is not None for s in steps for w in s):
        return None
    return _mean([sum(w.get("bytes_late") or 0 for w in s) for s in steps])


def collective_times(row: dict) -> dict[str, float]:
    """Per collective name, its median seconds over the timed steps that
    measured it."""
    by_name: dict[str, list[float]] = {}
    for step in row.get("collectives") or ():
        for c in step:
            by_name.setdefault(c["name"], []).append(c["seconds"])
    return {name: statistics.median(ts) for name, ts in by_name.items()}


def idle_outside_collectives(row: dict) -> float | None:
    """The median seconds per steady step (no compile, no profiling, with a
    collective record) outside every collective the marks bracket (the
    all-to-alls and the gradient all-reduce): the most a schedule can plan
    for the link, where R's idle time (the step less its all-to-alls) also
    holds the all-reduce. None for a row without collective records."""
    collectives = row.get("collectives")
    if not collectives:
        return None
    n = len(collectives)
    profiled = row.get("step_profiled") or [False] * n
    compiled = row.get("step_compiled") or [False] * n
    idle = [seconds - sum(c["seconds"] for c in record)
            for seconds, record, prof, comp in zip(row["step_s"], collectives, profiled,
                                                   compiled, strict=True)
            if record and not prof and not comp]
    return statistics.median(idle) if idle else None


def shift_effect(steps: Sequence[int], spans: Sequence[Sequence[dict]], shift_every: int,
                 ) -> dict[str, dict]:
    """How far a domain shift moves each expert span, next to its noise.

    Args:
      steps: the training step of each record.
      spans: per record, its ``expert_spans`` ([{"name", "seconds"}]).
      shift_every: the workload's steps per domain.

    Returns:
      Per span name: ``shift_s``, the median over the shifts seen of |median
      of the domain's steps after the shift - median of the steps before it|
      (each side the consecutive recorded steps of one domain); ``noise_s``,
      the median absolute difference between consecutive recorded steps of
      the same domain (step-to-step noise); ``multiple`` (shift over noise,
      None with no noise measured); ``shifts``: how many shifts were seen.
      Consecutive means steps i and i+1 both recorded: a bench block's first
      step is not recorded, so blocks do not join.
    """
    if shift_every < 1:
        raise ValueError(f"shift_every={shift_every} must be positive")
    series: dict[str, list[tuple[int, float]]] = {}
    for step, record in zip(steps, spans, strict=True):
        for s in record:
            series.setdefault(s["name"], []).append((step, s["seconds"]))
    out = {}
    for name, points in series.items():
        points.sort()
        runs = _domain_runs(points, shift_every)
        diffs = [abs(b - a) for run in runs for a, b in zip(run, run[1:], strict=False)]
        moves = [abs(statistics.median(after) - statistics.median(before))
                 for (before, after) in _shifts(points, shift_every)]
        noise = statistics.median(diffs) if diffs else None
        shift = statistics.median(moves) if moves else None
        out[name] = {"shift_s": shift, "noise_s": noise, "shifts": len(moves),
                     "multiple": (shift / noise if shift is not None and noise else None)}
    return out


def schedule_at_shifts(row: dict, shift_every: int) -> dict[str, dict] | None:
    """What a domain shift costs a schedule: the steady steps (no compile, no
    profiling) that open a domain (the first after a shift) against the other
    steady steps, each with its median step time and its mean bytes per step
    late (met a collective) and sent after the step (the schedule's bytes the
    windows did not carry: planned less sent and late inside them).

    Returns {"after_shift": {...}, "other": {...}} (each: ``steps``,
    ``step_s``, ``late_bytes``, ``after_step_bytes``), or None for a row
    without window records."""
    if shift_every < 1:
        raise ValueError(f"shift_every={shift_every} must be positive")
    windows = row.get("windows")
    if not windows or not any(windows):
        return None
    groups: dict[str, list[tuple[float, int, int]]] = {"after_shift": [], "other": []}
    n = len(row["record_steps"])
    profiled = row.get("step_profiled") or [False] * n
    compiled = row.get("step_compiled") or [False] * n
    for step, seconds, ws, prof, comp in zip(row["record_steps"], row["step_s"], windows,
                                             profiled, compiled, strict=True):
        if prof or comp or not ws:
            continue
        planned = sum(w.get("bytes_planned") or 0 for w in ws)
        inside = sum((w.get("bytes_sent") or 0) + (w.get("bytes_late") or 0) for w in ws)
        late = sum(w.get("bytes_late") or 0 for w in ws)
        key = "after_shift" if step % shift_every == 0 else "other"
        groups[key].append((seconds, late, max(0, planned - inside)))
    return {key: {"steps": len(g),
                  "step_s": statistics.median(x[0] for x in g) if g else None,
                  "late_bytes": _mean([x[1] for x in g]),
                  "after_step_bytes": _mean([x[2] for x in g])}
            for key, g in groups.items()}


def _domain_runs(points: list[tuple[int, float]], shift_every: int) -> list[list[float]]:
    """Maximal runs of consecutive steps within one domain: their values."""
    runs: list[list[float]] = []
    previous = None
    for step, value in points:
        if (previous is not None and step == previous + 1
                and step // shift_every == previous // shift_every):
            runs[-1].append(value)
        else:
            runs.append([value])
        previous = step
    return runs


def _shifts(points: list[tuple[int, float]], shift_every: int
            ) -> list[tuple[list[float], list[float]]]:
    """(values of the domain before, values of the domain after) at each
    shift whose last step before and first step after were both recorded."""
    by_domain: dict[int, dict[int, float]] = {}
    for step, value in points:
        by_domain.setdefault(step // shift_every, {})[step] = value
    out = []
    for domain, values in sorted(by_domain.items()):
        last = (domain + 1) * shift_every - 1
        after = by_domain.get(domain + 1, {})
        if last in values and last + 1 in after:
            out.append((list(values.values()), list(after.values())))
    return out


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0
