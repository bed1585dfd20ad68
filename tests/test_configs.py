"""Every shipped config parses, and its parameter count matches the model."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from models import CONFIGS, GPTMoE, get_config, param_count
from models.capacity import choose_capacity_factors
from models.config import ModelConfig, capacity


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_param_count_matches_flax(name):
    cfg = get_config(name)
    tokens = np.zeros((1, cfg.seq_len), np.int32)
    shapes = jax.eval_shape(lambda: GPTMoE(cfg).init(jax.random.key(0), tokens)["params"])
    counts = param_count(cfg)
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == counts["total"]
    expert = sum(
        int(np.prod(x.shape))
        for path, x in jax.tree_util.tree_leaves_with_path(shapes)
        if any(getattr(k, "key", None) in ("w_in", "w_out") for k in path)
    )
    assert expert == counts["expert"]
    assert 1 <= len(cfg.moe_layers) <= cfg.n_layers


def test_paper_configs_span_8_to_64_experts():
    experts = sorted(c.num_experts for n, c in CONFIGS.items() if n.startswith("gpt_moe"))
    assert experts[0] == 8 and experts[-1] == 64


def test_moe_every_other_layer():
    assert get_config("small").moe_layers == (1, 3)
    assert get_config("tiny").moe_layers == (0, 1)


@pytest.mark.parametrize(
    "field,value",
    [("top_k", 3), ("moe_every", 3), ("dispatch", "ragged"), ("n_heads", 5),
     ("capacity_buckets", (2.0, 1.0))],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ModelConfig(name="x", **{field: value})


def test_unknown_model_names_known_ones():
    with pytest.raises(KeyError, match="tiny"):
        get_config("nope")


def test_capacity_choice_follows_load():
    cfg = get_config("small")  # bucketed, buckets (1, 1.5, 2, 3, 4)
    tokens = 2048  # even share per expert: 2048 * 2 / 8 = 512
    assert choose_capacity_factors(cfg, None, tokens) == (cfg.capacity_factor,) * 2
    # 400*1.1=440 <= 512 -> 1.0; 700*1.1=770 > 768 (1.5) -> 2.0; beyond 4x -> largest.
    got = choose_capacity_factors(cfg, [400, 700], tokens) + choose_capacity_factors(
        cfg, [5000, 512], tokens)
    assert got == (1.0, 2.0, 4.0, 1.5)
    for f in got:
        assert capacity(cfg, tokens, f) >= 1
    fixed = get_config("tiny")
    assert choose_capacity_factors(fixed, [1, 10000], 512) == (fixed.capacity_factor,) * 2
    with pytest.raises(ValueError, match="max_routed"):
        choose_capacity_factors(cfg, [1, 2, 3], tokens)


def test_results_page_is_the_generated_one():
    """docs/results.md (every published table, the model table among them) is
    launch.tables' output for the JSONs in results/, verbatim."""
    from launch.results_page import RESULTS_PAGE, results_page
    from launch.tables import model_table

    root = Path(__file__).resolve().parent.parent
    page = (root / RESULTS_PAGE).read_text()
    assert page == results_page(root), \
        "regenerate: python -m launch.tables results > docs/results.md"
    assert model_table() in page


def test_the_cpu_headline_is_generated_from_the_bench_runs_beside_it():
    # The CPU headline (docs/results.md) is the generator's output for the
    # bench JSONs kept in results/, verbatim: no hand-copied ratio.
    from launch.results_page import RESULTS_PAGE
    from launch.tables import headline_table

    root = Path(__file__).resolve().parent.parent
    docs = [json.loads((root / "results" / f"bench_{w}.json").read_text())
            for w in ("steady", "dynamic")]
    assert [d["config"]["workload"] for d in docs] == ["steady", "dynamic"]
    for d in docs:
        assert {"none", "inmem", "capricorn"} <= set(d["strategies"])
        assert d["command"].startswith("python -m launch.bench")
    assert headline_table(docs, recovery=False) in (root / RESULTS_PAGE).read_text()


def test_the_superseded_sweep_of_0_18_stays_on_the_results_page():
    from launch.results_page import RESULTS_PAGE
    from launch.tables import long_run_table

    root = Path(__file__).resolve().parent.parent
    paths = sorted((root / "results" / "emulated" / "headline").glob("bench_*.json"))
    docs = [json.loads(p.read_text()) for p in paths]
    assert len(docs) >= 6 and all(d["config"]["accelerator"] == "emulated" for d in docs)
    assert all(d["link"]["burst_bytes"] == 20_000 for d in docs)
    assert {d["link"]["traffic_class"] for d in docs} == {"fifo", "priority"}
    assert {d["config"]["hosts"] for d in docs} == {2, 4}
    assert {d["config"]["workload"] for d in docs} == {"dynamic", "steady"}
    for d in docs:  # the long-run accounting of every strategy, R over the spans
        assert d["span_idle_share"] is not None
        for row in d["strategies"].values():
            assert row["steps_timed"] >= 78 and row["long_run_ratio"] is not None
            assert "warmup_s" in row and len(row["collectives"]) == row["steps_timed"]
    assert long_run_table(docs) in (root / RESULTS_PAGE).read_text()  # superseded: the page only
    assert (root / "results" / "emulated" / "headline.png").stat().st_size > 0
    # The superseded sweeps stay in docs/results.md with their plots.
    for png in ("deadline.png", "long_run.png", "sweep3.png"):
        assert (root / "results" / "emulated" / png).stat().st_size > 0


