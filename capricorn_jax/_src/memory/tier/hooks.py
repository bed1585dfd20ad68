"""Fault injection points of the in-memory tier: for tests and the chaos
harness only.

The launcher's fault plans stall a replica writer (a peer that stops
answering) and kill a host halfway through the replicas of a version. The
tier reaches both through a ``FaultHooks`` the caller passes to
``InMemoryCheckpointer(..., hooks=...)``; a user's ``InMemoryOptions`` holds
only what a user sets, and nothing is patched onto the checkpointer.

Design choice: one typed, frozen object at construction, so the points where
a fault can strike are listed in one place and a production checkpointer
(``hooks=None``) has none. Alternative not taken (the previous state): the
fault fields in ``InMemoryOptions`` and an ``on_pause`` attribute the
launcher assigned after construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class FaultHooks:
    """Test-only fault injection for one host's checkpointer.

    Attributes:
      stall_replica_writer_at: (step, seconds): the replica writer sleeps
        this long before writing the replicas of version ``step``.
      pause_mid_replication_at: at this version the replica writer stops
        halfway through its chunks and calls ``on_pause`` (when that
        version's replicas are dropped because the writer is busy, the save
        calls it instead: the host is lost while it drops them). Needs
        ``on_pause``.
      on_pause: called with the version at the pause (e.g. to kill the
        process there).
      flip_frame_at: the chunk channel (``chunk_path='threaded'``) flips one
        byte of the first frame it sends of this version or a later one
        (the first it moves on the channel), after the frame's checksum was
        computed: a byte corrupted in transit, which the peer's check must
        catch.
      on_flip: called with that version when the byte is flipped.
      flip_exchange_at: the in-graph exchange (``InMemoryCheckpointer.save``
        over the training mesh's collectives) flips one byte of each of
        this host's devices' first chunk of the first version it exchanges
        at or after this one, after the chunk's sums were taken (a byte
        corrupted in transit on the collectives' path); ``on_flip`` too.
      stall_channel_at: (version, seconds): the chunk channel stops sending
        for this long before the first frame of this version or a later one
        (a connection that hangs: past the channel's timeout, the hosts
        declare it lost and reconnect).
      on_stall: called with that version when the stall begins.
      on_serve: called with the version on a host about to serve a peer's
        payload in a recovery's serve round (e.g. to kill the process there).
      flip_serve: in each serve round this host serves, its first this many
        tries flip one byte of the first row it sends, after the row's
        checksum was taken (bytes corrupted in transit; the receiver's check
        fails and the round is served again: ``recovery.SERVE_ATTEMPTS``).
    """

    stall_replica_writer_at: tuple[int, float] | None = None
    pause_mid_replication_at: int | None = None
    on_pause: Callable[[int], None] | None = None
    flip_frame_at: int | None = None
    on_flip: Callable[[int], None] | None = None
    flip_exchange_at: int | None = None
    stall_channel_at: tuple[int, float] | None = None
    on_stall: Callable[[int], None] | None = None
    on_serve: Callable[[int], None] | None = None
    flip_serve: int = 0

    def __post_init__(self) -> None:
        if self.flip_serve < 0:
            raise ValueError(f"flip_serve must be >= 0, got {self.flip_serve}")
        stall = self.stall_replica_writer_at
        if stall is not None and (len(stall) != 2 or stall[1] < 0):
            raise ValueError(f"stall_replica_writer_at must be (step, seconds >= 0), got {stall!r}")
        channel = self.stall_channel_at
        if channel is not None and (len(channel) != 2 or channel[1] < 0):
            raise ValueError(f"stall_channel_at must be (version, seconds >= 0), got {channel!r}")
        if self.pause_mid_replication_at is not None and self.on_pause is None:
            raise ValueError(f"pause_mid_replication_at={self.pause_mid_replication_at} needs "
                             f"on_pause (what happens at the pause)")

    def pauses_at(self, step: int) -> bool:
        """Whether the writer pauses halfway through version ``step``."""
        return self.on_pause is not None and self.pause_mid_replication_at == step


NO_FAULTS = FaultHooks()
"""A checkpointer's hooks when the caller passes none."""
