"""A host's copy of the state as JAX arrays: where it lives, and the global
arrays built from its blocks.

* ``host_memory_kind``: the memory kind a host copy goes to when it leaves
  the device (the in-memory tier's payloads) or is handed to Orbax (the
  persistent tier's blocks): ``pinned_host`` on accelerators that have it (a
  DMA at device-to-host bandwidth), None where the device's own memory is
  host memory (CPU) or no pinned memory exists;
* ``global_arrays``: the global arrays whose shards on this host's devices
  are given blocks (numpy), in the state's shardings, used by recovery (the
  restored state) and by the persistent tier (the arrays Orbax writes,
  wrapping the blocks read from the host store without a copy on CPU).

Design choice: one function per question for both tiers, so that a memory
kind the in-memory tier uses is the one the persistent tier hands to Orbax.
Alternative not taken: each tier resolving "auto" itself, which had let an
explicit "device" mean the default memory in one and a named memory kind in
the other.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the options check the kinds without JAX
    from jax.sharding import Mesh

log = logging.getLogger("capricorn_jax")

HOST_MEMORY_KINDS = ("auto", "pinned_host", "unpinned_host", "device")


def check_host_memory_kind(kind: str) -> None:
    """Raises ValueError naming ``kind`` unless it is one of HOST_MEMORY_KINDS."""
    if kind not in HOST_MEMORY_KINDS:
        raise ValueError(f"host_memory_kind must be auto, pinned_host, unpinned_host or "
                         f"device, got {kind!r}")


def host_memory_kind(kind: str, device: Any) -> str | None:
    """The memory kind a host copy goes to on ``device``'s platform.

    Args:
      kind: "auto", or an explicit "pinned_host" / "unpinned_host" / "device".
      device: a device of the mesh.

    Returns:
      None for the device's own (default) memory: "device", and "auto" on
      CPU (whose device memory is host memory: ``copy_to_host_async``) or on
      an accelerator without ``pinned_host`` memory (logged); else the kind
      ("auto": "pinned_host").
    """
    check_host_memory_kind(kind)
    if kind != "auto":
        return None if kind == "device" else kind
    if device.platform == "cpu":
        return None
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" in kinds:
        return "pinned_host"
    log.warning("%s has no pinned_host memory; host copies go through the device's own memory",
                device.platform)
    return None


def global_arrays(blocks: dict[int, list[np.ndarray]], abstract: Any, shardings: Any,
                  mesh: Mesh, memory_kind: str | None = None,
                  shapes: list[tuple[int, ...]] | None = None) -> Any:
    """Global arrays from the blocks of this process's devices.

    Args:
      blocks: {mesh position: [block of each leaf]} for this host's devices
        (``packing.unpack``'s layout).
      abstract: the state's pytree (leaves with .shape).
      shardings: the matching shardings.
      mesh: the mesh the positions index.
      memory_kind: where the arrays live (``host_memory_kind``); None: the
        devices' default memory.
      shapes: the global shape of each leaf, when not ``abstract``'s (a
        persisted step that carries some experts only).

    Returns:
      ``abstract``'s pytree of ``jax.Array``s.
    """
    import jax
    from jax.sharding import SingleDeviceSharding

    devices = list(mesh.devices.flat)
    leaves, treedef = jax.tree.flatten(abstract)
    out = []
    for i, (leaf, sharding) in enumerate(zip(leaves, jax.tree.leaves(shardings), strict=True)):
        shape = leaf.shape if shapes is None else shapes[i]
        if memory_kind is not None:
            sharding = sharding.with_memory_kind(memory_kind)
        arrays = [jax.device_put(blocks[p][i], SingleDeviceSharding(devices[p],
                                                                    memory_kind=memory_kind))
                  for p in sorted(blocks)]
        out.append(jax.make_array_from_single_device_arrays(shape, sharding, arrays))
    return jax.tree.unflatten(treedef, out)
