"""Partial expert checkpointing: selection, PLT bookkeeping, dynamic K, restore plans."""

import functools
import json
import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capricorn_jax._src.memory.tier.retention import versions_to_keep
from capricorn_jax._src.partial.leaves import expert_leaf_axes, leaf_steps, state_bytes
from capricorn_jax._src.partial.plans import (
    newest_copies,
    persist_mask,
    persisted_needs,
    persisted_plan,
)
from capricorn_jax._src.partial.selection import (
    DynamicK,
    PecOptions,
    load_aware_mask,
    local_gather_indices,
    predict_plt,
    rank_counts,
    select_experts,
    sequential_mask,
)
from capricorn_jax._src.partial.tracker import PltTracker, restore_plan
from launch.trainer import OptimizerOptions, Trainer, make_mesh
from models import get_config, param_count


@st.composite
def layouts(draw):
    """(ranks, experts, k, layers): experts split contiguously over the ranks."""
    ranks = draw(st.sampled_from([1, 2, 4, 8]))
    experts = ranks * draw(st.integers(1, 4))
    return ranks, experts, draw(st.integers(1, experts)), draw(st.integers(1, 6))


@functools.cache
def abstract_state(name: str):
    cfg = get_config(name)
    trainer = Trainer(cfg, make_mesh(1, jax.devices()[:1]), OptimizerOptions())
    return cfg, trainer.abstract_state


# ------------------------------------------------------------------ options


@pytest.mark.parametrize("field,kwargs", [
    ("k", {"k": 0}), ("k_persist", {"k": 2, "k_persist": 3}), ("k_persist", {"k_persist": 0}),
    ("policy", {"policy": "random"}), ("plt_threshold", {"plt_threshold": 0.0}),
    ("plt_threshold", {"plt_threshold": 1.5}), ("dynamic", {"dynamic": "yes"}),
])
def test_bad_options_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        PecOptions(**kwargs)


def test_k_larger_than_experts_is_refused():
    with pytest.raises(ValueError, match="k=9"):
        PecOptions(k=9, k_persist=1).check(8)
    with pytest.raises(ValueError, match="k="):
        DynamicK(PecOptions(k=9), num_experts=8)


# ------------------------------------------------------------------ selection


@settings(max_examples=200, deadline=None)
@given(layouts(), st.integers(0, 1000))
def test_sequential_covers_every_expert_within_ceil_n_over_k(layout, start):
    ranks, n, k, layers = layout
    window = math.ceil(n / k)
    seen = np.zeros((layers, n), bool)
    for v in range(start, start + window):
        mask = sequential_mask(k, v, layers, n, ranks)
        assert (mask.sum(axis=1) == k).all()
        seen |= mask
    assert seen.all()


@settings(max_examples=200, deadline=None)
@given(layouts(), st.integers(0, 1000))
def test_sequential_balances_the_ranks(layout, version):
    ranks, n, k, layers = layout
    counts = rank_counts(sequential_mask(k, version, layers, n, ranks), ranks)
    assert counts.sum() == k * layers
    assert counts.max() - counts.min() <= 1
    if (k * layers) % ranks == 0:
        assert (counts == k * layers // ranks).all()
        idx = local_gather_indices(sequential_mask(k, version, layers, n, ranks), ranks)
        assert idx.shape == (ranks, k * layers // ranks)


def test_sequential_example_interleaves_ranks_and_offsets_layers():
    # N=8 on 4 ranks (experts 2r, 2r+1 on rank r), K=1, 2 layers: position p is
    # expert (p % 4) * 2 + p // 4; layer l of version v takes p = v + l.
    masks = [np.flatnonzero(sequential_mask(1, v, 2, 8, 4)[layer])[0]
             for v in range(3) for layer in range(2)]
    assert masks == [0, 2, 2, 4, 4, 6]
    assert rank_counts(sequential_mask(1, 0, 2, 8, 4), 4).tolist() == [1, 1, 0, 0]
    assert local_gather_indices(sequential_mask(2, 0, 2, 8, 4), 4).tolist() == [
        [0], [0], [2], [2]]  # layer 0: experts 0, 2; layer 1: experts 4, 6


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 12), st.data())
def test_load_aware_picks_the_k_largest(layers, n, data):
    k = data.draw(st.integers(1, n))
    since = np.array(data.draw(st.lists(st.integers(0, 5), min_size=layers * n,
                                        max_size=layers * n))).reshape(layers, n)
    mask = select_experts("load_aware", k, num_layers=layers, num_experts=n, since_save=since)
    for row, picked in zip(since, mask, strict=True):
        expected = sorted(range(n), key=lambda e: (-row[e], e))[:k]
        assert np.flatnonzero(picked).tolist() == sorted(expected)


