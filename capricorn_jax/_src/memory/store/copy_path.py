"""The choice of the copy path into the arena, and the copies it makes: pure.

``choose_copy_path`` names the fastest of ``COPY_PATHS`` that the backend's
capabilities (``BackendCaps``, probed by ``pinned.probe_backend``) allow, with
the reason, or refuses a forced one naming what is missing; ``row_copies``
lists the byte ranges each copy moves. See ``pinned`` for the paths.

Design choice: the decisions apart from the mappings, registrations and CUDA
calls that carry them out (``pinned``), so they are tested on any machine
with no device. Alternative not taken: one module for both, past the size a
reader can hold.
"""

from __future__ import annotations

import dataclasses
import logging

log = logging.getLogger("capricorn_jax")

COPY_PATHS = ("aliased_output", "async_copy", "pinned_pool", "host_plain")


@dataclasses.dataclass(frozen=True)
class BackendCaps:
    """What the backend offers a copy into the arena (``probe_backend``).

    Attributes:
      platform: "cpu", "gpu", ...
      pinned_host: the device has a ``pinned_host`` memory.
      dma_map: "ok" (a region was registered), "unimplemented" (the client
        refused: CPU), "failed" (the runtime returned another error: logged)
        or "absent" (no ``Client.dma_map`` in this jaxlib).
      dlpack_pinned: a ``kDLCUDAHost`` view imports as a ``pinned_host`` array
        at the slot's own address.
      alias_checked: the step program's donated slot view came back as its
        output at the slot's address (a run-time check; False until made).
      cudart: libcudart loads (``cudaMemcpyAsync`` is callable).
    """

    platform: str
    pinned_host: bool = False
    dma_map: str = "absent"
    dlpack_pinned: bool = False
    alias_checked: bool = False
    cudart: bool = False


@dataclasses.dataclass(frozen=True)
class CopyPath:
    """The copy path chosen (one of COPY_PATHS) and why."""

    kind: str
    reason: str


def choose_copy_path(caps: BackendCaps, prefer: str = "auto") -> CopyPath:
    """The fastest copy path ``caps`` allows (pure; module docstring).

    Args:
      caps: the backend's capabilities.
      prefer: "auto", or one of COPY_PATHS to force (an error if ``caps``
        does not allow it).

    Raises:
      ValueError: ``prefer`` is unknown or not possible on ``caps`` (naming why).
    """
    if prefer != "auto" and prefer not in COPY_PATHS:
        raise ValueError(f"copy path must be auto or one of {COPY_PATHS}, got {prefer!r}")
    feasible: dict[str, str] = {}
    missing: dict[str, str] = {}
    if caps.platform == "cpu":
        feasible["host_plain"] = "cpu: device memory is host memory, one copy per row"
        for k in COPY_PATHS[:3]:
            missing[k] = "the platform is cpu (no device-to-host DMA)"
    else:
        missing["host_plain"] = f"platform {caps.platform}: rows are not host memory"
        registered = caps.dma_map == "ok"
        why_not = f"slots not registered with the runtime (dma_map: {caps.dma_map})"
        if not registered:
            missing["aliased_output"] = missing["async_copy"] = why_not
        elif not caps.dlpack_pinned:
            missing["aliased_output"] = "no pinned_host view of a slot through dlpack"
        elif not caps.alias_checked:
            missing["aliased_output"] = "the step's output did not alias the slot view"
        else:
            feasible["aliased_output"] = "registered slot viewed as pinned_host, aliased output"
        if registered and caps.cudart:
            feasible["async_copy"] = "registered slot, cudaMemcpyAsync on a side stream"
        elif registered:
            missing["async_copy"] = "libcudart not loadable"
        if caps.pinned_host:
            feasible["pinned_pool"] = "device_put to pinned_host, then one host memcpy"
        else:
            missing["pinned_pool"] = "no pinned_host memory on the device"
    if prefer != "auto":
        if prefer not in feasible:
            raise ValueError(f"copy path {prefer!r} is not possible here: {missing[prefer]}")
        return CopyPath(prefer, "forced: " + feasible[prefer])
    for kind in COPY_PATHS:
        if kind in feasible:
            skipped = [f"{k}: {missing[k]}" for k in COPY_PATHS[:COPY_PATHS.index(kind)]]
            reason = feasible[kind] + (f" (not {'; '.join(skipped)})" if skipped else "")
            return CopyPath(kind, reason)
    return CopyPath("pinned_pool", "no path fits; device_put to the default memory, then a "
                    "host memcpy (" + "; ".join(f"{k}: {v}" for k, v in missing.items()) + ")")


def log_choice(path: CopyPath, caps: BackendCaps) -> str:
    """Logs the choice in one line; returns the line."""
    line = f"checkpoint copy path: {path.kind} on {caps.platform}: {path.reason}"
    log.info(line)
    return line


def row_copies(rows: int, payload_bytes: int, max_copy_bytes: int,
               row_stride: int | None = None) -> list[tuple[int, int, int, int]]:
    """The copies that move ``rows`` payload rows into a slot.

    Args:
      rows: local device rows.
      payload_bytes: bytes of one row.
      max_copy_bytes: the largest copy (> 0).
      row_stride: where row j starts in the slot (j * row_stride); default
        ``payload_bytes`` (rows back to back, as the checkpointer writes).

    Returns:
      (row, lo, hi, slot_offset) per copy: row ``row``'s bytes [lo, hi) go to
      ``slot_offset``; every byte of every row once, in order, each copy at
      most ``max_copy_bytes`` and a row split into equal parts (the fewest).
    """
    if rows < 0 or payload_bytes < 0 or max_copy_bytes <= 0:
        raise ValueError(f"row_copies({rows}, {payload_bytes}, {max_copy_bytes}): need rows, "
                         f"payload_bytes >= 0 and max_copy_bytes > 0")
    stride = payload_bytes if row_stride is None else row_stride
    if stride < payload_bytes:
        raise ValueError(f"row_stride {stride} < payload_bytes {payload_bytes}: rows overlap")
    out = []
    parts = max(1, -(-payload_bytes // max_copy_bytes))
    size = -(-payload_bytes // parts) if payload_bytes else 0
    for j in range(rows):
        for lo in range(0, payload_bytes, size or 1):
            hi = min(lo + size, payload_bytes)
            out.append((j, lo, hi, j * stride + lo))
    return out
