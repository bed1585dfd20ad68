"""The bench's paired bootstrap interval (``step_stats.paired_ratio_ci``) on known data."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launch.bench.step_stats import paired_ratio_ci

steps = st.lists(st.floats(0.05, 5.0, allow_nan=False), min_size=2, max_size=60)


@given(steps, st.floats(0.5, 2.0))
@settings(max_examples=40, deadline=None)
def test_a_strategy_exactly_k_times_none_has_the_interval_k_k(base, k):
    ci, pairs = paired_ratio_ci([k * b for b in base], base, [True] * len(base),
                                [True] * len(base), resamples=200)
    assert pairs == len(base)
    assert ci == pytest.approx([k, k], rel=1e-4)


@given(steps, st.floats(0.5, 2.0), st.integers(0, 3))
@settings(max_examples=40, deadline=None)
def test_the_interval_scales_with_the_strategy_s_steps(base, k, seed):
    """Equivariance: the same resamples (same seed), each ratio times k."""
    times = [b * (1 + 0.1 * ((i * 7) % 5)) for i, b in enumerate(base)]
    mask = [True] * len(base)
    ci, _ = paired_ratio_ci(times, base, mask, mask, resamples=200, seed=seed)
    scaled, _ = paired_ratio_ci([k * t for t in times], base, mask, mask, resamples=200,
                                seed=seed)
    assert ci is not None and scaled == pytest.approx([k * ci[0], k * ci[1]], rel=1e-3)
    assert ci[0] <= ci[1]


def test_only_steps_steady_in_both_are_paired_and_fewer_than_two_give_none():
    times, base = [1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]
    ci, pairs = paired_ratio_ci(times, base, [True, False, True, True],
                                [True, True, False, True])
    assert pairs == 2 and ci is not None and 1.0 <= ci[0] <= ci[1] <= 4.0
    assert paired_ratio_ci(times, base, [True, False, False, False], [True] * 4) == (None, 1)


def test_pairing_cancels_the_noise_both_share():
    """Each step's box noise (a slow moment) hits both strategies: paired, a
    strategy 2% slower on every step is 1.02 within a narrow interval; the same
    steps shuffled (unpaired) give a wide one."""
    noise = [1.0 + 0.3 * ((i * 37) % 11) / 10 for i in range(300)]
    base, times = noise, [1.02 * x for x in noise]
    mask = [True] * 300
    paired, _ = paired_ratio_ci(times, base, mask, mask, resamples=500)
    shuffled, _ = paired_ratio_ci(times[150:] + times[:150], base, mask, mask, resamples=500)
    assert paired == pytest.approx([1.02, 1.02], rel=1e-4)
    assert shuffled[1] - shuffled[0] > 10 * (paired[1] - paired[0] + 1e-6)


def test_the_tables_print_each_steady_ratio_with_its_interval():
    """The tables take the bench's interval where it recorded one and compute
    the same bootstrap from the per-step record of a run made before it did."""
    from launch.tables import ratio_cell, steady_ci

    base = [1.0 + 0.01 * (i % 7) for i in range(40)]
    none = {"step_s": base, "step_profiled": [False] * 40,
            "step_compiled": [i < 2 for i in range(40)]}
    late = {"step_s": [1.05 * b for b in base], "step_profiled": [i == 9 for i in range(40)],
            "step_compiled": [False] * 40}
    doc = {"strategies": {"none": none, "late": late,
                          "recorded": {**late, "steady_ratio_ci": [0.5, 0.6]},
                          "bare": {"steady_ratio": 1.2}}}
    mask = [not p and not c for p, c in zip(late["step_profiled"], late["step_compiled"],
                                                   strict=True)]
    base_mask = [not c for c in none["step_compiled"]]
    assert steady_ci(doc, "late") == paired_ratio_ci(late["step_s"], base, mask, base_mask)[0]
    assert steady_ci(doc, "late") == pytest.approx([1.05, 1.05])
    assert steady_ci(doc, "recorded") == [0.5, 0.6]
    assert steady_ci(doc, "bare") is None and steady_ci(doc, "none") is None
    assert ratio_cell(1.0341, [1.012, 1.0511], ".3f") == "1.034 [1.012-1.051]"
    assert ratio_cell(1.2, None, ".2f") == "1.20" and ratio_cell(None, None, ".2f") == "-"
