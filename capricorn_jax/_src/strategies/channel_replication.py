"""``inmem`` and ``pec`` over the threaded chunk channel: one transport per comparison.

On CPU the scheduled strategies (``strategies.scheduled``, ``chunk_path=
"threaded"``) move their chunks over a TCP channel to the peer, outside the
XLA program (``scheduling.threaded``), while ``inmem`` and ``pec`` replicate
in the jitted pack + exchange program over gloo. The two paths do not carry
bytes at the same rate (measured on the shaped links of this project: the
channel ~0.77 Gbit/s per direction, the gloo exchange 0.42-0.52), so a
comparison of the two families would measure the transport as much as the
schedule. This strategy moves ``inmem``'s and ``pec``'s versions over the
same channel, with the schedule the scheduled strategies would have without
a profile: the whole version in one go, sent as soon as it is packed.

Per save of version t:

* version t is packed by a jitted program (no collective; dispatched
  asynchronously, it reads ``state`` before the next step may donate it), and
  handed to the sender thread, which sends it when the pack is done. PEC:
  the version is decided now (K experts per layer) and only its payload
  moves;
* then the deferred version t-1 (packed and handed to the sender at the
  previous save) is committed: the peer's payload is taken from the channel
  (normally long complete: it had a whole step to travel) and
  ``InMemoryCheckpointer.save_transferred`` hands both payloads to the
  writers, with the save's status round (every host's status vector
  all-gathered) run inside version t's pack program rather than as a
  program of its own. (Committing first, measured: the pack's dispatch took
  7.0 ms of the save's 9.3 ms, behind the writers just woken.)

So the training thread dispatches, and never waits for the network unless a
version takes longer than a step to travel. A version is therefore committed
one save later than the in-graph path commits it; ``finish`` moves and
commits the last version at once.

Design choice: a strategy of its own on the strategies' floor, composed of the
memory tier's checkpointer and the scheduling floor's sender, so the
checkpointer keeps one transport (the in-graph one) and knows nothing of
sockets. Alternative not taken: a transport switch inside
``InMemoryCheckpointer.save``: the memory floor would import the scheduling
floor, an upward arrow (tests/test_layering.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
import socket
import struct
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from capricorn_jax._src.memory.tier.pec_tier import PecVersion
from capricorn_jax._src.memory.tier.writer_door import TierWriter
from capricorn_jax._src.memory.wire.transport import Transport, pack_payload
from capricorn_jax._src.multihost.agree import shared_digest
from capricorn_jax._src.multihost.client import distributed_client
from capricorn_jax._src.multihost.secret import resolve_secret
from capricorn_jax._src.scheduling.plan.partitioner import LinkModel, Schedule, partition
from capricorn_jax._src.scheduling.threaded.chunk_channel import ChunkChannel
from capricorn_jax._src.scheduling.threaded.sender import ThreadedSender, pack_program
from capricorn_jax._src.scheduling.threaded.versions import VersionDropped
from capricorn_jax._src.strategies.base import CheckpointEvent, HostState, State, TrainStep
from capricorn_jax._src.strategies.channel_loss import ChannelKeeper
from capricorn_jax._src.strategies.inmemory import InMemoryStrategy
from capricorn_jax._src.strategies.shared_identity import tier_parts

_channels = itertools.count()  # channel keys: strategies are built in the same order on every host
_InFlight = tuple[int, jax.Array, PecVersion | None]
"""A version handed to the sender and not committed yet: (version, own payload, PEC version)."""
_NO_LINK = LinkModel(0.0, 1.0)
"""The whole-version schedule has no window to fit: its link model is never read."""

log = logging.getLogger(__name__)


def peer_channel(ckpt: TierWriter, job: str | None = None, faults: bool = True
                 ) -> ChunkChannel:
    """The chunk channel to the peer of ``ckpt``'s replication round 0 (and
    from its source): every host builds its channels in the same order.
    ``job``: its key (default: the next of the job's channels; a reconnect
    passes the lost one's with its attempt); ``faults``: with the
    checkpointer's channel fault hooks (a reconnect's channel has none: the
    one-shot faults struck the first). Its ends prove the job's secret
    (``multihost.secret``: the environment's, else the options' file) and
    state the tier's shared digest (``strategies.shared_identity``) with
    the channel's key in their hello."""
    client = distributed_client()
    if client is None:
        raise RuntimeError("chunk_path='threaded' connects the hosts' processes: it needs "
                           "jax.distributed.initialize (or chunk_path='in_graph')")
    destination = ckpt.rounds[0][ckpt.host]
    source = next(h for h, d in ckpt.rounds[0].items() if d == ckpt.host)
    key = job or f"{ckpt.options.job}/{next(_channels)}"
    shared = shared_digest({**tier_parts(ckpt), "channel": key})
    channel = ChunkChannel(ckpt.host, destination, source, key, client,
                           ckpt.options.replication_timeout_s * 4, tos=ckpt.options.chunk_tos,
                           secret=resolve_secret(ckpt.options.channel_secret_file),
                           shared=shared)
    if ckpt.options.chunk_pacing_gbps is not None:
        pace(channel.out, ckpt.options.chunk_pacing_gbps)
    if faults:
        channel.flip_version, channel.on_flip = ckpt.hooks.flip_frame_at, ckpt.hooks.on_flip
        channel.stall_at, channel.on_stall = ckpt.hooks.stall_channel_at, ckpt.hooks.on_stall
    return channel


SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
"""Linux's socket option (asm-generic/socket.h: 47; Python names it on few builds)."""


def pace(sock: socket.socket, gbps: float) -> None:
    """Paces what ``sock`` sends at ``gbps`` (``InMemoryOptions.chunk_pacing_gbps``:
    TCP's own pacing, no qdisc needed); raises naming the option where the
    kernel has no pacing."""
    rate = int(gbps * 1e9 / 8)  # bytes per second
    # An unsigned long, as the kernel takes and returns it whole: an int
    # option is 32 bits (a 100 Gbit/s link's 12.5e9 B/s would not fit).
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=Q", rate))
    except OSError as e:
        raise OSError(f"chunk_pacing_gbps={gbps:g}: this kernel cannot pace a socket "
                      f"(SO_MAX_PACING_RATE: {e})") from e
    taken = struct.unpack("=Q", sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8))[0]
    if taken != rate:
        raise OSError(f"chunk_pacing_gbps={gbps:g}: the socket did not take the rate "
                      f"{rate} B/s")


def channel_keeper(ckpt: TierWriter, sender: ThreadedSender) -> ChannelKeeper:
    """The lost-channel rule of ``sender`` (``strategies.channel_loss``): a
    reconnect builds a channel to the same peers under the first one's key
    and the attempt's number."""
    base = sender.channel.job
    return ChannelKeeper(ckpt, sender,
                         lambda attempt: peer_channel(ckpt, f"{base}/r{attempt}", faults=False))


def whole_version(payload_bytes: int, chunk_cap: int) -> Schedule:
    """The schedule that sends a payload at once: no window, every chunk in
    the tail (``ThreadedSender`` sends the tail without waiting for a mark)."""
    return partition(payload_bytes, (), _NO_LINK, chunk_cap)


