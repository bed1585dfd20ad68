"""The dynamicity detector, its cost model and the profiling policies (no JAX)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capricorn_jax import DetectorOptions, ProfilePolicy
from capricorn_jax._src.profiling.cache import CacheOptions, ProfileCache
from capricorn_jax._src.profiling.detector import CostModel, Decision, drift_score
from capricorn_jax._src.profiling.policy import FirstNProfiler, should_profile
from capricorn_jax.experimental import DynamicityDetector

METRICS = ("jsd", "l1", "max_load")


@st.composite
def load_pairs(draw):
    experts = draw(st.integers(2, 16))
    counts = st.lists(st.integers(0, 10_000), min_size=experts, max_size=experts)
    return np.array(draw(counts)), np.array(draw(counts))


@settings(max_examples=200, deadline=None)
@given(load_pairs(), st.sampled_from(METRICS), st.integers(1, 1000))
def test_drift_score_properties(pair, metric, scale):
    a, b = pair
    score = drift_score(a, b, metric)
    assert drift_score(a, a, metric) == pytest.approx(0.0, abs=1e-6)
    assert score == pytest.approx(drift_score(b, a, metric), abs=1e-12)
    assert 0.0 <= score <= 1.0
    # Only the shares matter, not the tokens in total.
    assert drift_score(a * scale, b, metric) == pytest.approx(score, abs=1e-6)
    assert drift_score(a, b * scale, metric) == pytest.approx(score, abs=1e-6)


@pytest.mark.parametrize("metric", METRICS)
def test_drift_score_extremes(metric):
    # Disjoint loads are as far apart as shares go, but their peak is the same.
    disjoint = drift_score([1, 0], [0, 1], metric)
    assert disjoint == pytest.approx(0.0 if metric == "max_load" else 1.0)
    assert drift_score([8, 0, 0, 0], [2, 2, 2, 2], metric) == pytest.approx(
        {"jsd": math.sqrt(0.5 * (math.log2(1.6) + 0.25 * math.log2(0.4) + 0.75)),
         "l1": 0.75, "max_load": 0.75}[metric]
    )
    assert drift_score([0, 0, 0], [5, 5, 5], metric) == 0.0  # no tokens = uniform
    with pytest.raises(ValueError):
        drift_score([1, 2], [1, 2, 3], metric)
    with pytest.raises(ValueError):
        drift_score([-1, 2], [1, 2], metric)


def _skewed(p_first: float, experts: int = 8, tokens: int = 4096) -> np.ndarray:
    """Two layers, layer 1 uniform; layer 0 gives ``p_first`` of its tokens to expert 0."""
    layer0 = np.full(experts, (1 - p_first) * tokens / (experts - 1))
    layer0[0] = p_first * tokens
    return np.stack([layer0, np.full(experts, tokens / experts)]).round().astype(np.int32)


@pytest.mark.parametrize("metric", METRICS)
def test_detector_activates_only_past_the_threshold(metric):
    det = DynamicityDetector(DetectorOptions(threshold=0.2, metric=metric))
    first = det.observe(0, _skewed(1 / 8))
    assert first.profile_next and first.scores == (math.inf, math.inf)
    det.record_profile(1, _skewed(1 / 8), {})
    small = det.observe(1, _skewed(0.15))
    assert small.repartition and not small.profile_next  # new profile: re-plan once
    assert max(small.scores) <= 0.2 and small.scores[1] == 0.0
    big = det.observe(2, _skewed(0.9))
    assert big.profile_next and not big.repartition
    assert big.scores[0] > 0.2 and big.scores[1] == 0.0


def test_min_interval_delays_the_next_profile():
    det = DynamicityDetector(DetectorOptions(threshold=0.05, min_interval=3))
    det.record_profile(10, _skewed(1 / 8), {})
    assert not det.observe(10, _skewed(0.9)).profile_next  # step 11: 1 after the profile
    assert not det.observe(11, _skewed(0.9)).profile_next
    assert det.observe(12, _skewed(0.9)).profile_next  # step 13: 3 after


def test_detector_rejects_bad_loads_and_options():
    det = DynamicityDetector()
    with pytest.raises(ValueError):
        det.observe(0, [1, 2, 3])
    det.record_profile(0, _skewed(0.5), {})
    with pytest.raises(ValueError):
        det.observe(1, np.ones((2, 4)))
    with pytest.raises(ValueError):
        det.record_profile(1, _skewed(0.5), {(5, "fwd"): 1.0})
    with pytest.raises(ValueError):
        DetectorOptions(metric="kl")
    with pytest.raises(ValueError):
        DetectorOptions(min_interval=0)


@settings(max_examples=100, deadline=None)
@given(
    st.floats(-1.0, 1.0), st.floats(-1e-3, 1e-3),
    st.lists(st.integers(0, 100_000), min_size=2, max_size=30, unique=True),
)
def test_cost_model_recovers_exact_linear_data(a, b, xs):
    model = CostModel()
    for x in xs:
        model.update(x, a + b * x)
    got_a, got_b = model.coefficients
    assert got_b == pytest.approx(b, rel=1e-6, abs=1e-12)
    assert got_a == pytest.approx(a, rel=1e-6, abs=1e-7)
    assert model.predict(50_000) == pytest.approx(a + b * 50_000, rel=1e-6, abs=1e-7)


def test_cost_model_with_fewer_than_two_distinct_points():
    model = CostModel()
    assert model.coefficients is None and model.predict(3) is None
    model.update(100, 0.5)
    assert model.coefficients == (0.5, 0.0)
    model.update(100, 0.7)
    assert model.coefficients == pytest.approx((0.6, 0.0))
    assert model.predict(1000) == pytest.approx(0.6)


def test_cost_model_covers_only_loads_between_those_seen_once_its_slope_is_known():
    model = CostModel()
    assert not model.covers(10)
    model.update(10, 1.0)
    model.update(10, 1.2)
    assert not model.covers(10)  # one load seen: no slope
    model.update(20, 1.5)
    assert (model.x_min, model.x_max) == (10, 20)
    assert [model.covers(x) for x in (9.9, 10, 15, 20, 20.1)] == [False, True, True, True, False]
    assert model.covers(9, margin=0.1) and model.covers(22, margin=0.1)
    assert not model.covers(22.1, margin=0.1)
    with pytest.raises(ValueError, match="margin"):
        model.covers(10, margin=-0.1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=10), st.integers(0, 12_000),
       st.sampled_from([0.0, 0.1, 0.5]))
def test_cost_model_covers_exactly_the_widened_range_of_distinct_loads(xs, x, margin):
    model = CostModel()
    for v in xs:
        model.update(v, 0.001 * v)
    expect = len(set(xs)) > 1 and min(xs) * (1 - margin) <= x <= max(xs) * (1 + margin)
    assert model.covers(x, margin) is expect


def test_detector_predicts_from_this_hosts_max_load():
    det = DynamicityDetector(DetectorOptions(host_experts=(4, 5, 6, 7)))
    for peak in (100, 300):
        load = np.full((2, 8), 10)
        load[0, 5] = peak
        load[0, 0] = 10_000  # another host's expert: not this host's cost
        det.record_profile(peak, load, {(0, "fwd"): 0.001 + 1e-5 * peak, (1, "bwd"): 0.02})
    query = np.full((2, 8), 10)
    query[0, 6] = 200
    got = det.predict(query)
    assert got[(0, "fwd")] == pytest.approx(0.003)
    assert got[(1, "bwd")] == pytest.approx(0.02)
    np.testing.assert_array_equal(det.max_load(query), [200, 10])


def test_first_n_profile_is_taken_once_and_kept():
    prof = FirstNProfiler(n=3)
    assert prof.observe(0, 1.0) is None and prof.observe(1, 3.0) is None
    fixed = prof.observe(2, 2.0)
    assert fixed is not None and fixed.iterations == 3 and fixed.median_s == 2.0
    assert prof.observe(3, 100.0) is fixed and prof.observe(0, 100.0) is fixed
    with pytest.raises(ValueError):
        FirstNProfiler(0)


def test_should_profile_for_each_policy():
    yes, no = Decision(4, (0.5,), True, False), Decision(4, (0.0,), False, True)
    assert not any(should_profile("off", 5, d) for d in (None, yes, no))
    assert all(should_profile(ProfilePolicy.EVERY, 5, d) for d in (None, yes, no))
    assert should_profile("first_n", 5, no, first_n=6)
    assert not should_profile("first_n", 5, yes, first_n=5)
    assert should_profile("speculative", 0, None)
    assert should_profile("speculative", 5, yes)
    assert not should_profile("speculative", 5, no)
    with pytest.raises(ValueError):
        should_profile("speculative", 7, yes)  # a stale decision
    with pytest.raises(ValueError):
        should_profile("sometimes", 5, yes)


# ----- the profile cache keyed by capacity tuple -----


def _drive(cache, keys, drifts):
    """Runs the cache rule over a tuple sequence (step t has tuple keys[t]) as
    launch.train does: step 0 profiled; a profiled step's durations recorded.
    Returns the profiled steps and the decisions."""
    profiled, decisions = [0], []
    cache.record(keys[0], 0, {(0, "fwd"): float(hash(keys[0]) % 97)})
    for t in range(1, len(keys)):
        d = cache.decide(t, keys[t], keys[t - 1], drifts[t - 1])
        decisions.append(d)
        if d.profile:
            profiled.append(t)
            cache.record(keys[t], t, {(0, "fwd"): float(hash(keys[t]) % 97)})
    return profiled, decisions


_tuples = st.tuples(st.sampled_from((2.0, 3.0, 4.0)), st.sampled_from((2.0, 3.0, 4.0)))


@settings(max_examples=200, deadline=None)
@given(st.lists(_tuples, min_size=1, max_size=60), st.data())
def test_cache_profiles_each_tuple_at_most_once_within_max_age(keys, data):
    drifts = data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
    cache = ProfileCache(CacheOptions(max_age=len(keys), samples=1))  # nothing expires
    profiled, decisions = _drive(cache, keys, drifts)
    assert len(profiled) <= len(set(keys))
    assert len({keys[t] for t in profiled}) == len(profiled)  # never a tuple twice
    assert set(cache.entries) == set(keys)  # every tuple measured once
    for d in decisions:
        assert d.profile == (d.asked and not d.cached)
        assert d.hit == (d.asked and d.cached)
        assert not (d.profile and d.hit)


@settings(max_examples=200, deadline=None)
@given(st.lists(_tuples, min_size=2, max_size=60), st.integers(1, 20), st.data())
def test_a_new_tuple_always_profiles_and_an_expired_one_again(keys, max_age, data):
    drifts = data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
    cache = ProfileCache(CacheOptions(max_age=max_age, samples=1))
    profiled, decisions = _drive(cache, keys, drifts)
    last = {keys[0]: 0}  # tuple -> step of its last profile
    for t, d in enumerate(decisions, start=1):
        asked = drifts[t - 1] or keys[t] != keys[t - 1] or keys[t] not in last
        age = None if keys[t] not in last else t - last[keys[t]]
        fresh = age is not None and age < max_age
        assert d.asked == asked and d.cached == fresh
        if keys[t] not in last:
            assert d.profile  # never measured: always profiled
        elif asked and not fresh:
            assert d.profile  # expired: profiled again when asked
        elif fresh:
            assert not d.profile  # a young profile stands for the step
        if d.profile:
            last[keys[t]] = t
    assert profiled == [0] + [d.step for d in decisions if d.profile]


def test_cache_with_a_constant_tuple_and_no_drift_profiles_once():
    key = (1.25, 1.25)
    profiled, decisions = _drive(ProfileCache(CacheOptions(max_age=5, samples=1)), [key] * 30,
                                 [False] * 30)
    assert profiled == [0] and not any(d.asked for d in decisions)
    # A drift asks; answered by the cache until the entry expires.
    cache = ProfileCache(CacheOptions(max_age=5, samples=1))
    profiled, decisions = _drive(cache, [key] * 12, [True] * 12)
    assert profiled == [0, 5, 10]
    assert [d.hit for d in decisions] == [True] * 4 + [False] + [True] * 4 + [False, True]


def test_cache_lookup_age_and_options():
    cache = ProfileCache(CacheOptions(max_age=3, samples=1))
    assert cache.lookup((4.0,), 0) is None and cache.age((4.0,), 0) is None
    cache.record((4.0,), 10, {(0, "fwd"): 0.5})
    assert cache.age((4.0,), 12) == 2 and cache.lookup((4.0,), 12) == {(0, "fwd"): 0.5}
    assert cache.lookup((4.0,), 13) is None  # age 3: not younger than max_age
    assert cache.lookup((4.0,), 9) is None  # a step before the profile
    assert (ProfileCache().options.max_age, ProfileCache().options.samples) == (50, 5)
    with pytest.raises(ValueError):
        CacheOptions(max_age=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(_tuples, min_size=2, max_size=60), st.integers(1, 20), st.integers(1, 4),
       st.data())
def test_cache_with_samples_answers_with_the_median_of_k_young_profiles(keys, max_age, k, data):
    """A reference model of the rule with k samples: the cache answers for a
    tuple only once k of its profiles are younger than max_age, with their
    per-segment median; a tuple with fewer than k profiles ever is asked for."""
    drifts = data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
    cache = ProfileCache(CacheOptions(max_age=max_age, samples=k))
    history: dict = {}  # tuple -> steps of its profiles, in order

    def measure(t):  # a different duration per profile, so the median is checkable
        cache.record(keys[t], t, {(0, "fwd"): float(t % 7), (1, "bwd"): float(-t)})
        history.setdefault(keys[t], []).append(t)

    measure(0)
    for t in range(1, len(keys)):
        d = cache.decide(t, keys[t], keys[t - 1], drifts[t - 1])
        kept = history.get(keys[t], [])[-k:]
        young = [s for s in kept if t - s < max_age]
        asked = drifts[t - 1] or keys[t] != keys[t - 1] or len(history.get(keys[t], [])) < k
        assert d.asked == asked
        assert d.cached == (len(young) >= k)
        assert d.profile == (asked and len(young) < k)
        if d.cached:
            assert cache.sources(keys[t], t) == {keys[t]: tuple(young)}
            assert cache.lookup(keys[t], t) == {
                (0, "fwd"): float(np.median([s % 7 for s in young])),
                (1, "bwd"): float(np.median([-s for s in young]))}
        else:
            assert cache.sources(keys[t], t) is None and cache.lookup(keys[t], t) is None
        if d.profile:
            measure(t)
    assert all(len(entry) <= k for entry in cache.entries.values())


def test_cache_with_samples_profiles_a_constant_tuple_k_times_then_answers():
    key = (2.0, 3.0)
    cache = ProfileCache(CacheOptions(max_age=100, samples=3))
    profiled, decisions = _drive(cache, [key] * 10, [False] * 10)
    assert profiled == [0, 1, 2]  # asked until 3 samples are in, even without drift
    assert [d.hit for d in decisions] == [False] * 9
    cache = ProfileCache(CacheOptions(max_age=4, samples=2))
    profiled, _ = _drive(cache, [key] * 12, [True] * 12)
    # Both samples must be young: at step 4 step 0's is 4 steps old (expired),
    # so 4 is profiled; at 5 step 1's expires and 5 is profiled; 6 and 7 are
    # answered by steps 4 and 5.
    assert profiled == [0, 1, 4, 5, 8, 9]
    with pytest.raises(ValueError, match="samples"):
        CacheOptions(samples=0)
    with pytest.raises(ValueError, match="recorded after"):
        cache.record(key, 3, {})



@settings(max_examples=200, deadline=None)
@given(st.lists(_tuples, min_size=2, max_size=60), st.integers(1, 20), st.integers(1, 4),
       st.data())
def test_layer_cache_answers_each_layer_from_profiles_at_its_own_factor(keys, max_age, k, data):
    """Reference model of granularity="layer": layer i's segments at step t
    come from the newest k profiles (younger than max_age) in which layer i
    ran at factor keys[t][i], whatever the other layers ran at."""
    drifts = data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
    cache = ProfileCache(CacheOptions(max_age=max_age, samples=k, granularity="layer"))
    profiles: list[int] = []

    def measure(t):
        cache.record(keys[t], t, {(0, "fwd"): float(t % 5), (0, "bwd"): float(t % 3),
                                  (1, "fwd"): float(-t)})
        profiles.append(t)

    measure(0)
    for t in range(1, len(keys)):
        d = cache.decide(t, keys[t], keys[t - 1], drifts[t - 1])
        cells = {}
        for layer, factor in enumerate(keys[t]):
            ever = [s for s in profiles if keys[s][layer] == factor]
            cells[layer] = [s for s in ever[-k:] if t - s < max_age]
            if len(ever) < k:
                cells[layer] = None  # never sampled enough: asked for
        sampled = all(c is not None for c in cells.values())
        answers = sampled and all(len(c) >= k for c in cells.values())
        assert d.asked == (drifts[t - 1] or keys[t] != keys[t - 1] or not sampled)
        assert d.cached == answers and d.profile == (d.asked and not answers)
        if answers:
            assert cache.sources(keys[t], t) == {
                (layer, f): tuple(cells[layer]) for layer, f in enumerate(keys[t])}
            assert cache.lookup(keys[t], t) == {
                (0, "fwd"): float(np.median([s % 5 for s in cells[0]])),
                (0, "bwd"): float(np.median([s % 3 for s in cells[0]])),
                (1, "fwd"): float(np.median([-s for s in cells[1]]))}
        if d.profile:
            measure(t)


def test_layer_cache_answers_a_tuple_never_profiled_from_its_layers():
    cache = ProfileCache(CacheOptions(max_age=100, samples=1, granularity="layer"))
    cache.record((2.0, 3.0), 1, {(0, "fwd"): 1.0, (1, "fwd"): 2.0})
    cache.record((3.0, 4.0), 2, {(0, "fwd"): 5.0, (1, "fwd"): 6.0})
    # (2.0, 4.0) never ran, but layer 0 ran at 2.0 (step 1) and layer 1 at 4.0 (step 2).
    assert cache.lookup((2.0, 4.0), 3) == {(0, "fwd"): 1.0, (1, "fwd"): 6.0}
    assert cache.sources((2.0, 4.0), 3) == {(0, 2.0): (1,), (1, 4.0): (2,)}
    assert cache.age((2.0, 4.0), 3) == 2  # its stalest cell's newest profile
    assert cache.lookup((4.0, 4.0), 3) is None  # layer 0 never ran at 4.0
    with pytest.raises(ValueError, match="granularity"):
        CacheOptions(granularity="expert")


def test_layer_sources_name_each_layers_steps_at_both_granularities():
    for granularity, expected in (("tuple", {0: (1,), 1: (1,)}),
                                  ("layer", {0: (1,), 1: (2,)})):
        cache = ProfileCache(CacheOptions(max_age=100, samples=1, granularity=granularity))
        cache.record((2.0, 4.0), 1, {})
        cache.record((3.0, 4.0), 2, {})
        assert cache.layer_sources((2.0, 4.0), 3) == expected
        assert cache.layer_sources((4.0, 4.0), 3) is None


class _PlanningStrategy:
    """A strategy that plans on profiles and records what it was handed."""

    plans_on_profiles = True
    name = "planner"

    def __init__(self):
        self.planned = []

    def on_profile(self, step, profile, cold):
        self.planned.append((step, profile, cold))
        return {"window_bytes": [1]}


def test_a_cache_hit_on_another_tuple_replans_from_that_tuples_profile():
    from capricorn_jax import ProfilingDriver, ProfilingOptions

    strategy = _PlanningStrategy()
    driver = ProfilingDriver(object(), strategy, ProfilingOptions("speculative"),
                             next_factors=lambda m: (1.0,))
    assert driver.capacity_trigger and driver.options.cache == CacheOptions(200, 2)
    a, b = (1.0, 2.0), (2.0, 2.0)
    driver._warm = {a: "profile of a", b: "profile of b"}
    driver._planned_key, driver._next_key = b, a
    assert driver._replan_from_cache(7, {"cache_hit": False}) is None  # profiled, not a hit
    assert driver._replan_from_cache(7, {"cache_hit": True}) == {"window_bytes": [1],
                                                                 "from_cache": True}
    assert strategy.planned == [(7, "profile of a", False)] and driver._planned_key == a
    assert driver.cache_replans == [7]
    assert driver._replan_from_cache(8, {"cache_hit": True}) is None  # planned on a already
    driver._next_key = (4.0, 4.0)  # a hit on a tuple whose full profile is not kept here
    assert driver._replan_from_cache(9, {"cache_hit": True}) is None
    strategy.plans_on_profiles = False
    driver._next_key = b
    assert driver._replan_from_cache(10, {"cache_hit": True}) is None
    assert len(strategy.planned) == 1


def test_profiling_options_trigger():
    from capricorn_jax import ProfilingOptions

    assert ProfilingOptions().trigger == "capacity"
    assert ProfilingOptions("speculative", trigger="drift").cache is None
    with pytest.raises(ValueError, match="trigger"):
        ProfilingOptions("speculative", trigger="sometimes")


def test_a_strategys_own_request_profiles_the_next_step_past_the_cache():
    """capricorn asks for a profile when its windows spilled: the driver
    profiles the next step even when the trigger and the cache would not."""
    from capricorn_jax import ProfilingDriver, ProfilingOptions

    class Requesting(_PlanningStrategy):
        requested = False

        def allow_profile(self, detector, tokens_per_expert):
            return True

        def profile_requested(self):
            return self.requested

    strategy = Requesting()
    driver = ProfilingDriver(object(), strategy, ProfilingOptions("speculative"),
                             next_factors=lambda m: (1.0,))
    tpe = np.full((1, 4), 8.0)
    durations = {(0, "fwd"): 0.01}
    for step in range(3):  # the tuple profiled twice: the cache answers from then on
        driver.cache.record((1.0,), step, durations)
    event = driver._detect(3, (1.0,), {}, tpe, None, False)
    assert not event["profile_next"] and not event["requested"]
    strategy.requested = True
    event = driver._detect(4, (1.0,), {}, tpe, None, False)
    assert event["profile_next"] and event["requested"] and driver.decision.profile_next


def test_plan_s_counts_the_strategys_planning_calls_only(monkeypatch):
    """``ProfilingDriver.plan_s``: the time of the strategy's planning calls
    after a step (the bench's ``phase.plan``), each call timed, none of the
    driver's own work (a clock that ticks one second per reading)."""
    from capricorn_jax import ProfilingDriver, ProfilingOptions
    from capricorn_jax._src.strategies import driver as driver_module

    calls = []

    class Counting(_PlanningStrategy):
        def allow_profile(self, detector, tokens_per_expert):
            calls.append("allow_profile")
            return True

        def profile_requested(self):
            calls.append("profile_requested")
            return False

        def replan_at_load(self, step, detector, tokens_per_expert):
            calls.append("replan_at_load")
            return None

    def failing(*args):
        calls.append("failing")
        raise RuntimeError("a planning call that fails is timed too")

    ticks = iter(range(1000))
    monkeypatch.setattr(driver_module.time, "perf_counter", lambda: float(next(ticks)))
    driver = ProfilingDriver(object(), Counting(), ProfilingOptions("speculative"),
                             next_factors=lambda m: (1.0,))
    tpe = np.full((1, 4), 8.0)
    driver._detect(3, (1.0,), {}, tpe, None, False)
    assert calls and driver.plan_s == float(len(calls))
    driver.plan_s, calls[:] = 0.0, []
    with pytest.raises(RuntimeError, match="timed too"):
        driver._planning(failing, 4, None, tpe)
    assert driver.plan_s == 1.0 and calls == ["failing"]
