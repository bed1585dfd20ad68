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
"""

from __future__ import annotations

import dataclasses
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
    """

    leaves: tuple[LeafSlot, ...]
    chunk_bytes: int
    payload_bytes: int
    trailer_offset: int
    device_host: tuple[int, ...]
    ranks: tuple[tuple[int, ...], ...]
    block_keys: tuple[tuple[tuple, ...], ...]

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
        doc = {"leaves": [dataclasses.asdict(s) for s in self.leaves],
               "chunk": self.chunk_bytes, "hosts": self.device_host, "ranks": self.ranks}
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


def unpack(plan: PackPlan, owner: int, payloads: list[np.ndarray]) -> dict[int, list[np.ndarray]]:
    """The shard blocks of ``owner``'s devices from its device payloads.

    Args:
      plan: the layout the payloads were packed with.
      owner: the host whose payloads these are.
      payloads: one uint8 [payload_bytes] array per device of ``owner``, in
        local order.

    Returns:
      {mesh position: [block of each leaf]} for each of owner's devices.
    """
    positions = plan.host_positions(owner)
    if len(payloads) != len(positions):
        raise ValueError(f"host {owner} has {len(positions)} devices, got {len(payloads)} payloads")
    local = {p: j for j, p in enumerate(positions)}
    out: dict[int, list[np.ndarray]] = {p: [] for p in positions}
    for i, slot in enumerate(plan.leaves):
        cache: dict[tuple, np.ndarray] = {}
        for p in positions:
            key = plan.block_keys[i][p]
            if key not in cache:
                members = sorted((q for q in positions if plan.block_keys[i][q] == key),
                                 key=lambda q: plan.ranks[i][q])
                raw = np.concatenate([
                    payloads[local[q]][slot.offset: slot.offset + slot.segment] for q in members
                ])[: slot.block_bytes]
                cache[key] = raw.view(np.dtype(slot.dtype)).reshape(slot.block_shape)
            out[p].append(cache[key])
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
