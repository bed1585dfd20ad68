"""launch.train --profile=...: the profiling policies on the real 2-host x 2-device cluster.

The runs share a JAX persistent compilation cache (a temporary directory) so the
plain step compiled by the first run is reused by the later ones; the profiled
variant carries host callbacks, which JAX never caches, so it is compiled
for real in every run that profiles.
"""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, assert_no_orphans, run_train

MOE_SEGMENTS = [("block0", "fwd"), ("block1", "fwd"), ("head", "fwd"), ("block1", "bwd"),
                ("tail", "bwd")]
STEP_FIELDS = {"step", "loss", "step_time_s", "tokens_per_expert", "domain", "capacity_factors",
               "dropped", "profiled", "compiled"}


def _train(workdir, cache, steps, *flags):
    proc = run_train("--hosts=2", "--devices_per_host=2", "--model=tiny", f"--steps={steps}",
                     "--eval_sequences=0", f"--workdir={workdir}", *flags, env=cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_no_orphans(str(workdir))
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps_] == list(range(steps))  # a line for every step
    for r in steps_:
        assert set(r) >= STEP_FIELDS
    return records


def _events(records, name):
    return [r for r in records if r.get("event") == name]


@pytest.fixture(scope="module")
def off_run(tmp_path_factory, cache):
    return _train(tmp_path_factory.mktemp("off"), cache, 8, "--profile=off")


@pytest.fixture(scope="module")
def every_run(tmp_path_factory, cache):
    workdir = tmp_path_factory.mktemp("every")
    return workdir, _train(workdir, cache, 8, "--profile=every")


@pytest.mark.slow
def test_every_profiles_each_step_in_layer_order(every_run):
    _, records = every_run
    profiles = _events(records, "profile")
    assert [p["step"] for p in profiles] == list(range(8))
    assert not _events(records, "detector")  # the detector runs only when speculative
    for p in profiles:
        assert [(s["name"], s["direction"]) for s in p["layers"]] == MOE_SEGMENTS
        assert [s["moe_layer"] for s in p["layers"]] == [0, 1, None, 1, 0]
        assert all(s["duration_s"] >= 0 and s["collective_s"] is not None
                   for s in p["layers"] if s["moe_layer"] is not None)
        starts = [s["start_s"] for s in p["layers"]]
        assert starts == sorted(starts) and p["total_s"] > 0
    assert [p["compiled"] for p in profiles] == [True] + [False] * 7
    assert all(r["profiled"] for r in records if "event" not in r)


@pytest.mark.slow
def test_profiling_leaves_training_bitwise_unchanged(every_run, off_run):
    _, every = every_run
    losses = [r["loss"] for r in every if "event" not in r]
    assert losses == [r["loss"] for r in off_run if "event" not in r]
    assert not any(r["profiled"] for r in off_run if "event" not in r)
    assert not _events(off_run, "profile")


@pytest.mark.soak
@pytest.mark.slow
def test_speculative_profiles_when_the_detector_asks(tmp_path, cache):
    # A low threshold so the early, fast-moving router triggers it within 8 steps.
    records = _train(tmp_path / "spec", cache, 8, "--profile=speculative",
                     "--profile_trigger=drift", "--drift_threshold=0.05", "--drift_metric=l1")
    decisions = _events(records, "detector")
    assert [d["step"] for d in decisions] == list(range(8))
    profiles = {p["step"]: p for p in _events(records, "profile")}
    asked = {d["step"] + 1 for d in decisions if d["profile_next"]} - {8}
    # A profiled step that compiled its variant is measured again on the next step.
    again = {s + 1 for s, p in profiles.items() if p["compiled"]} - {8}
    assert asked, "the detector never asked for a profile"
    assert set(profiles) == {0} | asked | again
    assert len(profiles) < 8  # not every step
    for d in decisions:
        assert len(d["scores"]) == 2 and all(0 <= s <= 1 for s in d["scores"])
        assert d["repartition"] == (d["step"] in profiles)  # a new profile to plan from
    step_lines = {r["step"]: r for r in records if "event" not in r}
    assert {s for s, r in step_lines.items() if r["profiled"]} == set(profiles)


