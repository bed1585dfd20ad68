"""Moving payload chunks between hosts with collective-permutes in the training mesh.

``Transport.replicate`` is one jitted ``shard_map`` program over the whole
mesh that (1) packs every device's share of the state into its payload
(``packing``), (2) sends the payload to the peer device of each replication
round as ``num_chunks`` separate collective-permutes, one per chunk, and (3)
all-gathers each host's small status vector (the newest version it holds of
every owner), which is how owners learn that their replicas are in place. Its
outputs are fresh arrays, never the state's own buffers, so the next step may
donate the state while the host copies of these outputs are still being made.

Each chunk is checked end to end (``native.integrity``'s rule): before it
leaves, the sender computes its CRC32C (``integrity.crc32c_chunks``, inside
the program; one collective-permute carries every chunk's CRC of a round),
and after the receiver has it, the program computes it again over the bytes
as received; the program's fourth output says, per round, device and chunk,
whether they differ (a byte changed in transit). The replica writer stores
no version whose check failed (``writers``), so no holder commits it. The
check was a word sum and a position-weighted word sum (mod 2**32) until two
flipped top bits at word indices of the same parity were seen to cancel in
both; a CRC32C cost 2.6 ms against the sums' 1.5 ms per 2 MiB on this
project's CPU box (one core, jitted, best of 5).

``Transport.serve`` moves payloads read from a host store to the hosts that
need them during recovery, by the same collective-permutes.

With a PEC plan (``packing.make_pec_plan``) the program takes one more
input, the version's gather indices [R, C] (replicated, traced), and packs
only the selected experts' records: a new selection with the same C runs the
same compiled program.

Choice: XLA collectives over the training mesh, not ``jax.experimental.transfer``
(a side channel with its own server per process). The collective is the link
the expert all-to-all uses, which is the interference Capricorn schedules
around, and a chunk's collective-permute can later be placed at a layer
boundary inside the step. The cost: every host takes part in each transfer
call, in the same order, from its main thread.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from capricorn_jax._src.memory.wire.packing import PackPlan
from capricorn_jax._src.native.integrity import crc32c_chunks


def _linear_index(mesh: Mesh) -> jax.Array:
    index = jnp.int32(0)
    for name in mesh.axis_names:
        index = index * mesh.shape[name] + jax.lax.axis_index(name)
    return index


def _as_bytes(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if x.dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def device_perm(plan: PackPlan, host_perm: dict[int, int]) -> tuple[tuple[int, int], ...]:
    """Host-level (src -> dst) pairs to device-level pairs: local device j -> j."""
    pairs: list[tuple[int, int]] = []
    for src, dst in sorted(host_perm.items()):
        src_pos, dst_pos = plan.host_positions(src), plan.host_positions(dst)
        if len(src_pos) != len(dst_pos):
            raise ValueError(f"hosts {src} and {dst} have different device counts")
        pairs.extend(zip(src_pos, dst_pos, strict=True))
    return tuple(pairs)


class Transport:
    """Packs, replicates and serves checkpoint payloads over ``mesh``.

    Args:
      plan: the payload layout.
      mesh: the training mesh (all devices of all hosts).
      state_shardings: the state's NamedShardings (pytree).
      rounds: the replication rounds, host -> peer maps (placement.send_rounds).
      status_len: entries of each host's status vector.
      flip_input: fault injection (tests, the chaos harness): ``replicate``
        takes a byte that is XORed into the middle of each device's first
        chunk after its sums were taken (a byte corrupted in transit).
    """

    def __init__(self, plan: PackPlan, mesh: Mesh, state_shardings: Any,
                 rounds: list[dict[int, int]], status_len: int, flip_input: bool = False):
        self.plan, self.mesh, self.status_len = plan, mesh, status_len
        self.flip_input = flip_input
        self._state_shardings, self._rounds = state_shardings, rounds
        self.axes = tuple(mesh.axis_names)
        self.rows = NamedSharding(mesh, P(self.axes))
        self.perms = [device_perm(plan, r) for r in rounds]
        self.replicated = NamedSharding(mesh, P())
        specs = jax.tree.map(lambda s: s.spec, state_shardings)
        body = functools.partial(self._replicate_body, treedef=jax.tree.structure(specs))
        gather_spec = (P(),) if plan.experts is not None else ()
        flip_spec = (P(self.axes),) if flip_input else ()
        mapped = jax.shard_map(
            body, mesh=mesh,
            in_specs=(jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
                      P(self.axes), P(self.axes), *flip_spec, *gather_spec),
            out_specs=(P(self.axes), [P(self.axes)] * len(self.perms), P(),
                       [P(self.axes)] * len(self.perms)),
            check_vma=False,  # the all-gathered statuses are replicated by construction
        )
        self._replicate = jax.jit(lambda leaves, trailer, status, *rest: mapped(
            leaves, trailer, status, *rest))
        self._serve: dict[tuple, Any] = {}
        self._gather: Any = None  # compiled at the first gather_status

    def for_plan(self, plan: PackPlan) -> Transport:
        """A transport of ``plan`` over the same mesh, state and rounds (e.g.
        the plan of a PEC version with fewer records per device)."""
        return Transport(plan, self.mesh, self._state_shardings, self._rounds, self.status_len,
                         self.flip_input)

    def pack_local(self, leaves: list[jax.Array], trailer: jax.Array,
                   gather: jax.Array | None = None) -> jax.Array:
        """Inside a shard_map over the whole mesh: this device's payload.

        Args:
          leaves: this device's blocks of the state leaves.
          trailer: this device's trailer bytes.
          gather: int32 [R, C] gather indices (PEC plans only, replicated).
        """
        plan = self.plan
        if (gather is None) != (plan.experts is None):
            raise ValueError("gather indices are required by a PEC plan and only by one")
        lin = _linear_index(self.mesh)
        parts = []
        for slot, ranks, x in zip(plan.leaves, plan.ranks, leaves, strict=True):
            if plan.experts is not None and slot.segment == 0:
                continue  # an expert leaf: its records follow
            flat = _as_bytes(x)
            need = (max(ranks) + 1) * slot.segment
            flat = jnp.pad(flat, (0, max(0, need - flat.shape[0])))
            start = jnp.asarray(ranks, jnp.int32)[lin] * slot.segment
            parts.append(jax.lax.dynamic_slice(flat, (start,), (slot.segment,)))
        if gather is not None:
            parts.append(self._pack_experts(leaves, gather, lin))
        parts.append(trailer.reshape(-1))
        return jnp.concatenate(parts)

    def _pack_experts(self, leaves: list[jax.Array], gather: jax.Array,
                      lin: jax.Array) -> jax.Array:
        """This device's share of its selected experts' records (packing doc)."""
        ep = self.plan.experts
        assert ep is not None
        row = gather[jnp.asarray(ep.expert_rank, jnp.int32)[lin]]  # [C], -1: empty slot
        layer_of = jnp.where(row >= 0, row // ep.local_experts, -1)
        out = jnp.zeros((ep.count, ep.record_bytes), jnp.uint8)
        for layer in range(ep.num_layers):
            cols = [_as_bytes(leaves[i]).reshape(ep.local_experts, -1)
                    for i, at in zip(ep.leaves, ep.layers, strict=True) if at == layer]
            if not cols:
                continue
            rec = jnp.concatenate(cols, axis=1)
            rec = jnp.pad(rec, ((0, 0), (0, ep.record_bytes - rec.shape[1])))
            local = jnp.clip(row - layer * ep.local_experts, 0, ep.local_experts - 1)
            out = jnp.where((layer_of == layer)[:, None], jnp.take(rec, local, axis=0), out)
        flat = out.reshape(-1)
        need = (max(ep.member) + 1) * ep.segment
        flat = jnp.pad(flat, (0, max(0, need - flat.shape[0])))
        start = jnp.asarray(ep.member, jnp.int32)[lin] * ep.segment
        return jax.lax.dynamic_slice(flat, (start,), (ep.segment,))

    def permute(self, x: jax.Array, perm: tuple[tuple[int, int], ...]) -> jax.Array:
        """Inside a shard_map over the whole mesh: ``x`` sent along ``perm``
        (every path's bytes between devices go here: this exchange, the
        serve rounds, ``executor.InStepSender``; a test's corrupting
        transport overrides it)."""
        return jax.lax.ppermute(x, self.axes, perm)

    def _send(self, payload: jax.Array, perm: tuple[tuple[int, int], ...]) -> jax.Array:
        chunks = []
        for k in range(self.plan.num_chunks):
            lo, hi = self.plan.chunk_range(k)
            chunks.append(self.permute(payload[lo:hi], perm))
        return jnp.concatenate(chunks)

    def _send_checked(self, payload: jax.Array, perm: tuple[tuple[int, int], ...],
                      flip: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """``_send`` with each chunk checked end to end: (the received payload,
        bool [num_chunks]: whether a received chunk's CRC32C differs from the
        one its sender computed before it left)."""
        sent = crc32c_chunks(payload, self.plan.chunk_bytes)
        if flip is not None:  # fault injection: after the CRC, before the send
            lo, hi = self.plan.chunk_range(0)
            mid = lo + (hi - lo) // 2
            payload = payload.at[mid].set(payload[mid] ^ flip.reshape(()))
        received = self._send(payload, perm)
        sent = self.permute(sent, perm)
        return received, crc32c_chunks(received, self.plan.chunk_bytes) != sent

    def _replicate_body(self, leaves, trailer, status, *rest, treedef):
        del treedef
        flip, gather = (rest[0], rest[1:]) if self.flip_input else (None, rest)
        payload = self.pack_local(leaves, trailer, *gather)
        moved = [self._send_checked(payload, perm, flip) for perm in self.perms]
        statuses = jax.lax.all_gather(status, self.axes, tiled=True)
        return (payload[None], [r[None] for r, _ in moved], statuses,
                [bad[None] for _, bad in moved])

    def gather_status(self, status: np.ndarray) -> jax.Array:
        """All-gathers each host's status vector alone (used with scheduled steps)."""
        if self._gather is None:
            self._gather = jax.jit(jax.shard_map(
                lambda x: jax.lax.all_gather(x, self.axes, tiled=True), mesh=self.mesh,
                in_specs=P(self.axes), out_specs=P(), check_vma=False))
        return self._gather(self._rows(status, np.int32))

    def rows_of(self, per_host_row: np.ndarray, dtype) -> jax.Array:
        return self._rows(per_host_row, dtype)

    def _rows(self, per_host_row: np.ndarray, dtype) -> jax.Array:
        """A [devices, n] array whose rows on this process's devices are ``per_host_row``."""
        local = np.broadcast_to(per_host_row.astype(dtype), (jax.local_device_count(),
                                                              per_host_row.shape[-1]))
        return jax.make_array_from_process_local_data(self.rows, np.ascontiguousarray(local))

    def replicate(self, state: Any, trailer: np.ndarray, status: np.ndarray,
                  gather: np.ndarray | None = None, flip: int = 0):
        """Dispatches pack + replication of ``state``; returns device arrays.

        Args:
          state: the train state (global arrays in the plan's shardings).
          trailer: this host's trailer bytes (encode_trailer).
          status: this host's status vector.
          gather: int32 [R, C] gather indices of a PEC version (PEC plans
            only; every host passes the same).
          flip: fault injection (``flip_input`` transports only): this host's
            byte XORed into each of its devices' first chunk in transit.

        Returns:
          (own [devices, payload] uint8, [received per round], statuses
          [devices, status_len] int32, [corrupt per round]: bool [devices,
          num_chunks], a received chunk that failed its end-to-end check):
          own, received and corrupt rows live on each host's devices;
          statuses is replicated.
        """
        args = [jax.tree.leaves(state), self._rows(trailer, np.uint8), self._rows(status, np.int32)]
        if self.flip_input:
            args.append(self._rows(np.array([flip]), np.uint8))
        elif flip:
            raise ValueError("flip needs a transport built with flip_input=True")
        ep = self.plan.experts
        if (gather is None) != (ep is None):
            raise ValueError("gather indices are required by a PEC plan and only by one")
        if gather is not None:
            assert ep is not None  # checked just above
            if gather.shape != (ep.ranks, ep.count):
                raise ValueError(f"gather indices of shape {gather.shape}, the plan carries "
                                 f"{(ep.ranks, ep.count)}")
            args.append(self.gather_input(gather))
        return self._replicate(*args)

    def gather_input(self, gather: np.ndarray) -> jax.Array:
        """A PEC version's gather indices (the same on every host) as the
        replicated input of a program: from this process's copy, with no
        cross-host check (``jax.device_put`` of a host array onto a sharding
        over every process runs ``multihost_utils.assert_equal``, a collective
        and a host sync on the caller's thread; measured ~1.7 ms per save in
        the emulated bench: pec's pack 4.1 -> 2.3 ms)."""
        return jax.make_array_from_process_local_data(self.replicated,
                                                      np.ascontiguousarray(gather, np.int32))

    def serve(self, payloads: dict[int, np.ndarray], host_perm: dict[int, int]) -> jax.Array:
        """Sends payload rows between hosts (recovery from a peer's replica).

        Args:
          payloads: {local device index: uint8 [payload_bytes]} this host sends
            (missing rows are zeros).
          host_perm: {server host: receiving host}; every host passes the same.

        Returns:
          [devices, payload_bytes] uint8; the rows on a receiving host's
          devices are what its server sent.
        """
        perm = device_perm(self.plan, host_perm)
        if perm not in self._serve:
            mapped = jax.shard_map(
                lambda x: self._send(x[0], perm)[None], mesh=self.mesh,
                in_specs=P(self.axes), out_specs=P(self.axes),
            )
            self._serve[perm] = jax.jit(mapped)
        rows = np.zeros((jax.local_device_count(), self.plan.payload_bytes), np.uint8)
        for j, row in payloads.items():
            rows[j] = row
        return self._serve[perm](jax.make_array_from_process_local_data(self.rows, rows))


