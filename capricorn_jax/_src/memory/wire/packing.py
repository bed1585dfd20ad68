"""How a host's shards of the train state become equal-sized device payloads.

The plan (pure, deterministic: every host computes the same one) assigns each
host's *unique* shard blocks to its local devices: a block held by r local
devices (e.g. a replicated parameter on a host with r devices) is split into r
byte ranges, one per device, so every byte of a host's shards appears in
exactly one of its devices' payloads, and no block is sent twice. Each leaf
occupies the same segment (offset, size) in every device's payload, so all
payloads have one shape: what a collective-permute needs. A trailer region at
the end carries the host's small JSON state (data-iterator position, ...).

The union of a host's device payloads is the host's checkpoint: it is what the
host store keeps (one chunk file per device and chunk) and what the replicas
receive. ``unpack`` turns the payloads of one owner back into shard blocks.

Alternative not taken: serializing each shard on the host and shipping bytes
from there (jax.experimental.transfer). Packing on the device keeps the bytes
on the link the all-to-all uses and lets later schedules place each chunk's
collective-permute at a chosen layer boundary inside the step.

Partial expert checkpointing (``make_pec_plan``): a PEC version carries every
non-expert leaf (laid out as in the full plan) and, of the expert leaves, only
C *expert records* per device, one record being everything of one local expert
(its slice of every expert leaf of its MoE layer: parameters and Adam moments,
concatenated; the records of all layers are padded to one size). Which
records a device carries is a gather with indices that are an *input* of the
packing program (``pec.padded_gather_indices``), so a new expert selection
with the same C reuses the compiled program; there is one plan (and one
compiled variant) per C, and C = ceil(K*L/R) under the sequential policy.
The full plan stays the layout of K = N versions, so those are bitwise the
payloads of a run without PEC. Alternative not taken: one segment per expert
leaf, gathered leaf by leaf: an expert-parallel rank's share of a single
layer's K experts is not constant (the sequential policy balances the ranks
over all layers together, not per layer), so per-leaf segments would be
padded to the busiest rank of each layer.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from typing import Any

import jax
import numpy as np

TRAILER_BYTES = 8192


@dataclasses.dataclass(frozen=True)
class LeafSlot:
    """One state leaf's place in the device payloads."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    block_shape: tuple[int, ...]
    block_bytes: int
    offset: int
    segment: int


