"""How well does speculative profiling catch changes of the layer durations?

    python -m launch.experiments.speculation_quality --model=tiny --steps=300 --shift_every=50 \
        --workdir=/tmp/specq

Per workload (``--workloads``, default ``dynamic,steady``) it runs
``launch.train`` on the simulated cluster (``--hosts`` x ``--devices_per_host``)
twice with the same seed, so the training, hence the expert loads and the
capacity factors, are bitwise the same step for step:

1. ``--profile=every``: the ground truth, every step's per-layer durations;
2. ``--profile=speculative --profile_trigger=drift`` with train's detector defaults (or
   ``--spec_threshold`` / ``--spec_metric``): the real path. Its steps are
   either profiled or plain, in the same run, so it gives the overhead of an
   instrumented step (each profiled step against its plain neighbours at the
   same capacity factors); it also checks that the offline replay below
   reproduces its activations exactly.

Then it replays ``DynamicityDetector`` over run 1's tokens_per_expert for each
(``--metrics`` x ``--thresholds``), as train does (step 0 profiled; a profiled
step that ran its variant for the first time is measured again on the next
step), and scores it against the ground truth:

- durations: per MoE layer segment ((layer, fwd), (layer, bwd)); a step that
  ran its profiled variant for the first time (compile, cold run) is no
  measurement (``compiled`` in the profile event).
- two ground truths. ``measured``: each step's durations, median over the
  valid measurements within a centred window of ``--smooth`` steps (one-step
  spikes removed, level shifts kept). ``bucket``: a layer's duration at a step
  is the median over the run of its valid measurements at that step's
  capacity factor of the layer: on CPU the load changes a layer's time only
  through the capacity bucket (BUILD_NOTES: grouped matmuls cost the same
  whatever the group sizes), so this keeps the load-caused changes and drops
  the machine's own speed swings, which no load-based detector can foresee.
- a change: step c whose truth differs from step c-1's by more than
  ``--change`` (relative, any segment). Recall: the share of changes after
  which a valid profile is taken at c or c + 1 (within one iteration).
- an activation: a step profiled because the detector asked after the step
  before. Precision: the share of activations at which the truth differs by
  more than ``--change`` from the truth at the previous profile.
- activation rate: activations / steps. Amortized overhead: instrumented-step
  overhead x profiled steps (activations and re-measurements after a first
  run) / steps, plus the detector's own host time per step, as a fraction of
  the plain step time.

The ``+ cache`` rows replay the same detector with the profile cache keyed by
capacity tuple in front (``detector.ProfileCache``, max age
``--cache_max_age``, ``--cache_samples``; launch.train
``--profile_cache_max_age``, ``--profile_cache_samples``): step t is profiled
only when the detector asked after t-1 or t's capacity tuple differs from
t-1's (or has fewer than ``samples`` profiles), and the cache does not answer
for t's tuple (``samples`` warm profiles younger than the max age). For these
rows a change at step c also counts as caught when the cache answers for c's
tuple (profiles measured before c, younger than the max age: their
per-segment median stands for c; ``--cache_granularity=layer``: per MoE layer,
the profiles in which that layer ran at its factor at c) with durations each
within ``--change`` (relative) of the truth at c; the recall columns then
count both kinds of catch (the JSON splits them: ``caught_by_cache``).
A profile taken at c or c + 1 counts whatever its own error, so the last
column ("vs fresh") also counts a cached profile that is no further from the
truth at c (largest relative error over the segments) than the worse of the
profiles at c and c + 1 (every step is measured in the ``every`` run) would
have been: the cache on an equal footing with a fresh profile.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from absl import app, flags

from capricorn_jax import DetectorOptions, DynamicityDetector
from capricorn_jax.experimental import (
    CACHE_GRANULARITIES,
    CAPACITY_CACHE,
    CacheOptions,
    ProfileCache,
)
from capricorn_jax.experimental import DRIFT_METRICS as METRICS
from launch.metrics import read_metrics

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined only when run as a command: a test or
    another launcher importing this module for its logic must not define
    flags of the same names twice."""
    flags.DEFINE_string("model", "tiny", "Model config.")
    flags.DEFINE_integer("steps", 300, "Training steps per run.")
    flags.DEFINE_integer("shift_every", 50, "Steps between domain shifts (dynamic workload).")
    flags.DEFINE_list("workloads", ["dynamic", "steady"], "Workloads to run: dynamic, steady.")
    flags.DEFINE_integer("hosts", 2, "Simulated hosts.")
    flags.DEFINE_integer("devices_per_host", 2, "CPU devices per host.")
    flags.DEFINE_boolean("pin_hosts", False, "launch.train --pin_hosts: each host on its own CPUs.")
    flags.DEFINE_string("dispatch", "bucketed",
                        "MoE dispatch; bucketed makes a layer's time follow its load.")
    flags.DEFINE_integer("seed", 0, "Seed of both runs.")
    flags.DEFINE_integer("global_batch", 0, "Sequences per step; 0 = the model's.")
    flags.DEFINE_string("workdir", None, "Where the runs go; default: a temporary directory.")
    flags.DEFINE_boolean("reuse", False, "Score the runs already in --workdir instead of running.")
    flags.DEFINE_list("thresholds", ["0.05", "0.1", "0.2", "0.3"], "Detector thresholds replayed.")
    flags.DEFINE_list("metrics", list(METRICS), "Drift metrics replayed.")
    flags.DEFINE_float("spec_threshold", -1.0,
                       "Threshold of the real speculative run; < 0: train's.")
    flags.DEFINE_string("spec_metric", "", "Metric of the real speculative run; '': train's.")
    flags.DEFINE_integer("spec_cache_max_age", 0,
                         "--profile_cache_max_age of the real speculative run (0: no profile "
                         "cache).")
    flags.DEFINE_integer("spec_cache_samples", CacheOptions().samples,
                         "--profile_cache_samples of the real speculative run.")
    flags.DEFINE_list("cache_max_age", [str(CacheOptions().max_age)],
                      "Max ages of the profile cache replayed in the '+ cache' rows (each with "
                      "every metric, threshold and --cache_samples); empty: no such rows.")
    flags.DEFINE_list("cache_samples", [str(CacheOptions().samples)],
                      "Samples per cell (CacheOptions.samples) replayed in the '+ cache' rows.")
    flags.DEFINE_list("cache_granularity", [CacheOptions().granularity],
                      "Cache granularities (tuple, layer) replayed in the '+ cache' rows.")
    flags.DEFINE_string("spec_cache_granularity", CacheOptions().granularity,
                        "--profile_cache_granularity of the real speculative run.")
    flags.DEFINE_float("instrumented_overhead", -1.0,
                       "Overhead of an instrumented step (fraction of a plain step) used for the "
                       "amortized overhead; < 0: estimated from the real speculative run (few "
                       "profiled steps, e.g. with the cache, make that estimate loose).")
    flags.DEFINE_float("change", 0.10, "A duration change above this (relative) is a real change.")
    flags.DEFINE_integer("smooth", 5, "Window (steps) of the 'measured' truth's running median.")
    flags.DEFINE_string("json", None, "Also write the results here as JSON.")
    flags.DEFINE_float("timeout_s", 3600.0, "Deadline of each training run.")
    flags.DEFINE_integer("ab_rounds", 30,
                         "Cross-check of the overhead: rounds of plain vs instrumented step on one "
                         "batch (profiler.measure_overhead), one process with hosts x devices CPU "
                         "devices; 0 = skip.")
    flags.DEFINE_string("ab_worker", "",
                        "Internal: run the A/B at these capacity factors; print JSON.")


ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Run:
    """The per-step lines and profile events of one launch.train run."""

    steps: list[dict]
    profiles: dict[int, dict]

    @classmethod
    def load(cls, path: Path) -> Run:
        records = read_metrics(path)
        by_step = {r["step"]: r for r in records if "event" not in r}
        steps = [by_step[s] for s in sorted(by_step)]
        if [r["step"] for r in steps] != list(range(len(steps))):
            raise ValueError(f"{path}: steps are not 0..n-1")
        profiles = {r["step"]: r for r in records if r.get("event") == "profile"}
        return cls(steps, profiles)

    def factors(self, t: int) -> tuple[float, ...]:
        return tuple(self.steps[t]["capacity_factors"])


