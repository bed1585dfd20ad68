"""The sites of a step where windows open and close (pure).

A site is a mark's (name, direction): a layer boundary's, the step's start
(``START``, before the first layer), after the update (``AFTER``, where a
schedule's tail goes), or for a span window (``Window.edge``) a collective
edge of its layer. Both chunk paths place a window's bytes at its opening
site (``site_of``: the in-graph executor ties its permutes there, the threaded
sender waits for its mark) and the hardware clocks time a window from its
opening site to the next one a step passes (``window_sites``).

Design choice: one pure module both paths and the HLO check read, so a site
means the same in the compiled step, on the sender thread and in the
planner. Alternative not taken: the executor owning them (as it did), which
made the pure accounting of the threaded path import JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from capricorn_jax._src.scheduling.plan.partitioner import Schedule, Window

START = ("<start>", "fwd")
AFTER = ("<after>", "bwd")
Site = tuple[str, str]


def site_of(window: Window, boundaries: list[str]) -> Site:
    """The mark (name, direction) at which ``window`` opens: a layer boundary,
    or for a span window (``Window.edge``) the collective edge of its layer."""
    if window.edge:
        layer = boundaries[0] if window.name == "tail" else window.name
        return (layer, window.edge)
    if window.direction == "fwd":
        if window.name == "head":
            return (boundaries[-1], "fwd")
        i = boundaries.index(window.name)
        return START if i == 0 else (boundaries[i - 1], "fwd")
    if window.name == "tail":
        return (boundaries[0], "bwd")
    return (window.name, "bwd")


def sites_in_order(boundaries: list[str], windows: Sequence[Window] = ()) -> list[Site]:
    """The sites at which windows open, in the order a step passes them: the
    boundaries, and after each the collective edges at which ``windows``'
    span windows (``Window.edge``) of the segment it opens open, in their
    order in ``windows`` (step order)."""
    base = ([START] + [(b, "fwd") for b in boundaries]
            + [(b, "bwd") for b in reversed(boundaries)] + [AFTER])
    edges: dict[Site, list[Site]] = {}
    for window in windows:
        if window.edge:
            opener = site_of(dataclasses.replace(window, edge=""), boundaries)
            site = site_of(window, boundaries)
            if site not in edges.setdefault(opener, []):
                edges[opener].append(site)
    return [s for site in base for s in (site, *edges.get(site, ()))]


def window_sites(schedule: Schedule, boundaries: list[str]) -> dict[int, tuple[Site, Site]]:
    """Window index -> (opening site, closing site: the next one a step
    passes) of each window of ``schedule`` with chunks."""
    order = sites_in_order(boundaries, schedule.windows)
    out = {}
    for i, (window, chunks) in enumerate(zip(schedule.windows, schedule.chunks, strict=True)):
        if chunks:
            site = site_of(window, boundaries)
            out[i] = (site, order[min(order.index(site) + 1, len(order) - 1)])
    return out