@dataclasses.dataclass(frozen=True)
class ExpertSegment:
    """Where a PEC plan puts the selected experts' records (see the module doc).

    Attributes:
      leaves: plan indices of the expert leaves, in plan order.
      layers: the MoE layer of each of them.
      num_layers: MoE layers L.
      local_experts: experts of a layer each device holds (N/R).
      count: records each device carries (C).
      record_offsets: where each expert leaf's slice of one expert starts in
        its layer's record.
      slice_bytes: bytes of one expert's slice of each expert leaf.
      record_bytes: bytes of one record (the largest layer's; others padded).
      offset: where the segment starts in every payload.
      segment: bytes of the segment in every payload.
      expert_rank: expert-parallel rank of each mesh device (its experts are
        rank*N/R .. (rank+1)*N/R - 1 of every layer).
      member: which segment-sized byte range of its gathered records device p
        carries (devices of one host holding the same experts split them).
    """

    leaves: tuple[int, ...]
    layers: tuple[int, ...]
    num_layers: int
    local_experts: int
    count: int
    record_offsets: tuple[int, ...]
    slice_bytes: tuple[int, ...]
    record_bytes: int
    offset: int
    segment: int
    expert_rank: tuple[int, ...]
    member: tuple[int, ...]

    @property
    def ranks(self) -> int:
        """Expert-parallel ranks R."""
        return max(self.expert_rank) + 1


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """The payload layout of a state pytree over a mesh.

    Attributes:
      leaves: one LeafSlot per state leaf, in tree-flatten order.
      chunk_bytes: transfer chunk size (the last chunk of a payload may be shorter).
      payload_bytes: bytes of one device's payload.
      trailer_offset: where the host-state trailer starts.
      device_host: host index of each mesh device (mesh.devices.flat order).
      ranks: ranks[i][p]: which byte range of leaf i's block device p carries.
      block_keys: block_keys[i][p]: the block (index) of leaf i on device p.
      experts: the expert segment of a PEC plan (None: a full plan). In a PEC
        plan the expert leaves' slots have segment 0 (their bytes are in the
        expert segment) and ``unpack`` refuses the plan (``unpack_pec``).
    """

    leaves: tuple[LeafSlot, ...]
    chunk_bytes: int
    payload_bytes: int
    trailer_offset: int
    device_host: tuple[int, ...]
    ranks: tuple[tuple[int, ...], ...]
    block_keys: tuple[tuple[tuple, ...], ...]
    experts: ExpertSegment | None = None

    @property
    def num_chunks(self) -> int:
        return -(-self.payload_bytes // self.chunk_bytes)

    def chunk_range(self, k: int) -> tuple[int, int]:
        """Byte range of chunk k in a payload (the last chunk may be shorter)."""
        return k * self.chunk_bytes, min((k + 1) * self.chunk_bytes, self.payload_bytes)

    @property
    def hosts(self) -> int:
        return max(self.device_host) + 1

    def host_positions(self, host: int) -> list[int]:
        """Mesh positions of ``host``'s devices, in local order."""
        return [p for p, h in enumerate(self.device_host) if h == host]

    def leaf_table(self) -> list[dict[str, Any]]:
        return [{"path": s.path, "shape": list(s.shape), "dtype": s.dtype} for s in self.leaves]

    def fingerprint(self) -> str:
        """A digest of the layout (a reader checks a version's against its plan's)."""
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> str:
        # Once per plan: every version a writer commits carries it, and the
        # digest of the leaf table (dataclasses.asdict per leaf) took ~2 ms of
        # the writer's GIL per version (BUILD_NOTES, "Where the CPU goes").
        doc = {"leaves": [dataclasses.asdict(s) for s in self.leaves],
               "chunk": self.chunk_bytes, "hosts": self.device_host, "ranks": self.ranks}
        if self.experts is not None:  # full plans keep the fingerprint they always had
            doc["experts"] = dataclasses.asdict(self.experts)
        return hashlib.sha256(json.dumps(doc, default=list).encode()).hexdigest()[:16]


def _key(index: tuple, shape: tuple[int, ...]) -> tuple:
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True))