def train(workdir: Path, workload: str, profile: str, extra: tuple[str, ...] = ()) -> Path:
    """Runs launch.train; returns its metrics.jsonl."""
    cmd = [sys.executable, "-m", "launch.train", f"--hosts={FLAGS.hosts}",
           f"--devices_per_host={FLAGS.devices_per_host}", f"--model={FLAGS.model}",
           f"--steps={FLAGS.steps}", f"--workload={workload}", f"--shift_every={FLAGS.shift_every}",
           f"--dispatch={FLAGS.dispatch}", f"--seed={FLAGS.seed}", f"--profile={profile}",
           f"--global_batch={FLAGS.global_batch}", f"--pin_hosts={FLAGS.pin_hosts}",
           "--eval_sequences=0", f"--log_every={max(1, FLAGS.steps // 10)}",
           f"--workdir={workdir}", f"--timeout_s={FLAGS.timeout_s}", "--fresh", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    print("$ python " + " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"speculation_quality: training run failed ({workdir})")
    print(f"  done in {time.perf_counter() - t0:.0f}s", flush=True)
    return workdir / "metrics.jsonl"


# ----- ground truth -----

Key = tuple[int, str]  # (MoE layer, direction)


def durations(run: Run) -> tuple[list[Key], np.ndarray]:
    """[steps, keys] seconds per MoE segment, NaN where no valid measurement."""
    keys: list[Key] = []
    for p in run.profiles.values():
        keys = [(s["moe_layer"], s["direction"]) for s in p["layers"] if s["moe_layer"] is not None]
        break
    out = np.full((len(run.steps), len(keys)), np.nan)
    for t, p in run.profiles.items():
        if p.get("compiled"):
            continue
        d = {(s["moe_layer"], s["direction"]): s["duration_s"] for s in p["layers"]
             if s["moe_layer"] is not None}
        out[t] = [d[k] for k in keys]
    return keys, out


def measured_truth(raw: np.ndarray, window: int) -> np.ndarray:
    half = max(0, window - 1) // 2
    out = np.full_like(raw, np.nan)
    for t in range(len(raw)):
        block = raw[max(0, t - half):t + half + 1]
        for j in range(raw.shape[1]):
            col = block[:, j][~np.isnan(block[:, j])]
            if col.size:
                out[t, j] = np.median(col)
    return out


def bucket_truth(run: Run, keys: list[Key], raw: np.ndarray) -> tuple[np.ndarray, dict]:
    """Per step and key, the run's median duration at that step's capacity factor."""
    levels: dict[tuple[Key, float], float] = {}
    for j, key in enumerate(keys):
        by_factor: dict[float, list[float]] = {}
        for t in range(len(run.steps)):
            if not np.isnan(raw[t, j]):
                by_factor.setdefault(run.factors(t)[key[0]], []).append(raw[t, j])
        for f, values in by_factor.items():
            levels[(key, f)] = float(np.median(values))
    out = np.array([[levels.get((k, run.factors(t)[k[0]]), np.nan) for k in keys]
                    for t in range(len(run.steps))])
    return out, levels


def changed(a: np.ndarray, b: np.ndarray, x: float) -> bool | None:
    """Whether any segment differs by more than x (relative); None if unknown."""
    ok = ~(np.isnan(a) | np.isnan(b))
    if not ok.any():
        return None
    return bool(np.any(np.abs(a[ok] / b[ok] - 1.0) > x))


# ----- the detector, replayed -----

@dataclasses.dataclass
class Replay:
    profiled: list[int]  # every profiled step, in order
    activations: list[int]  # profiled because the detector asked
    valid: set[int]  # profiled steps that measured (not a first run of the variant)
    seconds_per_observe: float
    # With the profile cache: step -> MoE layer -> the (earlier, warm)
    # profiled steps whose durations' median the cache answers with for that
    # layer's segments at that step.
    cached_from: dict[int, dict[int, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    cache_hits: int = 0  # asked for a profile, answered by the cache


CAPACITY = "capacity"  # what-if trigger: the capacity factors differ from the last profile's
# launch.train's default trigger (--profile_trigger=capacity): the profile
# cache's rule alone, no drift (replayed with CAPACITY_CACHE's max age and samples).
CAPACITY_TRIGGER = "capacity trigger"


def replay(run: Run, metric: str, threshold: float, cache_max_age: int = 0,
           cache_samples: int = 1, cache_granularity: str = "tuple") -> Replay:
    """The profiled steps train's speculative policy takes on this run's loads.

    ``metric=CAPACITY`` replays a trigger train does not have (a what-if):
    profile a step whose capacity factors, known before it runs, differ from
    those of the last profiled step. ``cache_max_age`` > 0: with train's
    profile cache (``--profile_cache_max_age``, ``--profile_cache_samples``) in
    front of the detector. ``metric=CAPACITY_TRIGGER`` (needs the cache):
    train's default trigger, the cache's rule with the detector's drift off.
    """
    if metric == CAPACITY_TRIGGER and not cache_max_age:
        raise ValueError("the capacity trigger replays with the profile cache (cache_max_age)")
    options = (DetectorOptions() if metric in (CAPACITY, CAPACITY_TRIGGER)
               else DetectorOptions(threshold, metric))
    det = DynamicityDetector(options)
    cache = (ProfileCache(CacheOptions(cache_max_age, cache_samples, cache_granularity))
             if cache_max_age else None)
    profiled: list[int] = []
    acts: list[int] = []
    valid: set[int] = set()
    seen: set[tuple[float, ...]] = set()
    ask_next, reprofile, spent, cached_from, hits = False, False, 0.0, {}, 0
    n = len(run.steps)
    for t, line in enumerate(run.steps):
        if metric == CAPACITY:
            asked = t > 0 and run.factors(t) != run.factors(profiled[-1])
        else:
            asked = t > 0 and ask_next
        sources = None if cache is None else cache.layer_sources(run.factors(t), t)
        if sources is not None:
            cached_from[t] = sources
        if t == 0 or asked or reprofile:
            profiled.append(t)
            if asked:
                acts.append(t)
            first = run.factors(t) not in seen
            seen.add(run.factors(t))
            if not first:
                valid.add(t)
            det.record_profile(t, line["tokens_per_expert"], {})
            if cache is not None and not first:
                cache.record(run.factors(t), t, {})
            reprofile = first
        else:
            reprofile = False
        t0 = time.perf_counter()
        decision = det.observe(t, line["tokens_per_expert"])
        ask_next = decision.profile_next
        if cache is not None and t + 1 < n:
            drifted = ask_next and metric != CAPACITY_TRIGGER
            step = cache.decide(t + 1, run.factors(t + 1), run.factors(t), drifted)
            ask_next = step.profile
            hits += step.hit
        spent += time.perf_counter() - t0
    return Replay(profiled, acts, valid, spent / n, cached_from, hits)


def score(rep: Replay, truth: np.ndarray, x: float, raw: np.ndarray | None = None,
          layers: list[int] | None = None) -> dict:
    """Precision and recall of one replay against one ground truth.

    ``raw``: every step's measured durations (the profiles the cache holds),
    ``layers``: the MoE layer of each of its columns; with
    ``rep.cached_from``, a change is also caught when the cached profiles
    standing for its step (per segment, the median over the profiles the
    cache holds for the segment's layer) predict every segment within ``x``
    of the truth.
    """
    hits = 0
    judged = 0
    for t in rep.activations:
        before = max(p for p in rep.profiled if p < t)
        verdict = changed(truth[t], truth[before], x)
        if verdict is not None:
            judged += 1
            hits += verdict
    changes = [c for c in range(1, len(truth)) if changed(truth[c], truth[c - 1], x)]
    caught = [c for c in changes if c in rep.valid or c + 1 in rep.valid]
    by_cache, by_cache_fair = [], []
    if raw is not None:
        if layers is None:
            raise ValueError("score: raw needs layers (the MoE layer of each of its columns)")
        for c in changes:
            if c in caught or c not in rep.cached_from:
                continue
            true = truth[c]
            if np.isnan(true).any():
                continue
            predicted = np.array([np.median(raw[list(rep.cached_from[c][layer]), j])
                                  for j, layer in enumerate(layers)])
            error = _max_error(predicted, true)
            if error <= x:
                by_cache.append(c)
            # What a profile at c or c + 1, counted as caught whatever its
            # error, would have measured.
            fresh = [_max_error(raw[u], true) for u in (c, c + 1)
                     if u < len(raw) and not np.isnan(raw[u]).any()]
            if error <= max([x, *fresh]):
                by_cache_fair.append(c)
    n = len(changes)
    out = {"precision": hits / judged if judged else math.nan,
           "recall": (len(caught) + len(by_cache)) / n if n else math.nan,
           "changes": n, "caught": len(caught) + len(by_cache),
           "caught_by_cache": len(by_cache), "judged_activations": judged}
    if raw is not None:
        fair = len(caught) + len(by_cache_fair)
        out.update(recall_vs_fresh=fair / n if n else math.nan, caught_vs_fresh=fair,
                   caught_by_cache_vs_fresh=len(by_cache_fair))
    return out


def _max_error(predicted: np.ndarray, true: np.ndarray) -> float:
    """The largest relative error over the segments."""
    return float(np.max(np.abs(predicted / true - 1.0)))


# ----- overhead of an instrumented step, from the speculative run -----

def instrumented_overhead(spec: Run, radius: int = 3) -> dict:
    """Median over warm profiled steps of step time / mean of nearby plain steps - 1.

    Neighbours: warm plain steps within ``radius`` steps at the same capacity
    factors (this VM's speed swings over seconds, so only local pairs).
    """
    steps = spec.steps
    warm = [not r.get("compiled") for r in steps]
    ratios = []
    for t, r in enumerate(steps):
        if not (r.get("profiled") and warm[t]):
            continue
        near = [steps[u]["step_time_s"] for u in range(max(0, t - radius),
                                                         min(len(steps), t + radius + 1))
                if u != t and warm[u] and not steps[u].get("profiled")
                and spec.factors(u) == spec.factors(t)]
        if near:
            ratios.append(r["step_time_s"] / statistics.mean(near))
    plain = [r["step_time_s"] for t, r in enumerate(steps) if warm[t] and not r.get("profiled")]
    lo = hi = math.nan
    if ratios:  # bootstrap 90% interval of the median
        rng = np.random.default_rng(0)
        medians = np.median(rng.choice(ratios, (2000, len(ratios))), axis=1)
        lo, hi = (float(np.percentile(medians, q)) - 1.0 for q in (5, 95))
    return {"overhead": statistics.median(ratios) - 1.0 if ratios else math.nan,
            "pairs": len(ratios), "overhead_ci90": (lo, hi),
            "plain_step_s": statistics.median(plain) if plain else math.nan}


def ab_worker(factors: tuple[float, ...]) -> None:
    """Plain vs instrumented step, alternating on one batch, in this process."""
    import jax

    from capricorn_jax.experimental import measure_overhead
    from launch.trainer import OptimizerOptions, Trainer, make_mesh
    from models.config import get_config

    overrides = {"global_batch": FLAGS.global_batch} if FLAGS.global_batch else {}
    cfg = get_config(FLAGS.model, dispatch=FLAGS.dispatch, **overrides)
    devices = jax.devices()
    trainer = Trainer(cfg, make_mesh(math.gcd(cfg.num_experts, len(devices)), devices),
                      OptimizerOptions())
    rows = np.random.default_rng(0).integers(0, 256, (cfg.global_batch, cfg.seq_len + 1))
    batch = trainer.global_batch(rows.astype(np.int32))
    _, res = measure_overhead(trainer, factors, trainer.init_state(0), batch,
                              steps=FLAGS.ab_rounds, warmup=3)
    print("AB " + json.dumps(res))


_AB: dict[tuple[float, ...], dict] = {}


def run_ab(factors: tuple[float, ...]) -> dict:
    if factors in _AB:
        return _AB[factors]
    devices = FLAGS.hosts * FLAGS.devices_per_host
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    cmd = [sys.executable, "-m", "launch.experiments.speculation_quality", f"--model={FLAGS.model}",
           f"--dispatch={FLAGS.dispatch}", f"--ab_rounds={FLAGS.ab_rounds}",
           f"--global_batch={FLAGS.global_batch}",
           "--ab_worker=" + ",".join(str(f) for f in factors)]
    print("$ python " + " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("AB "):
            _AB[factors] = json.loads(line[3:])
            return _AB[factors]
    sys.stderr.write(proc.stderr[-2000:])
    return {}


def analyse(workload: str, every: Run, spec: Run, spec_metric: str,
            spec_threshold: float, spec_cache: int = 0, spec_samples: int = 1,
            spec_granularity: str = "tuple") -> dict:
    keys, raw = durations(every)
    truths = {"measured": measured_truth(raw, FLAGS.smooth)}
    truths["bucket"], levels = bucket_truth(every, keys, raw)
    over = instrumented_overhead(spec)
    if FLAGS.instrumented_overhead >= 0:
        over = {**over, "estimated": over["overhead"], "overhead": FLAGS.instrumented_overhead}
    tuples = [every.factors(t) for t in range(len(every.steps))]
    common = max(set(tuples), key=tuples.count)
    ab = run_ab(common) if FLAGS.ab_rounds > 0 else {}
    real = sorted(t for t, r in enumerate(spec.steps) if r.get("profiled"))
    check = replay(every, spec_metric, spec_threshold, spec_cache, spec_samples,
                   spec_granularity)
    rows = []
    grid = [(m, float(x), 0, 1, "tuple") for m in FLAGS.metrics for x in FLAGS.thresholds]
    cached = [(m, x, int(age), int(k), gran) for gran in FLAGS.cache_granularity
              for age in FLAGS.cache_max_age for k in FLAGS.cache_samples
              for m, x, _, _, _ in grid]
    for metric, threshold, max_age, samples, gran in (
            grid + [(CAPACITY, math.nan, 0, 1, "tuple"),
                    (CAPACITY_TRIGGER, math.nan, CAPACITY_CACHE.max_age,
                     CAPACITY_CACHE.samples, "tuple")] + cached):
        rep = replay(every, metric, threshold, max_age, samples, gran)
        n = len(every.steps)
        profiled_rate = (len(rep.profiled) - 1) / n  # step 0 is profiled by any policy
        row = {"workload": workload, "metric": metric, "threshold": threshold,
               "cache_max_age": max_age, "cache_samples": samples,
               "cache_granularity": gran,
               "cache_hits": rep.cache_hits,
               "activation_rate": len(rep.activations) / n, "profiled_rate": profiled_rate,
               "amortized_overhead": over["overhead"] * profiled_rate
               + rep.seconds_per_observe / over["plain_step_s"]}
        for name, truth in truths.items():
            row[name] = score(rep, truth, FLAGS.change, raw if max_age else None,
                              [k[0] for k in keys])
        rows.append(row)
    return {
        "workload": workload, "rows": rows, "overhead": over, "ab": ab, "ab_factors": common,
        "variants": len({every.factors(t) for t in range(len(every.steps))}),
        "levels": {f"{k[0]}/{k[1]}@{f}": v for (k, f), v in sorted(levels.items())},
        "replay_matches_real_run": check.profiled == real,
        "real_run": {"metric": spec_metric, "threshold": spec_threshold,
                     "cache_max_age": spec_cache, "cache_samples": spec_samples,
                     "cache_granularity": spec_granularity,
                     "profiled_steps": len(real)},
    }


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def _f(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def table(results: list[dict]) -> str:
    lines = [
        "| workload | metric | threshold | activation rate | precision (measured / bucket) "
        "| recall (measured / bucket) | amortized overhead | recall, cache vs fresh "
        "(measured / bucket) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for r in res["rows"]:
            m, b = r["measured"], r["bucket"]
            label = r["metric"] + {CAPACITY: " (what-if)",
                                   CAPACITY_TRIGGER: " (train's default)"}.get(r["metric"], "")
            if r.get("cache_max_age"):
                extra = ([f"median of {r['cache_samples']}"] if r.get("cache_samples", 1) > 1
                         else []) + (["per layer"] if r.get("cache_granularity") == "layer"
                                     else [])
                label += f" + cache ({', '.join([str(r['cache_max_age']), *extra])})"
            lines.append(
                f"| {r['workload']} | {label} "
                f"| {'-' if math.isnan(r['threshold']) else format(r['threshold'], 'g')} "
                f"| {_pct(r['activation_rate'])} | {_f(m['precision'])} / {_f(b['precision'])} "
                f"| {_f(m['recall'])} ({m['caught']}/{m['changes']}) / {_f(b['recall'])} "
                f"({b['caught']}/{b['changes']}) | {_pct(r['amortized_overhead'])} | "
                + (f"{_f(m['recall_vs_fresh'])} ({m['caught_vs_fresh']}/{m['changes']}) / "
                   f"{_f(b['recall_vs_fresh'])} ({b['caught_vs_fresh']}/{b['changes']}) |"
                   if "recall_vs_fresh" in b else "- |"))
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"speculation_quality: error: unexpected arguments {argv[1:]}", file=sys.stderr)
        sys.exit(2)
    if FLAGS.ab_worker:
        ab_worker(tuple(float(f) for f in FLAGS.ab_worker.split(",")))
        return
    for w in FLAGS.workloads:
        if w not in ("dynamic", "steady"):
            print(f"speculation_quality: error: --workloads: unknown workload {w!r}",
                  file=sys.stderr)
            sys.exit(2)
    bad = [g for g in [*FLAGS.cache_granularity, FLAGS.spec_cache_granularity]
           if g not in CACHE_GRANULARITIES]
    if bad:
        print(f"speculation_quality: error: --cache_granularity: unknown {bad}; known: "
              f"{CACHE_GRANULARITIES}", file=sys.stderr)
        sys.exit(2)
    bad = [m for m in FLAGS.metrics if m not in METRICS]
    if bad:
        print(f"speculation_quality: error: --metrics: unknown {bad}; known: {METRICS}",
              file=sys.stderr)
        sys.exit(2)
    if FLAGS.reuse and not FLAGS.workdir:
        print("speculation_quality: error: --reuse needs --workdir", file=sys.stderr)
        sys.exit(2)
    root = Path(FLAGS.workdir or tempfile.mkdtemp(prefix="specq-"))
    spec_threshold = FLAGS.spec_threshold if FLAGS.spec_threshold >= 0 else \
        DetectorOptions().threshold
    spec_metric = FLAGS.spec_metric or DetectorOptions().metric
    # The tool scores the drift detector: its real run uses the drift trigger.
    spec_flags = ("--profile_trigger=drift", f"--drift_threshold={spec_threshold}",
                  f"--drift_metric={spec_metric}",
                  f"--profile_cache_max_age={FLAGS.spec_cache_max_age}",
                  *((f"--profile_cache_samples={FLAGS.spec_cache_samples}",
                     f"--profile_cache_granularity={FLAGS.spec_cache_granularity}")
                    if FLAGS.spec_cache_max_age else ()))
    results = []
    for workload in FLAGS.workloads:
        paths = {}
        for profile, extra in (("every", ()), ("speculative", spec_flags)):
            workdir = root / f"{workload}_{profile}"
            paths[profile] = (workdir / "metrics.jsonl" if FLAGS.reuse
                              else train(workdir, workload, profile, extra))
        every, spec = Run.load(paths["every"]), Run.load(paths["speculative"])
        same = [a["loss"] for a in every.steps] == [b["loss"] for b in spec.steps]
        if not same:
            print(f"warning: {workload}: the two runs' losses differ; the loads are not paired",
                  file=sys.stderr)
        results.append(analyse(workload, every, spec, spec_metric, spec_threshold,
                               FLAGS.spec_cache_max_age, FLAGS.spec_cache_samples,
                               FLAGS.spec_cache_granularity))
    print()
    print(table(results))
    print()
    for res in results:
        o = res["overhead"]
        lo, hi = o["overhead_ci90"]
        fixed = (f" (fixed by --instrumented_overhead; the run's own estimate "
                 f"{_pct(o['estimated'])}, " if "estimated" in o else " (")
        print(f"{res['workload']}: instrumented step overhead {_pct(o['overhead'])}{fixed}"
              f"90% CI of the median {_pct(lo)} .. {_pct(hi)}, {o['pairs']} "
              f"profiled steps paired with plain neighbours) on a plain step of "
              f"{1e3 * o['plain_step_s']:.0f} ms; {res['variants']} capacity-factor tuples; "
              f"real run ({res['real_run']['metric']}, {res['real_run']['threshold']:g}, cache "
              f"{res['real_run']['cache_max_age']}) profiled "
              f"{res['real_run']['profiled_steps']} steps, replay matches it: "
              f"{res['replay_matches_real_run']}")
        if res["ab"]:
            ab = res["ab"]
            print(f"  A/B cross-check (one process, factors {res['ab_factors']}): plain "
                  f"{1e3 * ab['plain_s']:.1f} ms, instrumented {1e3 * ab['profiled_s']:.1f} ms, "
                  f"overhead {_pct(ab['overhead'])}")
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps(
            {"flags": {k: FLAGS[k].value for k in (
                "model", "steps", "shift_every", "hosts", "devices_per_host", "dispatch", "seed",
                "global_batch", "pin_hosts", "spec_threshold", "spec_metric",
                "spec_cache_max_age", "spec_cache_samples", "spec_cache_granularity",
                "cache_max_age", "cache_samples", "cache_granularity", "instrumented_overhead",
                "change", "smooth")}, "results": results}, indent=1,
            default=float))
        print(f"wrote {FLAGS.json}")


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    define_flags()
    app.run(main)
