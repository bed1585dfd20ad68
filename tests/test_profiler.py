"""The layer profiler on the tiny model over 4 CPU devices (expert axis 4)."""

import statistics

import jax
import numpy as np
import pytest

from capricorn_jax._src.profiling import layer_profile
from capricorn_jax._src.profiling.layer_profile import Segment
from capricorn_jax._src.profiling.probe import time_all_to_all
from capricorn_jax.experimental import LayerProfile, make_profiled_step
from launch.trainer import OptimizerOptions, Trainer, make_mesh
from models import get_config

FACTORS = (2.0, 2.0)
SEGMENTS = [("block0", "fwd"), ("block1", "fwd"), ("head", "fwd"), ("block1", "bwd"),
            ("tail", "bwd")]


@pytest.fixture(scope="module")
def setup():
    # A batch of 32 (twice tiny's) so the step is long next to its dispatch.
    cfg = get_config("tiny", global_batch=32)
    assert cfg.dropout > 0  # the dropout RNG must be used the same way in both
    trainer = Trainer(cfg, make_mesh(4), OptimizerOptions())
    rows = np.random.default_rng(0).integers(0, 256, (cfg.global_batch, cfg.seq_len + 1))
    batch = trainer.global_batch(rows.astype(np.int32))
    return trainer, batch


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow  # long: compiles or many examples
def test_profiled_step_computes_bitwise_what_the_plain_step_computes(setup):
    trainer, batch = setup
    want_state, want_metrics = trainer.step_fn(FACTORS)(trainer.init_state(0), batch)
    got_state, got_metrics, profile = make_profiled_step(trainer, FACTORS)(
        trainer.init_state(0), batch
    )
    assert jax.tree.structure(got_state) == jax.tree.structure(want_state)
    for got, want in zip(_leaves((got_state, got_metrics)), _leaves((want_state, want_metrics)),
                         strict=True):
        np.testing.assert_array_equal(got, want)
    assert profile.step == 0 and profile.devices == 4


def test_marks_fire_once_per_device_in_layer_order(setup):
    trainer, batch = setup
    step = make_profiled_step(trainer, FACTORS)
    state, _, _ = step(trainer.init_state(0), batch)  # compiled, marks traced
    step.recorder.clear()
    jax.block_until_ready(step.jitted(state, batch))
    times = step.recorder.drain()
    order = layer_profile.event_order(step.hook.names)
    assert step.hook.names == ["block0", "block1"]
    assert order[1:5] == [("block0", "fwd"), ("block1", "fwd"), ("block1", "bwd"),
                          ("block0", "bwd")]
    # The MoE layers' all-to-all edges too, in the order their collectives
    # run: forward begin -> end, backward (the transposes) end -> begin.
    moe = [f"block{i}" for i in trainer.moe_layers]
    assert moe
    fwd_edges = ["fwd:dispatch.begin", "fwd:dispatch.end", "fwd:combine.begin",
                 "fwd:combine.end"]
    bwd_edges = ["bwd:combine.end", "bwd:combine.begin", "bwd:dispatch.end",
                 "bwd:dispatch.begin"]
    edges = [(n, e) for n in moe for e in fwd_edges + bwd_edges]
    assert set(times) == {(n, d, dev) for n, d in order + edges for dev in range(4)}
    for dev in range(4):
        stamps = [times[(n, d, dev)] for n, d in order]
        assert stamps == sorted(stamps), f"device {dev}: marks out of order"
        for n in moe:
            i = step.hook.names.index(n)
            opens = order[0] if i == 0 else (step.hook.names[i - 1], "fwd")
            fwd = [times[(*opens, dev)]] + [times[(n, e, dev)] for e in fwd_edges] + [
                times[(n, "fwd", dev)]]
            closes = ("step", "end") if i == 0 else (step.hook.names[i - 1], "bwd")
            bwd = [times[(n, "bwd", dev)]] + [times[(n, e, dev)] for e in bwd_edges] + [
                times[(*closes, dev)]]
            assert fwd == sorted(fwd) and bwd == sorted(bwd), f"device {dev}: {n}'s edges"


