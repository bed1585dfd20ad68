"""What making a persistent step durable costs: the same save with fsync on and off.

    python -m launch.experiments.fsync_cost --mib=256 --pairs=6 --dir=/var/tmp/fsync

One process, the CPU devices of this process (``--devices``), a state of
``--mib`` MiB (float32 leaves sharded over the devices), saved by
``capricorn_jax.CheckpointManager`` every step to ``--dir`` (a real disk:
on tmpfs fsync is free and this measures nothing). Each pair saves one step
with ``CapricornHandler(fsync=True)`` and one with ``fsync=False`` (the order
alternates), each timed from ``save`` to ``wait_until_finished``; the page
cache is dropped (``sync``) before each save so that neither inherits the
other's dirty pages. Prints the median of each and the median of the paired
differences with a 95% bootstrap interval; ``--json`` writes them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS


# launch.cli_flags groups (and their flags) the command takes, and its own default of one.
SHARED_FLAGS = {"process": ("devices",), "output": ("json",)}
FSYNC_COST_DEFAULTS = {"json": ""}


def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """Its flags, defined when run as a command (nothing at import)."""
    from launch import cli_flags

    cli_flags.define(fv, SHARED_FLAGS, FSYNC_COST_DEFAULTS)
    flags.adopt_module_key_flags(cli_flags, flag_values=fv)
    flags.DEFINE_integer("mib", 256, "state size in MiB", flag_values=fv)
    flags.DEFINE_integer("pairs", 6, "paired saves (fsync on, off)", flag_values=fv)
    flags.DEFINE_string("dir", "/var/tmp/capricorn-fsync", "persistent directory (a real disk)",
                        flag_values=fv)
    return fv


def _interval(diffs: list[float], draws: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws)]


def main(argv: list[str]) -> None:
    del argv
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={FLAGS.devices}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import capricorn_jax

    mesh = Mesh(np.array(jax.devices()), ("d",))
    rows = FLAGS.mib * (1 << 20) // 4 // 1024 // 4
    sharding = NamedSharding(mesh, P("d"))
    state = {f"w{i}": jax.device_put(jnp.full((rows, 1024), i, jnp.float32), sharding)
             for i in range(4)}
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in state.items()}
    shardings = {k: sharding for k in state}
    root = Path(FLAGS.dir)
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for pair in range(FLAGS.pairs):
            for durable in ((True, False) if pair % 2 == 0 else (False, True)):
                shutil.rmtree(root, ignore_errors=True)
                ckpt = capricorn_jax.InMemoryCheckpointer(
                    capricorn_jax.InMemoryOptions(store_root=str(shm / f"{pair}{durable}"),
                                                  job="j", replicas=1),
                    mesh, abstract, shardings, 0, 1)
                handler = capricorn_jax.CapricornHandler(ckpt, fsync=durable)
                manager = capricorn_jax.CheckpointManager(
                    root, options=ocp.CheckpointManagerOptions(),
                    handler_registry=handler.registry("state"))
                os.sync()
                start = time.perf_counter()
                manager.save(0, args=ocp.args.Composite(
                    state=capricorn_jax.CapricornSave(state, {})))
                manager.wait_until_finished()
                times[durable].append(time.perf_counter() - start)
                assert manager.is_committed(0)
                manager.close()
                ckpt.release("none")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    diffs = [a - b for a, b in zip(times[True], times[False], strict=True)]
    low, high = _interval(diffs)
    doc = {"mib": FLAGS.mib, "pairs": FLAGS.pairs, "dir": str(root),
           "fsync_s": statistics.median(times[True]), "no_fsync_s": statistics.median(times[False]),
           "diff_s": statistics.median(diffs), "diff_ci_s": [low, high],
           "times": {"fsync": times[True], "no_fsync": times[False]}}
    print(f"{FLAGS.mib} MiB to {root}: fsync {doc['fsync_s']:.3f} s, no fsync "
          f"{doc['no_fsync_s']:.3f} s, paired difference {doc['diff_s'] * 1e3:+.0f} ms "
          f"[{low * 1e3:+.0f}, {high * 1e3:+.0f}] (95%)")
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    define_flags()
    app.run(main)