@pytest.mark.soak
@pytest.mark.slow
def test_first_n_profiles_the_first_steps_once(tmp_path, cache):
    records = _train(tmp_path / "first_n", cache, 5, "--profile=first_n", "--profile_first_n=3")
    assert [p["step"] for p in _events(records, "profile")] == [0, 1, 2]
    (iteration,) = _events(records, "iteration_profile")
    assert iteration["step"] == 2 and iteration["iterations"] == 3
    assert len(iteration["step_times_s"]) == 3 and iteration["median_s"] > 0
    assert iteration["collective_s"] > 0
    assert not _events(records, "detector")


@pytest.mark.slow
def test_plot_profile_writes_a_png(every_run, tmp_path):
    workdir, _ = every_run
    out = tmp_path / "profile.png"
    proc = subprocess.run(
        [sys.executable, "-m", "launch.experiments.plot_profile",
         f"--metrics={workdir / 'metrics.jsonl'}", f"--out={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.parametrize(
    "flags,flag_name",
    [(["--profile=sometimes"], "--profile"),
     (["--profile=every", "--drift_threshold=0.2"], "--drift_threshold"),
     (["--profile=speculative", "--profile_first_n=5"], "--profile_first_n"),
     (["--profile=every", "--profile_cache_max_age=50"], "--profile_cache_max_age"),
     (["--profile=speculative", "--profile_cache_max_age=-1"], "--profile_cache_max_age"),
     (["--profile=speculative", "--profile_trigger=drift", "--profile_cache_samples=3"],
      "--profile_cache_samples"),
     (["--profile=speculative", "--profile_cache_max_age=50", "--profile_cache_samples=-1"],
      "--profile_cache_samples"),
     (["--profile=speculative", "--profile_trigger=drift", "--profile_cache_granularity=layer"],
      "--profile_cache_granularity"),
     # The capacity trigger (default) reads no drift threshold or metric.
     (["--profile=speculative", "--drift_threshold=0.2"], "--drift_threshold"),
     (["--profile=speculative", "--drift_metric=l1"], "--drift_metric"),
     (["--profile=every", "--profile_trigger=drift"], "--profile_trigger")],
)
def test_bad_profile_flags_give_one_line_error(tmp_path, flags, flag_name):
    proc = run_train(*flags, f"--workdir={tmp_path}", "--steps=2", timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert flag_name in proc.stderr


@pytest.mark.slow
@pytest.mark.soak  # the trigger's logic is unit-tested in test_detector.py; this is the CLI run
def test_capacity_trigger_profiles_each_tuple_until_its_samples_are_in(tmp_path, cache):
    # The default speculative trigger: step t is profiled when its capacity
    # tuple (known before it runs) has fewer than --profile_cache_samples warm
    # profiles (none expires within 12 steps), after a cold profile (compile),
    # and at step 0; never because the load drifted.
    samples = 2
    records = _train(tmp_path / "cap", cache, 12, "--profile=speculative", "--dispatch=bucketed",
                     f"--profile_cache_samples={samples}")
    lines = [r for r in records if "event" not in r]
    profiles = {p["step"]: p for p in _events(records, "profile")}
    expected, warm, cold_before = set(), {}, False
    for r in lines:
        key = tuple(r["capacity_factors"])
        if r["step"] == 0 or cold_before or warm.get(key, 0) < samples:
            expected.add(r["step"])
        profiled = r["step"] in expected
        cold_before = profiled and r["compiled"]
        if profiled and not r["compiled"]:
            warm[key] = warm.get(key, 0) + 1
    assert set(profiles) == expected
    assert {r["step"] for r in lines if r["profiled"]} == expected
    assert len(expected) < 12
    # The detector still scores every step (its events), and never asked on its own.
    assert [d["step"] for d in _events(records, "detector")] == list(range(12))
