"""launch.experiments.shift_timelines rebuilds the schedules that ran and flags overflow."""

import pytest

from capricorn_jax._src.scheduling.partitioner import (
    LinkModel,
    partition,
    scale_windows,
    windows_from_profile,
)
from launch.experiments.shift_timelines import MARGIN, profile_at, schedule_in_force


def _profile_event(step, fwd_ms):
    layers, t = [], 0.0
    for name, direction, ms, coll in (("block0", "fwd", fwd_ms, 0.01), ("head", "fwd", 5, None),
                                      ("tail", "bwd", 40, 0.01)):
        layers.append({"name": name, "direction": direction, "start_s": t,
                       "duration_s": ms / 1e3, "collective_s": coll, "moe_layer": None})
        t += ms / 1e3
    return {"event": "profile", "step": step, "total_s": t, "devices": 1, "layers": layers}


def _repartition(records, step, payload, link, cap):
    windows = windows_from_profile(profile_at(records, step))
    schedule = partition(payload, scale_windows(windows, MARGIN), link, cap)
    return {"event": "repartition", "step": step,
            "window_bytes": [schedule.bytes_in_window(i) for i in range(len(windows))],
            "tail_bytes": schedule.tail_bytes, "link_alpha_s": link.alpha_s,
            "link_bytes_per_s": link.bytes_per_s,
            "windows_s": [round(w.duration_s, 6) for w in windows]}


def test_the_schedule_in_force_is_rebuilt_and_a_shift_overflows_it():
    link = LinkModel(alpha_s=1e-4, bytes_per_s=24e6)
    records = [_profile_event(3, fwd_ms=60.0)]
    records.append(_repartition(records, 3, 2_000_000, link, 1 << 20))
    records.append(_profile_event(9, fwd_ms=20.0))  # the shift: block0's window shrinks
    assert schedule_in_force(records, 3, 1 << 20) is None  # nothing before step 3
    schedule = schedule_in_force(records, 9, 1 << 20)
    assert [schedule.bytes_in_window(i) for i in range(3)] == records[1]["window_bytes"]
    from capricorn_jax.experimental import timeline

    after = timeline.trace(profile_at(records, 9), schedule)
    before = timeline.trace(profile_at(records, 3), schedule)
    assert not before["metadata"]["overflows"]
    assert [o["window"] for o in after["metadata"]["overflows"]] == ["block0 fwd"]
    with pytest.raises(ValueError, match="another --chunk_cap"):
        schedule_in_force(records, 9, 100_000)
    with pytest.raises(ValueError, match="no profile of step 5; profiled steps: \\[3, 9\\]"):
        profile_at(records, 5)
