"""One iteration's timeline as a Chrome / Perfetto trace: where the chunks went.

``launch.train --timeline`` writes it (``write_trace``) and draws it
(``launch.plot_timeline``). A tool, not a part of the library: it reads a
profile and a schedule through the library's faces.

Three lanes per host: the layers' compute (measured segments of a profiled
step), their all-to-alls (the profiler's estimate, drawn at the end of each MoE
segment: the profiler times a layer's collectives apart from the layer, so it
knows how long they take, not where inside the layer they sit), and the
checkpoint link: each window's chunks, sent back to back from the boundary
that opens the window, with the link model's cost (alpha + bytes / B).

A window *overflows* when its chunks take longer than the window measured in
this profile: it was planned on an older profile (gemini's fixed one, or
capricorn's before the load moved) and the chunks now spill into the next
layer's all-to-all. Overflowing chunk slices carry ``"overflow": true`` and
the trace's metadata lists the windows.

Alternative not taken: tracing a step that really moves the chunks. The
scheduled variant has no host callbacks (they would serialize it), so the
chunk spans here are the plan's, against measured layers; what a chunk
really cost is in the step time the benchmark measures.

Open the JSON in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from capricorn_jax.experimental import LayerProfile, Schedule

LANES = {"compute": 0, "all-to-all": 1, "checkpoint link": 2}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _slice(name: str, lane: str, start_s: float, dur_s: float, pid: int,
           **args: Any) -> dict[str, Any]:
    return {"name": name, "cat": lane, "ph": "X", "ts": _us(start_s), "dur": _us(dur_s),
            "pid": pid, "tid": LANES[lane], "args": args}


def layer_events(profile: LayerProfile, pid: int = 0) -> list[dict[str, Any]]:
    """Compute and all-to-all slices of every segment of ``profile``."""
    out = []
    for seg in profile.segments:
        label = f"{seg.name} {seg.direction}"
        collective = seg.collective_s or 0.0
        compute = max(0.0, seg.duration_s - collective)
        out.append(_slice(label, "compute", seg.start_s, compute, pid,
                          duration_s=seg.duration_s, collective_s=seg.collective_s))
        if collective > 0.0:
            out.append(_slice(f"all-to-all {label}", "all-to-all", seg.start_s + compute,
                              collective, pid, estimate=True))
    return out


def chunk_events(profile: LayerProfile, schedule: Schedule,
                 pid: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The schedule's chunks laid on ``profile``'s windows.

    Returns:
      (trace slices, overflows): an overflow is {"window", "chunks_s",
      "window_s"} for each window whose chunks outlast it in this profile.
    """
    segments = {(s.name, s.direction): s for s in profile.segments}
    events, overflows = [], []
    for i, window in enumerate(schedule.windows):
        chunks = schedule.chunks[i]
        seg = segments.get((window.name, window.direction))
        if not chunks or seg is None:
            continue
        room = seg.compute_s if seg.compute_s is not None else seg.duration_s
        t = seg.start_s
        total = schedule.window_cost_s(i)
        over = total > room
        if over:
            overflows.append({"window": f"{window.name} {window.direction}",
                              "chunks_s": total, "window_s": room})
        for c in chunks:
            cost = schedule.link.cost_s(1, c.size)
            events.append(_slice(f"chunk [{c.start}, {c.stop})", "checkpoint link", t, cost,
                                 pid, bytes=c.size, window=f"{window.name} {window.direction}",
                                 overflow=over and t + cost > seg.start_s + room))
            t += cost
    t = profile.span_s
    for c in schedule.tail:
        cost = schedule.link.cost_s(1, c.size)
        events.append(_slice(f"tail chunk [{c.start}, {c.stop})", "checkpoint link", t, cost,
                             pid, bytes=c.size, window="tail (after the step)", overflow=False))
        t += cost
    return events, overflows


def trace(profile: LayerProfile, schedule: Schedule | None, host: int = 0,
          title: str = "") -> dict[str, Any]:
    """The Chrome trace document of one profiled iteration of one host."""
    events = layer_events(profile, host)
    overflows: list[dict[str, Any]] = []
    if schedule is not None:
        chunks, overflows = chunk_events(profile, schedule, host)
        events += chunks
    names = [{"name": "thread_name", "ph": "M", "pid": host, "tid": tid, "args": {"name": lane}}
             for lane, tid in LANES.items()]
    names.append({"name": "process_name", "ph": "M", "pid": host,
                  "args": {"name": f"host {host}"}})
    return {"traceEvents": names + events, "displayTimeUnit": "ms",
            "metadata": {"title": title, "step": profile.step, "span_s": profile.span_s,
                         "scheduled": schedule is not None, "overflows": overflows,
                         "tail_bytes": schedule.tail_bytes if schedule is not None else None}}


def write_trace(path: str | Path, doc: dict[str, Any]) -> Path:
    """Writes the trace JSON (atomically: a reader never sees half of it)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)
    return path
