"""launch.bench's report: the measured steps summarized, as a table and a chart.

``summarize`` turns the raw samples that host 0 of a bench run collects into
the per-strategy numbers of the DESIGN.md JSON contract (median, spread,
ratio to ``none``, bytes, RAM, commit accounting); ``markdown`` and ``plot``
show them. Pure functions of the raw record (no flags, no JAX), so that the
report can be rebuilt and tested from a saved record. Split from
``launch.bench``, which runs the measurement; alternative not taken: one
module for measuring and reporting, which had grown past what a reader holds.
"""

from __future__ import annotations

import statistics

from launch.bench import step_stats
from launch.cluster import cpu_account
from launch.metrics import different_work
from launch.strategies import IN_MEMORY

# Bench-only rows: a strategy on other media or another chunk path (name ->
# the strategy it runs); inmem_in_graph / pec_in_graph: inmem / pec
# replicating in the in-graph exchange (gloo) beside their rows on the chunk
# channel, to compare the transports in one interleaved run; gemini_layers /
# capricorn_layers: one window per layer segment instead of the idle spans
# between its all-to-alls (the threaded path's default), to measure the spans;
# capricorn_paced: its chunk socket paced at the link probe's one-way rate
# (``InMemoryOptions.chunk_pacing_gbps``), against capricorn in one run.
VARIANTS = {"blocking_disk": "blocking", "gemini_in_graph": "gemini",
            "capricorn_in_graph": "capricorn", "inmem_in_graph": "inmem",
            "pec_in_graph": "pec", "gemini_layers": "gemini",
            "capricorn_layers": "capricorn", "capricorn_paced": "capricorn"}


