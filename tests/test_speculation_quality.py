"""launch.experiments.speculation_quality's offline replay, on synthetic runs (no JAX, no training).

Layer durations here are an exact function of the capacity tuple, as the bucket
model of the tool assumes, and the expert load never moves: the detector alone
profiles only the first steps, the profile cache keyed by tuple profiles each
tuple once and predicts every later flip exactly.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

A, B = (4.0, 4.0), (3.0, 4.0)
FACTORS = [A, A, B, B, A, A, B, A, A, B, B, A]
CHANGES = [2, 4, 6, 7, 9, 11]  # the tuple's first layer changes bucket
LOAD = [[10, 20, 30, 40], [25, 25, 25, 25]]


def _segments(factors):
    f0, f1 = factors
    return [{"name": "block0", "direction": "fwd", "moe_layer": 0, "duration_s": 0.01 * f0},
            {"name": "block1", "direction": "fwd", "moe_layer": 1, "duration_s": 0.01 * f1},
            {"name": "head", "direction": "fwd", "moe_layer": None, "duration_s": 0.005},
            {"name": "block1", "direction": "bwd", "moe_layer": 1, "duration_s": 0.02 * f1},
            {"name": "tail", "direction": "bwd", "moe_layer": 0, "duration_s": 0.02 * f0}]


def _write(path, profiled):
    path.mkdir(parents=True)
    lines, seen = [], set()
    for t, f in enumerate(FACTORS):
        lines.append({"step": t, "loss": 1.0, "step_time_s": 0.11 if t in profiled else 0.1,
                      "tokens_per_expert": LOAD, "capacity_factors": list(f),
                      "profiled": t in profiled, "compiled": t in profiled and f not in seen})
        if t in profiled:
            lines.append({"event": "profile", "step": t, "compiled": f not in seen,
                          "layers": _segments(f)})
            seen.add(f)
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("specq")
    _write(root / "dynamic_every", set(range(len(FACTORS))))
    # What train profiles with the cache (max age 200) on these loads:
    # step 0, step 1 (step 0 compiled), 2 (new tuple), 3 (2 compiled).
    _write(root / "dynamic_speculative", {0, 1, 2, 3})
    out = root / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "launch.experiments.speculation_quality", "--reuse",
         f"--workdir={root}",
         "--workloads=dynamic", f"--steps={len(FACTORS)}", "--ab_rounds=0", "--metrics=jsd",
         "--thresholds=0.05", "--cache_max_age=200,3", "--cache_samples=1,2",
         "--cache_granularity=tuple,layer",
         "--spec_cache_max_age=200", "--spec_cache_samples=1",
         f"--json={out}"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "jsd + cache (200)" in proc.stdout
    assert "jsd + cache (200, median of 2)" in proc.stdout
    assert "capacity trigger (train's default) + cache (200, median of 2)" in proc.stdout
    (res,) = json.loads(out.read_text())["results"]
    return res


def _row(res, metric, max_age, samples=1, granularity="tuple"):
    (row,) = [r for r in res["rows"] if r["metric"] == metric and r["cache_max_age"] == max_age
              and r["cache_samples"] == samples
              and r.get("cache_granularity", "tuple") == granularity]
    return row


def test_replay_with_the_cache_matches_the_run_it_scores(result):
    assert result["replay_matches_real_run"]
    assert result["real_run"]["cache_max_age"] == 200
    assert result["real_run"]["profiled_steps"] == 4


def test_the_cache_profiles_each_tuple_once_and_predicts_the_flips(result):
    row = _row(result, "jsd", 200)
    bucket = row["bucket"]
    assert bucket["changes"] == len(CHANGES)
    # Change at 2: profiled at 2 (compiled) and 3; the other 5 flips come
    # from the cache, whose profiles predict the durations exactly.
    assert bucket["caught"] == len(CHANGES) and bucket["caught_by_cache"] == 5
    assert bucket["recall"] == 1.0 and bucket["recall_vs_fresh"] == 1.0
    assert row["activation_rate"] == pytest.approx(3 / 12)  # steps 1, 2, 3
    assert row["profiled_rate"] == pytest.approx(3 / 12)
    assert row["cache_hits"] == 5  # each flip asked, the cache answered


def test_without_the_cache_the_detector_misses_load_free_flips(result):
    row = _row(result, "jsd", 0)
    assert row["bucket"]["caught"] == 0 and "recall_vs_fresh" not in row["bucket"]
    assert row["profiled_rate"] == pytest.approx(1 / 12)  # step 1, after step 0 compiled
    what_if = _row(result, "capacity", 0)
    assert what_if["bucket"]["recall"] == 1.0


def test_an_expired_entry_is_profiled_again(result):
    row = _row(result, "jsd", 3)
    # Max age 3: A (profiled at 1) is expired at 4, B (profiled at 3) at 6,
    # A (4) at 7, B (6) at 9, A (7) at 11: every flip is profiled again.
    assert row["profiled_rate"] == pytest.approx(8 / 12)  # steps 1, 2, 3, 4, 6, 7, 9, 11
    assert row["cache_hits"] == 0
    assert row["bucket"]["recall"] == 1.0


def test_with_two_samples_a_tuple_is_profiled_twice_before_the_cache_answers(result):
    row = _row(result, "jsd", 200, samples=2)
    # A: 0 (compiled), 1; B: 2 (compiled), 3; the flips at 4 (A) and 6 (B)
    # find one sample and are profiled; from then on the cache answers
    # (7, 9, 11) with the median of two exact profiles.
    assert row["profiled_rate"] == pytest.approx(5 / 12)  # steps 1, 2, 3, 4, 6
    assert row["cache_hits"] == 3
    assert row["bucket"]["caught"] == len(CHANGES)
    assert row["bucket"]["caught_by_cache"] == 3


def test_the_per_layer_cache_predicts_each_layer_from_its_own_profiles(result):
    row = _row(result, "jsd", 200, granularity="layer")
    # Layer 1 runs at 4.0 in A and B, so B's layer 1 could come from A's
    # profile; B's layer 0 (3.0) still needs a profile of B: the same steps
    # are profiled, and the per-layer medians predict every flip exactly.
    assert row["profiled_rate"] == pytest.approx(3 / 12)
    assert row["bucket"]["caught"] == len(CHANGES) and row["bucket"]["caught_by_cache"] == 5
    assert _row(result, "jsd", 200, samples=2, granularity="layer")["bucket"]["recall"] == 1.0


def test_trains_default_capacity_trigger_is_scored_with_its_own_cache(result):
    row = _row(result, "capacity trigger", 200, samples=2)
    # The cache's rule alone (max age 200, 2 samples): the steps the samples=2
    # cache profiles above, whatever the drift: A 0, 1; B 2, 3; the flips at 4
    # and 6 find one sample each; 7, 9 and 11 are answered by the cache.
    assert row["profiled_rate"] == pytest.approx(5 / 12)
    assert row["cache_hits"] == 3
    assert row["bucket"]["caught"] == len(CHANGES) and row["bucket"]["recall"] == 1.0


def test_the_capacity_trigger_needs_the_cache():
    from launch.experiments.speculation_quality import CAPACITY_TRIGGER, replay

    with pytest.raises(ValueError, match="cache"):
        replay(None, CAPACITY_TRIGGER, float("nan"))
