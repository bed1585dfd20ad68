"""Partial Expert Checkpointing (PEC, MoC-System): which experts a version carries.

A PEC version carries all non-expert state and, of every MoE layer, only K
of the N experts, each expert with its optimizer state (its Adam moments).
A restore takes the non-expert state from the restore point and every expert
from its newest saved copy at or before it, so the updates an expert received
after that copy are lost. This module is the decision logic, pure and
deterministic, on plain numpy data ([moe_layers, experts] arrays):

* ``select_experts``: the experts of one version (``sequential`` round robin,
  or ``load_aware``: the ones with most tokens since their last copy);
* ``PltTracker``: tokens per (layer, expert) since the newest saved copy and
  the step of that copy; the portion of lost tokens (PLT) of a restore now;
  JSON-able, so it travels in a version's host state and survives a restart;
* ``DynamicK``: the K of the next version (doubling while the predicted PLT
  would pass the threshold, halving back with hysteresis);
* ``restore_plan``: the step each expert is restored from and the PLT;
* ``expert_leaf_axes`` / ``state_bytes``: which train-state leaves are expert
  leaves (params and the optax moments that mirror them) and the bytes a
  version moves for a given K;
* for the in-memory tier's versions: ``version_mask`` (the K and experts of
  the next version), ``padded_gather_indices`` (its per-rank gather indices,
  padded to a fixed count), ``version_needs`` (the versions a restore to it
  reads) and ``versions_to_keep`` (the pruning policy of a store);
* for the persistent tier's steps: ``persist_mask`` (the least recently
  persisted experts), ``newest_copies`` / ``covering_steps`` (what retention
  keeps) and ``persisted_plan`` (each expert's source step and the PLT).

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
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from numpy.typing import ArrayLike

POLICIES = ("sequential", "load_aware")
_FORMAT = 1


class MoEShape(Protocol):
    """What PEC needs of a model config (``models.config.ModelConfig`` fits)."""

    num_experts: int
    top_k: int

    @property
    def moe_layers(self) -> tuple[int, ...]: ...


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


def _check_k(k: int, num_experts: int, ranks: int) -> None:
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
    _check_k(k, num_experts, ranks)
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
    _check_k(k, since.shape[1], 1)
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
    _check_k(1, mask.shape[1], ranks)
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


# --------------------------------------------------------------------------- PLT


class PltTracker:
    """Tokens each expert processed since its newest saved copy.

    Definitions (step t = the t-th update; the state "at step s" holds updates
    1..s; a copy saved at step s holds them too):

    * ``since_save[l, e]``: token-expert assignments that expert e of MoE
      layer l processed (kept, i.e. not dropped for capacity) in the steps
      after its newest saved copy, up to the current step: the assignments
      whose updates to that expert a restore now would lose.
    * ``saved_step[l, e]``: the step of that copy; -1 while it has none.
    * ``restored_lost[l]``: assignments lost by the restores done so far.
    * PLT (MoC-System): lost assignments / all assignments of the training,
      averaged over the MoE layers:
      ``mean_l (restored_lost[l] + sum_e since_save[l, e]) / (tokens * top_k)``
      where ``tokens`` is the number of tokens (sequence positions) the
      training has consumed from step 0 to the current step, each step
      counted once (steps replayed after a restore are not counted again);
      every token makes top_k assignments per MoE layer, so ``tokens * top_k``
      is all assignments of a layer, dropped ones included (a dropped
      assignment updates no expert, so it is never lost).

    The tracker is mutable (``observe``, ``on_saved``, ``on_restored``);
    ``copy()`` lets a caller revert a version that was not kept.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, step: int = 0):
        if num_layers < 1 or num_experts < 1 or top_k < 1:
            raise ValueError(f"num_layers, num_experts and top_k must be >= 1, got "
                             f"{num_layers}, {num_experts}, {top_k}")
        self.top_k = top_k
        self.step = step
        self.since_save = np.zeros((num_layers, num_experts), np.int64)
        self.saved_step = np.full((num_layers, num_experts), -1, np.int64)
        self.restored_lost = np.zeros(num_layers, np.int64)

    @property
    def shape(self) -> tuple[int, int]:
        """(MoE layers, experts per layer)."""
        return self.since_save.shape  # type: ignore[return-value]

    @property
    def complete(self) -> bool:
        """Whether every expert has a saved copy (a restore is possible)."""
        return bool(np.all(self.saved_step >= 0))

    def copy(self) -> PltTracker:
        return PltTracker.from_dict(self.to_dict())

    def observe(self, tokens_per_expert: ArrayLike) -> None:
        """Accounts one training step (the step's ``tokens_per_expert`` [L, N])."""
        tpe = np.asarray(tokens_per_expert)
        if tpe.shape != self.shape:
            raise ValueError(f"tokens_per_expert has shape {tpe.shape}, expected {self.shape}")
        if np.any(tpe < 0):
            raise ValueError("tokens_per_expert must be non-negative")
        self.since_save += tpe.astype(np.int64)
        self.step += 1

    def on_saved(self, step: int, mask: ArrayLike) -> None:
        """Records a version at ``step`` (the current step) holding ``mask``'s experts."""
        mask = np.asarray(mask, bool)
        if mask.shape != self.shape:
            raise ValueError(f"mask has shape {mask.shape}, expected {self.shape}")
        if step != self.step:
            raise ValueError(f"a version at step {step} does not hold the {self.step} "
                             f"steps observed; save after observing each step")
        self.since_save[mask] = 0
        self.saved_step[mask] = step

    def lost(self) -> np.ndarray:
        """[L] assignments lost so far plus those a restore now would lose."""
        return self.restored_lost + self.since_save.sum(axis=1)

    def plt(self, tokens_total: int) -> float:
        """The accumulated PLT if the training restored now (see the class doc).

        Args:
          tokens_total: tokens consumed by the training up to the current step.

        Returns:
          The PLT in [0, 1] for consistent inputs; 0 before any token.
        """
        return _plt(self.lost(), tokens_total, self.top_k)

    def on_restored(self, plan: RestorePlan) -> None:
        """Moves the tracker to the state a restore by ``plan`` leaves.

        The plan's lost assignments join ``restored_lost``; every expert is now
        its copy at ``plan.source`` (nothing since it), and the training goes on
        from ``plan.non_expert_step``. Call it on the tracker the plan was made
        with, the one saved with the restored version, so that the steps after
        the restore point, which the training replays, are not counted lost.
        """
        if plan.source.shape != self.shape:
            raise ValueError(f"plan is for shape {plan.source.shape}, tracker {self.shape}")
        if self.step != plan.non_expert_step:
            raise ValueError(f"tracker is at step {self.step}, the restore at step "
                             f"{plan.non_expert_step}; use the tracker saved with that version")
        self.restored_lost += plan.lost
        self.since_save[:] = 0
        self.saved_step[:] = plan.source

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; copies are stored as ages (step - saved_step, -1: none)."""
        age = np.where(self.saved_step >= 0, self.step - self.saved_step, -1)
        return {
            "format": _FORMAT, "top_k": self.top_k, "step": int(self.step),
            "since_save": self.since_save.tolist(), "age": age.tolist(),
            "restored_lost": self.restored_lost.tolist(),
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> PltTracker:
        """The tracker ``to_dict`` wrote."""
        if doc.get("format") != _FORMAT:
            raise ValueError(f"unknown tracker format {doc.get('format')!r}")
        since = np.asarray(doc["since_save"], np.int64)
        age = np.asarray(doc["age"], np.int64)
        if since.ndim != 2 or age.shape != since.shape:
            raise ValueError(f"since_save {since.shape} and age {age.shape} must be one [L, N]")
        out = cls(since.shape[0], since.shape[1], int(doc["top_k"]), int(doc["step"]))
        out.since_save[:] = since
        out.saved_step[:] = np.where(age >= 0, out.step - age, -1)
        out.restored_lost[:] = np.asarray(doc["restored_lost"], np.int64)
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PltTracker) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]


def _plt(lost: np.ndarray, tokens_total: int, top_k: int) -> float:
    if tokens_total < 0:
        raise ValueError(f"tokens_total must be >= 0, got {tokens_total}")
    if tokens_total == 0:
        return 0.0
    return float(np.mean(lost) / (tokens_total * top_k))


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
    return _plt(lost, tokens_total + tokens_per_step, tracker.top_k)


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
        _check_k(self.options.k, self.num_experts, self.ranks)

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


# --------------------------------------------------------------------------- restore


@dataclasses.dataclass(frozen=True, eq=False)
class RestorePlan:
    """Where a restore takes each expert from, and what it loses.

    Attributes:
      non_expert_step: the restore point; all non-expert state comes from it.
      source: int64 [L, N], the step each expert (its parameters and its
        optimizer state alike) is restored from: its newest copy at or before
        the restore point.
      lost: int64 [L], assignments whose expert updates the restore loses.
      plt: this restore's lost assignments / (tokens * top_k), layer mean.
      accumulated_plt: the same with the restores before it included.
    """

    non_expert_step: int
    source: np.ndarray
    lost: np.ndarray
    plt: float
    accumulated_plt: float


def _newest_at_or_before(steps: Sequence[int], point: int) -> int | None:
    usable = [int(s) for s in steps if int(s) <= point]
    return max(usable) if usable else None


def _plan_sources(saved: Mapping[tuple[int, int], Sequence[int]], non_expert_step: int,
                  shape: tuple[int, int]) -> np.ndarray:
    source = np.empty(shape, np.int64)
    for layer in range(shape[0]):
        for expert in range(shape[1]):
            step = _newest_at_or_before(saved.get((layer, expert), ()), non_expert_step)
            if step is None:
                raise ValueError(f"expert {expert} of MoE layer {layer} has no saved copy at "
                                 f"or before step {non_expert_step}")
            source[layer, expert] = step
    return source


def saved_from_masks(masks: Mapping[int, ArrayLike], shape: tuple[int, int]
                     ) -> dict[tuple[int, int], list[int]]:
    """``restore_plan``'s ``saved`` from versions' masks: {(layer, expert): the
    steps (ascending) whose mask {step: bool [L, N]} carries that expert}."""
    steps = sorted(masks)
    return {key: [v for v in steps if masks[v][key]] for key in np.ndindex(*shape)}


def whole_version_tracker(shape: tuple[int, int], top_k: int, step: int) -> PltTracker:
    """The tracker of a version saved whole (without PEC) at ``step``: every
    expert's newest copy is that version, nothing lost."""
    tracker = PltTracker(*shape, top_k, step)
    tracker.on_saved(step, np.ones(shape, bool))
    return tracker


