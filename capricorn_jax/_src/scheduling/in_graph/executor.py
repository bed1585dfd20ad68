"""The in-step transfer executor: checkpoint chunks sent at layer boundaries.

A ``Schedule`` (partitioner) assigns byte ranges of each device's payload to
the idle windows of the step. ``InStepSender`` turns it into a variant of the
jitted train step in which each chunk's collective-permute sits at the layer
boundary that opens its window:

* window (block_i, fwd) opens at the forward boundary after block i-1 (block 0's
  at the start of the step); (head, fwd) at the last forward boundary;
* window (block_i, bwd) opens at block i's backward boundary; (tail, bwd) at
  block 0's backward boundary; the schedule's tail is sent after the update.

Placement is by data dependency, not by wall clock: before its
collective-permute a chunk gets ``(v > +inf)`` added, v one element of the
boundary's activation (forward) or cotangent (backward): always 0, so the bytes
are unchanged, but XLA cannot start the permute before the layer is done.
(Measured: with ``lax.optimization_barrier`` as the only tie, XLA CPU hoisted
every permute to the start of the step.) The version sent is the state the
step starts from (version t while step t+1 runs). Forward receptions leave the
differentiated function as auxiliary outputs; a backward reception leaves it as
the cotangent of a zero "carrier" input of the boundary's ``custom_vjp``
identity (bytes viewed as float32; the cotangent is returned unchanged).

The reception tie bounds the other end: the receptions of a window are tied,
by the same kind of always-false flag (``jnp.where``, exact bits), into the
activation (forward) or cotangent (backward) at the boundary that closes the
window, so the layer after it cannot start before they arrive. Measured on an
sm_90 compile without a GPU (``tests/test_hlo_schedule_cuda.py``): without it
XLA:GPU issued every window's permute after the backward all-to-alls, start
and done back to back (no overlap); with it each one is in flight while its
window's layer computes (``hlo_schedule.check_windows``).

With a window clock (``window_clock.WindowClock``, capricorn's spill signal)
the step also carries unordered per-device marks: one on the activation or
cotangent of each site that opens or closes a filled window, taken before
the reception tie and the window's permutes, and one on each filled
window's receptions; without one the program has no callback.

Every byte it moves follows ``native.integrity``'s rule: ``begin`` takes
the CRC32C of each device's packed payload before any chunk leaves,
``finish`` sends it to the peer with the tail (through the transport's
``permute``, as every chunk) and computes the CRC32C of the received
payload as assembled from its pieces, whose ranges must be the schedule's;
the step's ``corrupt`` output (bool [devices, 1]) says whether the two
differ, and the writer stores no replica whose check failed, so no holder
commits that version (``strategies.scheduled``). One CRC per payload, not
per chunk: a version is committed whole or not at all, and one tree per
payload keeps the program small. A test runs this path on CPU with a
transport whose ``permute`` corrupts what it carries.

Alternative not taken here: a host thread that sends chunks through
``jax.experimental.transfer`` when the profile says a window opens. It needs no
recompilation per schedule, but its timing is a guess from the host clock and
its bytes leave the link the all-to-all uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from capricorn_jax._src.memory.wire.transport import Transport, pack_payload
from capricorn_jax._src.native.integrity import crc32c_rows
from capricorn_jax._src.profiling.boundary import boundary_hooks
from capricorn_jax._src.scheduling.plan.partitioner import Schedule
from capricorn_jax._src.scheduling.plan.sites import AFTER, START, Site, site_of

if TYPE_CHECKING:
    from capricorn_jax._src.profiling.train_step import TrainStep


class SiteClock(Protocol):
    """The window clock's side the executor calls (``window_clock.WindowClock``):
    site marks on primal values and done marks on a window's receptions."""

    def sites(self, schedule: Schedule) -> frozenset[Site]: ...

    def mark_site(self, x: Any, site: Site) -> Any: ...

    def mark_done(self, chunks: list[jax.Array], site: Site) -> list[jax.Array]: ...


@dataclasses.dataclass
class _Ctx:
    payload: jax.Array  # [devices, payload_bytes] uint8, this step's version
    crc: jax.Array  # [devices, 1] uint32: each payload's CRC32C, before any chunk left
    chunks: dict[Site, list[tuple[int, int]]]
    carriers: list[jax.Array]  # one zero float32 row block per backward chunk
    start_received: list[tuple[tuple[int, int], jax.Array]]


