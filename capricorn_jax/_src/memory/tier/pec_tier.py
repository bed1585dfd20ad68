"""The PEC bookkeeping of the in-memory tier: what each version carries.

Under partial expert checkpointing (``InMemoryOptions.pec``; MoC-System)
each version carries the non-expert state and K experts of every MoE layer,
each with its Adam moments. ``PecTier`` is the checkpointer's record of that:
a ``tracker.PltTracker`` fed with each step's ``tokens_per_expert``, the
current K, the cumulative assignments per expert; the decision of a version
is ``selection.version_mask`` (dynamic K, then the policy's selection), and a
version is packed with the plan of its per-device record count C
(``packing.make_pec_plan``; one compiled pack + replicate program per C, the
gather indices traced). A version with every expert (the first ones, or
K = N) uses the full plan: bitwise the payload of a run without PEC. Every
host takes the same decision, so a replica's manifest is written from the
receiver's own record of the version (``PecVersion.meta``: K, mask, the
tracker, the versions a restore to it reads). The caller may pass its own
``expert_mask`` (tests, external policies); the tracker still records it.

Alternative not taken: the caller selecting experts and carrying the tracker
in its host state (the trailer). The trailer would then differ between a PEC
version with K = N and a full one, and a receiver could not prune a replica
without decoding its payload.

A version recorded here may still be lost: a host drops it (a corrupt frame,
a chunk channel lost while it was in flight, a writer too busy to take it),
and the versions after it would keep naming its experts' copies, so none of
them could be restored until every one of those experts was saved again.
``roll_back`` takes such versions out of the tracker: it keeps a journal of
the last ``JOURNAL_STEPS`` steps (each step's tokens and the mask saved, if
any) over a copy of the tracker before them, and replays it without the lost
versions' saves. Every host rolls back the same versions at the same save
(the status round tells them, ``StatusRound``), so the trackers stay equal.
Alternative not taken: a copy of the tracker per version to go back to; the
versions recorded after a lost one must keep their own saves, which only a
replay gives.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from capricorn_jax._src.memory.wire.packing import PackPlan, make_pec_plan
from capricorn_jax._src.memory.wire.transport import Transport
from capricorn_jax._src.partial.leaves import MoEShape, expert_leaf_axes
from capricorn_jax._src.partial.plans import mask_to_hex, version_needs
from capricorn_jax._src.partial.selection import (
    DynamicK,
    PecOptions,
    padded_gather_indices,
    version_mask,
)
from capricorn_jax._src.partial.tracker import PltTracker

log = logging.getLogger("capricorn_jax")

JOURNAL_STEPS = 64
"""Steps the PEC tier can roll back over (``PecTier.roll_back``): a version
is lost, if at all, within a few saves of its own."""


@dataclasses.dataclass(frozen=True, eq=False)
class PecVersion:
    """One version under PEC, as every host decided it.

    Attributes:
      step: the version.
      k: experts per MoE layer (the largest row of ``mask``).
      mask: bool [L, N] the experts it carries.
      gather: int32 [R, C] gather indices, or None for a full version.
      plan, transport: the layout it is packed with and its program.
      meta: the manifest's "pec" entry.
    """

    step: int
    k: int
    mask: np.ndarray
    gather: np.ndarray | None
    plan: PackPlan
    transport: Transport
    meta: dict[str, Any]


class PecTier:
    """The PEC bookkeeping of an InMemoryCheckpointer (see the module doc).

    Args:
      options: the PEC options.
      model: the model's MoE shape (num_experts, top_k, moe_layers).
      tokens_per_step: tokens of one training step (global batch x seq len).
      abstract_state: the train state's shapes (which leaves hold experts).
      full: the transport of whole versions (its plan, mesh and rounds are
        those of every PEC version's transport).

    Design choice: the tier is built from what it reads (the state's shapes
    and the full transport), not from the checkpointer, so the memory tier's
    modules import one way (checkpointer -> pec_tier) and the tier can be
    built and tested alone. Alternative not taken (the previous state): the
    checkpointer passed itself and the tier read seven of its attributes.
    """

    def __init__(self, options: PecOptions, model: MoEShape, tokens_per_step: int,
                 abstract_state: Any, full: Transport):
        options.check(model.num_experts)
        axes = expert_leaf_axes(abstract_state, model)
        self.layers = [None if a is None else a.moe_layer for a in axes.values()]
        self.shape = (len(model.moe_layers), model.num_experts)
        self.tokens_per_step = tokens_per_step
        self._transports: dict[int | None, Transport] = {None: full}
        experts = make_pec_plan(full.plan, self.layers, 1).experts  # the expert layout
        assert experts is not None  # a PEC plan always has one
        self.experts = experts
        self.ranks = self.experts.ranks
        self.dyn = DynamicK(options, model.num_experts, self.ranks)
        self.tracker = PltTracker(*self.shape, model.top_k)
        self.k = options.k
        # Assignments each expert processed since step 0 of this training's
        # timeline (a restore rewinds it to the restore point's count); the
        # persistent tier's PLT is a difference of these counts.
        self.cumulative = np.zeros(self.shape, np.int64)
        self._restart_journal()

    def _restart_journal(self) -> None:
        """The journal starts over at the tracker as it is now."""
        self._base = self.tracker.copy()
        self._journal: list[tuple[int, np.ndarray, np.ndarray | None]] = []
        self.rolled_back: set[int] = set()

    def _journal_step(self, step: int, tokens: Any, mask: np.ndarray | None) -> None:
        """Records step ``step`` (its tokens, the mask its version saved or None),
        folding the oldest entry into the base past ``JOURNAL_STEPS``."""
        self._journal.append((step, np.array(tokens, np.int64),
                              None if mask is None else np.array(mask, bool)))
        while len(self._journal) > JOURNAL_STEPS:
            old, tokens, mask = self._journal.pop(0)
            self._replay_one(self._base, old, tokens, mask)
            self.rolled_back.discard(old)

    def _replay_one(self, tracker: PltTracker, step: int, tokens: np.ndarray,
                    mask: np.ndarray | None) -> None:
        tracker.observe(tokens)
        if mask is not None and step not in self.rolled_back:
            tracker.on_saved(step, mask)

    def roll_back(self, lost: set[int]) -> list[int]:
        """Takes versions ``lost`` out of the tracker: afterwards it is the
        tracker of the same steps with those versions never saved (the
        versions after them keep their saves). Versions it never recorded
        or already rolled back are ignored; one older than the journal is
        left in (logged: the versions after it stay unrestorable until its
        experts are saved again, which the retention rules already allow).

        Returns:
          The versions rolled back now, ascending.
        """
        recorded = {s for s, _, m in self._journal if m is not None}
        now = sorted((set(lost) & recorded) - self.rolled_back)
        too_old = sorted(v for v in lost if self._journal and v < self._journal[0][0]
                         and v not in self.rolled_back)
        if too_old:
            log.warning("PEC: versions %s are older than the %d steps the tracker can roll "
                        "back over; the versions naming their experts stay unrestorable until "
                        "those experts are saved again", too_old, JOURNAL_STEPS)
            self.rolled_back.update(too_old)
        if not now:
            return []
        self.rolled_back.update(now)
        tracker = self._base.copy()
        for step, tokens, mask in self._journal:
            self._replay_one(tracker, step, tokens, mask)
        self.tracker = tracker
        return now

    def transport(self, count: int | None) -> Transport:
        """The program of versions with ``count`` records per device (None: full)."""
        if count not in self._transports:
            assert count is not None  # the full transport is there from the start
            full = self._transports[None]
            self._transports[count] = full.for_plan(make_pec_plan(full.plan, self.layers, count))
        return self._transports[count]

    def resume(self, tracker: PltTracker, k: int, cumulative: Any = None) -> None:
        """Continues from ``tracker`` (restored, or fresh at a step) with K ``k``
        and, when given, the cumulative assignments [L, N] at the restore point."""
        if tracker.shape != self.shape:
            raise ValueError(f"tracker of shape {tracker.shape}, the model has {self.shape}")
        if cumulative is not None:
            cumulative = np.asarray(cumulative, np.int64)
            if cumulative.shape != self.shape:
                raise ValueError(f"cumulative of shape {cumulative.shape}, the model has "
                                 f"{self.shape}")
            self.cumulative = cumulative.copy()
        self.tracker, self.k = tracker, k
        self._restart_journal()

    def plt(self) -> float:
        """The PLT a restore now would leave (accumulated)."""
        return self.tracker.plt(self.tracker.step * self.tokens_per_step)

    def version(self, step: int, tokens_per_expert: Any, expert_mask: Any = None,
                full: bool = False) -> PecVersion:
        """Records version ``step`` (after observing its step) and returns it.

        Args:
          step: the version; must follow the tracker's step by one.
          tokens_per_expert: [L, N] kept assignments of the step that made it.
          expert_mask: bool [L, N] to save instead of the policy's choice.
          full: save every expert (a version moved by the full plan).
        """
        if tokens_per_expert is None:
            raise ValueError("PEC needs tokens_per_expert ([moe_layers, experts] of the step) "
                             "with every save")
        if step != self.tracker.step + 1:
            raise ValueError(f"PEC version {step} does not follow step {self.tracker.step}: "
                             f"save once per step, or call resume_pec first")
        tracker = self.tracker.copy()
        tracker.observe(tokens_per_expert)
        cumulative = self.cumulative + np.asarray(tokens_per_expert, np.int64)
        k, mask = self._choose(tracker, tokens_per_expert, expert_mask, full)
        tracker.on_saved(step, mask)
        self._journal_step(step, tokens_per_expert, mask)
        gather, _ = padded_gather_indices(mask, self.ranks)
        count = None if mask.all() else gather.shape[1]
        transport = self.transport(count)
        needed, complete = version_needs(tracker.saved_step)
        meta = {"k": k, "shape": list(self.shape), "mask": mask_to_hex(mask),
                "count": count, "needed": list(needed), "complete": complete,
                "tokens": step * self.tokens_per_step, "tracker": tracker.to_dict(),
                "cumulative": cumulative.tolist()}
        self.tracker, self.k, self.cumulative = tracker, k, cumulative
        return PecVersion(step, k, mask, None if count is None else gather,
                          transport.plan, transport, meta)

    def skip(self, step: int, tokens_per_expert: Any) -> None:
        """Accounts step ``step`` whose version is not taken (a cost budget):
        its tokens count as not saved."""
        if tokens_per_expert is None:
            raise ValueError("PEC needs tokens_per_expert ([moe_layers, experts] of the step) "
                             "with every save")
        if step != self.tracker.step + 1:
            raise ValueError(f"PEC step {step} does not follow step {self.tracker.step}")
        self.tracker.observe(tokens_per_expert)
        self._journal_step(step, tokens_per_expert, None)
        self.cumulative = self.cumulative + np.asarray(tokens_per_expert, np.int64)

    def _choose(self, tracker: PltTracker, rate: Any, expert_mask: Any,
                full: bool) -> tuple[int, np.ndarray]:
        if full:
            return self.shape[1], np.ones(self.shape, bool)
        if expert_mask is None:
            return version_mask(tracker, self.dyn, self.k, rate, self.tokens_per_step,
                                        tracker.step)
        mask = np.asarray(expert_mask)
        if mask.shape != self.shape or mask.dtype != bool:
            raise ValueError(f"expert_mask must be bool {self.shape}, got {mask.dtype} "
                             f"{mask.shape}")
        if not mask.any(axis=1).all():
            raise ValueError("expert_mask selects no expert of some MoE layer")
        return int(mask.sum(axis=1).max()), mask


def version_needs_of(manifest: dict[str, Any], step: int) -> tuple[tuple[int, ...], bool]:
    """(versions a restore to this version reads, complete) from its manifest;
    a version saved without PEC reads itself only."""
    pec = manifest.get("pec")
    if pec is None:
        return (step,), True
    return tuple(int(v) for v in pec["needed"]), bool(pec["complete"])