def make_plan(abstract: Any, shardings: Any, mesh: jax.sharding.Mesh, chunk_bytes: int,
              device_host: list[int] | None = None) -> PackPlan:
    """The payload layout of ``abstract`` (shapes/dtypes) under ``shardings``.

    Args:
      abstract: a pytree of arrays or ShapeDtypeStructs.
      shardings: the matching pytree of NamedShardings.
      mesh: the mesh the shardings use.
      chunk_bytes: transfer chunk size (> 0).
      device_host: host of each device in mesh order; default: process_index
        (tests override it to simulate hosts inside one process).
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    devices = list(mesh.devices.flat)
    hosts = tuple(device_host or [d.process_index for d in devices])
    paths_leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    sharding_leaves = jax.tree.leaves(shardings)
    slots, ranks, keys, offset = [], [], [], 0
    for (path, leaf), sharding in zip(paths_leaves, sharding_leaves, strict=True):
        shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
        index_map = sharding.devices_indices_map(shape)
        leaf_keys = tuple(_key(index_map[d], shape) for d in devices)
        groups: dict[tuple, list[int]] = {}
        for p, k in enumerate(leaf_keys):
            groups.setdefault((hosts[p], k), []).append(p)
        leaf_ranks = [0] * len(devices)
        for members in groups.values():
            for r, p in enumerate(members):
                leaf_ranks[p] = r
        block_shape = tuple(b - a for a, b in leaf_keys[0])
        block_bytes = math.prod(block_shape) * dtype.itemsize
        fewest = min(len(m) for m in groups.values())
        segment = math.ceil(block_bytes / fewest)
        slots.append(LeafSlot(jax.tree_util.keystr(path), shape, dtype.name, block_shape,
                              block_bytes, offset, segment))
        ranks.append(tuple(leaf_ranks))
        keys.append(leaf_keys)
        offset += segment
    payload = offset + TRAILER_BYTES
    return PackPlan(tuple(slots), chunk_bytes, payload, offset, hosts, tuple(ranks), tuple(keys))


def _expert_layout(base: PackPlan, idx: list[int]) -> tuple[tuple, int, tuple[int, ...]]:
    """(the experts-axis range of each device, N/R, member ranks), checked equal
    for every expert leaf (the same expert sharding, no other axis split)."""
    first = idx[0]
    ranges = tuple(base.block_keys[first][p][0] for p in range(len(base.device_host)))
    local = ranges[0][1] - ranges[0][0]
    num_experts = base.leaves[first].shape[0]
    for i in idx:
        slot = base.leaves[i]
        if not slot.shape or slot.shape[0] != num_experts:
            raise ValueError(f"expert leaf {slot.path}: shape {slot.shape} has no leading "
                             f"experts axis of {num_experts}")
        for p, key in enumerate(base.block_keys[i]):
            whole = all(k == (0, n) for k, n in zip(key[1:], slot.shape[1:], strict=True))
            if key[0] != ranges[p] or not whole:
                raise ValueError(f"expert leaf {slot.path} is sharded unlike "
                                 f"{base.leaves[first].path} (block {key} on device {p}); "
                                 f"PEC needs every expert leaf split over its experts axis only")
        if base.ranks[i] != base.ranks[first]:
            raise ValueError(f"expert leaf {slot.path}: its blocks are shared unlike "
                             f"{base.leaves[first].path}'s")
    if any(b - a != local for a, b in ranges):
        raise ValueError(f"expert blocks of {base.leaves[first].path} differ in size: {ranges}")
    return ranges, local, base.ranks[first]


def _record_layout(layers: list[int], slice_bytes: list[int]) -> tuple[tuple[int, ...], int]:
    """(offset of each expert leaf's slice in its layer's record, record bytes:
    the largest layer's)."""
    offsets, used = [], dict.fromkeys(layers, 0)
    for layer, size in zip(layers, slice_bytes, strict=True):
        offsets.append(used[layer])
        used[layer] += size
    return tuple(offsets), max(used.values())


def make_pec_plan(base: PackPlan, expert_layers: list[int | None], count: int) -> PackPlan:
    """The layout of PEC versions carrying ``count`` expert records per device.

    Args:
      base: the full plan of the state (``make_plan``).
      expert_layers: per leaf of ``base`` (plan order), its MoE layer, or None
        for a non-expert leaf (``pec.expert_leaf_axes``).
      count: records per device, C (``pec.padded_gather_indices``' width).

    Returns:
      A PackPlan with ``experts`` set: the non-expert slots of ``base`` (same
      segments, packed together), then the expert segment, then the trailer.
    """
    if base.experts is not None:
        raise ValueError("base must be a full plan, got a PEC plan")
    if len(expert_layers) != len(base.leaves):
        raise ValueError(f"expert_layers has {len(expert_layers)} entries for "
                         f"{len(base.leaves)} leaves")
    idx = [i for i, layer in enumerate(expert_layers) if layer is not None]
    if not idx:
        raise ValueError("the state has no expert leaves; PEC has nothing to select")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    ranges, local, member = _expert_layout(base, idx)
    layers = [int(layer) for layer in expert_layers if layer is not None]  # idx's layers
    slice_bytes = [base.leaves[i].block_bytes // local for i in idx]
    offsets, record = _record_layout(layers, slice_bytes)
    groups: dict[tuple, int] = {}
    for p, key in enumerate(ranges):
        groups[(base.device_host[p], key)] = groups.get((base.device_host[p], key), 0) + 1
    segment = math.ceil(count * record / min(groups.values()))
    offset = sum(s.segment for i, s in enumerate(base.leaves) if expert_layers[i] is None)
    end = offset + segment
    slots, at = [], 0
    for i, slot in enumerate(base.leaves):
        if expert_layers[i] is None:
            slots.append(dataclasses.replace(slot, offset=at))
            at += slot.segment
        else:  # its bytes live in the expert segment
            slots.append(dataclasses.replace(slot, offset=offset, segment=0))
    experts = ExpertSegment(tuple(idx), tuple(layers), max(layers) + 1, local, count, offsets,
                            tuple(slice_bytes), record, offset, segment,
                            tuple(a // local for a, _ in ranges), member)
    return dataclasses.replace(base, leaves=tuple(slots), payload_bytes=end + TRAILER_BYTES,
                               trailer_offset=end, experts=experts)


def encode_trailer(host_state: dict[str, Any]) -> np.ndarray:
    raw = json.dumps(host_state, separators=(",", ":")).encode()
    if len(raw) > TRAILER_BYTES:
        raise ValueError(f"host state is {len(raw)} bytes; the trailer holds {TRAILER_BYTES}")
    out = np.zeros(TRAILER_BYTES, np.uint8)
    out[: len(raw)] = np.frombuffer(raw, np.uint8)
    return out


def decode_trailer(plan: PackPlan, payload: np.ndarray) -> dict[str, Any]:
    raw = payload[plan.trailer_offset: plan.trailer_offset + TRAILER_BYTES].tobytes()
    return json.loads(raw.rstrip(b"\0").decode() or "{}")


def _group(plan: PackPlan, i: int, positions: list[int], p: int) -> list[int]:
    """The devices of ``positions`` holding leaf i's block of device p, by rank."""
    key = plan.block_keys[i][p]
    return sorted((q for q in positions if plan.block_keys[i][q] == key),
                  key=lambda q: plan.ranks[i][q])


def _leaf_blocks(plan: PackPlan, i: int, positions: list[int],
                 rows: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Leaf i's block on each of ``positions`` from their payloads (by position)."""
    slot = plan.leaves[i]
    cache: dict[tuple, np.ndarray] = {}
    out = {}
    for p in positions:
        key = plan.block_keys[i][p]
        if key not in cache:
            raw = np.concatenate([rows[q][slot.offset: slot.offset + slot.segment]
                                  for q in _group(plan, i, positions, p)])[: slot.block_bytes]
            cache[key] = raw.view(np.dtype(slot.dtype)).reshape(slot.block_shape)
        out[p] = cache[key]
    return out


def _owner_rows(plan: PackPlan, owner: int, payloads: list[np.ndarray]
                ) -> tuple[list[int], dict[int, np.ndarray]]:
    positions = plan.host_positions(owner)
    if len(payloads) != len(positions):
        raise ValueError(f"host {owner} has {len(positions)} devices, got {len(payloads)} payloads")
    for row in payloads:
        if row.shape != (plan.payload_bytes,):
            raise ValueError(f"payload of shape {row.shape}, the plan's has "
                             f"{plan.payload_bytes} bytes")
    return positions, dict(zip(positions, payloads, strict=True))


def unpack(plan: PackPlan, owner: int, payloads: list[np.ndarray]) -> dict[int, list[np.ndarray]]:
    """The shard blocks of ``owner``'s devices from its device payloads.

    Args:
      plan: the (full) layout the payloads were packed with.
      owner: the host whose payloads these are.
      payloads: one uint8 [payload_bytes] array per device of ``owner``, in
        local order.

    Returns:
      {mesh position: [block of each leaf]} for each of owner's devices.
    """
    if plan.experts is not None:
        raise ValueError("a PEC plan's payloads hold some experts only: use unpack_pec")
    positions, rows = _owner_rows(plan, owner, payloads)
    out: dict[int, list[np.ndarray]] = {p: [] for p in positions}
    for i in range(len(plan.leaves)):
        for p, block in _leaf_blocks(plan, i, positions, rows).items():
            out[p].append(block)
    return out


def unpack_pec(plan: PackPlan, owner: int, payloads: list[np.ndarray], gather: np.ndarray
               ) -> tuple[dict[int, list[np.ndarray | None]],
                          dict[int, dict[tuple[int, int], np.ndarray]]]:
    """The non-expert blocks and the carried experts of a PEC version.

    Args:
      plan: the PEC plan the payloads were packed with.
      owner: the host whose payloads these are.
      payloads: one uint8 [payload_bytes] array per device of ``owner``.
      gather: int32 [R, C] the version's gather indices (-1: an empty slot).

    Returns:
      ({position: [block of each leaf, None for expert leaves]},
       {position: {(leaf index, local expert j): the leaf's slice of expert j}}).
    """
    ep = plan.experts
    if ep is None:
        raise ValueError("unpack_pec needs a PEC plan; a full plan's payloads go to unpack")
    if gather.shape != (ep.ranks, ep.count):
        raise ValueError(f"gather indices of shape {gather.shape}, the plan carries "
                         f"{(ep.ranks, ep.count)}")
    positions, rows = _owner_rows(plan, owner, payloads)
    blocks: dict[int, list[np.ndarray | None]] = {p: [None] * len(plan.leaves) for p in positions}
    for i in range(len(plan.leaves)):
        if i not in ep.leaves:
            for p, block in _leaf_blocks(plan, i, positions, rows).items():
                blocks[p][i] = block
    return blocks, {p: _expert_slices(plan, positions, rows, p, gather) for p in positions}


def _expert_slices(plan: PackPlan, positions: list[int], rows: dict[int, np.ndarray], p: int,
                   gather: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    ep = plan.experts
    assert ep is not None
    members = sorted((q for q in positions if ep.expert_rank[q] == ep.expert_rank[p]),
                     key=lambda q: ep.member[q])
    raw = np.concatenate([rows[q][ep.offset: ep.offset + ep.segment] for q in members])
    records = raw[: ep.count * ep.record_bytes].reshape(ep.count, ep.record_bytes)
    out = {}
    for c, index in enumerate(gather[ep.expert_rank[p]]):
        if index < 0:
            continue
        layer, j = divmod(int(index), ep.local_experts)
        for n, i in enumerate(ep.leaves):
            if ep.layers[n] == layer:
                slot = plan.leaves[i]
                lo = ep.record_offsets[n]
                out[(i, j)] = records[c, lo: lo + ep.slice_bytes[n]].view(
                    np.dtype(slot.dtype)).reshape(slot.block_shape[1:])
    return out


def check_compatible(plan: PackPlan, leaves: list[dict[str, Any]]) -> None:
    """Raises ValueError naming the first leaf whose path, shape or dtype differ.

    Args:
      plan: the plan of the state being restored into.
      leaves: the leaf table stored with a checkpoint (PackPlan.leaf_table()).
    """
    ours = plan.leaf_table()
    for mine, theirs in zip(ours, leaves, strict=False):
        for field in ("path", "shape", "dtype"):
            if mine[field] != theirs[field]:
                raise ValueError(
                    f"checkpoint does not match the state at leaf {mine['path']}: "
                    f"{field} {theirs[field]} in the checkpoint, {mine[field]} in the state"
                )
    if len(ours) != len(leaves):
        extra = ours[len(leaves)] if len(ours) > len(leaves) else leaves[len(ours)]
        raise ValueError(f"checkpoint has {len(leaves)} leaves, the state {len(ours)}; first "
                         f"unmatched leaf: {extra['path']}")
