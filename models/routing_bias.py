"""Routing bias: load shifts as large as real MoE training's, made by the real router.

Why: the tiny model's own routing gives the dynamic workload's shifts little
to move (issue 37: a shift moved an MoE layer's emulated expert wait by 14-28
ms, a layer segment's step-to-step noise being 47-192 ms). Measured here
(BUILD_NOTES "Routing bias"): its router collapses within ~30 steps to the
top-2 ceiling, max/mean load ~4 (every token sends one choice to the same
expert) whatever the domain, so the load, saturated, barely follows a shift.
Real MoE training, with its balancing, has a busiest expert a few times the
mean whose load changes over training: Cong et al., "Prediction Is All MoE
Needs: Expert Load Distribution Goes from Fluctuating to Stabilizing" (arXiv
2404.16914; GPT-3 125M/350M MoE) trace each expert's load over training and
describe an early *transient* state of obvious load fluctuation and a later
*stable* state with temporal locality.

The table: a constant baked into the step, ``[rows, moe_layers, experts]``,
each entry an expert's target load over the mean; one row per shift period
of the transient phase, then one per domain of the stable phase. The step's
row comes from the traced step counter (``row_index``): period p = step //
shift_every; p < transient_periods: row p, else transient_periods + p %
n_domains (the domain ``launch.data``'s rotation reads at that step, so the
row follows the data without a host-side input). Each (domain, MoE layer) has
one hot expert (a seeded permutation: the hot expert changes at every shift)
at the row's ratio; the others share the rest evenly.

The bias (``apply``, per capacity group): the router's logits standardized
per expert over the group's tokens (which removes a collapsed router's
per-expert preference), plus a per-expert bias found in-graph by a few
fixed-point steps (as auxiliary-loss-free balancing adjusts its per-expert
bias across training steps, here within the step) that brings every
expert's top-k count to its target. Which tokens go where stays the
router's choice; the routing, ``tokens_per_expert``, the capacity buckets,
the all-to-all bytes and the emulated expert wait all follow the real
routing, nothing downstream is faked.

The transient phase of ``cong24`` lasts 100 shift periods (400 steps at the
sweep's shift every 4): the bench's runs (about 230 steps) emulate early
training, where the paper places the fluctuation, and a run past it shows
the stable phase. (It lasted 4 periods at first: every bench warm-up then
ended in the stable phase and no timed step saw a load change.)

Strength schedule (``Schedule``): in the transient phase a target max/mean
ratio per (period, layer) drawn in ``transient_ratio``, consecutive periods
at least ``min_jump`` of that range apart (fluctuating); in the stable phase
one ratio per layer drawn in ``stable_ratio``, the same at every shift.

Alternatives not taken: a multiplier on the emulated wait independent of the
routing (the planner's detector reads the real ``tokens_per_expert``, which
would not move); a constant logit bias on the hot expert (tried: it cannot
undo the collapse, and after standardizing alone the router's token clusters
overshot the targets by up to 1.7x in later periods); a bias table indexed on
the host and fed as an argument (one more input to every step variant and to
the profiled step's signature).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import jax

AUTO, NONE = "auto", "none"
CONG24 = "cong24"
"""Cong et al. 2024 (arXiv 2404.16914): a fluctuating transient phase, then a stable one."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A named source's strength schedule (module docstring).

    Attributes:
      name: the ``--routing_bias`` value.
      transient_periods: shift periods of the fluctuating early phase.
      transient_ratio: (low, high) max/mean load targets drawn per period and layer.
      min_jump: consecutive transient targets differ by at least this fraction
        of the range.
      stable_ratio: (low, high) of the stable phase's per-layer target.
      source: the citation.
    """

    name: str
    transient_periods: int
    transient_ratio: tuple[float, float]
    min_jump: float
    stable_ratio: tuple[float, float]
    source: str

    def __post_init__(self) -> None:
        lo, hi = self.transient_ratio
        if not 1.0 <= lo <= hi or not 1.0 <= self.stable_ratio[0] <= self.stable_ratio[1]:
            raise ValueError(f"schedule {self.name!r}: ratios must be >= 1 and ordered")
        if not 0.0 <= self.min_jump <= 0.5:
            raise ValueError(f"schedule {self.name!r}: min_jump must be in [0, 0.5]")
        if self.transient_periods < 0:
            raise ValueError(f"schedule {self.name!r}: transient_periods must be >= 0")


SCHEDULES: dict[str, Schedule] = {
    CONG24: Schedule(
        name=CONG24, transient_periods=100, transient_ratio=(1.5, 3.5), min_jump=0.375,
        stable_ratio=(1.4, 1.6),
        source="Cong et al., Prediction Is All MoE Needs: Expert Load Distribution Goes "
               "from Fluctuating to Stabilizing, arXiv 2404.16914 (2024): transient state "
               "of obvious load fluctuation, then a stable state with temporal locality; "
               "ratios inside Tutel (arXiv 2206.03382) Fig. 1's capacity factor changing up "
               "to 4.38x in a training, stable near Loss-Free Balancing (arXiv 2408.15664) "
               "Table 2's max/mean 1.52-1.72 with an auxiliary loss (BUILD_NOTES)"),
}
VALUES: tuple[str, ...] = (AUTO, NONE, *SCHEDULES)
"""The ``--routing_bias`` values."""
ITERATIONS = 32
"""Fixed-point steps of the in-graph bias search (``apply``)."""
RATE = 0.25
"""Its step: the bias moves by RATE x log(count / wanted count)."""


def resolve(value: str, *, accelerator: str, workload: str) -> str:
    """The bias a job runs with: ``auto`` is the published schedule under
    ``--accelerator=emulated --workload=dynamic`` and none otherwise; a named
    schedule needs the dynamic workload (its hot experts follow the domains).

    Raises:
      ValueError: naming the bad value, or a named schedule without the
        dynamic workload.
    """
    if value not in VALUES:
        raise ValueError(f"--routing_bias={value!r}: one of {', '.join(VALUES)}")
    if value == AUTO:
        return CONG24 if accelerator == "emulated" and workload == "dynamic" else NONE
    if value != NONE and workload != "dynamic":
        raise ValueError(f"--routing_bias={value}: its hot experts follow the dynamic "
                         f"workload's domains; not with --workload={workload}")
    return value


def _transient_targets(rng: np.random.Generator, s: Schedule, n_moe: int) -> np.ndarray:
    """[transient_periods, n_moe] targets: a circular walk over the range whose
    steps are in [min_jump, 1 - min_jump] of it, so neighbours differ by >= min_jump."""
    lo, hi = s.transient_ratio
    u = np.empty((s.transient_periods, n_moe))
    if s.transient_periods:
        u[0] = rng.uniform(size=n_moe)
    for p in range(1, s.transient_periods):
        u[p] = (u[p - 1] + s.min_jump + (1.0 - 2.0 * s.min_jump) * rng.uniform(size=n_moe)) % 1.0
    return lo + (hi - lo) * u


@dataclasses.dataclass(frozen=True, eq=False)
class RoutingBias:
    """The baked table of one job (``build``) and how a step reads it.

    Attributes:
      name: the schedule's name.
      shift_every, n_domains: the dynamic workload's rotation (``launch.data``).
      transient_periods: rows of the transient phase.
      hot: [n_domains, n_moe] int, each domain's hot expert per MoE layer.
      ratio: [rows, n_moe] the target max/mean load of each row and layer.
      table: [rows, n_moe, num_experts] float32, each expert's target load
        over the mean (the hot one's is ``ratio``; the row sums to experts).
    """

    name: str
    shift_every: int
    n_domains: int
    transient_periods: int
    hot: np.ndarray
    ratio: np.ndarray
    table: np.ndarray

    def row(self, step: int) -> int:
        """The table row of a step (host-side twin of ``row_index``)."""
        period = step // self.shift_every
        if period < self.transient_periods:
            return period
        return self.transient_periods + period % self.n_domains

    def row_index(self, step: jax.Array) -> jax.Array:
        """The table row of a traced step counter."""
        import jax.numpy as jnp  # in-graph code only: the schedules' readers need no JAX

        period = step // self.shift_every
        return jnp.where(period < self.transient_periods, period,
                         self.transient_periods + period % self.n_domains)

    def at(self, step: jax.Array) -> jax.Array:
        """[n_moe, num_experts] float32: the step's target loads, read in-graph
        from the constant table (one compiled program for every step)."""
        import jax.numpy as jnp

        return jnp.asarray(self.table)[self.row_index(step)]


def build(name: str, *, num_experts: int, top_k: int, n_moe: int, n_domains: int,
          shift_every: int, seed: int = 0) -> RoutingBias:
    """The table of schedule ``name`` for a model and a rotation (pure, seeded).

    Raises:
      ValueError: an unknown name, or an empty rotation.
    """
    if name not in SCHEDULES:
        raise ValueError(f"routing bias {name!r}: one of {', '.join(SCHEDULES)}")
    if n_domains < 1 or shift_every < 1 or n_moe < 1 or num_experts <= top_k:
        raise ValueError(f"routing bias needs domains, shift_every, MoE layers >= 1 and more "
                         f"experts than top_k; got {n_domains}, {shift_every}, {n_moe}, "
                         f"{num_experts}, {top_k}")
    s = SCHEDULES[name]
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    hot = np.stack([rng.permutation(num_experts)[np.arange(n_domains) % num_experts]
                    for _ in range(n_moe)], axis=1)  # [n_domains, n_moe]
    stable = rng.uniform(*s.stable_ratio, size=n_moe)
    ratio = np.concatenate([_transient_targets(rng, s, n_moe),
                            np.broadcast_to(stable, (n_domains, n_moe))])
    table = np.zeros((len(ratio), n_moe, num_experts), np.float32)
    for r in range(len(ratio)):
        domain = r % n_domains if r < s.transient_periods else r - s.transient_periods
        for layer in range(n_moe):
            hot_load = min(float(ratio[r, layer]), num_experts / top_k)
            table[r, layer] = (num_experts - hot_load) / (num_experts - 1)
            table[r, layer, hot[domain, layer]] = hot_load
    return RoutingBias(name, shift_every, n_domains, s.transient_periods, hot, ratio, table)


def apply(logits: jax.Array, load: jax.Array, top_k: int) -> jax.Array:
    """One capacity group's [T, E] router logits under the step's target ``load`` [E].

    Each expert's logits are standardized over the group's tokens (taking
    out the router's per-expert offset and spread, which top-k turns into
    load: a collapsed router's), then a per-expert bias is found in-graph,
    ``ITERATIONS`` fixed-point steps as auxiliary-loss-free balancing makes
    them across training steps, that brings each expert's top-k count to
    ``load`` x the mean. Which tokens go to which expert stays the router's
    preference; the statistics and the bias are not differentiated through.
    """
    import jax
    import jax.numpy as jnp

    x = logits.astype(jnp.float32)
    num_tokens, num_experts = x.shape
    mean = jax.lax.stop_gradient(jnp.mean(x, axis=0, keepdims=True))
    spread = jax.lax.stop_gradient(jnp.std(x, axis=0, keepdims=True))
    z = (x - mean) / jnp.maximum(spread, 1e-6)
    want = jnp.log1p(load * (num_tokens * top_k / num_experts))

    def step(_, bias):
        _, chosen = jax.lax.top_k(z + bias, top_k)
        counts = jnp.sum(jax.nn.one_hot(chosen, num_experts, dtype=jnp.float32), axis=(0, 1))
        return bias - RATE * (jnp.log1p(counts) - want)

    # Started from z's own row so that under shard_map the carry varies per device, as z.
    bias = jax.lax.fori_loop(0, ITERATIONS, step, jnp.log(load) + 0.0 * z[0])
    return (z + jax.lax.stop_gradient(bias)).astype(logits.dtype)
