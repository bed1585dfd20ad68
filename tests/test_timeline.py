"""The timeline trace (``launch.timeline``): layers, all-to-alls and chunks on their lanes; overflow
flagged when a schedule planned on older windows outlasts this profile's."""

import json

from capricorn_jax._src.profiling.layer_profile import LayerProfile, Segment
from capricorn_jax._src.scheduling.plan.partitioner import LinkModel, Window, partition
from launch import timeline

LINK = LinkModel(alpha_s=0.001, bytes_per_s=1e6)  # 1 MB/s: 1000 bytes = 1 ms + 1 ms


def _profile(fwd_s: float) -> LayerProfile:
    return LayerProfile(step=7, total_s=0.1, segments=(
        Segment("block0", "fwd", 0.0, fwd_s, 0.002),
        Segment("head", "fwd", fwd_s, 0.010, None),
        Segment("tail", "bwd", fwd_s + 0.010, 0.020, 0.002),
    ))


def _slices(doc, lane):
    return [e for e in doc["traceEvents"] if e.get("ph") == "X" and e["cat"] == lane]


def test_lanes_and_chunks_follow_the_schedule():
    # Windows: block0 fwd 8 ms of compute, head 10 ms, tail bwd 18 ms.
    schedule = partition(30_000, [Window("block0", "fwd", 0.008), Window("head", "fwd", 0.010),
                                  Window("tail", "bwd", 0.018)], LINK, chunk_cap=4_000)
    doc = json.loads(json.dumps(timeline.trace(_profile(0.010), schedule, host=0)))
    compute = _slices(doc, "compute")
    assert [e["name"] for e in compute] == ["block0 fwd", "head fwd", "tail bwd"]
    # The all-to-all closes each segment that has one: block0 fwd [8, 10) ms.
    a2a = _slices(doc, "all-to-all")
    assert [(e["ts"], e["dur"]) for e in a2a] == [(8000.0, 2000.0), (38000.0, 2000.0)]
    chunks = _slices(doc, "checkpoint link")
    assert sum(e["args"]["bytes"] for e in chunks) == 30_000
    in_block0 = [e for e in chunks if e["args"]["window"] == "block0 fwd"]
    assert in_block0[0]["ts"] == 0.0  # sent from the boundary that opens the window
    assert sum(e["dur"] for e in in_block0) <= 8000.0
    tail = [e for e in chunks if e["args"]["window"].startswith("tail (")]
    assert sum(e["args"]["bytes"] for e in tail) == schedule.tail_bytes > 0
    assert tail[0]["ts"] == 40000.0  # after the step's last mark
    assert doc["metadata"]["overflows"] == [] and not any(e["args"]["overflow"] for e in chunks)


def test_window_that_shrank_overflows():
    schedule = partition(6_000, [Window("block0", "fwd", 0.010)], LINK, chunk_cap=2_000)
    assert schedule.tail_bytes == 0
    # The load moved: block0's compute is now 3 ms, the 6 ms of chunks spill.
    doc = timeline.trace(_profile(0.005), schedule)
    (over,) = doc["metadata"]["overflows"]
    assert over["window"] == "block0 fwd" and over["window_s"] == 0.003
    flags = [e["args"]["overflow"] for e in _slices(doc, "checkpoint link")]
    assert flags[0] is False and flags[-1] is True


def test_write_trace_and_png(tmp_path):
    from launch.plot_timeline import render

    doc = timeline.trace(_profile(0.010), None)
    path = timeline.write_trace(tmp_path / "t.json", doc)
    assert json.loads(path.read_text())["metadata"]["scheduled"] is False
    assert not _slices(doc, "checkpoint link")
    png = render(doc, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