def test_selection_errors():
    with pytest.raises(ValueError, match="since_save"):
        select_experts("load_aware", 1, num_layers=1, num_experts=4)
    with pytest.raises(ValueError, match="ranks"):
        sequential_mask(1, 0, 1, 6, 4)
    with pytest.raises(ValueError, match="differ"):
        local_gather_indices(sequential_mask(1, 0, 1, 8, 4), 4)
    assert load_aware_mask(2, [[1, 1, 1]]).tolist() == [[True, True, False]]


# ------------------------------------------------------------------ PLT


def hand_tracker() -> PltTracker:
    """2 MoE layers, 4 experts, top-2, 4 tokens a step (8 assignments per layer)."""
    t = PltTracker(2, 4, top_k=2)
    t.observe([[3, 1, 2, 2], [4, 0, 4, 0]])  # step 1, then a full version
    t.on_saved(1, np.ones((2, 4), bool))
    t.observe([[2, 2, 2, 2], [1, 3, 2, 2]])  # step 2, version with experts (0,0), (1,1)
    t.on_saved(2, [[1, 0, 0, 0], [0, 1, 0, 0]])
    return t


def test_plt_hand_example():
    t = hand_tracker()
    assert t.since_save.tolist() == [[0, 2, 2, 2], [1, 0, 2, 2]]
    assert t.lost().tolist() == [6, 5]
    assert t.plt(8) == pytest.approx((6 / 16 + 5 / 16) / 2)  # 8 tokens * top-2 = 16
    t.observe([[4, 0, 0, 4], [0, 0, 8, 0]])  # step 3, no version
    assert t.since_save.tolist() == [[4, 2, 2, 6], [1, 0, 10, 2]]
    assert t.saved_step.tolist() == [[2, 1, 1, 1], [1, 2, 1, 1]]
    assert t.plt(12) == pytest.approx((14 / 24 + 13 / 24) / 2)
    assert t.plt(0) == 0.0


def test_tracker_checks_and_roundtrip():
    t = hand_tracker()
    with pytest.raises(ValueError, match="step 5"):
        t.on_saved(5, np.ones((2, 4), bool))
    with pytest.raises(ValueError, match="shape"):
        t.observe(np.zeros((2, 3)))
    assert not PltTracker(1, 2, 1).complete and t.complete
    doc = json.loads(json.dumps(t.to_dict()))
    assert PltTracker.from_dict(doc) == t and t.copy() == t


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 50), min_size=6, max_size=6),
                          st.lists(st.booleans(), min_size=6, max_size=6)), max_size=20))
def test_tracker_json_roundtrip(steps):
    t = PltTracker(2, 3, top_k=1, step=7)
    for tpe, save in steps:
        t.observe(np.reshape(tpe, (2, 3)))
        t.on_saved(t.step, np.reshape(save, (2, 3)))
    back = PltTracker.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t
    np.testing.assert_array_equal(back.saved_step, t.saved_step)


# ------------------------------------------------------------------ dynamic K


def steady(tracker: PltTracker, rate: np.ndarray, steps: int, dyn: DynamicK, k: int,
           tokens_per_step: int, version: int = 0):
    """Runs ``steps`` steps at a constant rate, a version after each; returns the Ks."""
    ks = []
    for _ in range(steps):
        tracker.observe(rate)
        tokens = tracker.step * tokens_per_step
        k = dyn.next_k(k, tracker, rate, tokens, tokens_per_step, version)
        mask = select_experts(dyn.options.policy, k, num_layers=rate.shape[0],
                              num_experts=rate.shape[1], version=version, ranks=dyn.ranks,
                              since_save=tracker.since_save)
        tracker.on_saved(tracker.step, mask)
        version += 1
        ks.append(k)
    return ks