class InStepSender:
    """Sends a Schedule's chunks inside the train step (see module docstring).

    Args:
      transport: packs the payload (its plan) and knows the mesh.
      state_shardings: the train state's NamedShardings.
      schedule: byte ranges of the payload per window, plus the tail.
      boundaries: the model's boundary names in forward order.
      round_index: which replication round (peer) the chunks go to.
      clock: a ``window_clock.WindowClock`` whose marks time each filled
        window (its sites and its receptions' arrival); None: no marks.
    """

    def __init__(self, transport: Transport, state_shardings: Any, schedule: Schedule,
                 boundaries: list[str], round_index: int = 0, tie_receptions: bool = True,
                 clock: SiteClock | None = None):
        if schedule.payload_bytes != transport.plan.payload_bytes:
            raise ValueError(f"schedule covers {schedule.payload_bytes} bytes, the payload has "
                             f"{transport.plan.payload_bytes}")
        spans = [f"{w.name}/{w.direction}@{w.edge}" for w in schedule.windows if w.edge]
        if spans:
            raise ValueError(f"the in-graph path places chunks at layer boundaries; the span "
                             f"windows {spans[:3]} open at collective edges (the threaded path's)")
        self.transport, self.schedule, self.boundaries = transport, schedule, boundaries
        self.tie_receptions = tie_receptions
        self.clock = clock
        self.marked = clock.sites(schedule) if clock is not None else frozenset()
        self.state_specs = [s.spec for s in jax.tree.leaves(state_shardings)]
        self.perm = transport.perms[round_index]
        self.axes = transport.axes
        self.sites: dict[Site, list[tuple[int, int]]] = {}
        for window, chunks in zip(schedule.windows, schedule.chunks, strict=True):
            site = site_of(window, boundaries)
            self.sites.setdefault(site, []).extend((c.start, c.stop) for c in chunks)
        tail = [(c.start, c.stop) for c in schedule.tail]
        if tail:
            self.sites.setdefault(AFTER, []).extend(tail)
        self.bwd_chunks = [r for site, rs in sorted(self.sites.items())
                           if site[1] == "bwd" and site != AFTER for r in rs]

    # --- collectives, each inside a shard_map over the whole mesh ---
    def _permute(self, chunk: jax.Array, tie: jax.Array | None) -> jax.Array:
        """chunk [devices, n] uint8 -> the peer's chunk; after ``tie`` is computed."""
        spec = P(self.axes)

        def body(c, t=None):
            if t is not None:
                # A true data dependency that leaves the bytes as they are:
                # nothing compares greater than +inf, so the flag is always 0,
                # but XLA cannot know it before the layer output exists.
                probe = t.reshape(-1)[:64].astype(jnp.float32)
                flag = (jnp.max(probe) > jnp.inf).astype(c.dtype)
                c = c + flag
            return self.transport.permute(c, self.perm)

        if tie is None:
            return jax.shard_map(body, mesh=self.transport.mesh, in_specs=spec,
                                 out_specs=spec)(chunk)
        return jax.shard_map(body, mesh=self.transport.mesh, in_specs=(spec, spec),
                             out_specs=spec)(chunk, tie)

    # --- the protocol TrainStep.step_with_sender calls ---
    @property
    def pec(self) -> bool:
        """Whether the payload is a PEC version's (packing takes gather indices)."""
        return self.transport.plan.experts is not None

    def begin(self, state: Any, trailer: jax.Array, *gather: jax.Array) -> _Ctx:
        """Packs the version (``gather``: a PEC plan's int32 [R, C] indices,
        replicated) and sends the chunks of the step's start."""
        transport = self.transport
        if len(gather) != int(self.pec):
            raise ValueError(f"{len(gather)} gather arrays for a "
                             f"{'PEC' if self.pec else 'full'} payload")
        payload = pack_payload(transport, self.state_specs, state, trailer, *gather)
        crc = self._crc(payload)  # before any chunk leaves
        if START in self.marked:
            payload = self._mark(payload, START)
        ranges = self.sites.get(START, [])
        start = list(zip(ranges, self._done([self._permute(payload[:, lo:hi], None)
                                             for lo, hi in ranges], START), strict=True))
        carriers = [jnp.zeros((payload.shape[0], -(-(hi - lo) // 4)), jnp.float32)
                    for lo, hi in self.bwd_chunks]
        return _Ctx(payload, crc, self.sites, carriers, start)

    def _crc(self, payload: jax.Array) -> jax.Array:
        """Each device's payload's CRC32C, [devices, 1] uint32."""
        spec = P(self.axes)
        return jax.shard_map(lambda x: crc32c_rows(x)[:, None], mesh=self.transport.mesh,
                             in_specs=spec, out_specs=spec)(payload)

    def _tie_receptions(self, x: jax.Array, chunks: list[jax.Array]) -> jax.Array:
        """``x`` unchanged, but computed only once ``chunks`` have arrived: the
        layer after this boundary waits for the window's receptions, so XLA
        cannot defer them past it (the reception tie; ``where`` on a flag that
        is always False returns ``x`` bit for bit, -0.0 included)."""
        spec = P(self.axes)

        def body(y, *cs):
            probe = jnp.concatenate([c.reshape(-1)[:64] for c in cs]).astype(jnp.float32)
            return jnp.where(jnp.max(probe) > jnp.inf, -y, y)

        return jax.shard_map(body, mesh=self.transport.mesh, in_specs=(spec,) * (1 + len(chunks)),
                             out_specs=spec)(x, *chunks)

    def _mark(self, x: Any, site: Site) -> Any:
        """``x`` tied to ``site``'s clock mark (primal values only)."""
        assert self.clock is not None
        return self.clock.mark_site(x, site)

    def _mark_differentiable(self, x: Any, site: Site) -> Any:
        """``x`` tied to ``site``'s clock mark inside the differentiated
        forward: an identity whose backward passes the cotangent through."""
        @jax.custom_vjp
        def ident(y):
            return self._mark(y, site)

        def fwd(y):
            return self._mark(y, site), None

        def bwd(_, g):
            return (g,)

        ident.defvjp(fwd, bwd)
        return ident(x)

    def _done(self, chunks: list[jax.Array], site: Site) -> list[jax.Array]:
        """The window's receptions tied to its clock's done mark (no clock or
        no chunks: unchanged). They carry no gradient: the stop only makes it
        explicit to the differentiation around the forward ones."""
        if self.clock is None or not chunks:
            return chunks
        return self.clock.mark_done([jax.lax.stop_gradient(c) for c in chunks], site)

    def hooks(self, ctx: _Ctx, carriers: list[jax.Array], received: list) -> tuple:
        bwd_index = {r: i for i, r in enumerate(self.bwd_chunks)}
        # Receptions of the window the next forward boundary closes (measured on
        # an sm_90 compile: without this tie XLA:GPU issued every forward
        # window's permute after the backward all-to-alls, start and done together).
        pending = [r for _, r in ctx.start_received]
        bwd_pending: list[list[jax.Array]] = [[]]  # the same, backward (the vjp rules)

        def hook(x, name):
            nonlocal pending
            if (name, "fwd") in self.marked:  # the layer is done: before the tie
                x = self._mark_differentiable(x, (name, "fwd"))
            if pending and self.tie_receptions:
                x = self._tie_receptions(x, pending)
            ranges = ctx.chunks.get((name, "fwd"), [])
            pending = self._done([self._permute(ctx.payload[:, lo:hi], x) for lo, hi in ranges],
                                 (name, "fwd"))
            received.extend(zip(ranges, pending, strict=True))
            bwd = ctx.chunks.get((name, "bwd"), [])
            if (bwd or (self.tie_receptions and self.bwd_chunks)
                    or (name, "bwd") in self.marked):
                # Every boundary gets the identity once backward chunks exist:
                # one without chunks still ties the previous window's receptions
                # (or carries the clock's mark of a window it closes).
                x = self._bwd_identity(ctx, bwd_pending, bwd, name)(
                    x, [carriers[bwd_index[r]] for r in bwd])
            return x

        return (hook,)

    def _bwd_identity(self, ctx: _Ctx, pending: list[list[jax.Array]],
                      ranges: list[tuple[int, int]], name: str):
        """The boundary's identity whose backward ties the receptions of the
        window opened at the previous backward boundary (``pending[0]``) into
        the cotangent, then sends this boundary's chunks (``ranges``)."""
        @jax.custom_vjp
        def ident(x, carriers):
            return x

        def fwd(x, carriers):
            return x, None

        def bwd(_, g):
            if (name, "bwd") in self.marked:  # the layer's backward is done: before the tie
                g = self._mark(g, (name, "bwd"))
            if pending[0] and self.tie_receptions:
                g = self._tie_receptions(g, pending[0])
            cts = []
            pending[0] = self._done([self._permute(ctx.payload[:, lo:hi], g)
                                     for lo, hi in ranges], (name, "bwd"))
            for (lo, hi), recv in zip(ranges, pending[0], strict=True):
                pad = -(-(hi - lo) // 4) * 4 - (hi - lo)
                recv = jnp.pad(recv, ((0, 0), (0, pad)))
                cts.append(jax.lax.bitcast_convert_type(
                    recv.reshape(recv.shape[0], -1, 4), jnp.float32))
            return g, cts

        ident.defvjp(fwd, bwd)
        return ident

    def finish(self, ctx: _Ctx, received: list, carrier_cts: list) -> dict[str, jax.Array]:
        pieces = list(ctx.start_received) + list(received)
        for (lo, hi), ct in zip(self.bwd_chunks, carrier_cts, strict=True):
            raw = jax.lax.bitcast_convert_type(ct, jnp.uint8).reshape(ct.shape[0], -1)
            pieces.append(((lo, hi), raw[:, : hi - lo]))
        # The tail goes after the backward pass: tied to every reception so far.
        tie = jnp.concatenate([p[:, :1] for _, p in pieces], axis=1) if pieces else None
        for lo, hi in ctx.chunks.get(AFTER, []):
            pieces.append(((lo, hi), self._permute(ctx.payload[:, lo:hi], tie)))
        pieces.sort(key=lambda p: p[0][0])
        got = [r for r, _ in pieces]
        expect = sorted(r for rs in self.sites.values() for r in rs)
        if got != expect:
            raise RuntimeError(f"chunks received {got} differ from those scheduled {expect}")
        peer = jnp.concatenate([p for _, p in pieces], axis=1)
        # The sender's CRC, after every chunk (tied to each reception, the tail's too).
        sent = self._permute(ctx.crc, jnp.concatenate([p[:, :1] for _, p in pieces], axis=1))
        return {"own": ctx.payload, "received": peer, "corrupt": self._crc(peer) != sent}


def scheduled_step(trainer: TrainStep, sender: InStepSender, factors: tuple[float, ...],
                   hooks: tuple = ()) -> Callable[..., tuple[Any, dict, dict[str, jax.Array]]]:
    """The jitted train step that also moves the schedule's chunks.

    ``hooks``: boundary hooks attached around the whole step besides the
    sender's (e.g. a CollectiveProbe timing the all-to-alls under the chunks'
    traffic); they come first at every boundary.

    Returns:
      (state, batch, trailer[, gather]) -> (new state, metrics, {"own",
      "received", "corrupt"}), the state donated; "own" is this step's input
      version packed, "received" the peer's payload of the same version, both
      [devices, payload_bytes]; "corrupt" bool [devices, 1]: the received
      payload's CRC32C differs from the one its sender took; ``gather`` (PEC
      payloads only): the version's int32 [R, C] gather indices, a traced
      input (one compile per plan).
    """
    rows = NamedSharding(trainer.mesh, P(sender.axes))
    gather = (trainer.replicated,) if sender.pec else ()

    def body(s, b, t, *g):
        with boundary_hooks(*hooks):
            return trainer.step_with_sender(s, b, tuple(factors), sender, t, *g)

    return jax.jit(
        body,
        in_shardings=(trainer.state_shardings, trainer.batch_sharding, rows, *gather),
        out_shardings=(trainer.state_shardings, trainer.replicated,
                       {"own": rows, "received": rows, "corrupt": rows}),
        donate_argnums=(0,),
    )