def local_rows(array: jax.Array, copy: bool = True) -> list[np.ndarray]:
    """This process's rows of a [devices, n] array, in local device order:
    copies, or with ``copy=False`` read-only views of the device buffers where
    the backend allows (CPU, host memory), valid while ``array`` lives: a
    writer that copies the rows into its store anyway saves a copy of the
    version (on this box ~0.8 ms per MB, BUILD_NOTES "Where the CPU goes")."""
    mesh = array.sharding.mesh  # type: ignore[attr-defined]  # the rows' NamedSharding
    position = {d: p for p, d in enumerate(mesh.devices.flat)}
    rows = sorted((position[s.device], s) for s in array.addressable_shards)
    read = np.array if copy else np.asarray
    return [read(s.data)[0] for _, s in rows]


def pack_payload(transport: Transport, state_specs: list, state: Any, trailer: jax.Array,
                 *gather: jax.Array) -> jax.Array:
    """Version ``state`` packed into its payload [devices, bytes] (traceable,
    no collective): each device packs its shards (``gather``: a PEC plan's
    int32 [R, C] indices, replicated; ``state_specs``: the leaves' specs).
    Both chunk paths pack a version so: the in-graph executor inside the
    step, the threaded path in a program of its own before it."""
    return jax.shard_map(
        lambda leaves, t, *g: transport.pack_local(leaves, t[0], *g)[None],
        mesh=transport.mesh,
        in_specs=(state_specs, P(transport.axes), *(P() for _ in gather)),
        out_specs=P(transport.axes),
    )(jax.tree.leaves(state), trailer, *gather)
