"""Capricorn's model of the expert windows (scheduling.plan.window_model): the fit,
its noise, and the re-plan rule, property-tested."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capricorn_jax._src.scheduling.plan.partitioner import Window
from capricorn_jax._src.scheduling.plan.window_model import (
    MIN_SAMPLES,
    SpanFit,
    WindowModel,
    fit,
    moved_windows,
    window_key,
)


@settings(max_examples=100, deadline=None)
@given(a=st.floats(0.0, 0.05), b=st.floats(0.0, 1e-4), noise=st.floats(1e-5, 2e-3),
       seed=st.integers(0, 2**16))
def test_the_fit_recovers_the_line_and_its_noise(a, b, noise, seed):
    rng = np.random.default_rng(seed)
    loads = rng.uniform(100, 2000, 64)
    idle = a + b * loads + rng.normal(0, noise, 64)
    f = fit(list(zip(loads, idle, strict=True)))
    assert f is not None and f.samples == 64
    assert abs(f.slope_s - b) < 6 * noise / np.ptp(loads) * 4
    assert 0.4 * noise < f.noise_s < 2.0 * noise
    assert f.low == loads.min() and f.high == loads.max()


def test_no_fit_without_enough_points_or_loads():
    assert fit([(100.0, 0.01)] * (MIN_SAMPLES - 1)) is None
    assert fit([(100.0, 0.01)] * 20) is None  # one load: no slope
    with pytest.raises(ValueError, match="history=2"):
        WindowModel(history=2)
    model = WindowModel(history=MIN_SAMPLES)
    for i in range(2 * MIN_SAMPLES):
        model.observe("w", 100.0 + i, 0.001 * i)
    assert model.samples("w") == MIN_SAMPLES and model.fit_of("w") is not None
    assert model.fit_of("other") is None


@settings(max_examples=200, deadline=None)
@given(planned=st.lists(st.floats(0.0, 0.1), min_size=1, max_size=6),
       predicted=st.lists(st.floats(0.0, 0.1), min_size=6, max_size=6),
       noise=st.floats(0.0, 0.01), k=st.floats(0.5, 4.0))
def test_a_window_moves_exactly_when_its_change_exceeds_k_noises(planned, predicted, noise, k):
    windows = [Window(f"block{i}", "fwd", d, "fwd:dispatch.end") for i, d in enumerate(planned)]
    keys = [window_key(w) for w in windows]
    fits = {key: SpanFit(p, 0.0, noise, 10, 100.0, 200.0)
            for key, p in zip(keys, predicted, strict=False)}
    loads = {key: 150.0 for key in keys}
    got = moved_windows(windows, loads, fits, k)
    assert got == {i: predicted[i] for i, w in enumerate(windows)
                   if abs(predicted[i] - w.duration_s) > k * noise}


def test_a_load_outside_the_fit_asks_for_a_profile_and_unmodelled_windows_stand():
    windows = [Window("block1", "fwd", 0.02, "fwd:dispatch.end"), Window("head", "fwd", 0.01)]
    fits = {window_key(windows[0]): SpanFit(0.0, 1e-5, 1e-4, 10, 1000.0, 2000.0)}
    assert moved_windows(windows, {window_key(windows[0]): 5000.0}, fits) is None
    assert moved_windows(windows, {window_key(windows[0]): 2000.0}, fits) == {}
    assert moved_windows(windows, {window_key(windows[0]): 1000.0}, fits) == {0: 0.01}