def test_segments_tile_the_step_and_add_up_to_its_wall_time(setup):
    trainer, batch = setup
    step = make_profiled_step(trainer, FACTORS)
    state, _, _ = step(trainer.init_state(0), batch)
    ratios = []
    for _ in range(5):
        state, _, profile = step(state, batch)
        assert [(s.name, s.direction) for s in profile.segments] == SEGMENTS
        starts = np.cumsum([0.0] + [s.duration_s for s in profile.segments[:-1]])
        np.testing.assert_allclose([s.start_s for s in profile.segments], starts, atol=1e-9)
        assert all(s.duration_s >= 0 for s in profile.segments)
        # Taken off the segments: one mark per segment, and one per edge of
        # its collectives (2 per collective, one collective between spans).
        marks = sum(1 + 2 * (len(s.spans) - 1 if s.spans else 0)
                    for s in profile.segments) * profile.mark_cost_s
        ratios.append((profile.span_s + marks) / profile.total_s)
    # The rest is the host's dispatch before the first device starts.
    assert 0.9 <= statistics.median(ratios) <= 1.0, ratios


@pytest.mark.slow  # long: compiles or many examples
def test_only_the_profiled_variant_is_instrumented(setup):
    trainer, batch = setup
    abstract = trainer.abstract_state
    plain = trainer.step_fn(FACTORS).lower(abstract, batch).compile().as_text()
    step = make_profiled_step(trainer, FACTORS)
    profiled = step.jitted.lower(abstract, batch).compile().as_text()
    assert "custom-call" not in plain and "python_cpu_callback" not in plain
    # start, a fwd and a bwd mark per boundary, end; 8 all-to-all edges per
    # MoE layer (dispatch and combine, begin and end, forward and backward).
    assert profiled.count("python_cpu_callback") == (2 + 2 * len(step.hook.names)
                                                     + 8 * len(trainer.moe_layers))
    assert make_profiled_step(trainer, FACTORS) is step
    assert trainer.step_fn(FACTORS) is trainer.step_fn(FACTORS)


def test_profile_json_round_trip_and_collective_split():
    names = ["block0", "block1"]
    order = layer_profile.event_order(names)
    times = {(n, d, dev): 1.0 + 0.1 * i + 0.01 * dev for i, (n, d) in enumerate(order)
             for dev in range(2)}
    profile = layer_profile.build_profile(3, 0.7, names, times, {"block1": 0.02})
    assert [(s.name, s.direction) for s in profile.segments] == SEGMENTS
    # START: first device; every later mark: last device.
    np.testing.assert_allclose(profile.segments[0].duration_s, 0.11)
    np.testing.assert_allclose(profile.span_s, 0.51)
    by_key = {(s.name, s.direction): s for s in profile.segments}
    assert by_key[("block1", "fwd")].collective_s == 0.02
    np.testing.assert_allclose(by_key[("block1", "bwd")].compute_s, 0.08)
    assert by_key[("block0", "fwd")].collective_s is None
    assert by_key[("block0", "fwd")].compute_s is None
    again = LayerProfile.from_json(profile.to_json())
    assert again == profile and isinstance(again.segments[0], Segment)


