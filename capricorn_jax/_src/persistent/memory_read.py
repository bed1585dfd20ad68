"""Reading this host's committed in-memory versions for the persistent tier.

The persistent tier writes a step from the host-RAM copy the memory tier
already holds. ``read_own_blocks`` waits (bounded) until this host's own
writer has committed version ``step``, then copies it out of the host
store's shared-memory slot (zero-copy views of each device row, checksummed
with CRC32C after the copy) straight into one 64-byte aligned host buffer per
shard block (the bytes ``packing.unpack`` yields): peak memory is the host's
shards, and the CPU client wraps such buffers as
``jax.Array``s without a copy (``host_arrays.global_arrays``).

Under partial expert checkpointing ``read_pec_blocks`` assembles, from this
host's own store, the state a memory-tier restore to version ``step`` gives
(non-expert state from ``step``, every expert with its Adam moments from its
newest in-memory copy), and ``carried_blocks`` keeps of it the experts a
persisted step carries. ``check_tree`` names the first leaf where a restore
target and a saved tree differ.

Design choice: read the committed, checksummed store copy, each row's view
into its blocks. Alternative not taken: reading each payload row whole and
unpacking it (what recovery does), which holds the rows and the blocks at
once; it stays for the PEC read, which folds several versions.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from capricorn_jax._src.memory.tier.reader import TierReader
from capricorn_jax._src.memory.tier.recovery import PecBlocks, read_rows, row_chunk_names
from capricorn_jax._src.memory.wire.packing import make_pec_plan
from capricorn_jax._src.partial.plans import mask_from_hex
from capricorn_jax._src.partial.tracker import (
    PltTracker,
    RestorePlan,
    restore_plan,
    saved_from_masks,
    whole_version_tracker,
)

_ALIGN = 64  # the CPU client wraps host buffers aligned to 64 bytes without a copy


def aligned(nbytes: int) -> np.ndarray:
    """An uninitialized uint8 buffer of ``nbytes`` starting at a 64-byte boundary."""
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start: start + nbytes]


def read_own_blocks(ckpt: TierReader, step: int, timeout_s: float
                    ) -> tuple[dict[int, list[np.ndarray]], dict[str, Any]]:
    """This host's shard blocks of its committed in-memory version ``step``.

    Waits (at most ``timeout_s``) for the own writer to commit the version, then
    copies each device row's view of the store (checksummed) straight into one
    aligned buffer per unique block: peak memory is the host's shards.

    Returns:
      ({mesh position: [block of each leaf]}, host_state), the blocks being what
      ``packing.unpack`` returns for these payloads.
    """
    host, plan, store = ckpt.host, ckpt.plan, ckpt.store
    _await_version(ckpt, step, timeout_s)
    manifest = store.manifest(host, step)
    if manifest["fingerprint"] != plan.fingerprint():
        raise ValueError(f"in-memory version {step} has another layout than the checkpointer")
    positions = plan.host_positions(host)
    local = {p: j for j, p in enumerate(positions)}
    blocks: dict[int, list[np.ndarray]] = {p: [] for p in positions}
    pieces: list[list[tuple[int, int, np.ndarray, int]]] = [[] for _ in positions]
    for i, slot in enumerate(plan.leaves):
        by_key: dict[tuple, np.ndarray] = {}
        for p in positions:
            key = plan.block_keys[i][p]
            if key not in by_key:
                by_key[key] = aligned(slot.block_bytes)
            buf = by_key[key]
            blocks[p].append(buf.view(np.dtype(slot.dtype)).reshape(slot.block_shape))
            # Device p carries bytes [rank*segment, (rank+1)*segment) of the block.
            lo = plan.ranks[i][p] * slot.segment
            n = min(slot.segment, slot.block_bytes - lo)
            if n > 0:
                pieces[local[p]].append((slot.offset, slot.offset + n, buf, lo))
    for j, row_pieces in enumerate(pieces):
        # Zero-copy: the pieces are copied straight out of the store's slot,
        # then the source is checked (a slot reused meanwhile fails its
        # checksums and raises VersionGone, a FileNotFoundError).
        names = row_chunk_names(plan, j)
        row = store.span_view(host, step, names, manifest)
        for lo, hi, buf, dst in row_pieces:
            buf[dst:dst + hi - lo] = row[lo:hi]
        store.check_span(host, step, names, row, manifest)
    return blocks, manifest.get("host_state", {})


def _await_version(ckpt: TierReader, step: int, timeout_s: float) -> None:
    """Waits (at most ``timeout_s``) until this host's own version ``step`` is committed."""
    deadline = time.monotonic() + timeout_s
    while step not in ckpt.store.versions(ckpt.host):
        if time.monotonic() > deadline:
            raise TimeoutError(f"host {ckpt.host}: in-memory version {step} not committed after "
                               f"{timeout_s:.0f}s")
        time.sleep(0.005)