def summarize(raw: dict) -> dict:
    """The DESIGN.md JSON: per strategy median, spread, ratio, bytes, RAM.

    Raises RuntimeError when two strategies trained different work: a step
    whose losses differ between strategies (a checkpoint must not change
    training; every strategy replays the same steps from the same state)."""
    differ = different_work(raw.get("losses", {}))
    if differ:
        raise RuntimeError(f"strategies trained different work ({len(differ)} steps differ; "
                           f"first: {differ[0]})")
    out = {}
    for name, steps in raw["samples"].items():
        if not steps:
            raise RuntimeError(f"strategy {name}: no measured steps")
        times = [t for t, _, _ in steps]
        per_host = raw["ram"][name]
        out[name] = {
            "median_step_s": statistics.median(times),
            "spread_s": _iqr(times),
            **step_stats.distribution(times),
            **step_stats.blocked(raw.get("blocked", {}).get(name, [])),
            "min_step_s": min(times), "max_step_s": max(times),
            "samples": len(times), "steps_timed": len(times),
            "steps_profiled": sum(p for _, p, _ in steps),
            "steps_compiled": sum(c for _, _, c in steps),
            "ckpt_bytes_per_step": int(sum(h[1] for h in per_host)),
            "store_bytes_per_host": [int(h[0]) for h in per_host],
            # Every timed step in order (blocks of --steps, repetitions interleaved).
            "step_s": [round(t, 6) for t in times],
            # How an in-memory row's versions travel: "threaded" (the chunk
            # channel) or "in_graph" (collectives in a jitted program); None
            # for the other rows.
            "transport": raw.get("transport", {}).get(name),
        }
        if name in raw.get("cpu", {}):
            steady = sum(not p and not c for _, p, c in steps)
            out[name]["cpu_ms_per_step"] = cpu_per_step(raw["cpu"][name]["all"], len(times))
            out[name]["steady_cpu_ms_per_step"] = cpu_per_step(raw["cpu"][name]["steady"],
                                                               steady)
        for key, chosen in (("profiled", [t for t, p, _ in steps if p]),
                            ("compiled", [t for t, _, c in steps if c]),
                            ("steady", [t for t, p, c in steps if not p and not c])):
            if chosen:
                out[name][f"{key}_median_s"] = statistics.median(chosen)
        a2a = raw.get("a2a", {}).get(name) or []
        if a2a:
            q = statistics.quantiles(a2a, n=4) if len(a2a) > 1 else [a2a[0]] * 3
            out[name].update(a2a_median_s=statistics.median(a2a), a2a_spread_s=q[2] - q[0],
                             a2a_samples=len(a2a))
    base = out.get("none", {}).get("median_step_s")
    steady_base = out.get("none", {}).get("steady_median_s")
    mean = out.get("none", {}).get("mean_step_s")
    for name, row in out.items():
        row["ratio"] = row["median_step_s"] / base if base else None
        row["steady_ratio"] = (row["steady_median_s"] / steady_base
                               if steady_base and "steady_median_s" in row else None)
        row["long_run_ratio"] = row["mean_step_s"] / mean if mean else None
        if "none" in raw["samples"]:  # paired with none's steps, both steady
            none_steps = raw["samples"]["none"]
            row["steady_ratio_ci"], row["pairs"] = step_stats.paired_ratio_ci(
                [t for t, _, _ in raw["samples"][name]], [t for t, _, _ in none_steps],
                [not p and not c for _, p, c in raw["samples"][name]],
                [not p and not c for _, p, c in none_steps])
        row["warmup_compiles"] = ((raw.get("warmup") or {}).get(name) or {}).get("compiles")
        row["warmup_s"] = warmup_seconds(
            raw["samples"][name], (raw.get("warmup") or {}).get(name),
            name in raw.get("one_time_profiling", ()))
        records = (raw.get("records") or {}).get(name)
        if records is not None:  # per timed step, in step_s's order
            row["record_steps"] = [r["step"] for r in records]
            # What each step was: a profiled step carries the profiler's marks,
            # not the probe (its collectives are empty), a compiled one its compile.
            row["step_profiled"] = [bool(p) for _, p, _ in raw["samples"][name]]
            row["step_compiled"] = [bool(c) for _, _, c in raw["samples"][name]]
            for key in ("windows", "collectives", "expert_spans"):
                row[key] = [r[key] for r in records]
    for name, schedule in raw.get("schedules", {}).items():
        out[name]["schedule"] = schedule
    for name, records in raw.get("emulation_checks", {}).items():
        out[name]["emulation_check"] = step_stats.error_summary(records)
        out[name]["emulation_windows"] = records
    for name, recovery in raw.get("recovery", {}).items():
        out[name]["recovery"] = recovery
    for name, (saved, skipped) in raw.get("saves", {}).items():
        if name in out and (VARIANTS.get(name, name) in IN_MEMORY or skipped):
            out[name]["versions_skipped"] = skipped
            out[name]["versions_taken"] = (saved - skipped) / saved if saved else None
    for name in out:  # the steps at which its loss was checked against another strategy's
        out[name]["steps_compared"] = sum(
            name in by and len(by) > 1 for by in raw.get("losses", {}).values())
    for name, commits in raw.get("commits", {}).items():
        at = {int(v): i for v, i in commits["committed_at"].items()}
        timed = commits["timed"]
        lags = [at[v] - i for v, i in timed if v in at]
        out[name]["versions_committed"] = len(lags) / len(timed) if timed else None
        out[name]["max_commit_lag"] = max(lags, default=None)
    return out


def warmup_seconds(steps: list, warmup: dict | None, one_time_profiling: bool
                   ) -> float | None:
    """A strategy's one-time cost (DESIGN.md "Long-run accounting"): what
    its warm-up block and its timed steps that compiled (a step variant for a
    new capacity bucket, a program its save needs) or ran its one-time
    profiling (``one_time_profiling``: gemini's first steps) took beyond its
    steady median, in seconds. None without a steady step. A recurring cost
    (capricorn's re-profiles, skipped versions) is not in it: the long-run
    ratio holds it."""
    steady = [t for t, p, c in steps if not p and not c]
    if not steady:
        return None
    base = statistics.median(steady)
    extra = sum(t - base for t, p, c in steps if c or (p and one_time_profiling))
    if warmup:
        extra += warmup["seconds"] - warmup["steps"] * base
    return round(extra, 3)


