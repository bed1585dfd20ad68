"""The searches over ``partition``: the least share, the fewest steps.

Both call the partitioner (``scheduling.plan.partitioner.partition``) on windows
changed in one parameter and keep the least value whose schedule holds the
whole payload: ``even_partition`` every window scaled by one share (found by
bisection), so the windows fill evenly rather than the first ones to their
end; ``spread`` the windows of ``k`` consecutive steps (the fewest ``k``), for
a version one step's windows cannot hold. Separate from the partitioner,
which is one greedy pass over given windows with its optimality argument:
these are policies over that pass, each with its own argument.

Pure Python, no JAX: property-tested without devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from capricorn_jax._src.scheduling.plan.partitioner import (
    LinkModel,
    Schedule,
    Window,
    _index,
    partition,
    placed_bytes,
    scale_windows,
)

SCHEDULE_MARGIN = 0.8
"""The share of each measured window a schedule may use: the windows are scaled
by it before partitioning (``scale_windows``), so a window that comes out
shorter than profiled by up to 20% still holds its chunks. The default of the
compiled-step cache (``in_graph.transfers.ScheduledTransfers``) and of the
planner (``launch.plan``), which replays it."""


def even_partition(payload_bytes: int, windows: Sequence[Window], link: LinkModel,
                   chunk_cap: int, min_chunk: int = 1, max_share: float = 1.0,
                   tolerance: float = 1e-3) -> tuple[Schedule, float]:
    """``partition`` with every window filled to the same share of its time.

    The least share s <= ``max_share`` at which the windows scaled by s hold
    the whole payload (no tail), found by bisection to ``tolerance``: greedy
    filling of the scaled windows puts at most s of each window's time in
    it, every window but the last one used near s (chunk granularity), so no
    window runs to its end while another idles. Where even ``max_share``
    leaves a tail, s = ``max_share`` and the tail is the least any schedule
    leaves at that share (``partition``'s argument). The schedule keeps the
    windows' own durations (the deadline sender's close); its chunks are the
    scaled windows' (cost <= s x duration each).

    Alternative not taken: greedy filling to the margin (``partition``
    alone): the first windows full to their end, so any lateness of theirs
    meets the collective that closes them, while later windows stay empty.

    Returns:
      (the schedule, s).

    Raises:
      ValueError: ``max_share`` outside (0, 1], or as ``partition``.
    """
    if not 0.0 < max_share <= 1.0:
        raise ValueError(f"max_share={max_share} must be in (0, 1]")
    windows = tuple(windows)

    def at(share: float) -> Schedule:
        return partition(payload_bytes, scale_windows(windows, share), link, chunk_cap, min_chunk)

    def holds(share: float) -> bool:  # partition(at(share)) leaves no tail, unbuilt
        return placed_bytes(payload_bytes, [w.duration_s * share for w in windows], link,
                            chunk_cap, min_chunk) == payload_bytes

    share = max_share
    if payload_bytes and holds(max_share):
        lo = 0.0
        while share - lo > tolerance:
            mid = (lo + share) / 2
            if holds(mid):
                share = mid
            else:
                lo = mid
    elif not payload_bytes:
        share = 0.0
    best = at(share if payload_bytes else max_share)
    return dataclasses.replace(best, windows=windows), share


def spread(payload_bytes: int, windows: Sequence[Window], link: LinkModel, chunk_cap: int,
           max_steps: int, min_chunk: int = 1) -> tuple[Schedule, int]:
    """One payload over the windows of the fewest consecutive steps that hold it.

    A version that does not fit in one step's idle windows (a tail) goes
    over ``k`` steps instead: the schedule of ``windows`` repeated ``k``
    times (step j's windows are ``k``-th copies j * len(windows) ..), with the
    smallest ``k`` <= ``max_steps`` whose schedule has no tail; at
    ``max_steps`` what is left is still the tail (after the last step).
    Greedy filling makes the tail shrink as ``k`` grows, so the first ``k``
    without one is the least.

    Returns:
      (the schedule, k).

    Raises:
      ValueError: ``max_steps`` < 1, or as ``partition``.
    """
    max_steps = _index("max_steps", max_steps, 1)
    windows = tuple(windows)
    for k in range(1, max_steps + 1):
        schedule = partition(payload_bytes, windows * k, link, chunk_cap, min_chunk)
        if not schedule.tail or k == max_steps or not windows:
            return schedule, k
    raise AssertionError("unreachable")
