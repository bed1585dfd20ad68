"""The window rules a scheduled strategy applies and the planner replays (pure).

``average_windows`` and ``shortest_windows`` turn several profiles into the
windows a schedule is partitioned into (gemini's mean over its first
profiles, capricorn's shortest over its recent ones); ``schedule_at_risk`` is
capricorn's gate on speculative profiling (whether a drift of the expert load
can overflow a window the schedule fills). ``strategies.scheduled`` runs them
on the live step, ``launch.plan`` replays them on a simulated cluster
(through ``capricorn_jax.experimental.planning``): the same functions, no JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from capricorn_jax._src.profiling.layer_profile import LayerProfile, moe_segments
from capricorn_jax._src.scheduling.plan.load_windows import windows_at
from capricorn_jax._src.scheduling.plan.partitioner import Schedule, Window

if TYPE_CHECKING:
    from capricorn_jax._src.profiling.detector import DynamicityDetector

WindowKey = tuple[str, str, str]  # name, direction, edge


def _per_window(profiles: Sequence[LayerProfile], windows_of: Callable[[LayerProfile], list[Window]]
                ) -> tuple[list[WindowKey], dict[WindowKey, list[float]]]:
    """The windows' keys in step order, and each key's durations over ``profiles``."""
    per_key: dict[WindowKey, list[float]] = {}
    order: list[WindowKey] = []
    for profile in profiles:
        for w in windows_of(profile):
            key = (w.name, w.direction, w.edge)
            if key not in per_key:
                per_key[key] = []
                order.append(key)
            per_key[key].append(w.duration_s)
    return order, per_key


def average_windows(profiles: Sequence[LayerProfile],
                    windows_of: Callable[[LayerProfile], list[Window]]) -> list[Window]:
    """Mean window per (name, direction, edge) over several profiles, in step order."""
    order, per_key = _per_window(profiles, windows_of)
    return [Window(n, d, float(np.mean(per_key[(n, d, e)])), e) for n, d, e in order]


def shortest_windows(profiles: Sequence[LayerProfile],
                     windows_of: Callable[[LayerProfile], list[Window]]) -> list[Window]:
    """Shortest window per (name, direction, edge) over several profiles, in
    step order: a plan that holds if the step is as fast as the fastest of
    them (a profile that caught a slow step only lengthens windows, so it
    cannot overfill one)."""
    order, per_key = _per_window(profiles, windows_of)
    return [Window(n, d, float(min(per_key[(n, d, e)])), e) for n, d, e in order]


def schedule_at_risk(schedule: Schedule | None, detector: DynamicityDetector,
                     tokens_per_expert: Any, profile: LayerProfile | None,
                     moe_layers: Sequence[int]) -> bool:
    """Whether ``schedule`` may overflow a window at this expert load.

    Capricorn's gate on speculative profiling: a drift of the load only
    matters to the checkpoint if a window the schedule fills shrinks below its
    chunks. Each MoE window is predicted from the detector's cost model of
    its segment at this load (``load_windows.windows_at`` on ``profile``, the
    one the schedule was planned on, span windows when the schedule has
    them); other windows do not depend on the load. At risk when some
    window's chunks cost more than its predicted length (the partitioner
    filled only a share of each window, so a small shrink is absorbed), when
    the schedule has a tail that grown windows might take, or when a model
    has fewer than two profiles to fit (exploration: the model must see the
    load move).

    Args:
      schedule: the schedule in force (None: at risk, there is none).
      detector: the DynamicityDetector whose cost models are keyed
        (MoE layer, direction).
      tokens_per_expert: [moe_layers, experts] load now.
      profile: the LayerProfile the schedule was planned on.
      moe_layers: the model's MoE layer indices.
    """
    if schedule is None or profile is None or schedule.tail_bytes > 0:
        return True
    layer_of = moe_segments(profile, moe_layers)
    for i, window in enumerate(schedule.windows):
        if not schedule.chunks[i] or (window.name, window.direction) not in layer_of:
            continue
        model = detector.cost_models.get((layer_of[(window.name, window.direction)],
                                          window.direction))
        if model is None or model.count < 2:
            return True
    durations = detector.predict(tokens_per_expert)
    for (name, direction), layer in layer_of.items():  # no model: as profiled (none filled)
        durations.setdefault((layer, direction), next(
            s.duration_s for s in profile.segments if (s.name, s.direction) == (name, direction)))
    spans = any(w.edge for w in schedule.windows)
    room = {(w.name, w.direction, w.edge): w.duration_s
            for w in windows_at(profile, lambda layer, d: durations[(layer, d)], moe_layers,
                                spans) or ()}
    return any(schedule.chunks[i] and (w.name, w.direction) in layer_of
               and schedule.window_cost_s(i) > room.get((w.name, w.direction, w.edge), 0.0)
               for i, w in enumerate(schedule.windows))