def restore_plan(saved: Mapping[tuple[int, int], Sequence[int]], non_expert_step: int,
                 tracker: PltTracker, tokens_total: int) -> RestorePlan:
    """The per-expert sources of a restore to ``non_expert_step`` and its PLT.

    The lost assignments of an expert are the tracker's ``since_save``: those
    after the tracker's newest copy of it, which must be the copy the plan
    uses. With the tracker saved in the restored version's host state (at the
    restore point), that is exactly what PEC loses (MoC-System's PLT); a live
    tracker that has seen steps after the restore point also counts those
    steps, which the restore rolls back (and the training replays).

    Args:
      saved: {(layer, expert): steps with a saved copy of that expert}.
      non_expert_step: the restore point (the version's step).
      tracker: the PLT tracker at the restore point or later.
      tokens_total: tokens of the training up to the restore point.

    Returns:
      The RestorePlan.

    Raises:
      ValueError: an expert without a copy at or before the restore point, or
        a tracker that does not know the copy the plan uses.
    """
    if tracker.step < non_expert_step:
        raise ValueError(f"tracker at step {tracker.step} predates the restore point "
                         f"{non_expert_step}")
    source = _plan_sources(saved, non_expert_step, tracker.shape)
    differ = np.argwhere(source != tracker.saved_step)
    if differ.size:
        layer, expert = (int(i) for i in differ[0])
        raise ValueError(
            f"expert {expert} of MoE layer {layer}: the plan restores its copy at step "
            f"{source[layer, expert]}, the tracker's newest copy is at step "
            f"{tracker.saved_step[layer, expert]}; use the tracker saved with the version "
            f"at step {non_expert_step}")
    lost = tracker.since_save.sum(axis=1)
    return RestorePlan(
        non_expert_step=non_expert_step, source=source, lost=lost,
        plt=_plt(lost, tokens_total, tracker.top_k),
        accumulated_plt=_plt(lost + tracker.restored_lost, tokens_total, tracker.top_k),
    )


