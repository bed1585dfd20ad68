"""The portion of lost tokens (PLT): what a PEC restore loses, and where each
expert comes from.

A restore takes the non-expert state from the restore point and every expert
from its newest saved copy at or before it, so the updates an expert received
after that copy are lost. This module keeps that account, pure, on numpy data:

* ``PltTracker``: tokens per (layer, expert) since the newest saved copy and
  the step of that copy; the PLT of a restore now; JSON-able, so it travels
  in a version's manifest and survives a restart;
* ``restore_plan`` / ``RestorePlan``: the step each expert is restored from
  and the PLT, from the versions' masks (``saved_from_masks``) and the
  tracker saved with the restore point (``whole_version_tracker`` for a
  version saved without PEC).

Design choice: every version carries its own tracker, so a restore reads the
loss off the restored version exactly. Alternative not taken: only the live
tracker, which after a restore would also count the steps after the restore
point (replayed, not lost) and is gone after a restart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

_FORMAT = 1


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
        return self.since_save.shape

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
        return plt_of(self.lost(), tokens_total, self.top_k)

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

    def forget_copies(self) -> None:
        """Takes every expert as having no saved copy (losses so far kept): the
        next version carries every expert. After a restore that read some
        host's versions from peers, that host's own store lacks the copies
        the tracker points at, and the next persistent read needs them."""
        self.saved_step[:] = -1

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


def plt_of(lost: np.ndarray, tokens_total: int, top_k: int) -> float:
    """lost [L] assignments / (tokens_total * top_k), the mean over the MoE layers."""
    if tokens_total < 0:
        raise ValueError(f"tokens_total must be >= 0, got {tokens_total}")
    if tokens_total == 0:
        return 0.0
    return float(np.mean(lost) / (tokens_total * top_k))


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
    arrays = {v: np.asarray(masks[v]) for v in steps}
    return {key: [v for v in steps if arrays[v][key]] for key in np.ndindex(*shape)}


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
        plt=plt_of(lost, tokens_total, tracker.top_k),
        accumulated_plt=plt_of(lost + tracker.restored_lost, tokens_total, tracker.top_k),
    )
