"""Which experts a PEC version carries, and how many (K).

A PEC version carries all non-expert state and, of every MoE layer, only K
of the N experts, each expert with its optimizer state (its Adam moments).
This module is the decision, pure and deterministic, on plain numpy data
([moe_layers, experts] arrays):

* ``PecOptions``: K, K_persist, the policy and the PLT threshold;
* ``select_experts``: the experts of one version (``sequential`` round robin,
  or ``load_aware``: the ones with most tokens since their last copy);
* ``DynamicK`` / ``predict_plt``: the K of the next version (doubling while
  the predicted PLT would pass the threshold, halving back with hysteresis);
* ``version_mask``: the K and experts of the in-memory tier's next version,
  and ``local_gather_indices`` / ``padded_gather_indices``: its per-rank
  gather indices (padded to a fixed count).

Design choice: the unit of selection is the *expert* (one (layer, expert)
pair), never a leaf: an expert's ``w_in``, ``w_out`` and their Adam ``mu`` and
``nu`` are always saved and restored together, from one step. The sequential
order interleaves the expert-parallel ranks (position p of the round robin is
the expert p // R of rank p % R) and shifts layer l's window by l*K, so the
K*L experts of a version are K*L consecutive positions modulo R: every rank
moves the same number of experts (within 1), which is what a fixed-size,
equal-layout device payload needs.

Alternatives not taken: a per-leaf selection (saving a parameter without its
moments, or some leaves of an expert), which restores experts whose parts come
from different steps; and the plain round robin over expert indices, where the
K experts of a layer sit on one or two ranks, so the device payloads (one
layout for every device) would be padded to the busiest rank's share.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import ArrayLike

from capricorn_jax._src.partial.tracker import PltTracker, plt_of

POLICIES = ("sequential", "load_aware")


@dataclasses.dataclass(frozen=True)
class PecOptions:
    """Partial expert checkpointing options.

    Attributes:
      k: experts per MoE layer in every version (the base K; dynamic K moves
        between k and num_experts).
      k_persist: experts per MoE layer of each step the persistent tier
        writes (MoC-System's K_persist <= K_snapshot); None: all of them (a
        full step). The persistent tier assembles a step from the memory
        tier's newest copies, so it may carry any expert (``persist_mask``).
      policy: "sequential" (round robin, interleaved over the expert-parallel
        ranks) or "load_aware" (the experts with most tokens since their copy).
      plt_threshold: the accumulated portion of lost tokens that dynamic K
        keeps the training under (MoC-System: 3.75%).
      dynamic: whether K adapts to the PLT (False: always k).
    """

    k: int = 1
    k_persist: int | None = None
    policy: str = "sequential"
    plt_threshold: float = 0.0375
    dynamic: bool = True

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.k_persist is not None and not 1 <= self.k_persist <= self.k:
            raise ValueError(f"k_persist must be in [1, k={self.k}] (or None: all experts), "
                             f"got {self.k_persist}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0.0 < self.plt_threshold < 1.0:
            raise ValueError(f"plt_threshold must be in (0, 1), got {self.plt_threshold}")
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"dynamic must be a bool, got {self.dynamic!r}")

    def check(self, num_experts: int) -> None:
        """Raises ValueError (naming ``k``) when k exceeds the experts per layer."""
        if self.k > num_experts:
            raise ValueError(f"k={self.k} exceeds num_experts={num_experts}")


# --------------------------------------------------------------------------- selection


def check_k(k: int, num_experts: int, ranks: int) -> None:
    """Raises ValueError unless 1 <= k <= num_experts and ranks divides num_experts."""
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be in [1, num_experts={num_experts}], got {k}")
    if ranks < 1 or num_experts % ranks:
        raise ValueError(f"ranks={ranks} must be >= 1 and divide num_experts={num_experts}")


def rank_of(num_experts: int, ranks: int) -> np.ndarray:
    """[num_experts] the expert-parallel rank of each expert (contiguous split)."""
    return np.arange(num_experts) // (num_experts // ranks)


def sequential_mask(k: int, version: int, num_layers: int, num_experts: int,
                    ranks: int = 1) -> np.ndarray:
    """The experts of version ``version`` under the sequential policy.

    Round-robin position p stands for local expert p // R of rank p % R
    (expert (p % R) * N/R + p // R). Layer l takes positions
    (version*k + l*k + i) mod N, i < k: each layer's windows tile the cycle, so
    any ceil(N/k) consecutive versions (at a constant k) cover every expert;
    and a version's k*L positions are consecutive modulo R, so every rank moves
    k*L/R experts when R divides k*L, otherwise counts differing by at most 1.
    When k changes (dynamic K) the windows move, and the coverage bound holds
    again from the first version with the new k.

    Args:
      k: experts per layer.
      version: index of the version (0, 1, 2, ... for consecutive versions).
      num_layers, num_experts: the MoE layers and experts per layer.
      ranks: expert-parallel ranks R (must divide num_experts).

    Returns:
      bool [num_layers, num_experts], k True per row.
    """
    check_k(k, num_experts, ranks)
    pos = (version * k + np.arange(num_layers)[:, None] * k + np.arange(k)[None, :]) % num_experts
    experts = (pos % ranks) * (num_experts // ranks) + pos // ranks
    mask = np.zeros((num_layers, num_experts), bool)
    np.put_along_axis(mask, experts, True, axis=1)
    return mask


def load_aware_mask(k: int, since_save: ArrayLike) -> np.ndarray:
    """The k experts per layer with the most tokens since their newest copy.

    Args:
      k: experts per layer.
      since_save: [L, N] tokens (assignments) since each expert's newest copy.

    Returns:
      bool [L, N]; ties go to the lower expert index.
    """
    since = np.asarray(since_save)
    check_k(k, since.shape[1], 1)
    order = np.argsort(-since.astype(np.float64), axis=1, kind="stable")[:, :k]
    mask = np.zeros(since.shape, bool)
    np.put_along_axis(mask, order, True, axis=1)
    return mask


def select_experts(policy: str, k: int, *, num_layers: int, num_experts: int,
                   version: int = 0, ranks: int = 1,
                   since_save: ArrayLike | None = None) -> np.ndarray:
    """The experts one version saves: bool [num_layers, num_experts].

    Args:
      policy: "sequential" or "load_aware".
      k: experts per layer in this version.
      num_layers, num_experts: MoE layers and experts per layer.
      version: the version's index (sequential).
      ranks: expert-parallel ranks (sequential balances them).
      since_save: [L, N] tokens since each expert's copy (load_aware).

    Returns:
      The mask; exactly k experts per layer.
    """
    if policy == "sequential":
        return sequential_mask(k, version, num_layers, num_experts, ranks)
    if policy == "load_aware":
        if since_save is None:
            raise ValueError("since_save is required by the load_aware policy")
        since = np.asarray(since_save)
        if since.shape != (num_layers, num_experts):
            raise ValueError(f"since_save has shape {since.shape}, "
                             f"expected {(num_layers, num_experts)}")
        return load_aware_mask(k, since)
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def rank_counts(mask: ArrayLike, ranks: int) -> np.ndarray:
    """[ranks] experts of a mask (all layers together) on each expert-parallel rank."""
    mask = np.asarray(mask, bool)
    check_k(1, mask.shape[1], ranks)
    return np.bincount(rank_of(mask.shape[1], ranks), weights=mask.sum(0), minlength=ranks
                       ).astype(np.int64)


def local_gather_indices(mask: ArrayLike, ranks: int) -> np.ndarray:
    """Per rank, the selected experts as indices into its local [L * N/R] stack.

    Rank r holds experts r*N/R .. (r+1)*N/R - 1 of every layer; flattening its
    [L, N/R] local experts layer-major, expert (l, r*N/R + j) has index
    l*N/R + j. Equal per-rank counts make this a fixed-size gather.

    Args:
      mask: bool [L, N].
      ranks: expert-parallel ranks R.

    Returns:
      int32 [R, C], ascending per row, C the (equal) per-rank count.

    Raises:
      ValueError: when the ranks' counts differ.
    """
    mask = np.asarray(mask, bool)
    counts = rank_counts(mask, ranks)
    if np.any(counts != counts[0]):
        raise ValueError(f"per-rank expert counts differ: {counts.tolist()}")
    local = mask.shape[1] // ranks
    by_rank = mask.reshape(mask.shape[0], ranks, local).transpose(1, 0, 2).reshape(ranks, -1)
    return np.stack([np.flatnonzero(row) for row in by_rank]).astype(np.int32).reshape(
        ranks, int(counts[0]))


# --------------------------------------------------------------------------- dynamic K


def predict_plt(tracker: PltTracker, k: int, policy: str, rate: ArrayLike, tokens_total: int,
                tokens_per_step: int, version: int, ranks: int = 1) -> float:
    """The PLT the next version would leave if it saved k experts per layer.

    One more step at ``rate`` is added to every expert, then the experts the
    policy picks for the next version (at ``version``, with k) are reset; the
    PLT is taken after that step (``tokens_total + tokens_per_step`` tokens).

    Args:
      tracker: the state after the current step's version.
      k: experts per layer of the next version.
      policy: the selection policy.
      rate: [L, N] assignments per step expected (e.g. the last step's).
      tokens_total: tokens consumed up to the current step.
      tokens_per_step: tokens of one step (global batch x sequence length).
      version: the next version's index.
      ranks: expert-parallel ranks.

    Returns:
      The predicted accumulated PLT.
    """
    rate = np.asarray(rate, np.int64)
    if rate.shape != tracker.shape:
        raise ValueError(f"rate has shape {rate.shape}, expected {tracker.shape}")
    since = tracker.since_save + rate
    layers, experts = tracker.shape
    mask = select_experts(policy, k, num_layers=layers, num_experts=experts, version=version,
                          ranks=ranks, since_save=since)
    since[mask] = 0
    lost = tracker.restored_lost + since.sum(axis=1)
    return plt_of(lost, tokens_total + tokens_per_step, tracker.top_k)


@dataclasses.dataclass(frozen=True)
class DynamicK:
    """Chooses the K of each version from the PLT it would leave.

    K moves along base, 2*base, 4*base, ... capped at num_experts. Over the
    threshold, K jumps to the smallest larger K of that chain whose predicted
    PLT is within the threshold (num_experts if none is). Under it, K halves
    one step toward the base when the PLT predicted with the halved K stays
    below threshold/2 (hysteresis: no flapping around the threshold). While
    some expert has no saved copy yet, K is num_experts (a restore needs one).

    Attributes:
      options: the PEC options (base k, policy, threshold, dynamic).
      num_experts: experts per MoE layer.
      ranks: expert-parallel ranks.
    """

    options: PecOptions
    num_experts: int
    ranks: int = 1

    def __post_init__(self) -> None:
        self.options.check(self.num_experts)
        check_k(self.options.k, self.num_experts, self.ranks)

    def chain(self) -> tuple[int, ...]:
        """The K values used, ascending: base * 2^i, then num_experts."""
        ks = [self.options.k]
        while ks[-1] < self.num_experts:
            ks.append(min(2 * ks[-1], self.num_experts))
        return tuple(ks)

    def next_k(self, k_current: int, tracker: PltTracker, rate: ArrayLike, tokens_total: int,
               tokens_per_step: int, version: int) -> int:
        """The K of the next version (see the class doc); ``version`` is its index."""
        opts = self.options
        if not tracker.complete:
            return self.num_experts
        if not opts.dynamic:
            return opts.k

        def predicted(k: int) -> float:
            return predict_plt(tracker, k, opts.policy, rate, tokens_total, tokens_per_step,
                               version, self.ranks)

        k_current = min(max(k_current, opts.k), self.num_experts)
        if predicted(k_current) > opts.plt_threshold:
            larger = [k for k in self.chain() if k > k_current]
            fitting = [k for k in larger if predicted(k) <= opts.plt_threshold]
            return fitting[0] if fitting else self.num_experts
        smaller = [k for k in self.chain() if k < k_current]
        if smaller and predicted(smaller[-1]) < opts.plt_threshold / 2:
            return smaller[-1]
        return k_current


# --------------------------------------------------------------------------- versions


def padded_gather_indices(mask: ArrayLike, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """``local_gather_indices`` for unequal per-rank counts, padded to the largest.

    A fixed-size device payload carries C = max per-rank count experts on every
    device; a rank with fewer selected experts fills its other slots with -1
    (the packer leaves those records zero, the unpacker skips them).

    Args:
      mask: bool [L, N].
      ranks: expert-parallel ranks R (must divide N).

    Returns:
      (int32 [R, C] ascending indices into each rank's [L * N/R] local stack,
      then -1s; int64 [R] the real count of each row).
    """
    mask = np.asarray(mask, bool)
    counts = rank_counts(mask, ranks)
    local = mask.shape[1] // ranks
    by_rank = mask.reshape(mask.shape[0], ranks, local).transpose(1, 0, 2).reshape(ranks, -1)
    out = np.full((ranks, int(counts.max())), -1, np.int32)
    for r, row in enumerate(by_rank):
        picked = np.flatnonzero(row)
        out[r, : picked.size] = picked
    return out, counts


def version_mask(tracker: PltTracker, dyn: DynamicK, k_current: int, rate: ArrayLike,
                 tokens_per_step: int, version: int) -> tuple[int, np.ndarray]:
    """The K and experts of the version at ``tracker.step`` (pure).

    Call it after ``tracker.observe`` of the version's step and before
    ``tracker.on_saved``: the K comes from ``dyn.next_k`` (full while some
    expert has no copy), the experts from ``select_experts``.

    Args:
      tracker: the PLT tracker, the version's step observed.
      dyn: the dynamic-K policy (options, experts, ranks).
      k_current: the K of the previous version.
      rate: [L, N] assignments per step expected (the step's own counts).
      tokens_per_step: tokens of one step (global batch x sequence length).
      version: the version's index (its step: one version per step).

    Returns:
      (k, bool [L, N] mask with k experts per layer).
    """
    layers, experts = tracker.shape
    k = dyn.next_k(k_current, tracker, rate, tracker.step * tokens_per_step, tokens_per_step,
                   version)
    mask = select_experts(dyn.options.policy, k, num_layers=layers, num_experts=experts,
                          version=version, ranks=dyn.ranks, since_save=tracker.since_save)
    return k, mask
