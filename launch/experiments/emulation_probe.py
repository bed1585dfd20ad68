"""The emulated accelerator's wait, measured against a Python callback that sleeps.

    python -m launch.experiments.emulation_probe [--json=PATH]

A jitted, shard_map'd step over 2 CPU devices of this process: ``layers``
waits of ``total_ms / layers`` each, a psum across the devices after each,
timed over ``--repeats`` steps after a warm-up, for two wait mechanisms:
the native XLA FFI wait the emulated accelerator uses (``models.emulation``:
it holds no core and no GIL) and a Python ``io_callback`` that calls
``time.sleep`` (it needs the GIL to start and return). Each is timed on a
quiet process and beside one busy pure-Python thread (as the checkpoint's
sender and writer threads are). Reported per case: the median step, its
excess over the requested waits, and the excess per layer.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_float("total_ms", 100.0, "Waits per step, milliseconds in all.")
    flags.DEFINE_list("layers", ["1", "4", "10"], "Layer counts the waits are split over.")
    flags.DEFINE_integer("repeats", 5, "Timed steps per case (after one warm-up).")
    flags.DEFINE_string("json", None, "Also write the results here.")


def _step(layers: int, ms: float, native_wait: bool):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import io_callback
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from models.emulation import native

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))

    def sleep(x):
        time.sleep(ms / 1e3)
        return x

    def body(x):
        for _ in range(layers):
            if native_wait:
                x = native.wait(x, jnp.float32(ms))
            else:
                x = io_callback(sleep, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ordered=False)
            x = jax.lax.psum(x, "d") * 0.5
        return x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))), mesh


def measure(layers: int, total_ms: float, native_wait: bool, busy: bool, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    fn, _ = _step(layers, total_ms / layers, native_wait)
    x = jnp.ones((2, 8))
    jax.block_until_ready(fn(x))
    stop = threading.Event()

    def spin():
        n = 0
        while not stop.is_set():
            n += 1

    spinner = threading.Thread(target=spin, daemon=True)
    if busy:
        spinner.start()
    try:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        stop.set()
        if busy:
            spinner.join(timeout=5)
    median = statistics.median(times)
    return {"mechanism": "native" if native_wait else "python_callback", "layers": layers,
            "busy_thread": busy, "requested_ms": total_ms, "median_ms": round(median, 2),
            "excess_ms": round(median - total_ms, 2),
            "excess_per_layer_ms": round((median - total_ms) / layers, 3),
            "steps_ms": [round(t, 2) for t in times]}


def main(argv: list[str]) -> None:
    del argv
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    rows = [measure(int(n), FLAGS.total_ms, native_wait, busy, FLAGS.repeats)
            for native_wait in (True, False) for busy in (False, True) for n in FLAGS.layers]
    print("| mechanism | busy thread | layers | median step (ms) | excess (ms) | per layer (ms) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mechanism']} | {'yes' if r['busy_thread'] else 'no'} | {r['layers']} | "
              f"{r['median_ms']:.1f} | {r['excess_ms']:.1f} | {r['excess_per_layer_ms']:.2f} |")
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump({"rows": rows, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "load_average": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
