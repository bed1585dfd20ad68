"""The emulated sweep's grid, rates and plot series (launch.experiments.emulated_sweep)."""

from __future__ import annotations

import pytest

from launch.experiments import emulated_sweep as sweep


def _doc(r, hosts, devices, workload, medians):
    return {"link_idle_share": r, "config": {"hosts": hosts, "devices_per_host": devices,
                                             "workload": workload},
            "strategies": {name: {"median_step_s": m} for name, m in medians.items()}}


def test_link_rate_puts_r_at_its_target():
    assert sweep.link_gbps_for(0.5, 0.077) == 0.154
    assert sweep.link_gbps_for(0.25, 0.04) == 0.16
    with pytest.raises(ValueError, match="must be > 0"):
        sweep.link_gbps_for(0.0, 0.077)


def test_topology_names_the_bad_text():
    assert sweep.parse_topology("4x1") == (4, 1)
    with pytest.raises(ValueError, match="'2by2'"):
        sweep.parse_topology("2by2")
    with pytest.raises(ValueError, match="at least 2 hosts"):
        sweep.parse_topology("1x4")


def test_grid_order_and_budget():
    grid = sweep.points([1.5, 0.5], ["dynamic"], ["2x2", "4x1"], {"2x2": 0.08, "4x1": 0.04}, 1.0)
    assert [(p["topology"], p["r_target"], p["budget"]) for p in grid] == [
        ("2x2", 0.5, False), ("2x2", 1.5, True), ("4x1", 0.5, False), ("4x1", 1.5, True)]
    assert grid[0]["link_gbps"] == 0.16 and grid[2]["link_gbps"] == 0.08
    assert sweep.point_name(grid[1]) == "bench_2x2_dynamic_r1.5.json"
    with pytest.raises(ValueError, match="4x1: no --r_per_gbps"):
        sweep.points([0.5], ["steady"], ["4x1"], {"2x2": 0.08}, 1.0)


def test_series_use_measured_r_and_skip_unusable_runs():
    docs = [_doc(0.8, 2, 2, "dynamic", {"none": 0.5, "inmem": 0.75, "capricorn": 0.625}),
            _doc(0.3, 2, 2, "dynamic", {"none": 0.4, "inmem": 0.5}),
            _doc(None, 2, 2, "dynamic", {"none": 0.4, "inmem": 9.0}),
            _doc(0.5, 4, 1, "steady", {"inmem": 0.5})]
    out = sweep.series(docs)
    assert out == {"dynamic": {"inmem 2x2": [(0.3, 1.25), (0.8, 1.5)],
                               "capricorn 2x2": [(0.8, 1.25)]}}


def test_plot_writes_a_png(tmp_path):
    png = tmp_path / "sweep.png"
    sweep.plot([_doc(0.3, 2, 2, "dynamic", {"none": 0.4, "inmem": 0.5}),
                _doc(0.6, 4, 1, "steady", {"none": 0.4, "pec": 0.44})], png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no sweep JSON"):
        sweep.plot([_doc(None, 2, 2, "dynamic", {"none": 0.4})], tmp_path / "x.png")


def test_series_of_the_long_run_ratios():
    doc = _doc(0.5, 2, 2, "dynamic", {"none": 0.4, "inmem": 0.5, "gemini": 0.6})
    doc["strategies"]["none"]["long_run_ratio"] = 1.0
    doc["strategies"]["inmem"]["long_run_ratio"] = 1.5  # gemini has none: left out
    assert sweep.series([doc], "long_run_ratio") == {"dynamic": {"inmem 2x2": [(0.5, 1.5)]}}


def test_plot_panels_per_ratio(tmp_path):
    doc = _doc(0.5, 2, 2, "dynamic", {"none": 0.4, "inmem": 0.5})
    for name, row in doc["strategies"].items():
        row.update(steady_ratio=1.0 if name == "none" else 1.2, long_run_ratio=1.3)
    png = tmp_path / "long_run.png"
    sweep.plot([doc], png, ("steady_ratio", "long_run_ratio"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_traffic_class_names_the_point_and_its_series(tmp_path):
    point = sweep.points([0.75], ["dynamic"], ["2x2"], {"2x2": 0.07}, 1.0)[0]
    assert sweep.point_name(point) == "bench_2x2_dynamic_r0.75.json"
    assert sweep.point_name(point, "priority") == "bench_2x2_dynamic_r0.75_priority.json"
    assert sweep.point_name(point, "fifo", 9000) == "bench_2x2_dynamic_r0.75_mtu9000.json"
    fifo = _doc(0.7, 2, 2, "dynamic", {"none": 0.5, "inmem": 0.625})
    fifo["link"] = {"traffic_class": "fifo", "mtu": 1500}
    prio = _doc(0.7, 2, 2, "dynamic", {"none": 0.5, "inmem": 0.5625})
    prio["link"] = {"traffic_class": "priority"}
    jumbo = _doc(0.6, 2, 2, "dynamic", {"none": 0.4, "inmem": 0.45})
    jumbo["link"] = {"traffic_class": "fifo", "mtu": 9000}
    assert sweep.series([fifo, prio, jumbo]) == {"dynamic": {
        "inmem 2x2": [(0.7, 1.25)], "inmem 2x2 priority": [(0.7, 1.125)],
        "inmem 2x2 mtu9000": [(0.6, 1.125)]}}
    png = tmp_path / "p.png"
    sweep.plot([fifo, prio, jumbo], png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_point_runs_the_bench_with_the_sweeps_flags():
    """The flags the sweep passes on are launch.bench's, with the sweep's
    defaults; bench_argv takes their values (it reads no flags)."""
    from pathlib import Path

    from absl import flags

    fv = sweep.define_flags(flags.FlagValues())
    fv(["sweep"])
    assert sweep.PointFlags.from_flags(fv) == sweep.PointFlags()
    fv = sweep.define_flags(flags.FlagValues())
    fv(["sweep", "--strategies=none,inmem", "--reps=2", "--steps=40", "--traffic_class=priority",
        "--link_mtu=9000", "--ckpt_budget=0.5"])
    bench = sweep.PointFlags.from_flags(fv)
    low, high = sweep.points([0.5, 1.5], ["dynamic"], ["2x2"], {"2x2": 0.077}, 1.0)
    assert sweep.bench_argv(low, Path("out"), bench)[1:] == [
        "-m", "launch.bench", "--accelerator=emulated", "--strategies=none,inmem", "--hosts=2",
        "--devices_per_host=2", "--workload=dynamic", "--shift_every=4", "--steps=40",
        "--reps=2", "--bandwidth_mib=0", "--link_gbps=0.154", "--traffic_class=priority",
        "--json=out/bench_2x2_dynamic_r0.5_priority_mtu9000.json", "--link_mtu=9000"]
    assert sweep.bench_argv(high, Path("out"), bench)[-1] == "--ckpt_budget=0.5"
