"""What a window mark costs the step: a native stamp against a host callback.

    python -m launch.experiments.mark_cost [--devices=2] [--marks=48] [--repeats=30]

A jitted chain of ``--marks`` unordered marks (the threaded sender's kind, on
``--devices`` CPU devices, each mark tied to a small array) is run
``--repeats`` times with the marks native (an FFI stamp) and as Python host
callbacks, interleaved, and the same chain without marks; prints per mark and
device the extra wall time and the extra process CPU time (median of the
repeats). The CPU time is the number that matters on a host whose cores the
accelerator does not use: it is what the checkpoint's threads and gloo lose.
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app, flags

FLAGS = flags.FLAGS


def measure(devices: int, marks: int, repeats: int) -> dict[str, dict[str, float]]:
    """{variant: {"wall_us", "cpu_us"}} per mark and device over the plain chain."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from capricorn_jax.experimental import WindowMarks, profile_mark

    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    tables = {"native": WindowMarks(devices, devices=devices),
              "callback": WindowMarks(devices, devices=devices, native=False)}

    def chain(recorder):
        def body(y):
            for i in range(marks):
                if recorder is not None:
                    y = profile_mark(y, P("x"), mesh, recorder, f"m{i}", "fwd", ordered=False)
                y = jnp.tanh(y)
            return y
        return jax.jit(body, in_shardings=sharding, out_shardings=sharding)

    programs = {"plain": chain(None), **{k: chain(v) for k, v in tables.items()}}
    x = jax.device_put(np.zeros((devices, 64), np.float32), sharding)
    for p in programs.values():
        p(x).block_until_ready()
    got: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in programs}
    for _ in range(repeats):
        for name, p in programs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            p(x).block_until_ready()
            got[name]["wall"].append(time.perf_counter() - t0)
            got[name]["cpu"].append(time.process_time() - c0)
    for t in tables.values():
        t.close()
    base = {k: statistics.median(v) for k, v in got["plain"].items()}
    per = marks * devices
    return {name: {f"{k}_us": (statistics.median(v) - base[k]) / per * 1e6
                   for k, v in got[name].items()} for name in tables}


def main(argv: list[str]) -> None:
    del argv
    out = measure(FLAGS.devices, FLAGS.marks, FLAGS.repeats)
    for name, v in out.items():
        print(f"{name:9s} per mark and device: +{v['wall_us']:.0f} us wall, "
              f"+{v['cpu_us']:.0f} us process CPU")


if __name__ == "__main__":
    flags.DEFINE_integer("devices", 2, "CPU devices (XLA_FLAGS forces the count).")
    flags.DEFINE_integer("marks", 48, "Marks in the chain.")
    flags.DEFINE_integer("repeats", 30, "Timed runs of each variant.")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    app.run(main)
