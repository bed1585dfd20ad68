"""The pacing of one part of a version on the threaded path (pure).

Before a step the sender lays out the part of a version that step moves:
which byte ranges each site sends (a window's chunks at the site that opens
it, ``sites.site_of``; the schedule's tail after the step, ``AFTER``, with
the last planned part), the sites in the order the step passes them, which
windows its marks time (``sites.window_sites``), how long each site's
windows were planned to stay open (the deadline sender stops a window's
frames there: ``stop_rule``), and the bytes each window planned. A flushed
part (``flush``: a low-priority channel, or a step without marks) sends
every part left at the start, untimed. A version spread over several steps
(``parts`` > 1, ``partition_search.spread``) sends the windows of step
``part`` in step ``part``; a held part (past the planned ones,
``ThreadedSender.hold_tail``) carries only the bytes held and runs in the
windows of the schedule's first step.

Design choice: the layout a pure function of the schedule and the part, so
a test checks it without threads, sockets or marks; the sender thread only
follows it. Alternative not taken: computing it inside the sender (as it
was), testable only through a live channel.
"""

from __future__ import annotations

import dataclasses

from capricorn_jax._src.scheduling.plan.partitioner import Schedule
from capricorn_jax._src.scheduling.plan.sites import (
    AFTER,
    START,
    Site,
    site_of,
    sites_in_order,
    window_sites,
)


@dataclasses.dataclass(frozen=True)
class PartPlan:
    """One part's layout (see the module docstring).

    Attributes:
      by_site: site -> the byte ranges (lo, hi) of a row it sends, in order.
      order: the sites in the order the step passes them.
      window_sites: window index -> (opening site, closing site) of the
        part's windows with chunks (none for a flushed part: untimed).
      site_idle: site -> the planned idle time of the windows it opens
        (their deadline; empty without a deadline or for a flushed part).
      planned: window index -> its bytes planned, all ``rows``.
      upto: the parts handed over once this one is (the version's next part).
      last: whether this is the version's last part (so far: ``extend`` adds one).
      hold: whether what the part leaves is held for a later step.
    """

    by_site: dict[Site, list[tuple[int, int]]]
    order: list[Site]
    window_sites: dict[int, tuple[Site, Site]]
    site_idle: dict[Site, float]
    planned: dict[int, int]
    upto: int
    last: bool
    hold: bool


def part_plan(schedule: Schedule, boundaries: list[str], part: int, parts: int,
              planned_parts: int, per_part: int, rows: int, flush: bool = False,
              deadline: bool = False, hold_tail: int = 0) -> PartPlan:
    """The layout of part ``part`` of a version whose ``schedule`` holds
    ``planned_parts`` steps' windows, ``per_part`` each (``parts`` >=
    ``planned_parts``: the held ones included). ``rows``: the local rows
    (devices) a range goes from; ``flush``: every part left now, at the
    start; ``deadline``: the sites' deadlines are wanted; ``hold_tail``:
    the most parts a version may take (0: none held)."""
    n = per_part
    upto = parts if flush else part + 1
    by_site: dict[Site, list[tuple[int, int]]] = {}
    indices = range(part * n, min(upto, planned_parts) * n)
    for i in indices:
        site = START if flush else site_of(schedule.windows[i], boundaries)
        by_site.setdefault(site, []).extend((c.start, c.stop) for c in schedule.chunks[i])
    if part < planned_parts <= upto:
        by_site.setdefault(AFTER, []).extend((c.start, c.stop) for c in schedule.tail)
    first = (part % planned_parts) * n
    step_windows = schedule.windows[first:first + n]
    pairs = window_sites(dataclasses.replace(
        schedule, windows=step_windows, chunks=schedule.chunks[first:first + n]), boundaries)
    site_idle: dict[Site, float] = {}
    if deadline and not flush:
        for i in range(first, first + n):
            site = site_of(schedule.windows[i], boundaries)
            site_idle[site] = site_idle.get(site, 0.0) + schedule.windows[i].duration_s
    last = upto == parts
    return PartPlan(
        by_site=by_site, order=sites_in_order(boundaries, step_windows),
        window_sites={} if flush else {first + i: p for i, p in pairs.items()},
        site_idle=site_idle,
        planned={i: sum(c.stop - c.start for c in schedule.chunks[i]) * rows for i in indices},
        upto=upto, last=last,
        hold=last and not flush and hold_tail > 0 and parts < hold_tail)