def test_dynamic_k_doubles_caps_and_returns_to_base():
    n, tokens_per_step = 8, 16  # top-2: 32 assignments per layer per step, 4 per expert
    rate = np.full((2, n), 4)
    dyn = DynamicK(PecOptions(k=1, plt_threshold=0.0375), num_experts=n, ranks=2)
    assert dyn.chain() == (1, 2, 4, 8)
    ks = steady(PltTracker(2, n, top_k=2), rate, 400, dyn, 1, tokens_per_step)
    assert ks[0] == n  # no copy of any expert yet: a full version first
    assert max(ks) <= n and ks[-1] == 1
    assert ks.index(1) > 20  # early on, K=1 would lose more than 3.75% of the tokens
    assert all(b >= a or b == a // 2 for a, b in zip(ks, ks[1:], strict=False))  # K halves


def test_dynamic_k_doubles_to_the_smallest_k_within_threshold():
    # One layer, 4 experts, top-1, 10 tokens a step (rate 1 per expert on
    # average), 100 tokens so far; every expert was copied at step 0.
    t = PltTracker(1, 4, top_k=1)
    t.on_saved(0, np.ones((1, 4), bool))
    for _ in range(10):
        t.observe([[4, 3, 2, 1]])
    rate = np.array([[4, 3, 2, 1]])
    dyn = DynamicK(PecOptions(k=1, policy="load_aware", plt_threshold=0.2), num_experts=4)
    # since = 40, 30, 20, 10; after one more step 44, 33, 22, 11 (110) over
    # 110 tokens: K=1 saves 44 -> 66/110 = 0.6; K=2 -> 33/110 = 0.3; K=4 -> 0.
    assert predict_plt(t, 1, "load_aware", rate, 100, 10, 0) == pytest.approx(0.6)
    assert predict_plt(t, 2, "load_aware", rate, 100, 10, 0) == pytest.approx(0.3)
    assert predict_plt(t, 4, "load_aware", rate, 100, 10, 0) == 0.0
    assert dyn.next_k(1, t, rate, 100, 10, 0) == 4  # 2 is still over 0.2
    relaxed = DynamicK(PecOptions(k=1, policy="load_aware", plt_threshold=0.5), num_experts=4)
    assert relaxed.next_k(1, t, rate, 100, 10, 0) == 2
    # At K=2 under threshold: halve only when K=1 stays below threshold / 2.
    assert relaxed.next_k(2, t, rate, 100, 10, 0) == 2  # 0.6 >= 0.25
    assert relaxed.next_k(2, t, rate, 10_000, 10, 0) == 1  # 66/10010 < 0.25
    assert relaxed.next_k(4, t, rate, 10_000, 10, 0) == 2  # one halving per version
    fixed = DynamicK(PecOptions(k=1, dynamic=False), num_experts=4)
    assert fixed.next_k(1, t, rate, 100, 10, 0) == 1


def test_a_lossy_restore_raises_k():
    rate = np.full((1, 8), 2)  # 16 tokens a step, top-2
    dyn = DynamicK(PecOptions(k=1), num_experts=8)
    t = PltTracker(1, 8, top_k=2)
    ks = steady(t, rate, 300, dyn, 1, 8)
    assert ks[-1] == 1
    t.restored_lost[:] = int(0.036 * t.step * 8 * 2)  # a past restore lost 3.6%
    assert dyn.next_k(1, t, rate, t.step * 8, 8, 300) > 1


# ------------------------------------------------------------------ restore plan


def test_restore_plan_hand_example():
    t = hand_tracker()
    saved = {(layer, e): [1] for layer in range(2) for e in range(4)}
    saved[(0, 0)] = saved[(1, 1)] = [1, 2]
    plan = restore_plan(saved, 2, t, tokens_total=8)
    assert plan.source.tolist() == [[2, 1, 1, 1], [1, 2, 1, 1]]
    assert plan.lost.tolist() == [6, 5] and plan.plt == pytest.approx(11 / 32)
    t.on_restored(plan)
    assert t.restored_lost.tolist() == [6, 5] and not t.since_save.any()
    assert t.plt(8) == pytest.approx(11 / 32)
    with pytest.raises(ValueError, match="no saved copy"):
        restore_plan({}, 2, t, 8)
    saved[(0, 0)] = [1]  # the tracker's copy of (0, 0) at step 2 is gone
    with pytest.raises(ValueError, match="tracker's newest copy is at step 2"):
        restore_plan(saved, 2, hand_tracker(), 8)


def test_restore_with_k_equal_n_loses_only_the_steps_after_the_restore_point():
    t = PltTracker(2, 4, top_k=2)
    saved = {}
    for step in range(1, 4):  # versions with every expert at steps 1..3
        t.observe(np.full((2, 4), 2))
        t.on_saved(t.step, np.ones((2, 4), bool))
        for key in np.ndindex(2, 4):
            saved.setdefault(key, []).append(step)
    after = [[1, 2, 3, 4], [0, 0, 5, 5]]  # steps 4 and 5, no version
    t.observe(after)
    t.observe(after)
    plan = restore_plan(saved, 3, t, tokens_total=5 * 4)
    assert (plan.source == 3).all()
    assert plan.lost.tolist() == [20, 20]  # 2 * (1+2+3+4), 2 * (5+5)
    assert plan.plt == pytest.approx(20 / 40)


# ------------------------------------------------------------------ state leaves


def test_expert_leaves_of_the_tiny_train_state():
    cfg, state = abstract_state("tiny")
    leaves = expert_leaf_axes(state, cfg)
    experts = {p: i.moe_layer for p, i in leaves.items() if i is not None}
    assert len(experts) == 2 * 2 * 3  # 2 layers x (w_in, w_out) x (params, mu, nu)
    assert experts["['params']['block1']['moe']['w_out']"] == 1
    assert experts["['opt_state'][1][0].mu['block0']['moe']['w_in']"] == 0
    assert leaves["['params']['block0']['moe']['router']"] is None
    assert leaves["['opt_state'][1][0].count"] is None
    split = state_bytes(state, cfg)
    total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))
    expert = 3 * 4 * param_count(cfg)["expert"]  # float32 params, mu and nu
    assert (split.expert, split.non_expert) == (expert, total - expert)
    assert split.expert_fraction == pytest.approx(expert / total)
    assert split.per_version(8) == total
    assert split.per_version(1) == total - expert + expert // 8
    assert expert_leaf_axes(list(leaves), cfg) == leaves  # paths alone give the same