# --------------------------------------------------------------------------- state leaves


@dataclasses.dataclass(frozen=True)
class ExpertLeaf:
    """An expert leaf of the train state.

    Attributes:
      moe_layer: index of its MoE layer (0 .. len(cfg.moe_layers) - 1).
      axis: its experts axis (always the leading one).
    """

    moe_layer: int
    axis: int = 0


@dataclasses.dataclass(frozen=True)
class ExpertLeafRule:
    """How expert leaves are named (defaults: ``models.gpt``).

    A leaf is an expert leaf iff its path *ends* with
    ``(f"{block_prefix}{i}", moe_name, p)``, p in ``expert_params``; whatever
    comes before (``['params']``, or ``['opt_state'][1][0].mu``) does not
    matter, so the optax moments, which mirror the params tree below their own
    prefix, are matched like the parameters. Block i must be a MoE layer, and
    the leaf's leading axis must have num_experts entries (its experts axis).
    Everything else (router, scalar counts, rng, ...) is non-expert state.
    """

    block_prefix: str = "block"
    moe_name: str = "moe"
    expert_params: tuple[str, ...] = ("w_in", "w_out")


_KEY = re.compile(r"\['((?:[^'\\]|\\.)*)'\]|\[(-?\d+)\]|\.([A-Za-z_]\w*)")