def _pack_with_status(transport: Transport, specs: list, state: Any, trailer: jax.Array,
                      status: jax.Array, *gather: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The version's payload and every host's status vector all-gathered
    (``Transport.gather_status``'s round), in one program."""
    own = pack_payload(transport, specs, state, trailer, *gather)
    statuses = jax.shard_map(lambda x: jax.lax.all_gather(x, transport.axes, tiled=True),
                             mesh=transport.mesh, in_specs=P(transport.axes), out_specs=P(),
                             check_vma=False)(status)
    return own, statuses


class ChannelReplication(InMemoryStrategy):
    """``inmem`` / ``pec`` replicating over the threaded chunk channel (see
    the module docstring).

    Args:
      checkpointer: the host's memory tier (``TierWriter``), one peer replica (its
        PEC options make this ``pec``).
      train: the caller's TrainStep (its state shardings and mesh).
      name: the strategy's name in events and reports.
      chunk_cap: the largest frame the sender hands the channel, bytes.
      channel: the connections to the peer (default: ``peer_channel``).
    """

    def __init__(self, checkpointer: TierWriter, train: TrainStep,
                 name: str = "inmem", chunk_cap: int = 1 << 20,
                 channel: ChunkChannel | None = None) -> None:
        if len(checkpointer.sources) != 1:
            raise ValueError(f"{name} over the chunk channel sends one peer replica; it needs "
                             f"replicas=2, got {len(checkpointer.sources) + 1}")
        super().__init__(checkpointer, name)
        self.train, self.chunk_cap = train, chunk_cap
        channel = channel or peer_channel(checkpointer)
        self.sender = ThreadedSender(channel, train.boundaries, jax.local_device_count(),
                                     train.mesh, channel.timeout_s)
        self.keeper = channel_keeper(checkpointer, self.sender)
        # transport id -> (pack program, pack + status round program,
        # whole-version schedule, the transport: kept so that its id is not
        # reused while the entry lives)
        self._programs: dict[int, tuple[Any, Any, Schedule, Transport]] = {}
        # The version handed to the sender and not committed yet.
        self._inflight: _InFlight | None = None

    def _program(self, transport: Transport) -> tuple[Any, Any, Schedule]:
        key = id(transport)
        if key not in self._programs:
            specs = [s.spec for s in jax.tree.leaves(self.train.state_shardings)]
            self._programs[key] = (
                pack_program(transport, self.train.state_shardings),
                jax.jit(functools.partial(_pack_with_status, transport, specs)),
                whole_version(transport.plan.payload_bytes, self.chunk_cap), transport)
        pack, pack_status, schedule, _ = self._programs[key]
        return pack, pack_status, schedule

    def _commit(self, inflight: _InFlight | None,
                status_round: tuple[Any, Any] | None = None) -> list[CheckpointEvent]:
        """Commits a version sent earlier once the peer's payload is in
        (``status_round``: its save's round, already run with the pack)."""
        if inflight is None:
            return []
        version, own, pec_version = inflight
        try:
            with self.ckpt.clock.phase("peer_wait"):
                received = self.keeper.wait(version)  # [local devices, bytes]; bounded
        except VersionDropped as e:  # no version here, the job goes on
            log.warning("%s; host %d takes no version %d", e, self.ckpt.host, version)
            report = self.ckpt.drop(version, status_round=status_round, corrupt=e.corrupt)
        except Exception as e:
            if not self.keeper.is_loss(e):
                raise
            report = self.ckpt.drop(version, status_round=status_round, corrupt=False)
            return [{**self._event(version, report), "channel_lost": True}]
        else:
            report = self.ckpt.save_transferred(version, own, [received], version=pec_version,
                                                status_round=status_round)
        event = self._event(version, report)
        if report.corrupt:
            event["corrupt"] = True
        event["chunk_times_s"] = {k: round(v, 4) for k, v in self.sender.last_times.items()}
        return [event]

    def save(self, step: int, state: State, host_state: HostState, *,
             tokens_per_expert: np.ndarray | None = None,
             next_step_profiled: bool = False) -> list[CheckpointEvent]:
        """Sends version ``step``, then commits the previous one.

        The pack is dispatched before the commit wakes the writers (whose
        threads then compete with the dispatch for the interpreter), and the
        commit's status round runs inside the pack's program (one dispatch,
        one program on the devices, instead of two); the sender starts a
        status round earlier. Versions are still committed once each, in
        version order.

        Returns:
          The ``checkpoint`` event of the version committed now (the previous
          save's), if any.
        """
        previous, round_ = self._inflight, None
        if self.keeper.down(step):  # every host alike: no version moves until it is back
            return self._save_while_down(step, tokens_per_expert)
        self.keeper.note()
        gather: tuple[jax.Array, ...] = ()
        pec_version, transport = None, self.ckpt.transport
        if self.ckpt.pec is not None:
            pec_version = self.ckpt.plan_pec_version(step, tokens_per_expert)
            transport = pec_version.transport
        if previous is not None:  # the same on every host: the collectives match
            round_ = self.ckpt.begin_round()
        with self.ckpt.clock.phase("pack"):
            if pec_version is not None and pec_version.gather is not None:
                gather = (transport.gather_input(pec_version.gather),)
            pack, pack_status, schedule = self._program(transport)
            trailer = self.ckpt.trailer_rows(host_state)
            if round_ is None:
                own = pack(state, trailer, *gather)
            else:
                status = self.ckpt.transport.rows_of(round_[1], np.int32)
                own, statuses = pack_status(state, trailer, status, *gather)
        with self.ckpt.clock.phase("send_handoff"):
            self.sender.start(step, own, schedule)
        self._inflight = (step, own, pec_version)
        return self._commit(previous, None if round_ is None else (round_[0], statuses))

    def _save_while_down(self, step: int, tokens_per_expert: np.ndarray | None
                         ) -> list[CheckpointEvent]:
        """A save while the hosts agree the channel is lost: the version in
        flight is abandoned, the channel reconnects when the backoff says so
        (``ChannelKeeper.while_down``), and version ``step`` is not taken."""
        self._inflight = None
        return self.keeper.skip_save(step, self._event, tokens_per_expert)

    def finish(self, step: int, state: State, host_state: HostState) -> list[CheckpointEvent]:
        """Commits the version in flight (the loop's last ``save`` sent the
        final version, so nothing is left behind); with the channel lost on
        some host, it is abandoned on every host."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None and self.keeper.down(step):
            lost = self.sender.abandon()
            self.ckpt.note_lost(lost)
            return [{"version": v, "skipped": True, "channel_lost": True} for v in lost]
        return self._commit(inflight)

    def close(self) -> None:
        self.sender.close()
        super().close()