def test_expert_leaf_rule_on_paths():
    cfg = get_config("small")  # MoE layers 1 and 3
    paths = ["['params']['block1']['moe']['w_in']", "['x'][0].nu['block3']['moe']['w_out']",
             "['params']['block0']['fc_in']['kernel']", "['params']['block3']['moe']['router']"]
    got = expert_leaf_axes(paths, cfg)
    assert [None if v is None else v.moe_layer for v in got.values()] == [0, 1, None, None]
    with pytest.raises(ValueError, match="not a MoE layer"):
        expert_leaf_axes(["['params']['block2']['moe']['w_in']"], cfg)
    with pytest.raises(ValueError, match="experts axis"):
        expert_leaf_axes({"block1": {"moe": {"w_in": np.zeros((3, 2))}}}, cfg)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_restored_expert_params_and_moments_share_a_step(data):
    cfg, state = abstract_state("tiny")
    layers, n = len(cfg.moe_layers), cfg.num_experts
    t = PltTracker(layers, n, cfg.top_k)
    saved = {key: [] for key in np.ndindex(layers, n)}
    for version in range(data.draw(st.integers(1, 6))):
        t.observe(np.ones((layers, n), np.int64))
        k = n if version == 0 else data.draw(st.sampled_from([1, 2, 4]))
        mask = select_experts(data.draw(st.sampled_from(["sequential", "load_aware"])), k,
                              num_layers=layers, num_experts=n, version=version, ranks=2,
                              since_save=t.since_save)
        t.on_saved(t.step, mask)
        for key in zip(*np.nonzero(mask), strict=True):
            saved[key].append(t.step)
    plan = restore_plan(saved, t.step, t, t.step * 64)
    steps = leaf_steps(plan, expert_leaf_axes(state, cfg))
    for layer in range(layers):
        block = f"['block{cfg.moe_layers[layer]}']['moe']"
        group = [steps[f"{prefix}{block}['{w}']"] for w in ("w_in", "w_out")
                 for prefix in ("['params']", "['opt_state'][1][0].mu", "['opt_state'][1][0].nu")]
        for vec in group:
            np.testing.assert_array_equal(vec, plan.source[layer])
    assert steps["['opt_state'][1][0].count"] == t.step


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=8, max_size=8), st.sampled_from([1, 2, 4, 8]),
       st.integers(1, 2000), st.sampled_from(["sequential", "load_aware"]))
