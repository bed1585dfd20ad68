"""Memory-copy bandwidths of this machine, for reading the benchmarks.

    python -m launch.experiments.bandwidth --mib=256 --repeats=5

Measures, on the default JAX backend of this process (CPU here; a GPU when
one is present): host memcpy (numpy), host -> device (``jax.device_put``),
device -> host (``np.asarray`` of a device array, after
``copy_to_host_async``), device -> ``pinned_host`` memory (accelerators
that have it: the copy Orbax and the persistent tier use), and a write + read of the same bytes on the RAM disk
the in-memory tier uses (tmpfs). The link between simulated hosts is measured
by ``launch.experiments.transfer_alt`` (and by each scheduled strategy at start,
``scheduling.measure_link``). Median and best of ``--repeats``, GB/s (1e9).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("mib", 256, "Bytes per copy, MiB.")
flags.DEFINE_integer("repeats", 5, "Timed copies per kind.")
flags.DEFINE_string("tmpfs", "/dev/shm", "RAM disk for the store write/read.")
flags.DEFINE_string("json", None, "Write the results here.")


def _timed(fn, repeats: int) -> tuple[float, float]:
    fn()  # warm: page faults, compilation
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def measure(nbytes: int, repeats: int, tmpfs: str) -> dict[str, dict[str, float]]:
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
        target.write_bytes(memoryview(src))
        target.read_bytes()

    kinds = {
        "host memcpy": lambda: np.copyto(dst, src),
        "host -> device": lambda: jax.block_until_ready(jax.device_put(src)),
        "device -> host": d2h,
        "tmpfs write + read": store,
    }
    device = jax.devices()[0]
    if device.platform != "cpu" and "pinned_host" in {m.kind for m in device.addressable_memories()}:
        pinned = dev.sharding.with_memory_kind("pinned_host")

        def d2pinned() -> None:  # what Orbax's and the persistent tier's host copies use
            jax.block_until_ready(jax.device_put(dev + 0, pinned))

        kinds["device -> pinned_host"] = d2pinned
    out = {}
    try:
        for name, fn in kinds.items():
            median, best = _timed(fn, repeats)
            moved = nbytes * (2 if name == "tmpfs write + read" else 1)
            out[name] = {"median_gb_s": moved / median / 1e9, "best_gb_s": moved / best / 1e9}
    finally:
        target.unlink(missing_ok=True)
        base.rmdir()
    out["backend"] = {"platform": jax.default_backend(), "devices": jax.device_count()}
    return out


def main(argv: list[str]) -> None:
    if len(argv) > 1 or FLAGS.mib < 1 or FLAGS.repeats < 1:
        print("bandwidth: error: --mib and --repeats must be >= 1 (no positional arguments)",
              file=sys.stderr)
        sys.exit(2)
    results = measure(FLAGS.mib << 20, FLAGS.repeats, FLAGS.tmpfs)
    backend = results.pop("backend")
    print(f"backend {backend['platform']}, {FLAGS.mib} MiB per copy, {FLAGS.repeats} repeats")
    print("| copy | median GB/s | best GB/s |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['median_gb_s']:.2f} | {r['best_gb_s']:.2f} |")
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps({"backend": backend, "copies": results}))


if __name__ == "__main__":
    app.run(main)
