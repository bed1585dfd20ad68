"""The bench's step statistics beyond the median: the distribution, the
training thread's blocked time, the emulation's check and R.

- ``distribution``: mean and p95 of every timed step (a strategy whose cost
  lands in a few steps, e.g. a compile, shows in the mean, not the median).
- ``blocked``: what the training thread waited for in a step, split into the
  step call (dispatch to the loss on the host) and the strategy's ``save``.
  With the emulated accelerator the cores are idle during the layers, so what
  a strategy adds to a step is what it adds here.
- ``emulation_errors``: the profiler's measured MoE layer windows against the
  emulated waits at that step's load (``models.emulation``): the mechanism's
  check. A window also holds the layer's all-to-alls and host work, so it is
  expected a little above the wait.
- ``paired_ratio_ci``: the 95% bootstrap interval of a strategy's steady
  ratio over none's, from paired steps (the same step of both: every
  strategy replays the same steps), so the noise the two share cancels.
- ``link_idle_share`` (R): the version's link time over the link's idle time
  per step: (bytes a host sends per version / the link rate) / (none's step
  minus its all-to-all time). R < 1: a schedule can hide the version in the
  idle link; R > 1: no schedule can. That idle time also holds the gradient
  all-reduce; the bench JSON's ``span_idle_share`` divides by none's step less
  every collective its marks bracket (``records.idle_outside_collectives``):
  what a schedule can plan, so the larger of the two.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
"""Resamples of the paired bootstrap (seeded numpy generator, vectorized: the
same steps give the same interval, in milliseconds, so the tables can compute
it for runs recorded before the bench did)."""


def paired_ratio_ci(times: Sequence[float], base: Sequence[float], mask: Sequence[bool],
                    base_mask: Sequence[bool], resamples: int = BOOTSTRAP_RESAMPLES,
                    seed: int = 0) -> tuple[list[float] | None, int]:
    """([low, high], pairs): the 95% percentile bootstrap interval of
    median(times) / median(base) over the pairs (step i of both, where both
    ``mask`` and ``base_mask`` hold, e.g. both steady), resampling pairs, not
    steps, so what the two steps share (the data, the box's slow moments)
    stays paired. None with fewer than 2 pairs.

    Design choice: a percentile bootstrap of the ratio of medians (the
    ratio the tables print), seeded. Alternative not taken: a t-interval of
    the mean paired difference (steps are skewed: a compile or a spill is a
    long tail the median ignores and the mean does not)."""
    pairs = [(t, b) for t, b, m, bm in zip(times, base, mask, base_mask, strict=False)
             if m and bm]
    if len(pairs) < 2:
        return None, len(pairs)
    n = len(pairs)
    drawn = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    t, b = np.asarray(pairs, dtype=np.float64).T
    base_median = np.median(b[drawn], axis=1)
    with np.errstate(divide="ignore"):
        ratios = np.sort(np.where(base_median > 0,
                                  np.median(t[drawn], axis=1) / base_median, np.inf))
    low = float(ratios[int(0.025 * (resamples - 1))])
    high = float(ratios[int(round(0.975 * (resamples - 1)))])
    return [round(low, 5), round(high, 5)], n


def distribution(times: Sequence[float]) -> dict[str, float]:
    """{"mean_step_s", "p95_step_s"} of the timed steps (p95: nearest rank)."""
    ordered = sorted(times)
    rank = max(0, -(-95 * len(ordered) // 100) - 1)
    return {"mean_step_s": statistics.fmean(ordered), "p95_step_s": ordered[rank]}


def _blocked_means(records: Sequence[dict]) -> dict[str, float]:
    """Mean milliseconds per step of the step call, the save and each phase
    (``phase.NAME``; a step without that phase counts 0)."""
    flat = [{"step": r["step"], "save": r["save"],
             **{f"phase.{k}": v for k, v in r.get("phases", {}).items()}} for r in records]
    keys = sorted({k for p in flat for k in p})
    return {k: round(statistics.fmean(p.get(k, 0.0) for p in flat) * 1e3, 3) for k in keys}


def blocked(records: Sequence[dict]) -> dict:
    """What the training thread waited on, mean milliseconds per timed step:
    ``blocked_ms`` the step call, the strategy's save and the phases its
    phase clock measured in them (``Strategy.blocked_phases``; a phase of the
    strategy's ``run_step`` lies inside the step call), ``blocked_steady_ms``
    the same over the steady steps only (neither profiled nor compiled; None
    when there were none), and ``blocked_ms_per_step``: the save."""
    if not records:
        return {}
    steady = [r for r in records if r.get("steady", True)]
    means = _blocked_means(records)
    return {"blocked_ms_per_step": means.get("save", 0.0), "blocked_ms": means,
            "blocked_steady_ms": _blocked_means(steady) if steady else None}


def emulation_errors(emulation, segments, tokens_per_expert,
                     moe_layers: Sequence[int]) -> list[dict]:
    """One record per MoE layer window of a profile: expected (the emulated
    wait at the step's load) and measured milliseconds, and the relative error.

    ``segments``: the profile's segments (``LayerProfile.segments``); the
    window of layer i is the segment named ``block{i}`` in each direction
    (forward: closing at its boundary; backward: opening there). The backward
    ``tail`` segment is left out: it holds the first layer's backward AND the
    optimizer update. The expert part's scale is the busiest expert's tokens
    over the balanced share, from the step's global counts: exact where every
    device sends to every expert's device (one data row), an estimate otherwise.
    """
    out = []
    moe = list(moe_layers)
    for seg in segments:
        if not seg.name.startswith("block") or int(seg.name[5:]) not in moe:
            continue
        layer = int(seg.name[5:])
        times = emulation.layers[layer]
        counts = [float(c) for c in tokens_per_expert[moe.index(layer)]]
        total = sum(counts)
        scale = max(counts) / (total / len(counts)) if total else 0.0
        if seg.direction == "fwd":
            expected = times.dense_fwd_ms + times.expert_fwd_ms * scale
        else:
            expected = times.dense_bwd_ms + times.expert_bwd_ms * scale
        measured = seg.duration_s * 1e3
        out.append({"layer": layer, "direction": seg.direction,
                    "expected_ms": round(expected, 3), "measured_ms": round(measured, 3),
                    "error": round((measured - expected) / expected, 4) if expected else None})
    return out


def error_summary(records: Sequence[dict]) -> dict | None:
    """Median and max absolute relative error of the windows, and their count."""
    errors = [abs(r["error"]) for r in records if r.get("error") is not None]
    if not errors:
        return None
    return {"median_abs_error": round(statistics.median(errors), 4),
            "max_abs_error": round(max(errors), 4), "windows": len(errors)}


def link_idle_share(version_bytes_per_host: float, link_gbps: float | None,
                    none_step_s: float | None, none_a2a_s: float | None) -> float | None:
    """R (module docstring); None where the link rate or none's times are unknown."""
    if not link_gbps or not none_step_s or none_a2a_s is None:
        return None
    idle = none_step_s - none_a2a_s
    if idle <= 0:
        return None
    return (version_bytes_per_host * 8 / (link_gbps * 1e9)) / idle