def read_pec_blocks(ckpt: TierReader, step: int, timeout_s: float
                    ) -> tuple[dict[int, list[np.ndarray]], dict[str, Any], RestorePlan]:
    """This host's shard blocks of the state a memory-tier restore to PEC
    version ``step`` gives: non-expert state from ``step``, every expert
    (parameters and optimizer state) from its newest copy at or before it.

    Reads from this host's own store only: the version and each version its
    manifest says a restore to it reads (the writer keeps them while ``step``
    is the newest, and the next in-memory save waits for this read). Each
    version is read whole (checksummed) and folded in before the next one.

    Returns:
      ({mesh position: [block of each leaf]}, host_state, the restore plan:
      each expert's source step).
    """
    host, store, tier = ckpt.host, ckpt.store, ckpt.pec
    assert tier is not None, "read_pec_blocks reads a memory tier under PEC"
    _await_version(ckpt, step, timeout_s)
    manifest = store.manifest(host, step)
    shape = tier.shape
    top = manifest.get("pec")
    if top is None:  # a version saved whole (without PEC): it is its own source
        tracker = whole_version_tracker(shape, tier.tracker.top_k, step)
        needed, tokens = [step], step * tier.tokens_per_step
    else:
        tracker = PltTracker.from_dict(top["tracker"])
        needed, tokens = sorted({*top["needed"], step}), top["tokens"]
    metas = {v: (manifest if v == step else store.manifest(host, v)).get("pec") or {}
             for v in needed}
    masks = {v: (mask_from_hex(m["mask"], shape) if "mask" in m
                 else np.ones(shape, bool)) for v, m in metas.items()}
    plan = restore_plan(saved_from_masks(masks, shape), step, tracker, tokens)
    blocks = PecBlocks(ckpt, plan.source)
    for v in needed:
        count = metas[v].get("count")
        layout = ckpt.plan if count is None else make_pec_plan(ckpt.plan, tier.layers, count)
        rows = read_rows(ckpt, host, v, layout)
        blocks.fold(v, rows, layout, masks[v], v == step)
        del rows
    return blocks.result(), manifest.get("host_state", {}), plan


def carried_blocks(ckpt: TierReader, blocks: dict[int, list[np.ndarray]],
             plan: RestorePlan, record: dict[str, Any] | None
             ) -> tuple[dict[int, list[np.ndarray]], list[tuple[int, ...]] | None]:
    """The blocks of a persisted step carrying ``record``'s experts, and the
    global shape of each leaf (None: every expert, the state's own shapes).

    An expert leaf keeps only the carried experts of its layer, in ascending
    order: each device's block holds those of its expert-parallel rank (the
    same number on every rank), so the leaf stays sharded like the full one.
    """
    if record is None:
        return blocks, None
    tier = ckpt.pec
    assert tier is not None, "a PEC record is written only from a memory tier under PEC"
    data_step = np.asarray(record["data_step"], np.int64)
    mask = mask_from_hex(record["mask"], tier.shape)
    if not np.array_equal(data_step[mask], plan.source[mask]):
        raise RuntimeError(f"step {record['step']}: the memory tier's copies changed between the "
                           f"persistent record and the read")
    if mask.all():
        return blocks, None
    ep = tier.experts
    shapes = [tuple(leaf.shape) for leaf in jax.tree.leaves(ckpt.abstract_state)]
    out = {p: list(row) for p, row in blocks.items()}
    for i, layer in zip(ep.leaves, ep.layers, strict=True):
        shapes[i] = (int(mask[layer].sum()), *shapes[i][1:])
        done: dict[int, np.ndarray] = {}
        for p in out:
            rank = ep.expert_rank[p]
            if rank not in done:
                local = mask[layer, rank * ep.local_experts:(rank + 1) * ep.local_experts]
                part = blocks[p][i][np.flatnonzero(local)]
                done[rank] = aligned(part.nbytes).view(part.dtype).reshape(part.shape)
                done[rank][...] = part
            out[p][i] = done[rank]
    return out, shapes


def _flat(tree: Any) -> dict[tuple, Any]:
    return ocp.tree.to_flat_dict(tree)


def _name(path: tuple) -> str:
    return "/".join(str(k) for k in path)


def check_tree(abstract: Any, saved: Any, where: str) -> None:
    """Raises ValueError naming the first leaf where ``abstract`` and ``saved`` differ.

    Args:
      abstract: the restore target (leaves with .shape and .dtype).
      saved: the saved tree (Orbax metadata tree, or ShapeDtypeStructs).
      where: what ``saved`` is, for the message.
    """
    want, have = _flat(abstract), _flat(saved)
    missing = [k for k in want if k not in have]
    extra = [k for k in have if k not in want]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"leaf {_name(missing[0])} of the target is not in {where}")
        if extra:
            parts.append(f"leaf {_name(extra[0])} of {where} is not in the target")
        raise ValueError(f"restore target does not match {where}: " + "; ".join(parts) +
                         f" ({len(missing)} missing, {len(extra)} extra leaves)")
    for key, target in want.items():
        if target is ocp.PLACEHOLDER:  # a leaf not restored
            continue
        got = have[key]
        shape, dtype = tuple(getattr(got, "shape", ())), getattr(got, "dtype", None)
        if tuple(target.shape) != shape:
            raise ValueError(f"restore target does not match {where} at leaf {_name(key)}: "
                             f"shape {shape} in {where}, {tuple(target.shape)} in the target")
        if dtype is not None and np.dtype(dtype) != np.dtype(target.dtype):
            raise ValueError(f"restore target does not match {where} at leaf {_name(key)}: "
                             f"dtype {np.dtype(dtype).name} in {where}, "
                             f"{np.dtype(target.dtype).name} in the target")
