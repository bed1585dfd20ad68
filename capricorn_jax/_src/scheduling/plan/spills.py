"""What each filled window of a step really held against its plan (pure).

``window_spills`` turns a step's window spans (the threaded sender's marks or
the in-graph window clock's), the link model's cost of each window's chunks
and, where measured, when its last byte went and where its bytes went
(``window_bytes.WindowBytes``) into one record per filled window: the
scheduled strategies count spills from them, capricorn's window model fits
on them, and the bench writes them. Both chunk paths produce the same
records, from the same function.
"""

from __future__ import annotations

from typing import Any

from capricorn_jax._src.profiling.layer_profile import LayerProfile
from capricorn_jax._src.scheduling.plan.partitioner import Schedule
from capricorn_jax._src.scheduling.plan.policies import WindowKey


def window_spills(schedule: Schedule, spans_s: dict[int, float],
                  profile: LayerProfile | None,
                  sends_s: dict[int, float] | None = None,
                  window_bytes: dict[int, Any] | None = None) -> list[dict[str, Any]]:
    """What each filled window of a step that moved ``schedule`` really held.

    A window's idle time in the step is the span between the marks of the
    boundaries that open and close it, less the all-to-all estimate of its
    segment in ``profile`` (the one the schedule was planned on; 0 without
    one). Two measures of its overflow: ``spill_s``, the link time of its
    chunks (the link model's) beyond that idle time, i.e. what the cost model
    promised and the step did not give; and, with ``sends_s``, ``late_s``,
    how long after the window's closing mark its last byte was handed to the
    kernel (measured, no model: the link's real rate and its sharing with
    the step's own traffic included).

    Args:
      schedule: the schedule the step moved.
      spans_s: window index -> seconds between its opening and closing marks
        (windows without both marks left out).
      profile: the LayerProfile the schedule was planned on.
      sends_s: window index -> seconds from its opening mark until its last
        frame was sent (None: not measured).
      window_bytes: window index -> its bytes planned, sent inside it and
        late (``window_bytes.WindowBytes``: measured on the threaded path; None:
        not measured: the in-graph path).

    Returns:
      One record per window in ``spans_s`` with chunks, in step order:
      window ("name/direction"), planned_s (the window the schedule was
      partitioned into: measured x the safety margin), observed_s (idle time
      measured), chunks_s (its chunks' link time, modelled), spill_s, and
      with ``sends_s`` sent_s and late_s; bytes_planned, bytes_sent,
      bytes_late, bytes_carried (to later windows) and bytes_carried_in
      from ``window_bytes`` (None without).
    """
    busy = {} if profile is None else _busy_after(profile, any(w.edge for w in schedule.windows))
    out = []
    for i in sorted(spans_s):
        if not schedule.chunks[i]:
            continue
        window = schedule.windows[i]
        idle = max(0.0, spans_s[i] - busy.get((window.name, window.direction, window.edge), 0.0))
        cost = schedule.window_cost_s(i)
        name = f"{window.name}/{window.direction}" + (f"@{window.edge}" if window.edge else "")
        record = {"window": name,
                  "planned_s": round(window.duration_s, 6), "observed_s": round(idle, 6),
                  "chunks_s": round(cost, 6), "spill_s": round(max(0.0, cost - idle), 6)}
        measured = (window_bytes or {}).get(i)
        record["bytes_planned"] = None if measured is None else measured.planned
        record["bytes_sent"] = None if measured is None else measured.sent
        record["bytes_late"] = None if measured is None else measured.late
        record["bytes_carried"] = None if measured is None else measured.carried_out
        record["bytes_carried_in"] = None if measured is None else measured.carried_in
        if sends_s is not None and i in sends_s:
            record["sent_s"] = round(sends_s[i], 6)
            record["late_s"] = round(max(0.0, sends_s[i] - spans_s[i]), 6)
        out.append(record)
    return out


def _busy_after(profile: LayerProfile, spans: bool) -> dict[WindowKey, float]:
    """Per window key, the link-busy time between its opening mark and the
    next window's (the marks a step's span measures): a segment window's
    all-to-all estimate; with ``spans``, a span window's closing collective
    (``windows_from_profile``'s windows)."""
    out: dict[WindowKey, float] = {}
    for seg in profile.segments:
        if spans and seg.spans:
            out.update({(seg.name, seg.direction, s.edge): s.busy_s for s in seg.spans})
        else:
            out[(seg.name, seg.direction, "")] = seg.collective_s or 0.0
    return out