def test_each_segment_is_its_marks_gap_less_one_marks_cost():
    names = ["block0", "block1"]
    order = layer_profile.event_order(names)
    times = {(n, d, 0): 1.0 + 0.1 * i for i, (n, d) in enumerate(order)}
    times[("block1", "fwd", 0)] = times[("block0", "fwd", 0)] + 0.01  # a gap below the cost
    raw = layer_profile.build_profile(3, 0.7, names, times)
    net = layer_profile.build_profile(3, 0.7, names, times, mark_cost_s=0.03)
    assert raw.mark_cost_s == 0.0 and net.mark_cost_s == 0.03
    want = [max(0.0, s.duration_s - 0.03) for s in raw.segments]
    np.testing.assert_allclose([s.duration_s for s in net.segments], want)
    assert net.segments[1].duration_s == 0.0  # the 0.01 s gap
    np.testing.assert_allclose([s.start_s for s in net.segments],
                               np.cumsum([0.0] + want[:-1]), atol=1e-12)
    assert LayerProfile.from_json(net.to_json()) == net
    old = {k: v for k, v in raw.to_dict().items() if k != "mark_cost_s"}  # before the field
    assert LayerProfile.from_dict(old) == raw
    with pytest.raises(ValueError, match="mark_cost_s must be >= 0, got -0.001"):
        layer_profile.build_profile(3, 0.7, names, times, mark_cost_s=-0.001)


def test_the_marks_cost_is_measured_once_per_trainer_and_taken_off(setup, monkeypatch):
    from capricorn_jax._src.profiling import profiler

    trainer, batch = setup
    measured = profiler.time_marks(trainer.mesh, marks=4, repeats=3)
    assert np.isfinite(measured) and measured >= 0.0
    with pytest.raises(ValueError, match="marks >= 1"):
        profiler.time_marks(trainer.mesh, marks=0)
    calls = []

    def fake(mesh, *args, **kwargs):
        calls.append(mesh)
        return 0.0015

    monkeypatch.setattr(profiler, "time_marks", fake)
    fresh = Trainer(trainer.cfg, trainer.mesh, OptimizerOptions())  # no variants cached yet
    first = make_profiled_step(fresh, FACTORS)
    second = make_profiled_step(fresh, (1.0, 2.0))
    assert calls == [fresh.mesh]  # once per trainer
    assert first.mark_cost_s == second.mark_cost_s == 0.0015
    _, _, profile = first(fresh.init_state(0), batch)
    assert profile.mark_cost_s == 0.0015


def test_build_profile_rejects_missing_or_disordered_marks():
    names = ["block0"]
    order = layer_profile.event_order(names)
    times = {(n, d, 0): float(i) for i, (n, d) in enumerate(order)}
    with pytest.raises(RuntimeError, match="missing"):
        layer_profile.build_profile(0, 1.0, names,
                                    {k: v for k, v in times.items() if k[1] != "bwd"})
    times[("block0", "bwd", 0)] = -1.0
    with pytest.raises(RuntimeError, match="out of order"):
        layer_profile.build_profile(0, 1.0, names, times)


def test_all_to_all_estimate_for_the_moe_layers(setup):
    trainer, _ = setup
    bufs = trainer.all_to_alls(FACTORS)
    cfg = trainer.cfg
    assert sorted(bufs) == [f"block{i}" for i in cfg.moe_layers]
    cap = 2 * trainer.tokens_per_group * cfg.top_k // cfg.num_experts
    assert [b.shape for b in bufs["block0"]] == [(cfg.num_experts, cap, cfg.d_model)] * 2
    seconds = time_all_to_all(trainer.mesh, "expert", bufs["block0"][0], repeats=3)
    assert 0.0 <= seconds < 1.0


