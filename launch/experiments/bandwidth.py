"""Memory-copy bandwidths of this machine, for reading the benchmarks.

    python -m launch.experiments.bandwidth --mib=256 --repeats=5

Measures, on the default JAX backend of this process (CPU here; a GPU when
one is present): host memcpy (numpy), host -> device (``jax.device_put``),
device -> host (``np.asarray`` of a device array, after
``copy_to_host_async``), device -> ``pinned_host`` memory (accelerators
that have it: the copy Orbax and the persistent tier use), a write + read of
the same bytes as one file on the RAM disk the in-memory tier uses (tmpfs),
and the in-memory tier's own path through its store (``HostStore``, the
shared-memory arena): ``store ingest`` writes a version the way the
checkpointer does (one row per device, ``--chunk_mib`` chunks placed at row *
payload + chunk start, ``--threads`` writer threads, CRC32C per chunk, the
previous version kept so the slots are reused), ``store restore`` reads it
back the way recovery does (one copy per row, each chunk checked, rows in
parallel). The JSON's ``memcpy_gbps``, ``store_ingest_gbps`` and
``restore_gbps`` are the three medians side by side. The link between
simulated hosts was measured by ``launch.experiments.transfer_alt`` (tag
experiments-2026-12-05; and by each scheduled strategy at start,
``scheduling.measure_link``). Median and
best of ``--repeats``, GB/s (1e9).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """The command's flags (only when run as a command, or by a test on a fresh
    ``fv``: launch.bench imports ``measure`` and has flags of the same names)."""
    from launch import cli_flags

    cli_flags.define(fv, {"output": ("json",)})
    flags.adopt_module_key_flags(cli_flags, flag_values=fv)
    flags.DEFINE_integer("mib", 256, "Bytes per copy, MiB.", flag_values=fv)
    flags.DEFINE_integer("repeats", 5, "Timed copies per kind.", flag_values=fv)
    flags.DEFINE_string("tmpfs", "/dev/shm", "RAM disk for the store write/read.", flag_values=fv)
    flags.DEFINE_integer("rows", 4, "Device rows per store version (devices per host).",
                         flag_values=fv)
    flags.DEFINE_integer("chunk_mib", 4,
                         "Chunk size of the store path, MiB (the checkpointer's default).",
                         flag_values=fv)
    flags.DEFINE_integer("threads", 4, "Writer / reader threads of the store path.", flag_values=fv)
    return fv


def _timed(fn, repeats: int) -> tuple[float, float]:
    fn()  # warm: page faults, compilation
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


class _StorePath:
    """A version of ``src`` through the host store, as the in-memory tier moves it."""

    def __init__(self, root: Path, src: Any, rows: int, chunk_bytes: int, threads: int):
        import numpy as np

        from capricorn_jax.experimental import HostStore

        self.store = HostStore(root)
        payload = -(-src.size // rows)
        self.rows = [src[j * payload:(j + 1) * payload] for j in range(rows)]
        self.payload, self.chunk_bytes = payload, chunk_bytes
        self.names = [(j, k) for j in range(rows)
                      for k in range(-(-self.rows[j].size // chunk_bytes))]
        self.out = [np.empty_like(r) for r in self.rows]
        self.pool = concurrent.futures.ThreadPoolExecutor(threads)
        self.step = 0

    def ingest(self) -> None:
        self.step += 1
        self.store.prune(0, keep={self.step - 1})  # the keep rule's steady state: slots reused
        writer = self.store.begin(0, self.step, len(self.rows) * self.payload)

        def write(name: tuple[int, int]) -> None:
            j, k = name
            lo = k * self.chunk_bytes
            writer.write_chunk(f"d{j}.c{k}", self.rows[j][lo:lo + self.chunk_bytes],
                               offset=j * self.payload + lo)

        list(self.pool.map(write, self.names))
        writer.commit({})

    def restore(self) -> None:
        manifest = self.store.manifest(0, self.step)
        per_row = {j: [f"d{j}.c{k}" for jj, k in self.names if jj == j]
                   for j in range(len(self.rows))}

        def read(j: int) -> None:
            self.store.read_span_into(0, self.step, per_row[j], self.out[j], manifest)

        list(self.pool.map(read, range(len(self.rows))))

    def close(self) -> None:
        self.pool.shutdown()
        self.store.close()
        shutil.rmtree(self.store.root, ignore_errors=True)


def measure(nbytes: int, repeats: int, tmpfs: str, rows: int = 4, chunk_bytes: int = 4 << 20,
            threads: int = 4) -> dict[str, dict[str, float | str]]:
    import jax
    import numpy as np

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dev = jax.device_put(src)
    jax.block_until_ready(dev)

    def d2h() -> None:
        fresh = dev + 0  # a new buffer each time, so nothing is cached on the host
        fresh.copy_to_host_async()
        np.asarray(fresh)

    base = Path(tempfile.mkdtemp(dir=tmpfs if os.path.isdir(tmpfs) else None))
    target = base / "copy.bin"

    def store() -> None:
        target.write_bytes(src.data)  # the array's own buffer, as memoryview(src)
        target.read_bytes()

    arena = _StorePath(base / "arena", src, rows, chunk_bytes, threads)
    arena.ingest()  # with _timed's warm call: both slots of the steady state exist
    kinds = {
        "host memcpy": lambda: np.copyto(dst, src),
        "host -> device": lambda: jax.block_until_ready(jax.device_put(src)),
        "device -> host": d2h,
        "tmpfs write + read": store,
        "store ingest": arena.ingest,
        "store restore": arena.restore,  # the version the last ingest committed
    }
    device = jax.devices()[0]
    memories = {m.kind for m in device.addressable_memories()}
    if device.platform != "cpu" and "pinned_host" in memories:
        pinned = dev.sharding.with_memory_kind("pinned_host")

        def d2pinned() -> None:  # what Orbax's and the persistent tier's host copies use
            jax.block_until_ready(jax.device_put(dev + 0, pinned))

        kinds["device -> pinned_host"] = d2pinned
    out: dict[str, dict[str, float | str]] = {}
    try:
        for name, fn in kinds.items():
            median, best = _timed(fn, repeats)
            moved = nbytes * (2 if name == "tmpfs write + read" else 1)
            out[name] = {"median_gb_s": moved / median / 1e9, "best_gb_s": moved / best / 1e9}
        if not np.array_equal(np.concatenate(arena.out), src):
            raise AssertionError("store restore read back other bytes than were ingested")
    finally:
        arena.close()
        target.unlink(missing_ok=True)
        base.rmdir()
    out["backend"] = {"platform": jax.default_backend(), "devices": jax.device_count()}
    return out


def main(argv: list[str]) -> None:
    if (len(argv) > 1 or min(FLAGS.mib, FLAGS.repeats, FLAGS.rows, FLAGS.chunk_mib,
                             FLAGS.threads) < 1):
        print("bandwidth: error: --mib, --repeats, --rows, --chunk_mib and --threads must be "
              ">= 1 (no positional arguments)", file=sys.stderr)
        sys.exit(2)
    results = measure(FLAGS.mib << 20, FLAGS.repeats, FLAGS.tmpfs, FLAGS.rows,
                      FLAGS.chunk_mib << 20, FLAGS.threads)
    backend = results.pop("backend")
    print(f"backend {backend['platform']}, {FLAGS.mib} MiB per copy, {FLAGS.repeats} repeats")
    print("| copy | median GB/s | best GB/s |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['median_gb_s']:.2f} | {r['best_gb_s']:.2f} |")
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps({
            "backend": backend, "copies": results,
            "memcpy_gbps": results["host memcpy"]["median_gb_s"],
            "store_ingest_gbps": results["store ingest"]["median_gb_s"],
            "restore_gbps": results["store restore"]["median_gb_s"]}))


if __name__ == "__main__":
    define_flags()
    app.run(main)