def cpu_per_step(per_host: list[list[float]], steps: int) -> dict[str, float]:
    """CPU milliseconds per timed step, summed over the hosts' processes, per
    ``launch.cluster.cpu_account`` group, with their ``total`` (which the box's cores
    bound: cores x the step's wall time)."""
    groups = {g: sum(h[i] for h in per_host) * 1e3 / max(steps, 1)
              for i, g in enumerate(cpu_account.GROUPS)}
    return {**{g: round(v, 2) for g, v in groups.items()},
            "total": round(sum(groups.values()), 2)}


def _iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def markdown(results: dict) -> str:
    """The console table of ``summarize``'s results, with CPU and recovery lines."""
    lines = ["| strategy | steady ratio | long-run ratio | warm-up (s) | median step, all "
             "steps (ms) | spread IQR (ms) | ratio to none | "
             "steps timed / profiled / compiled | steady state only (ms, ratio) | all-to-all "
             "(ms, IQR) | ckpt bytes/step (all hosts) | store RAM per host (MB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "-"
        ram = ", ".join(f"{b / 1e6:.1f}" for b in r["store_bytes_per_host"]) or "-"
        a2a = (f"{r['a2a_median_s'] * 1e3:.1f} ({r['a2a_spread_s'] * 1e3:.1f})"
               if "a2a_median_s" in r else "-")
        steady = "-"
        if "steady_median_s" in r:
            steady = f"{r['steady_median_s'] * 1e3:.1f}" + (
                f", {r['steady_ratio']:.3f}" if r.get("steady_ratio") else "")
        counts = f"{r['steps_timed']} / {r['steps_profiled']} / {r['steps_compiled']}"
        if r.get("versions_committed") is not None:
            # "A version every step" only at 100%; else the share and the lag.
            name = (f"{name} (committed {r['versions_committed']:.0%}, lag <= "
                    f"{r['max_commit_lag']} saves)")
        elif r.get("versions_taken") is not None and r["versions_taken"] < 1:
            name = f"{name} (a version at {r['versions_taken']:.0%} of steps)"
        three = " | ".join("-" if r.get(k) is None else f"{r[k]:.3f}" if k != "warmup_s"
                           else f"{r[k]:.1f}"
                           for k in ("steady_ratio", "long_run_ratio", "warmup_s"))
        lines.append(f"| {name} | {three} | {r['median_step_s'] * 1e3:.1f} | "
                     f"{r['spread_s'] * 1e3:.1f} | "
                     f"{ratio} | {counts} | {steady} | {a2a} | {r['ckpt_bytes_per_step']:,} | "
                     f"{ram} |")
    for name, r in results.items():
        for key, label in (("cpu_ms_per_step", "timed step"),
                           ("steady_cpu_ms_per_step", "steady-state step")):
            if r.get(key):
                cpu = r[key]
                lines.append(f"\n{name}: CPU per {label}, all hosts: {cpu['total']:.0f} ms ("
                             + ", ".join(f"{g} {cpu[g]:.0f}" for g in cpu_account.GROUPS
                                         if cpu[g]) + ")")
    for name, r in results.items():
        for tier, rec in r.get("recovery", {}).items():
            cold = " (page cache dropped first)" if rec.get("cold_cache") else ""
            lines.append(f"\n{name}: recovery from {tier}: {rec['seconds']:.3f} s, "
                         f"{rec['bytes_moved']:,} bytes between hosts{cold}")
    return "\n".join(lines)


def plot(results: dict, path: str, title: str) -> None:
    """A bar chart of the median step time per strategy (min-max bars) at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    med = [results[n]["median_step_s"] * 1e3 for n in names]
    err = [[(results[n]["median_step_s"] - results[n]["min_step_s"]) * 1e3 for n in names],
           [(results[n]["max_step_s"] - results[n]["median_step_s"]) * 1e3 for n in names]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, med, yerr=err, capsize=4, color="#4c72b0")
    ax.set_ylabel("median step time (ms), min-max bars")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