def _path_names(path: str) -> tuple[str, ...]:
    """keystr path -> names: "['a'][1].mu" -> ("a", "1", "mu")."""
    names = tuple(next(g for g in m.groups() if g is not None) for m in _KEY.finditer(path))
    if "".join(m.group(0) for m in _KEY.finditer(path)) != path:
        raise ValueError(f"cannot parse leaf path {path!r} (expected jax.tree_util.keystr form)")
    return names


def _classify(path: str, shape: tuple[int, ...] | None, cfg: MoEShape,
              rule: ExpertLeafRule) -> ExpertLeaf | None:
    names = _path_names(path)
    if len(names) < 3 or names[-2] != rule.moe_name or names[-1] not in rule.expert_params:
        return None
    block = names[-3]
    index = block[len(rule.block_prefix):]
    if not block.startswith(rule.block_prefix) or not index.isdigit():
        return None
    if int(index) not in cfg.moe_layers:
        raise ValueError(f"leaf {path}: layer {index} is not a MoE layer {cfg.moe_layers}")
    if shape is not None and (len(shape) == 0 or shape[0] != cfg.num_experts):
        raise ValueError(f"leaf {path}: shape {shape} has no leading experts axis of "
                         f"{cfg.num_experts}")
    return ExpertLeaf(cfg.moe_layers.index(int(index)))


def _leaf_shapes(tree_or_paths: Any) -> list[tuple[str, tuple[int, ...] | None]]:
    if isinstance(tree_or_paths, list | tuple) and tree_or_paths and all(
            isinstance(p, str) for p in tree_or_paths):
        return [(p, None) for p in tree_or_paths]
    flat = jax.tree_util.tree_flatten_with_path(tree_or_paths)[0]
    return [(jax.tree_util.keystr(p), tuple(getattr(leaf, "shape", np.shape(leaf))))
            for p, leaf in flat]