def test_the_gradient_all_reduce_is_the_tails_collective(setup, monkeypatch):
    """The parameters every device holds are all-reduced after the backward:
    their buffers, timed as one all-reduce, go into the TAIL segment's
    collective estimate, and only there."""
    from capricorn_jax._src.profiling import probe, profiler

    trainer, batch = setup
    reduced = trainer.gradient_reductions()
    params, specs = trainer.abstract_state["params"], trainer.state_shardings["params"]
    replicated = [(leaf.shape, leaf.dtype) for leaf, s in
                  zip(jax.tree.leaves(params), jax.tree.leaves(specs), strict=True)
                  if s.spec == jax.sharding.PartitionSpec()]
    assert [(b.shape, b.dtype) for b in reduced] == replicated
    expert_shapes = {leaf.shape for leaf, s in zip(jax.tree.leaves(params),
                                                    jax.tree.leaves(specs), strict=True)
                     if "expert" in s.spec}
    assert expert_shapes and not expert_shapes & {b.shape for b in reduced}
    seconds = probe.time_all_reduce(trainer.mesh, reduced, repeats=3)
    assert np.isfinite(seconds) and seconds >= 0.0
    assert probe.time_all_reduce(trainer.mesh, []) == 0.0

    monkeypatch.setattr(profiler, "time_all_reduce", lambda mesh, bufs: 0.004)
    monkeypatch.setattr(profiler, "time_marks", lambda mesh: 0.0)
    fresh = Trainer(trainer.cfg, trainer.mesh, OptimizerOptions())
    a2a = trainer.all_to_alls(FACTORS)
    _, _, plain = make_profiled_step(fresh, FACTORS, a2a)(fresh.init_state(0), batch)
    _, _, tail = make_profiled_step(fresh, FACTORS, a2a, reductions=reduced)(
        fresh.init_state(0), batch)
    want = {(s.name, s.direction): s.collective_s for s in plain.segments}
    want[("tail", "bwd")] += 0.004
    assert {(s.name, s.direction): s.collective_s for s in tail.segments} == want


def test_build_profile_adds_the_tail_collective_to_the_tail_only():
    names = ["block0", "block1"]
    order = layer_profile.event_order(names)
    times = {(n, d, 0): 1.0 + 0.1 * i for i, (n, d) in enumerate(order)}
    with_a2a = layer_profile.build_profile(0, 0.7, names, times, {"block0": 0.02},
                                           tail_collective_s=0.01)
    got = {(s.name, s.direction): s.collective_s for s in with_a2a.segments}
    assert got == {("block0", "fwd"): 0.02, ("block1", "fwd"): None, ("head", "fwd"): None,
                   ("block1", "bwd"): None, ("tail", "bwd"): 0.03}
    alone = layer_profile.build_profile(0, 0.7, names, times, tail_collective_s=0.01)
    assert [s.collective_s for s in alone.segments] == [None, None, None, None, 0.01]


@pytest.mark.slow  # long: compiles or many examples
def test_collective_probe_stamps_each_all_to_all_edge_on_every_device(setup):
    """The all-to-all probe in the plain step: bitwise the same results, one
    callback per edge (begin, end of dispatch and combine, forward and backward)
    per MoE layer, each stamped once on every device, the end after the begin."""
    from capricorn_jax.experimental import CollectiveProbe

    trainer, batch = setup
    probe = CollectiveProbe()
    want = trainer.step_fn(FACTORS)(trainer.init_state(0), batch)
    probed = trainer.step_fn(FACTORS, hooks=(probe,))
    got = jax.block_until_ready(probed(trainer.init_state(0), batch))
    for g, w in zip(_leaves(got), _leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)
    moe = [f"block{i}" for i in trainer.cfg.moe_layers]
    stamps = probe.recorder.drain()
    edges = {(b, f"{d}:{c}.{e}") for b in moe for d in ("fwd", "bwd")
             for c in ("dispatch", "combine") for e in ("begin", "end")}
    assert set(stamps) == {(b, k, dev) for b, k in edges for dev in range(4)}
    for b in moe:
        for dev in range(4):
            for c in ("dispatch", "combine"):
                assert stamps[(b, f"fwd:{c}.end", dev)] > stamps[(b, f"fwd:{c}.begin", dev)]
                # The backward runs the transposed all-to-all from the end edge to the begin.
                assert stamps[(b, f"bwd:{c}.begin", dev)] > stamps[(b, f"bwd:{c}.end", dev)]
    hlo = probed.lower(trainer.abstract_state, batch).compile().as_text()
    assert hlo.count("python_cpu_callback") == len(edges)