def test_next_k_stays_on_the_chain_and_within_threshold(since, k_now, tokens, policy):
    t = PltTracker(2, 4, top_k=2)
    t.on_saved(0, np.ones((2, 4), bool))
    t.since_save[:] = np.reshape(since, (2, 4))
    rate = np.ones((2, 4), np.int64)
    dyn = DynamicK(PecOptions(k=1, policy=policy), num_experts=4, ranks=2)
    k_now = min(k_now, 4)
    k = dyn.next_k(k_now, t, rate, tokens, 4, 3)
    assert k in dyn.chain()

    def plt(k):
        return predict_plt(t, k, policy, rate, tokens, 4, 3, 2)

    if plt(k_now) > dyn.options.plt_threshold:
        assert k > k_now or k == 4
        assert plt(k) <= dyn.options.plt_threshold or k == 4
    else:
        assert k in (k_now, k_now // 2)


# ------------------------------------------------------------------ persistent tier


@settings(max_examples=200, deadline=None)
@given(layouts(), st.data())
def test_persist_mask_covers_every_expert_from_any_state(layout, data):
    """Least recently persisted first: from any persisted copies, ceil(N/K)
    consecutive steps carry every expert, K/R of each rank and layer each."""
    ranks, n, k, layers = layout
    k = ranks * max(1, k // ranks)  # a multiple of the ranks
    newest = np.array(data.draw(st.lists(st.lists(st.integers(0, 20), min_size=n, max_size=n),
                                         min_size=layers, max_size=layers)))
    fresh = np.array(data.draw(st.lists(st.lists(st.integers(0, 20), min_size=n, max_size=n),
                                        min_size=layers, max_size=layers)))
    seen = np.zeros((layers, n), bool)
    for step in range(21, 21 + math.ceil(n / k)):
        mask = persist_mask(k, newest, ranks, fresh)
        assert (mask.sum(axis=1) == k).all()
        assert (mask.reshape(layers, ranks, -1).sum(axis=2) == k // ranks).all()
        seen |= mask
        newest = np.where(mask, step, newest)
    assert seen.all()


def test_persist_mask_example_and_errors():
    # 8 experts on 2 ranks (0-3, 4-7); K=2: one of each rank, the oldest copy
    # first, then the freshest values, then the lower index.
    newest = np.array([[3, 1, 1, 2, 5, 5, 4, 4]])
    fresh = np.array([[0, 2, 7, 0, 0, 0, 1, 6]])
    assert np.flatnonzero(persist_mask(2, newest, 2, fresh)[0]).tolist() == [2, 7]
    assert np.flatnonzero(persist_mask(2, newest, 2)[0]).tolist() == [1, 6]
    assert persist_mask(2, np.array([[3, -1, 1, 2, 5, 5, 4, 4]]), 2).all()  # no copy of 1
    assert persist_mask(8, newest, 2).all()
    with pytest.raises(ValueError, match="multiple of the 4"):
        persist_mask(2, newest, 4)


def test_persisted_plan_hand_example():
    """2 experts, 1 layer, top-1. Step 4 carries expert 0 (its values from step
    3), step 6 expert 1 (values from 6). Restore at 6: expert 0 loses the
    assignments after its values (cumulative 60 at 6, 30 at 3)."""
    copies = {
        2: (np.array([[True, True]]), np.array([[20, 10]]), np.array([[2, 2]])),
        4: (np.array([[True, False]]), np.array([[30, -1]]), np.array([[3, -1]])),
        6: (np.array([[False, True]]), np.array([[-1, 40]]), np.array([[-1, 6]])),
    }
    plan = persisted_plan(copies, 6, [[60, 40]], [5], tokens_total=100, top_k=1)
    assert plan.source.tolist() == [[4, 6]] and plan.data_step.tolist() == [[3, 6]]
    assert plan.lost.tolist() == [30] and plan.plt == 0.3 and plan.accumulated_plt == 0.35
    assert persisted_plan(copies, 4, [[50, 20]], [0], 80, 1).source.tolist() == [[4, 2]]
    assert newest_copies({s: c[0] for s, c in copies.items()}, (1, 2)).tolist() == [[4, 6]]
    needs = persisted_needs({s: c[0] for s, c in copies.items()}, (1, 2))
    assert needs == {2: ((2,), True), 4: ((2, 4), True), 6: ((4, 6), True)}
    # The persistent tier keeps the steps a restore of the newest one reads.
    assert versions_to_keep(needs, 6, window=0) == {4, 6}
    with pytest.raises(ValueError, match="expert 1 of MoE layer 0"):
        persisted_plan({4: copies[4]}, 4, [[50, 20]], [0], 80, 1)
    with pytest.raises(ValueError, match="one training"):
        persisted_plan(copies, 6, [[10, 40]], [0], 100, 1)