def expert_leaf_axes(tree_or_paths: Any, cfg: MoEShape,
                     rule: ExpertLeafRule = ExpertLeafRule()) -> dict[str, ExpertLeaf | None]:
    """Which leaves of a state are expert leaves, and of which MoE layer.

    Args:
      tree_or_paths: a pytree of arrays or ShapeDtypeStructs (e.g. the
        trainer's abstract train state), or a list of leaf paths in
        ``jax.tree_util.keystr`` form (then shapes are not checked).
      cfg: the model config (num_experts, moe_layers).
      rule: the naming rule (see ExpertLeafRule).

    Returns:
      {path: ExpertLeaf, or None for a non-expert leaf}, in tree-flatten order
      (the paths are those of ``packing.LeafSlot.path``).
    """
    return {path: _classify(path, shape, cfg, rule)
            for path, shape in _leaf_shapes(tree_or_paths)}


def leaf_steps(plan: RestorePlan,
               leaves: Mapping[str, ExpertLeaf | None]) -> dict[str, int | np.ndarray]:
    """The step each leaf is restored from: an int for non-expert leaves, an
    int64 [N] vector along the experts axis for expert leaves (the plan's row
    of its MoE layer, shared by an expert's parameters and moments)."""
    return {path: plan.non_expert_step if info is None else plan.source[info.moe_layer].copy()
            for path, info in leaves.items()}


@dataclasses.dataclass(frozen=True)
class PecBytes:
    """Bytes of a train state split into expert and non-expert state.

    Attributes:
      non_expert: bytes of every non-expert leaf.
      expert: bytes of every expert leaf (parameters and moments, all layers).
      num_experts: experts per MoE layer.
    """

    non_expert: int
    expert: int
    num_experts: int

    @property
    def expert_fraction(self) -> float:
        return self.expert / (self.expert + self.non_expert)

    def per_version(self, k: int) -> int:
        """Bytes of one PEC version: non-expert + k/N of the expert bytes."""
        _check_k(k, self.num_experts, 1)
        return self.non_expert + k * self.expert // self.num_experts


def state_bytes(tree: Any, cfg: MoEShape, rule: ExpertLeafRule = ExpertLeafRule()) -> PecBytes:
    """Splits the bytes of a state pytree (arrays or ShapeDtypeStructs)."""
    leaves = expert_leaf_axes(tree, cfg, rule)
    sizes = [math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
             for leaf in jax.tree_util.tree_leaves(tree)]
    expert = sum(s for s, info in zip(sizes, leaves.values(), strict=True) if info is not None)
    return PecBytes(sum(sizes) - expert, expert, cfg.num_experts)


def pec_bytes(tree: Any, cfg: MoEShape, k: int,
              rule: ExpertLeafRule = ExpertLeafRule()) -> int:
    """Bytes per PEC version with k experts per layer (see PecBytes.per_version)."""
    return state_bytes(tree, cfg, rule).per_version(k)


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


def version_needs(saved_step: ArrayLike) -> tuple[tuple[int, ...], bool]:
    """The versions a restore to a version reads, from its tracker's ``saved_step``.

    Returns:
      (the distinct steps of the experts' newest copies, ascending; whether
      every expert has one, i.e. whether the version can be restored at all).
    """
    saved = np.asarray(saved_step, np.int64)
    return tuple(int(s) for s in np.unique(saved[saved >= 0])), bool(np.all(saved >= 0))


def versions_to_keep(needs: Mapping[int, tuple[Sequence[int], bool]], newest: int,
                     replicated: int, window: int = 2) -> set[int]:
    """The versions of one owner a store keeps under PEC (pure).

    A version is *restorable* when every expert has a copy (``complete``) and
    every version its restore reads is stored. Roots: the newest version; the
    *safe* one (the newest restorable version at or before ``replicated``,
    the newest step every holder confirmed); and the restorable versions among
    the ``window`` before the newest (the candidates to become safe while
    replication lags by up to ``window`` versions). The store keeps the roots
    and every version a root reads. With the sequential policy at a constant
    K and replication lagging by at most ``window``, that is at most
    ceil(N/K) + window versions (ceil(N/K) consecutive versions hold every
    expert); a longer lag adds the safe version's own needs (at most
    2 * ceil(N/K) + window), until replication catches up.

    Alternative not taken: keeping every version after the safe one, which
    also survives any lag but grows without bound while a peer stalls.

    Args:
      needs: {stored step: (steps its restore reads, complete)} (version_needs).
      newest: the version just written (must be stored).
      replicated: the newest step every holder confirmed (-1: none).
      window: how many versions before the newest stay candidates.

    Returns:
      The steps to keep.
    """
    if newest not in needs:
        raise ValueError(f"newest version {newest} is not among the stored {sorted(needs)}")
    stored = set(needs)

    def restorable(v: int) -> bool:
        steps, complete = needs[v]
        return complete and set(steps) <= stored

    safe = max((v for v in stored if v <= min(replicated, newest) and restorable(v)),
               default=None)
    roots = {newest} | ({safe} if safe is not None else set())
    roots |= {v for v in stored if newest - window <= v < newest and restorable(v)
              and (safe is None or v > safe)}
    keep = set(roots)
    for root in roots:
        keep |= set(needs[root][0]) & stored
    return keep


