"""Expert-load traces: tokens per expert, per MoE layer, per step.

A trace is a float array [steps, moe_layers, experts] of *shares* (each
layer's row sums to 1); ``tokens`` scales it to a model's assignments per
step. Two sources:

* ``synthetic``: calibrated to the dynamics the MoE checkpointing papers
  describe (Capricorn, CLUSTER 2025: layer- and iteration-level dynamicity,
  with temporal locality; MoEvement, NSDI 2026: experts' token rates change
  enough to reorder its snapshots; the targets below are the issue's
  reading of them): an *early* phase in which one expert's load changes by
  up to 16x within 3 steps, a *late* phase drifting about 1-2% of load share
  (total variation) per 1K steps, and occasional *regime jumps* (a layer's
  routing redrawn). ``steady``: a fixed skewed routing with sampling noise.
* ``from_metrics``: a run's ``metrics.jsonl`` (``tokens_per_expert`` per step).

Design choice: shares, not token counts, so one trace serves every model
size. Alternative not taken: replaying a recorded trace only, which has the
project's small CPU models' dynamics, not a large run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

KINDS = ("steady", "dynamic")


def _skewed(rng: np.random.Generator, layers: int, experts: int) -> np.ndarray:
    """Initial shares: a Zipf-like skew, shuffled per layer."""
    base = 1.0 / np.arange(1, experts + 1) ** 0.6
    out = np.stack([rng.permutation(base) for _ in range(layers)])
    return out / out.sum(axis=1, keepdims=True)


def synthetic(kind: str, steps: int, layers: int, experts: int, seed: int = 0, *,
              early_steps: int = 100, spike_prob: float = 0.2, drift_per_1k: float = 0.015,
              jump_every: int = 5000) -> np.ndarray:
    """A synthetic trace of shares [steps, layers, experts] (module docstring).

    Args:
      kind: "steady" (fixed routing, 1% sampling noise) or "dynamic".
      steps, layers, experts: the trace's shape.
      seed: the RNG seed.
      early_steps: dynamic: length of the early phase.
      spike_prob: dynamic, early phase: per layer and step, the chance that
        one expert (not already swinging) starts a swing of its load by a
        factor in [1/16, 16] spread over 3 steps.
      drift_per_1k: dynamic, late phase: total-variation drift of a layer's
        shares per 1000 steps.
      jump_every: dynamic: mean steps between regime jumps of one layer.
    """
    if kind not in KINDS:
        raise ValueError(f"trace kind must be one of {KINDS}, got {kind!r}")
    if steps < 1 or layers < 0 or experts < 2:
        raise ValueError(f"trace shape: steps={steps}, layers={layers}, experts={experts}")
    if layers == 0:  # a dense model: no expert load
        return np.zeros((steps, 0, experts))
    rng = np.random.default_rng(seed)
    shares = _skewed(rng, layers, experts)
    out = np.empty((steps, layers, experts))
    swings: list[tuple[int, int, float, int]] = []  # (layer, expert, factor per step, steps left)
    for t in range(steps):
        if kind == "dynamic":
            logits = np.log(shares)
            if t < early_steps:
                swinging = {(layer, e) for layer, e, _, _ in swings}
                for layer in range(layers):
                    e = int(rng.integers(experts))
                    if rng.random() < spike_prob and (layer, e) not in swinging:
                        factor = 16.0 ** rng.uniform(-1, 1)
                        swings.append((layer, e, factor ** (1 / 3), 3))
            else:
                # Per-step logit noise sized for ~drift_per_1k TV over 1K steps.
                logits += rng.normal(0, drift_per_1k * 2.5 / np.sqrt(1000), logits.shape)
            kept = []
            for layer, e, f, left in swings:
                logits[layer, e] += np.log(f)
                if left > 1:
                    kept.append((layer, e, f, left - 1))
            swings = kept
            shares = np.exp(logits - logits.max(axis=1, keepdims=True))
            shares /= shares.sum(axis=1, keepdims=True)
            for layer in range(layers):
                if rng.random() < 1.0 / jump_every:
                    shares[layer] = _skewed(rng, 1, experts)[0]
        noisy = shares * rng.normal(1.0, 0.01, shares.shape).clip(0.5, 1.5)
        out[t] = noisy / noisy.sum(axis=1, keepdims=True)
    return out


def from_metrics(path: str | Path) -> np.ndarray:
    """The shares of a run's ``metrics.jsonl``: [steps, layers, experts], in
    step order (a step logged twice, e.g. after a restart, keeps its last line).

    Raises:
      ValueError: naming the file when it has no ``tokens_per_expert`` lines.
    """
    per_step: dict[int, np.ndarray] = {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        doc = json.loads(line)
        if "tokens_per_expert" in doc and "event" not in doc:
            per_step[int(doc["step"])] = np.asarray(doc["tokens_per_expert"], np.float64)
    if not per_step:
        raise ValueError(f"{path}: no step lines with tokens_per_expert")
    load = np.stack([per_step[s] for s in sorted(per_step)])
    if load.ndim == 2:
        load = load[:, None, :]
    total = load.sum(axis=2, keepdims=True)
    return np.where(total > 0, load / np.where(total > 0, total, 1), 1.0 / load.shape[2])


def fit_shape(trace: np.ndarray, steps: int, layers: int, experts: int) -> np.ndarray:
    """``trace`` cycled to ``steps`` steps and ``layers`` layers; its experts
    must match (a recorded trace of another model cannot say where tokens go)."""
    if trace.shape[2] != experts:
        raise ValueError(f"trace has {trace.shape[2]} experts per layer, the model {experts}")
    t_idx = np.arange(steps) % trace.shape[0]
    l_idx = np.arange(layers) % trace.shape[1]
    return trace[t_idx][:, l_idx]


def tokens(shares: np.ndarray, routed_per_step: int) -> np.ndarray:
    """Integer tokens per expert [.., experts] summing to ``routed_per_step`` per row."""
    raw = shares * routed_per_step
    out = np.floor(raw).astype(np.int64)
    short = routed_per_step - out.sum(axis=-1)
    order = np.argsort(-(raw - out), axis=-1, kind="stable")
    ranks = np.argsort(order, axis=-1, kind="stable")
    out += ranks < short[..., None]
    return out


def tv_per_1k(trace: np.ndarray, start: int, stop: int) -> float:
    """Mean total-variation distance of the layers' shares between ``start``
    and ``stop``, per 1000 steps (what the late phase is calibrated on)."""
    tv = 0.5 * np.abs(trace[stop] - trace[start]).sum(axis=-1).mean()
    return float(tv * 1000 / (stop - start))
