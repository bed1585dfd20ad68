"""The in-graph path's window clock: when each window's chunks arrived.

On the in-graph path (``in_graph.executor``) a window's chunks move by
collective-permutes inside the jitted step, so no host thread sees them go.
With a ``WindowClock`` attached, the scheduled step carries three kinds of
unordered per-device marks (``profiler.mark``: a host callback placed by its
data dependency alone, inside a ``shard_map`` over the mesh, no collective):

* a *site* mark on the boundary's activation (forward) or cotangent
  (backward) at each site that opens or closes a window with chunks, taken
  before the reception tie and before the window's permutes, so it fires when
  the layer is done, not when the previous window's bytes are in; the
  step's start is marked on the packed payload (the start window's chunks
  can go from then on);
* a *done* mark on the receptions of each window with chunks (one mark over
  all of them: it fires once every chunk of the window arrived on the device).

After the step, ``window_times`` reads per window (opening site o, closing
site c, as ``window_sites`` pairs them): the span, ``t(c) - t(o)``, and when
its chunks were in, ``done(o) - t(o)``, each site and done time being the
last local device's (a boundary is passed when its last local device passed
it, as the profiler counts). ``WindowClock.windows`` hands both to
``spills.window_spills``, so the records are the threaded path's:
``spill_s`` (the modelled overflow: what the strategy counts) and ``late_s``,
here how long after the closing boundary's mark the window's last chunk
arrived (``sent_s``: when it arrived, from the opening mark). The tail window
(closed by the step's end, after the update) has no closing mark and no
record, as on the threaded path.

Cost: one host callback per marked site and per filled window (~0.1-0.5 ms
each on CPU). The scheduled step carries them only when a clock is attached
(capricorn, which acts on the spills); without one its program is unchanged.

Alternative not taken: the profiler's ordered marks at every boundary. They
serialise the step's callbacks, and only the sites of filled windows matter.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from capricorn_jax._src.profiling.layer_profile import LayerProfile, Recorder
from capricorn_jax._src.profiling.profiler import mark
from capricorn_jax._src.scheduling.plan.partitioner import Schedule
from capricorn_jax._src.scheduling.plan.sites import AFTER, Site, window_sites
from capricorn_jax._src.scheduling.plan.spills import window_spills

DONE = ":done"
"""Suffix of a done mark's direction: (opening site name, direction + DONE)."""


def window_times(pairs: dict[int, tuple[Site, Site]],
                 stamps: dict[tuple[str, str, int], float]
                 ) -> tuple[dict[int, float], dict[int, float]]:
    """Each window's span and done time from the step's marks (pure).

    Args:
      pairs: window index -> (opening site, closing site) (``window_sites``).
      stamps: {(name, direction, device): time} (``Recorder.drain``): site
        marks keyed by the site, done marks by (opening site name, its
        direction + ``DONE``).

    Returns:
      (spans, done): window index -> seconds from its opening site's mark to
      its closing site's (both present), and -> seconds from its opening mark
      until its last chunk arrived (both present); each site's and done time
      is its latest device's.
    """
    last: dict[tuple[str, str], float] = {}
    for (name, direction, _), t in stamps.items():
        last[(name, direction)] = max(t, last.get((name, direction), t))
    spans, done = {}, {}
    for i, (open_, close) in pairs.items():
        if open_ not in last:
            continue
        if close in last:
            spans[i] = last[close] - last[open_]
        finished = (open_[0], open_[1] + DONE)
        if finished in last:
            done[i] = last[finished] - last[open_]
    return spans, done


class WindowClock:
    """The marks of the in-graph path's windows and what they measured.

    Args:
      mesh: the training mesh (a mark fires once per device).
      boundaries: the model's boundary names, forward order.
    """

    def __init__(self, mesh: Mesh, boundaries: list[str]) -> None:
        self.mesh, self.boundaries = mesh, boundaries
        self.recorder = Recorder()
        self._axes = tuple(mesh.axis_names)

    def sites(self, schedule: Schedule) -> frozenset[Site]:
        """The sites a step moving ``schedule`` marks (open or close a filled window)."""
        return frozenset(s for pair in window_sites(schedule, self.boundaries).values()
                         for s in pair) - {AFTER}

    def _mark(self, x: Any, name: str, direction: str) -> Any:
        # Every leaf sharded on its leading dimension over all mesh axes (the
        # activations, cotangents and [devices, bytes] chunks the executor has).
        specs = jax.tree.map(lambda _: P(self._axes), x)
        return mark(x, specs, self.mesh, self.recorder, name, direction, ordered=False)

    def mark_site(self, x: Any, site: Site) -> Any:
        """``x`` (the site's activation, cotangent or, at the start, the
        payload), tied to the site's mark (traceable, not differentiable:
        the executor calls it on primal values only)."""
        return self._mark(x, site[0], site[1])

    def mark_done(self, chunks: list[jax.Array], site: Site) -> list[jax.Array]:
        """The receptions of the window opened at ``site``, tied to its done mark."""
        return self._mark(list(chunks), site[0], site[1] + DONE)

    def clear(self) -> None:
        """Forgets the marks so far (before a step that moves chunks)."""
        self.recorder.clear()

    def windows(self, schedule: Schedule, profile: LayerProfile | None) -> list[dict[str, Any]]:
        """The ``window_spills`` records of the step just run (call it once the
        step's outputs are ready; drains the marks)."""
        spans, done = window_times(window_sites(schedule, self.boundaries),
                                   self.recorder.drain())
        return window_spills(schedule, spans, profile, done)