# --------------------------------------------------------------------------- persistent tier


def persist_mask(k: int, newest_copy: ArrayLike, ranks: int = 1,
                 fresh: ArrayLike | None = None) -> np.ndarray:
    """The experts a persisted step carries: the least recently persisted ones.

    Per MoE layer and expert-parallel rank, the k/R local experts whose newest
    persisted copy is the oldest (ties: the one with the largest ``fresh``,
    then the lower index). This is a round robin
    that needs no counter: from any state, ceil(N/k) consecutive persisted
    steps carry every expert (the experts not picked yet stay the oldest); a
    persisted step that failed leaves its experts among the oldest, so they
    are carried within the next ceil(N/k) steps. While some expert has no
    persisted copy, or k = N, the step carries every expert (a full step).

    Args:
      k: experts per layer; a multiple of ``ranks`` unless k = N, so that every
        rank writes k/R experts of every layer (equal work, and the carried
        experts of a leaf form an array sharded like the leaf itself).
      newest_copy: int [L, N] the step of each expert's newest persisted copy,
        -1 for none (``newest_copies``).
      ranks: expert-parallel ranks R (expert e belongs to rank e // (N/R)).
      fresh: int [L, N] the tie-break, larger first (the persistent tier
        passes the step of each expert's newest copy in memory, so that among
        equally old persisted copies the freshest values go to disk); None: 0.

    Returns:
      bool [L, N].
    """
    newest = np.asarray(newest_copy, np.int64)
    layers, experts = newest.shape
    fresh = np.zeros(newest.shape, np.int64) if fresh is None else np.asarray(fresh, np.int64)
    if fresh.shape != newest.shape:
        raise ValueError(f"fresh has shape {fresh.shape}, expected {newest.shape}")
    _check_k(k, experts, ranks)
    if k == experts or np.any(newest < 0):
        return np.ones(newest.shape, bool)
    if k % ranks:
        raise ValueError(f"k={k} is not a multiple of the {ranks} expert-parallel ranks: "
                         f"every rank carries k/R experts of every layer")
    local, per_rank = experts // ranks, k // ranks
    position = np.broadcast_to(np.arange(local), (layers, ranks, local))
    order = np.lexsort((position, -fresh.reshape(layers, ranks, local),
                        newest.reshape(layers, ranks, local)), axis=2)
    mask = np.zeros((layers, ranks, local), bool)
    np.put_along_axis(mask, order[:, :, :per_rank], True, axis=2)
    return mask.reshape(layers, experts)


def newest_copies(masks: Mapping[int, ArrayLike], shape: tuple[int, int],
                  up_to: int | None = None) -> np.ndarray:
    """int64 [L, N]: the newest step (at or before ``up_to``) whose mask carries
    each expert, -1 where none does.

    Args:
      masks: {step: bool [L, N] the experts that step carries}.
      shape: (L, N).
      up_to: the newest step considered (None: all).
    """
    out = np.full(shape, -1, np.int64)
    for step in sorted(masks):
        if up_to is not None and step > up_to:
            continue
        mask = np.asarray(masks[step], bool)
        if mask.shape != tuple(shape):
            raise ValueError(f"mask of step {step} has shape {mask.shape}, expected {shape}")
        out[mask] = step
    return out