def test_readme_long_run_table_is_generated_from_the_corrected_sweeps_jsons_beside_it():
    """The README's table: the sweep on the corrected emulator (one-frame
    buckets, the control beside every point, paired intervals; issue 53)."""
    from launch.results_page import RESULTS_PAGE
    from launch.tables import long_run_summary, long_run_table

    root = Path(__file__).resolve().parent.parent
    paths = sorted((root / "results" / "emulated" / "corrected").glob("bench_*.json"))
    docs = [json.loads(p.read_text()) for p in paths]
    assert len(docs) >= 4 and all(d["config"]["accelerator"] == "emulated" for d in docs)
    assert {d["link"]["traffic_class"] for d in docs} == {"fifo", "priority"}
    for d in docs:
        link = d["link"]
        assert link["burst_bytes"] == link["mtu"] + 14  # one frame at the link's MTU
        assert {"none", "control", "inmem", "gemini", "capricorn"} <= set(d["strategies"])
        for name, row in d["strategies"].items():
            assert row["steps_timed"] >= 78 and row["long_run_ratio"] is not None
            assert name == "none" or len(row["steady_ratio_ci"]) == 2
    assert long_run_summary(docs) in (root / "README.md").read_text()
    assert long_run_table(docs) in (root / RESULTS_PAGE).read_text()
    assert (root / "results" / "emulated" / "corrected.png").stat().st_size > 0


def test_the_projection_is_generated_from_the_planner_json_beside_it():
    from launch.results_page import RESULTS_PAGE
    from launch.tables import projection_table

    root = Path(__file__).resolve().parent.parent
    doc = json.loads((root / "results" / "planner" / "projection.json").read_text())
    assert projection_table(doc) in (root / RESULTS_PAGE).read_text()
    assert "(simulated)" in (root / "README.md").read_text()
    assert (root / "results" / "planner" / "projection.png").stat().st_size > 0


def test_shaped_table_has_a_row_per_run_with_each_strategys_ratio_and_spread():
    from launch.tables import shaped_table

    def run(gbps, ratios):
        link = {"requested_gbps": gbps, "one_way_gbps": gbps * 0.96,
                "exchange_gbps": gbps / 2} if gbps else {}
        rows = {"none": {"ratio": 1.0, "median_step_s": 0.2, "spread_s": 0.03}}
        rows.update({n: {"ratio": r, "median_step_s": 0.2 * r, "spread_s": 0.011}
                     for n, r in ratios.items()})
        return {"config": {"hosts": 2, "devices_per_host": 2, "workload": "dynamic"},
                "link": link, "strategies": rows, "command": f"bench {gbps}",
                "date": "d", "machine": "m"}

    table = shaped_table([run(0.4, {"gemini": 1.5, "capricorn": 1.25}),
                          run(0.0, {"capricorn": 1.1})]).splitlines()
    assert "- `bench 0.4` (d, m)" in table and "- `bench 0.0` (d, m)" in table
    assert table[-4].endswith("| none (ms) | gemini | capricorn |")
    assert table[-3] == "|---|---|---|---|---|---|"
    assert table[-2] == "| 2x2 | dynamic | 0.4 / 0.38 / 0.20 | 200 (30) | 1.50 (11) | 1.25 (11) |"
    assert table[-1] == "| 2x2 | dynamic | loopback | 200 (30) | - | 1.10 (11) |"
    with pytest.raises(ValueError):
        shaped_table([])


def test_the_long_run_tables_name_the_link_and_where_queued_bytes_wait():
    """On a FIFO link the bytes ahead at a collective's start delay it; in a
    traffic class they wait behind it, and the tables say so; a frame size of
    the link's own is named beside its class."""
    from launch.tables import _late_cell, _link_cell

    assert _late_cell(67_000, "fifo") == "67 KB"
    assert _late_cell(67_000, "priority") == "none (67 KB queued behind)"
    assert _late_cell(None, "priority") == "-"
    assert _link_cell({"link": {"traffic_class": "fifo", "mtu": 1500}}) == "fifo"
    assert _link_cell({"link": {"traffic_class": "fifo", "mtu": 9000}}) == "fifo, MTU 9000"
    assert _link_cell({"link": {"traffic_class": "priority", "mtu": 9000, "filler": True}}) \
        == "priority, MTU 9000, busy (filler)"
    assert _link_cell({"link": {"traffic_class": "priority"}}) == "priority"
    assert _link_cell({}) == "fifo"
