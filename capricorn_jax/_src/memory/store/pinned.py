"""The device-to-host copy into the arena: registered slots and the copy path.

A version's payload rows (one per local device, the leaves packed back to back
on the device by ``Transport.pack_local``) must reach the host store's slot
with no host memcpy. Three parts:

* ``SlotRegistry.map_file`` maps a slot file at a 2 MiB-aligned address, its
  length rounded up to 2 MiB, with ``madvise(MADV_HUGEPAGE)`` where the
  kernel's transparent huge pages allow it for that mapping (``hugepage_modes``:
  anonymous memory and shmem are separate switches; a tmpfs slot gets huge
  pages only with ``shmem_enabled`` at ``advise`` or above). ``register``
  registers a mapping with the GPU runtime once (``Client.dma_map(addr, size)``,
  jaxlib 0.10), so device-to-host DMA lands in it directly; the cost is timed.
* ``choose_copy_path`` (module ``copy_path``, with ``row_copies``): a pure
  decision over the backend's capabilities (``BackendCaps``, probed by
  ``probe_backend``) naming one of

  - ``aliased_output``: the slot is viewed as a ``pinned_host`` array
    (``jax.dlpack.from_dlpack`` of a ``kDLCUDAHost`` view) and written by the
    step program as an aliased (donated) output: no copy outside the program;
  - ``async_copy``: ``cudaMemcpyAsync`` from the device buffer into the
    registered slot on a side stream (libcudart through ctypes), the device
    array kept alive until the copy's event completes;
  - ``pinned_pool``: ``jax.device_put`` to ``pinned_host`` (one DMA into XLA's
    pool), then one host memcpy into the slot: the path before this module;
  - ``host_plain``: CPU, whose device memory is host memory: one
    ``numpy.copyto`` per row from the device buffer's zero-copy view.

  The choice is logged once, in one line, with its reason (``log_choice``).
* ``row_copies``: the byte ranges each copy moves (every byte of every row
  exactly once, each copy at most ``max_copy_bytes`` so a writer can checksum
  a copy while the next one runs, and each as large as that allows).

Alternative not taken: registering XLA's own pinned pool and reading versions
from it, which keeps one extra copy of the state in pinned memory per version
in flight and still needs a copy into the arena that survives the process.
Not verifiable without a GPU: whether the runtime honours the donation of an
externally owned ``pinned_host`` buffer (on CPU an imported buffer is not
aliased: measured, the output got a fresh buffer), hence the run-time check
of the slot's address against the output's (``zero_copy``).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import dataclasses
import logging
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from capricorn_jax._src.memory.store.copy_path import (
    BackendCaps,
    CopyPath,
    choose_copy_path,
    log_choice,
    row_copies,
)

log = logging.getLogger("capricorn_jax")

HUGE_PAGE = 2 << 20
_THP = Path("/sys/kernel/mm/transparent_hugepage")
_MADV_HUGEPAGE = 14
_MAP_FAILED = ctypes.c_void_p(-1).value


def align_up(n: int, alignment: int = HUGE_PAGE) -> int:
    """``n`` rounded up to a multiple of ``alignment`` (a power of two)."""
    if n < 0 or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"align_up({n}, {alignment}): need n >= 0 and a power-of-two alignment")
    return (n + alignment - 1) & ~(alignment - 1)


def _selected(text: str) -> str | None:
    """The bracketed word of a sysfs switch ("always [madvise] never" -> "madvise")."""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def hugepage_modes(root: str | os.PathLike = _THP) -> dict[str, str | None]:
    """{"anon": mode, "shmem": mode} of transparent huge pages (None: no such switch)."""
    out: dict[str, str | None] = {}
    for key, name in (("anon", "enabled"), ("shmem", "shmem_enabled")):
        try:
            out[key] = _selected((Path(root) / name).read_text())
        except OSError:
            out[key] = None
    return out


def wants_madvise(mode: str | None, shared: bool) -> bool:
    """Whether ``madvise(MADV_HUGEPAGE)`` gives a mapping huge pages: anonymous
    memory under "always"/"madvise", shmem (tmpfs slots) under "always",
    "within_size", "advise" or "force"."""
    ok = ("always", "within_size", "advise", "force") if shared else ("always", "madvise")
    return mode in ok


# ----------------------------------------------------------------- mapping
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


class AlignedMapping:
    """A file mapped shared at a ``HUGE_PAGE``-aligned address (``SlotRegistry.map_file``).

    Attributes:
      address: the mapping's first byte (a multiple of HUGE_PAGE).
      size: its length (a multiple of HUGE_PAGE).
      view: a uint8 numpy view of the whole mapping.
      huge: whether ``madvise(MADV_HUGEPAGE)`` was applied and accepted.
    """

    def __init__(self, libc: ctypes.CDLL, address: int, size: int, huge: bool):
        self._libc, self.address, self.size, self.huge = libc, address, size, huge
        self.view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))
        self.registered = False

    def close(self) -> None:
        """Unmaps (the caller drops every view first: they point into the mapping)."""
        if self.size:
            self.view = np.zeros(0, np.uint8)
            self._libc.munmap(self.address, self.size)
            self.size = 0


class SlotRegistry:
    """Maps slot files 2 MiB-aligned and registers them with the GPU runtime once.

    Args:
      client: the backend's client (``jax.devices()[0].client``); None: no
        registration (mapping only).
      thp_root: the transparent-huge-page sysfs folder (tests point it elsewhere).

    ``registration_s`` and ``registered_bytes`` add up what ``register`` cost.
    """

    def __init__(self, client: Any = None, thp_root: str | os.PathLike = _THP):
        self.client = client
        self.modes = hugepage_modes(thp_root)
        self._libc = _libc()
        self.registration_s = 0.0
        self.registered_bytes = 0
        self.dma_map = "absent" if client is None or not hasattr(client, "dma_map") else "ok"
        self._mappings: list[AlignedMapping] = []

    def map_file(self, fd: int, nbytes: int) -> AlignedMapping:
        """Maps ``align_up(nbytes)`` bytes of file ``fd`` (already that long) shared,
        at a HUGE_PAGE-aligned address; advises huge pages where they apply."""
        size = align_up(max(nbytes, 1))
        if os.fstat(fd).st_size < size:
            raise ValueError(f"file of {os.fstat(fd).st_size} bytes; the mapping needs {size}: "
                             f"grow it to align_up(nbytes) first")
        libc = self._libc
        prot_rw, prot_none = mmap.PROT_READ | mmap.PROT_WRITE, 0
        anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        # Reserve size + one huge page, then map the file over its aligned part.
        base = libc.mmap(None, size + HUGE_PAGE, prot_none, anon, -1, 0)
        if base in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap reserve of {size + HUGE_PAGE} bytes failed")
        aligned = align_up(base)
        addr = libc.mmap(aligned, size, prot_rw, mmap.MAP_SHARED | 0x10, fd, 0)  # MAP_FIXED
        if addr in (None, _MAP_FAILED) or addr != aligned:
            err = ctypes.get_errno()
            libc.munmap(base, size + HUGE_PAGE)
            raise OSError(err, f"mmap of {size} bytes at {aligned:#x} failed")
        if aligned > base:
            libc.munmap(base, aligned - base)
        tail = base + size + HUGE_PAGE - (aligned + size)
        if tail:
            libc.munmap(aligned + size, tail)
        huge = False
        if wants_madvise(self.modes.get("shmem"), shared=True):
            huge = libc.madvise(aligned, size, _MADV_HUGEPAGE) == 0
        mapping = AlignedMapping(libc, aligned, size, huge)
        self._mappings.append(mapping)
        return mapping

    def probe(self) -> str:
        """Registers and unregisters a scratch huge page once, so ``dma_map``
        says whether registration works here before any slot exists."""
        if self.dma_map != "ok":
            return self.dma_map
        scratch = mmap.mmap(-1, HUGE_PAGE)
        view = np.frombuffer(scratch, np.uint8)
        try:
            self.client.dma_map(view.ctypes.data, HUGE_PAGE)
            self.client.dma_unmap(view.ctypes.data)
        except Exception as e:  # noqa: BLE001 - jaxlib raises JaxRuntimeError
            self._refused(e)
        finally:
            del view
            scratch.close()
        return self.dma_map

    def register(self, mapping: AlignedMapping) -> bool:
        """Registers ``mapping`` with the runtime (once); False where the client
        cannot (``dma_map`` absent, unimplemented or failed: ``_refused``)."""
        if mapping.registered:
            return True
        if self.dma_map != "ok":
            return False
        t0 = time.perf_counter()
        try:
            self.client.dma_map(mapping.address, mapping.size)
        except Exception as e:  # noqa: BLE001 - jaxlib raises JaxRuntimeError
            self._refused(e)
            return False
        self.registration_s += time.perf_counter() - t0
        self.registered_bytes += mapping.size
        mapping.registered = True
        return True

    def _refused(self, error: Exception) -> None:
        """A registration failed: "unimplemented" (the platform has none, CPU)
        or "failed" (logged with the runtime's error); no slot is registered
        after it, and the copy path falls back to one needing none. A failure
        costs speed, never the checkpoint, hence no exception."""
        if "UNIMPLEMENTED" in str(error):
            self.dma_map = "unimplemented"
            return
        self.dma_map = "failed"
        log.warning("registering a store slot with the runtime failed (%s); slots stay "
                    "unregistered", str(error)[:300])

    def unregister(self, mapping: AlignedMapping) -> None:
        """Undoes ``register`` (before unmapping)."""
        if mapping.registered:
            self.client.dma_unmap(mapping.address)
            mapping.registered = False

    def close(self) -> None:
        """Unregisters and unmaps every mapping made."""
        for m in self._mappings:
            self.unregister(m)
            m.close()
        self._mappings.clear()


# ----------------------------------------------------------------- probing
class PinnedView:
    """A numpy view presented to ``jax.dlpack.from_dlpack`` as CUDA host memory."""

    KDL_CUDA_HOST = 3

    def __init__(self, array: np.ndarray):
        self.array = array

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.KDL_CUDA_HOST, 0)


def slot_array(view: np.ndarray, device: Any, pinned: bool) -> Any:
    """The slot bytes ``view`` as a jax array without a copy: a ``pinned_host``
    array on an accelerator (``pinned``), the device's own array on CPU.

    Raises:
      ValueError: the import would copy (the view is not aligned, ...).
    """
    import jax

    src = PinnedView(view) if pinned else view
    arr = jax.dlpack.from_dlpack(src, copy=False)
    if zero_copy(arr, view) is False:
        raise ValueError(f"from_dlpack copied the slot view at {view.ctypes.data:#x}")
    return arr


def buffer_address(array: Any) -> int | None:
    """The address of a single-device jax array's buffer (None where unknown)."""
    try:
        return int(array.addressable_data(0).unsafe_buffer_pointer())
    except Exception:  # noqa: BLE001 - not every buffer exposes a pointer
        return None


def zero_copy(array: Any, view: np.ndarray) -> bool | None:
    """Whether ``array``'s buffer is ``view``'s bytes (None: address unknown)."""
    addr = buffer_address(array)
    return None if addr is None else addr == view.ctypes.data


def _cudart() -> ctypes.CDLL | None:
    names = [ctypes.util.find_library("cudart"), "libcudart.so.12", "libcudart.so"]
    try:
        import nvidia.cuda_runtime as rt  # the pip wheel jax[cuda12] installs

        names.insert(0, str(Path(list(rt.__path__)[0]) / "lib" / "libcudart.so.12"))
    except ImportError:
        pass
    for name in names:
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def probe_backend(device: Any, registry: SlotRegistry | None = None,
                  probe_view: np.ndarray | None = None) -> BackendCaps:
    """The capabilities of ``device``'s backend (``registry``'s registration
    result and a dlpack import of ``probe_view``, a registered slot, where given)."""
    kinds = {m.kind for m in device.addressable_memories()}
    dma = registry.dma_map if registry is not None else (
        "ok" if hasattr(device.client, "dma_map") else "absent")
    if device.platform == "cpu":
        return BackendCaps("cpu", "pinned_host" in kinds, "unimplemented" if dma == "ok" else dma)
    dl = False
    if probe_view is not None and "pinned_host" in kinds:
        try:
            arr = slot_array(probe_view, device, pinned=True)
            dl = getattr(arr.sharding, "memory_kind", None) == "pinned_host"
        except Exception as e:  # noqa: BLE001 - any failure means: not available
            log.info("no pinned_host view of a slot through dlpack: %s", e)
    return BackendCaps(device.platform, "pinned_host" in kinds, dma, dl, False,
                       _cudart() is not None)


# ----------------------------------------------------------------- copying
class SlotCopier:
    """Copies payload rows into a slot by the chosen path, on its own thread:
    ``copy`` returns at once (the caller is the training thread), ``wait``
    returns when every copy started so far is in its slot.

    The thread waits for each row to be computed (``block_until_ready``), then
    copies it: ``cudaMemcpyAsync`` on a side stream (``async_copy``, the device
    arrays kept alive until the stream is synchronized: a raw pointer holds no
    reference), ``device_put`` to ``pinned_host`` then one host copy
    (``pinned_pool``), or one host copy from the row's zero-copy view
    (``host_plain``).

    Args:
      path: the CopyPath chosen.
      max_copy_bytes: the largest single copy (``row_copies``).
    """

    def __init__(self, path: CopyPath, max_copy_bytes: int = 256 << 20):
        if path.kind == "aliased_output":
            raise ValueError("aliased_output is written by the step program (slot_array); "
                             "SlotCopier does the other paths")
        self.path, self.max_copy_bytes = path, max_copy_bytes
        self._keep: list[list[Any]] = []  # device rows of issued async copies
        self._futures: list[concurrent.futures.Future] = []
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-slot-copy")
        self._rt = _cudart() if path.kind == "async_copy" else None
        self._stream = ctypes.c_void_p()
        if path.kind == "async_copy":
            if self._rt is None:
                raise RuntimeError("async_copy: libcudart could not be loaded")
            if self._rt.cudaStreamCreateWithFlags(ctypes.byref(self._stream), 1) != 0:
                raise RuntimeError("cudaStreamCreateWithFlags failed")  # 1: non-blocking

    def copy(self, rows: list[Any], slot: np.ndarray, payload_bytes: int) -> None:
        """Starts copying ``rows`` (device arrays of one row each, or numpy
        rows) into ``slot`` at j * payload_bytes.

        Raises:
          ValueError: the slot is too small for the rows (nothing started).
        """
        if slot.size < len(rows) * payload_bytes:
            raise ValueError(f"slot of {slot.size} bytes; {len(rows)} rows of "
                             f"{payload_bytes} need {len(rows) * payload_bytes}")
        future = self._pool.submit(self._copy, list(rows), slot, payload_bytes)
        with self._lock:
            self._futures.append(future)

    def _copy(self, rows: list[Any], slot: np.ndarray, payload_bytes: int) -> None:
        copies = row_copies(len(rows), payload_bytes, self.max_copy_bytes)
        kind = self.path.kind
        if kind == "async_copy":
            assert self._rt is not None, "__init__ loads the CUDA runtime for async_copy"
            for j, lo, hi, off in copies:
                src = buffer_address(rows[j])
                if src is None:
                    raise ValueError(f"row {j} exposes no device pointer")
                rows[j].block_until_ready()  # the producer's stream is not ours
                rc = self._rt.cudaMemcpyAsync(ctypes.c_void_p(slot.ctypes.data + off),
                                              ctypes.c_void_p(src + lo),
                                              ctypes.c_size_t(hi - lo), 2, self._stream)
                if rc != 0:
                    raise RuntimeError(f"cudaMemcpyAsync of row {j} [{lo}, {hi}) failed: {rc}")
            with self._lock:
                self._keep.append(rows)
            return
        if kind == "pinned_pool":
            import jax

            rows = [r if isinstance(r, np.ndarray) else
                    jax.device_put(r, r.sharding.with_memory_kind("pinned_host")) for r in rows]
        for j, lo, hi, off in copies:
            flat = np.asarray(rows[j]).reshape(-1).view(np.uint8)
            np.copyto(slot[off:off + hi - lo], flat[lo:hi])

    def wait(self) -> None:
        """Returns when every copy started before the call is in its slot.

        Raises:
          The first error of those copies.
        """
        with self._lock:
            futures = list(self._futures)
        try:
            for f in futures:
                f.result()
        finally:
            with self._lock:
                self._futures = [f for f in self._futures if f not in futures]
                issued = len(self._keep)
            if self._rt is not None and issued:
                if self._rt.cudaStreamSynchronize(self._stream) != 0:
                    raise RuntimeError("cudaStreamSynchronize failed")
            with self._lock:
                del self._keep[:issued]

    def close(self) -> None:
        """Waits for the copies, then stops the thread."""
        self.wait()
        self._pool.shutdown(wait=True)


ARENA_COPY = ("auto", "off", "async_copy", "pinned_pool", "host_plain")


def arena_copier(setting: str, device: Any) -> tuple[SlotRegistry | None, SlotCopier | None]:
    """The registry and copier the checkpointer uses for ``InMemoryOptions.arena_copy``.

    Args:
      setting: "off" (none: the writers copy from the host copy, as before);
        "auto" (on accelerators: the fastest path ``probe_backend`` allows
        outside the step program; on CPU "off", whose writers already copy
        from the device buffers' own memory); or a path of ARENA_COPY to force.
      device: a device of the mesh.

    Raises:
      ValueError: ``setting`` is unknown, or forces a path not possible here.
    """
    if setting not in ARENA_COPY:
        raise ValueError(f"arena_copy must be one of {ARENA_COPY}, got {setting!r}")
    if setting == "off" or (setting == "auto" and device.platform == "cpu"):
        return None, None
    registry = SlotRegistry(device.client)
    registry.probe()
    # No slot view is probed: the aliased output needs the step program to
    # write the slot, which this copier does not do.
    caps = probe_backend(device, registry)
    path = choose_copy_path(caps, setting)
    try:
        copier = SlotCopier(path)
    except RuntimeError as e:  # the CUDA runtime refused a stream: the next path down
        if setting != "auto" or path.kind != "async_copy":
            raise
        caps = dataclasses.replace(caps, cudart=False)
        path = choose_copy_path(caps)
        path = CopyPath(path.kind, f"{path.reason}; async_copy failed: {e}")
        copier = SlotCopier(path)
    log_choice(path, caps)
    return registry, copier
