"""Options of the in-memory tier, one frozen dataclass per concern.

Partial expert checkpointing has its own options (``selection.PecOptions``: K,
policy, PLT threshold); the in-memory tier turns it on through
``InMemoryOptions.pec``, the model's shape and tokens per step being given to
the checkpointer (they are the model's, not the tier's). Fault injection is
no option of a user's: tests pass a ``hooks.FaultHooks`` to the checkpointer.
"""

from __future__ import annotations

import dataclasses
import math

from capricorn_jax._src.memory.wire.host_arrays import check_host_memory_kind
from capricorn_jax._src.partial.selection import PecOptions

LOW_PRIORITY_TOS = 0x08
"""IP TOS "maximize throughput": Linux's pfifo_fast puts it in its last band,
behind the default class the training's collectives send in."""
CHUNK_SENDS = ("windows", "at_once")
"""How the scheduled strategies' threaded sender sends a version
(``InMemoryOptions.chunk_send``)."""


@dataclasses.dataclass(frozen=True)
class InMemoryOptions:
    """Where and how the in-memory tier keeps and replicates versions.

    Attributes:
      store_root: base directory in host RAM (tmpfs); each (job, host) gets
        ``store_root/job/host{h}``.
      job: the job's name; restarts of the same job find its versions.
      replicas: m, copies of each host's shards (own + m-1 peers).
      chunk_bytes: the store's and the transport's chunk: a payload moves as
        collective-permutes of this many bytes and is stored as chunk files
        of this size (it is part of a version's layout: a version saved with
        another chunk size is not read back). The scheduled strategies'
        chunk cap (the largest piece the partitioner places in one window,
        ``ScheduledTransfers(chunk_cap=...)``) is a separate setting.
      replication_timeout_s: a version whose replicas are not all confirmed
        this long after its save is reported under-replicated.
      writer_timeout_s: how long a save waits for the writer of the previous
        version before skipping this version (never an unbounded wait).
      max_wait_s: the cost budget: the longest a step waits for the tier.
        None (default): a version every step, a save waiting up to
        ``writer_timeout_s`` for the previous one. Set: when a host's writers
        were still busy with the previous version at the last save, every host
        skips the next version together (nothing packed, moved or written;
        the statuses still travel), and a save waits at most this long for
        its own writer before this host drops its copy. A version is never
        half written: each (owner, version) is whole or absent, and the safe
        version rule reads only versions every holder holds. The interval
        achieved is in each ``SaveReport``.
      pec: partial expert checkpointing (None: every version is the whole
        state, as without PEC); with it each version carries the non-expert
        state and K experts of every MoE layer (``InMemoryCheckpointer``).
      window: how many versions before the newest a host keeps, per owner,
        as candidates for the safe version while the writers of its holders
        lag (``retention.versions_to_keep``, with and without PEC); at least
        1, or a one-version lag between two holders would stall the safe
        version.
      host_memory_kind: where a version's payload goes when it leaves the
        device: "auto" (``pinned_host`` memory on accelerators that have it,
        a DMA at device-to-host bandwidth; on CPU the payload is already host
        memory, ``copy_to_host_async``), or an explicit memory kind.
      write_threads: chunk files of one version written in parallel (file
        writes and their CRC32 release the GIL).
      max_store_fraction: a slot grows only while the RAM disk holding
        ``store_root`` (every job's stores and anything else on it) stays
        at most this full; a slot that would grow past it, or past the RAM
        disk's free space, raises ``StoreFullError`` naming the command that
        lists and prunes stores. Checked when a slot grows only (a version's slot
        is reused afterwards). In (0, 1].
      arena_copy: how this host's own version reaches its slot
        (``pinned.arena_copier``): "auto" (accelerators: slots registered
        with the runtime, then an asynchronous copy straight into the slot
        where the backend allows it; CPU: as "off"), "off" (the writers copy
        from the host copy), or a path forced: "async_copy", "pinned_pool",
        "host_plain".
      chunk_tos: the IP TOS byte of the chunk channel's sockets (the
        threaded path): 0 leaves the default class; a low-priority class
        (e.g. ``LOW_PRIORITY_TOS``, 0x08: Linux's pfifo_fast puts it in its
        last band) lets the training's collectives pass the checkpoint's
        bytes where the network has classes (DESIGN.md: on real clusters
        DSCP with ETS on RoCE, an InfiniBand service level). The class says
        nothing of when the bytes go: ``chunk_send`` does.
      chunk_send: how the scheduled strategies' threaded sender sends a
        version (``CHUNK_SENDS``): "windows" holds its bytes to the planned
        idle windows of the step (a FIFO network: a chunk on the link delays
        a collective behind it); "at_once" sends every part at the step's
        start, in large frames, for a network whose classes let the
        collectives pass the checkpoint's bytes (``chunk_tos``).
        Measured (R 0.77, priority class): held to the windows, 6-7% of the
        version was still under way at the step's end (capricorn 1.10x,
        inmem 1.04x).
      chunk_pacing_gbps: the chunk channel's sending socket paced at this
        rate (Gbit/s of all of a host's rows; Linux ``SO_MAX_PACING_RATE``,
        TCP's own pacing): the kernel spaces the frames it holds at the
        link's rate instead of sending a congestion window's worth at once
        into a first-in-first-out queue the collectives share. None: not
        paced. Set it at (or just under) the link's measured rate.
      channel_secret_file: the file holding the job's secret, which the
        chunk channel's ends prove they know in their hello (the threaded
        path): read, or created when absent (random, mode 0600); one the
        group or others may read is refused. Every host must read the same
        secret (a shared workdir, or a file the cluster distributes). The
        environment wins over it: ``CAPRICORN_CHANNEL_SECRET`` (the secret)
        or ``CAPRICORN_CHANNEL_SECRET_FILE`` (a file, never created). None
        and no environment: the threaded path refuses to start, naming
        these (``multihost.secret``).
    """

    store_root: str
    job: str
    replicas: int = 2
    chunk_bytes: int = 4 << 20
    replication_timeout_s: float = 30.0
    writer_timeout_s: float = 60.0
    max_wait_s: float | None = None
    pec: PecOptions | None = None
    window: int = 1
    host_memory_kind: str = "auto"
    write_threads: int = 4
    max_store_fraction: float = 0.8
    arena_copy: str = "auto"
    chunk_tos: int = 0
    chunk_send: str = "windows"
    chunk_pacing_gbps: float | None = None
    channel_secret_file: str | None = None

    def __post_init__(self) -> None:
        if self.chunk_send not in CHUNK_SENDS:
            raise ValueError(f"chunk_send must be one of {CHUNK_SENDS}, got {self.chunk_send!r}")
        if self.chunk_pacing_gbps is not None and not 0 < self.chunk_pacing_gbps < math.inf:
            raise ValueError(f"chunk_pacing_gbps must be a rate > 0 (Gbit/s) or None, got "
                             f"{self.chunk_pacing_gbps}")
        if not 0 <= self.chunk_tos <= 255:
            raise ValueError(f"chunk_tos must be an IP TOS byte in [0, 255], got "
                             f"{self.chunk_tos}")
        if self.arena_copy not in ("auto", "off", "async_copy", "pinned_pool", "host_plain"):
            raise ValueError(f"arena_copy must be auto, off, async_copy, pinned_pool or "
                             f"host_plain, got {self.arena_copy!r}")
        if not 0 < self.max_store_fraction <= 1:
            raise ValueError(f"max_store_fraction must be in (0, 1], got "
                             f"{self.max_store_fraction}")
        check_host_memory_kind(self.host_memory_kind)
        if self.write_threads < 1:
            raise ValueError(f"write_threads must be >= 1, got {self.write_threads}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be >= 1024, got {self.chunk_bytes}")
        if not self.job or "/" in self.job:
            raise ValueError(f"job must be a non-empty name without '/', got {self.job!r}")
        if self.pec is not None and not isinstance(self.pec, PecOptions):
            raise ValueError(f"pec must be a PecOptions or None, got {self.pec!r}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.max_wait_s is not None and not 0 <= self.max_wait_s <= self.writer_timeout_s:
            raise ValueError(f"max_wait_s must be None or in [0, writer_timeout_s="
                             f"{self.writer_timeout_s}], got {self.max_wait_s}")
