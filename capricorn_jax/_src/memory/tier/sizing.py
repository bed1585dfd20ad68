"""What the memory tier needs of a host, and a preflight that refuses too little.

Why. The memory tier's slots grow on the RAM disk as versions arrive; on a
tmpfs too small for them the first versions fail one by one, minutes into
training, and a host short of process memory fails the first persistent
save (its host copy) or is killed by the kernel. Orbax's emergency-manager
users report exactly this (saves taking several times the state, OOMs).
Said before the first step, with the numbers, it is a configuration error.

What. ``memory_needs`` is the arithmetic of ``docs/guide.md`` section 5 over
an abstract state and its shardings: each host's bytes (its distinct
shards), the RAM disk's share (``replicas`` owners held per host, ``window``
+ 2 slots each: the newest stored, the safe one and ``window`` after it; PEC
needs more, see the guide) and the process memory of a persistent save (the
host copy it writes from: measured 1.1-1.4x the host's state, so 1.5x here).
``preflight`` compares them with the RAM disk holding ``store_root`` (its
free bytes plus what this job's store already holds, within the store's
``max_store_fraction`` bound) and with the host's available memory, and
raises ``HostMemoryTooSmall`` naming every number.

Alternative not taken: letting the store's own growth check (``StoreLimit``)
refuse the first slot that does not fit: correct but late, and it cannot
speak for the versions that come after.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax

from capricorn_jax._src.memory.store.store_admin import mib, ram_disk
from capricorn_jax._src.memory.store.store_lifecycle import tree_bytes

PERSIST_COPY = 1.5
"""The persistent save's process memory over the host's state bytes."""


class HostMemoryTooSmall(MemoryError):
    """The RAM disk or the host's memory cannot hold what the memory tier needs."""


@dataclasses.dataclass(frozen=True)
class MemoryNeeds:
    """One host's needs (the largest host's, when they differ).

    Attributes:
      host_state_bytes: the host's distinct shards of the state.
      slots_per_owner: versions kept per owner (``window`` + 2).
      owners: owners a host holds versions of (``replicas``).
      ram_disk_bytes: the store on the RAM disk.
      process_bytes: a persistent save's host copy.
    """

    host_state_bytes: int
    slots_per_owner: int
    owners: int
    ram_disk_bytes: int
    process_bytes: int

    def describe(self) -> str:
        return (f"{mib(self.ram_disk_bytes)} on the RAM disk ({self.owners} owner(s) x "
                f"{self.slots_per_owner} versions x {mib(self.host_state_bytes)} of a host's "
                f"shards) and {mib(self.process_bytes)} of process memory for a persistent "
                f"save's host copy")


def host_state_bytes(abstract_state: Any, shardings: Any, devices_of_host: Any = None) -> int:
    """The largest host's bytes of ``abstract_state`` under ``shardings``: per
    leaf the distinct shards its devices hold (a replicated leaf once)."""
    per_host: dict[int, int] = {}
    for leaf, sharding in zip(jax.tree.leaves(abstract_state), jax.tree.leaves(shardings),
                              strict=True):
        shape = tuple(leaf.shape)
        itemsize = jax.numpy.dtype(leaf.dtype).itemsize
        seen: dict[int, set[tuple]] = {}
        for device, index in sharding.devices_indices_map(shape).items():
            host = device.process_index if devices_of_host is None else devices_of_host(device)
            key = tuple((s.start, s.stop) for s in index)
            if key in seen.setdefault(host, set()):
                continue
            seen[host].add(key)
            count = 1
            for s, dim in zip(index, shape, strict=True):
                count *= len(range(*s.indices(dim)))
            per_host[host] = per_host.get(host, 0) + count * itemsize
    return max(per_host.values(), default=0)


def memory_needs(abstract_state: Any, shardings: Any, replicas: int, window: int = 1,
                 devices_of_host: Any = None) -> MemoryNeeds:
    """What the memory tier needs of each host (module docstring)."""
    state = host_state_bytes(abstract_state, shardings, devices_of_host)
    slots = window + 2
    return MemoryNeeds(state, slots, replicas, replicas * slots * state,
                       int(PERSIST_COPY * state))


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def preflight(needs: MemoryNeeds, store_root: str | os.PathLike, job_root: str | os.PathLike,
              max_store_fraction: float) -> None:
    """Raises ``HostMemoryTooSmall`` when the RAM disk holding ``store_root``
    (with what ``job_root``, this job's store, already holds) or the host's
    available memory is smaller than ``needs``."""
    disk, size, free = ram_disk(store_root)
    held = tree_bytes(job_root)
    bound = int(max_store_fraction * size)
    room = min(free + held, bound)
    if needs.ram_disk_bytes > room:
        raise HostMemoryTooSmall(
            f"the memory tier needs {needs.describe()}; the RAM disk {disk} holding "
            f"{store_root} has {mib(size)}, {mib(free)} free (+{mib(held)} this job holds), and "
            f"the store may use {max_store_fraction:g} of it ({mib(bound)}): room for "
            f"{mib(room)}. Give the RAM disk more (e.g. mount -o remount,size=... on a tmpfs), "
            f"use fewer replicas, or partial expert checkpointing (PecOptions)")
    available = _available_memory()
    if available is not None and needs.process_bytes > available:
        raise HostMemoryTooSmall(
            f"the memory tier needs {needs.describe()}; this host has {mib(available)} of "
            f"memory available")