def covering_steps(masks: Mapping[int, ArrayLike], shape: tuple[int, int]) -> set[int]:
    """The steps that hold some expert's newest copy (retention keeps them)."""
    newest = newest_copies(masks, shape)
    return {int(s) for s in np.unique(newest[newest >= 0])}


@dataclasses.dataclass(frozen=True, eq=False)
class PersistedPlan:
    """A restore from persisted steps that carry some experts each.

    Attributes:
      point: the restore point; all non-expert state comes from it.
      source: int64 [L, N] the persisted step each expert (parameters and
        optimizer state alike) is read from: its newest copy at or before
        ``point``.
      data_step: int64 [L, N] the training step whose values that copy holds
        (the memory tier's newest copy when the step was persisted).
      lost: int64 [L] assignments whose expert updates the restore loses.
      plt: lost / (tokens * top_k), mean over the MoE layers.
      accumulated_plt: the same with the earlier restores' losses included.
    """

    point: int
    source: np.ndarray
    data_step: np.ndarray
    lost: np.ndarray
    plt: float
    accumulated_plt: float


def persisted_plan(copies: Mapping[int, tuple[ArrayLike, ArrayLike, ArrayLike]], point: int,
                   cumulative: ArrayLike, restored_lost: ArrayLike, tokens_total: int,
                   top_k: int) -> PersistedPlan:
    """Where a restore to persisted step ``point`` takes each expert, and its PLT.

    The lost assignments of expert e are those it processed after the values
    its copy holds: ``cumulative[e]`` (assignments up to ``point``) minus the
    count at the copy's values.

    Args:
      copies: {persisted step: (bool [L, N] experts carried, int [L, N]
        cumulative assignments of each carried expert at the values it holds,
        int [L, N] the training step of those values)}.
      point: the restore point (a step of ``copies``).
      cumulative: int [L, N] assignments of each expert up to ``point``.
      restored_lost: int [L] assignments lost by earlier restores.
      tokens_total: tokens of the training up to ``point``.
      top_k: assignments per token and MoE layer.

    Raises:
      ValueError: an expert without a copy at or before ``point``.
    """
    if point not in copies:
        raise ValueError(f"restore point {point} is not a persisted step {sorted(copies)}")
    cumulative = np.asarray(cumulative, np.int64)
    shape = cumulative.shape
    source = newest_copies({s: c[0] for s, c in copies.items()}, shape, point)
    missing = np.argwhere(source < 0)
    if missing.size:
        layer, expert = (int(i) for i in missing[0])
        raise ValueError(f"expert {expert} of MoE layer {layer} has no persisted copy at or "
                         f"before step {point}")
    at_copy = np.empty(shape, np.int64)
    data_step = np.empty(shape, np.int64)
    for step in np.unique(source):
        take = source == step
        at_copy[take] = np.asarray(copies[int(step)][1], np.int64)[take]
        data_step[take] = np.asarray(copies[int(step)][2], np.int64)[take]
    lost = (cumulative - at_copy).sum(axis=1)
    if np.any(lost < 0):
        raise ValueError("a persisted copy counts more assignments than the restore point: "
                         "the steps are not from one training")
    before = np.asarray(restored_lost, np.int64)
    return PersistedPlan(point, source, data_step, lost, _plt(lost, tokens_total, top_k),
                         _plt(lost + before, tokens_total, top_k))


def mask_to_hex(mask: ArrayLike) -> str:
    """A bool [L, N] mask as a hex string (row-major bits; for manifests)."""
    return np.packbits(np.asarray(mask, bool).reshape(-1)).tobytes().hex()


def mask_from_hex(text: str, shape: tuple[int, int]) -> np.ndarray:
    """The mask ``mask_to_hex`` wrote, of ``shape``."""
    bits = np.unpackbits(np.frombuffer(bytes.fromhex(text), np.uint8))
    size = shape[0] * shape[1]
    if bits.size < size or bits[size:].any():
        raise ValueError(f"mask {text!r} does not encode a {shape} mask")
    return bits[:size].astype(bool).reshape(shape)
