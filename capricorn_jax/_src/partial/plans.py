"""What each tier's PEC versions read and carry: the per-tier plans (pure).

* in-memory tier: ``version_needs``, the versions a restore to a version reads
  (from the tracker saved with it), which recovery's choice and the store's
  retention (``retention.versions_to_keep``) take;
* persistent tier: ``persist_mask`` (the experts a persisted step carries: the
  least recently persisted ones), ``newest_copies`` / ``persisted_needs``
  (the steps a restore to each persisted step reads, which retention keeps)
  and ``persisted_plan`` (each expert's source step, the training step of its
  values, and the PLT);
* ``mask_to_hex`` / ``mask_from_hex``: masks in manifests and step metadata.

Design choice: a persisted step carries the least recently persisted experts
of the memory tier's newest copies (a round robin that needs no counter, and
that carries the experts of a failed step again within ceil(N/K_persist)
steps). Alternative not taken: persisting K_persist of the experts the
version itself carries (MoC-System's buffer rotation): those follow the
memory tier's own round robin, so with a persist interval that is a multiple
of N/K the same experts would be persisted every time and others never.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
from numpy.typing import ArrayLike

from capricorn_jax._src.partial.selection import check_k
from capricorn_jax._src.partial.tracker import plt_of


def version_needs(saved_step: ArrayLike) -> tuple[tuple[int, ...], bool]:
    """The versions a restore to a version reads, from its tracker's ``saved_step``.

    Returns:
      (the distinct steps of the experts' newest copies, ascending; whether
      every expert has one, i.e. whether the version can be restored at all).
    """
    saved = np.asarray(saved_step, np.int64)
    return tuple(int(s) for s in np.unique(saved[saved >= 0])), bool(np.all(saved >= 0))


# --------------------------------------------------------------------------- the persistent tier


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
    check_k(k, experts, ranks)
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

def persisted_needs(masks: Mapping[int, ArrayLike], shape: tuple[int, int]
                    ) -> dict[int, tuple[tuple[int, ...], bool]]:
    """{persisted step: (the steps a restore to it reads, complete)}: each step
    reads, for every expert, the newest step at or before it that carries the
    expert (``version_needs`` of those copies); complete when every expert has
    one. What ``retention.versions_to_keep`` takes for the persistent tier.

    Args:
      masks: {step: bool [L, N] the experts that step carries}.
      shape: (L, N).
    """
    return {int(step): version_needs(newest_copies(masks, shape, step)) for step in masks}


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
    return PersistedPlan(point, source, data_step, lost, plt_of(lost, tokens_total, top_k),
                         plt_of(lost + before, tokens_total, top_k))


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
