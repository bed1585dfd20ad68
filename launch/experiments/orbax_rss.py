"""Host memory of a persistent save: CapricornHandler vs plain Orbax async save.

    python -m launch.experiments.orbax_rss --mib=256 --devices=4

Each writer runs in a fresh process with ``--devices`` CPU devices and the same
train state (float32 leaves sharded over the devices, plus a small replicated
leaf; ``--mib`` MiB in all). After a warm-up save (compilation, Orbax's code
paths) the process frees what it can, resets its peak-RSS counter
(``/proc/self/clear_refs``), records its RSS, runs one measured save to
completion and reads the peak (``VmHWM``). Reported: the peak minus the RSS
before, in MiB and as a multiple of the state size. Phases:

* ``capricorn memory``: ``handler.save_to_memory`` until its writer has
  committed the version to the tmpfs store (pack + replicate program, device
  to host copy, chunk files).
* ``capricorn persistent``: the Orbax part of ``CheckpointManager.save`` alone
  (``ocp.CheckpointManager.save`` + ``wait_until_finished``), which reads the
  version back from the store into aligned host buffers and hands Orbax
  arrays that wrap them.
* ``orbax``: plain ``ocp.CheckpointManager.save(StandardSave(state))`` +
  ``wait_until_finished``.

On CPU "device" memory is host memory, so the state itself is in the RSS
before every measured save; tmpfs pages are not part of a process's RSS.
Prints a markdown table. Single host (replicas=1).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined only when run as a command: a test or
    another launcher importing this module for its logic must not define
    flags of the same names twice."""
    flags.DEFINE_integer("mib", 256, "State size in MiB.")
    flags.DEFINE_integer("devices", 4, "CPU devices of each measuring process.")
    flags.DEFINE_integer("leaves", 4, "Sharded float32 leaves the state is split into.")
    flags.DEFINE_string("store_root", "/dev/shm", "tmpfs for the in-memory store.")
    flags.DEFINE_string("workdir", None,
                        "Persistent checkpoints go here; default: a temporary dir.")
    flags.DEFINE_string("json", None, "Also write the rows as JSON here.")
    flags.DEFINE_string("mode", "", "Internal: run one writer (capricorn or orbax) and print JSON.")


MIB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _measure(name: str, fn, state_bytes: int) -> dict:
    gc.collect()
    reset = _reset_peak()
    before = _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM") * 1024
    return {"phase": name, "state_mib": state_bytes / MIB, "rss_before_mib": before / MIB,
            "peak_mib": peak / MIB, "delta_mib": (peak - before) / MIB,
            "x_state": (peak - before) / state_bytes, "seconds": seconds,
            "peak_reset": reset}


def _state(mib: int, leaves: int):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    n = jax.device_count()
    rows = max(n, (mib * MIB // 4 // leaves // 1024) // n * n)
    shardings = {f"w{i}": NamedSharding(mesh, P("data", None)) for i in range(leaves)}
    shardings["bias"] = NamedSharding(mesh, P())
    abstract = {f"w{i}": jax.ShapeDtypeStruct((rows, 1024), jnp.float32) for i in range(leaves)}
    abstract["bias"] = jax.ShapeDtypeStruct((4096,), jnp.float32)
    make = jax.jit(lambda k: {name: jax.random.normal(jax.random.fold_in(k, i), a.shape, a.dtype)
                              for i, (name, a) in enumerate(sorted(abstract.items()))},
                   out_shardings={k: shardings[k] for k in sorted(abstract)})
    state = make(jax.random.key(0))
    jax.block_until_ready(state)
    state_bytes = sum(a.size * a.dtype.itemsize for a in abstract.values())
    return mesh, shardings, abstract, state, state_bytes


def _run_capricorn(workdir: str) -> list[dict]:
    import orbax.checkpoint as ocp

    from capricorn_jax import (
        CapricornHandler,
        CapricornSave,
        CheckpointManager,
        InMemoryCheckpointer,
        InMemoryOptions,
    )

    mesh, shardings, abstract, state, state_bytes = _state(FLAGS.mib, FLAGS.leaves)
    store = tempfile.mkdtemp(prefix="capricorn_rss_", dir=FLAGS.store_root)
    try:
        inmem = InMemoryCheckpointer(InMemoryOptions(store_root=store, job="rss", replicas=1),
                                     mesh, abstract, shardings, 0, 1)
        handler = CapricornHandler(inmem)
        manager = CheckpointManager(os.path.join(workdir, "capricorn"),
                                    options=ocp.CheckpointManagerOptions(max_to_keep=1),
                                    handler_registry=handler.registry("state"))

        def args(step):
            return ocp.args.Composite(state=CapricornSave(state, {"step": step}))

        manager.save(0, args=args(0), force=True)  # warm-up: compile, first Orbax save
        manager.wait_until_finished()
        inmem.wait_until_finished(600)
        rows = []

        def memory_tier():
            handler.save_to_memory(1, state, {"step": 1})
            inmem.wait_until_finished(600)

        def persistent_tier():
            ocp.CheckpointManager.save(manager, 1, args=args(1), force=True)
            ocp.CheckpointManager.wait_until_finished(manager)

        read_rss = []  # RSS once the version's bytes are in host buffers, before Orbax
        handler.on_persist = lambda step, phase: (
            read_rss.append(_status_kib("VmRSS") * 1024) if phase == "read" else None)
        rows.append(_measure("capricorn memory", memory_tier, state_bytes))
        rows.append(_measure("capricorn persistent", persistent_tier, state_bytes))
        rows[-1]["after_read_mib"] = read_rss[-1] / MIB - rows[-1]["rss_before_mib"]
        assert not manager.persistent_errors and 1 in manager.all_steps()
        rows.append(_blocking(manager, inmem, state, args))
        manager.close()
        return rows
    finally:
        shutil.rmtree(store, ignore_errors=True)


def _blocking(manager, inmem, state, args, repeats: int = 3) -> dict:
    """How long a persistent step's ``manager.save`` holds the training thread,
    split into its memory-tier part and its Orbax part, against one
    device-to-host copy of the state into fresh host memory."""
    import statistics

    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    d2h, memory, persistent = [], [], []
    for step in range(2, 2 + repeats):
        t0 = time.perf_counter()
        jax.tree.map(lambda a: np.array(a, copy=True), state)
        d2h.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        manager.handler.save_to_memory(step, state, {"step": step})  # what save() runs first
        t1 = time.perf_counter()
        started = ocp.CheckpointManager.save(manager, step, args=args(step))  # then this
        t2 = time.perf_counter()
        assert started, f"step {step} was not persisted"
        memory.append(t1 - t0)
        persistent.append(t2 - t1)
        manager.wait_until_finished()
        inmem.wait_until_finished(600)
    return {"phase": "timing", "d2h_s": statistics.median(d2h),
            "memory_s": statistics.median(memory), "persistent_s": statistics.median(persistent),
            "save_blocked_s": statistics.median(
                m + p for m, p in zip(memory, persistent, strict=True)),
            "repeats": repeats}


def _run_orbax(workdir: str) -> list[dict]:
    import orbax.checkpoint as ocp

    _, _, _, state, state_bytes = _state(FLAGS.mib, FLAGS.leaves)
    manager = ocp.CheckpointManager(os.path.join(workdir, "orbax"),
                                    options=ocp.CheckpointManagerOptions(max_to_keep=1))
    manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    manager.wait_until_finished()

    def save():
        manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
        manager.wait_until_finished()

    rows = [_measure("orbax", save, state_bytes)]
    manager.close()
    return rows


def _child(mode: str, workdir: str) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={FLAGS.devices}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    cmd = [sys.executable, "-m", "launch.experiments.orbax_rss", f"--mode={mode}",
           f"--mib={FLAGS.mib}", f"--devices={FLAGS.devices}", f"--leaves={FLAGS.leaves}",
           f"--store_root={FLAGS.store_root}", f"--workdir={workdir}"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(x[len("ROW "):]) for x in proc.stdout.splitlines() if x.startswith("ROW ")]


def main(argv) -> None:
    del argv
    if FLAGS.mode:
        rows = {"capricorn": _run_capricorn, "orbax": _run_orbax}[FLAGS.mode](FLAGS.workdir)
        for row in rows:
            print("ROW " + json.dumps(row), flush=True)
        return
    workdir = FLAGS.workdir or tempfile.mkdtemp(prefix="orbax_rss_")
    try:
        rows = _child("capricorn", workdir) + _child("orbax", workdir)
    finally:
        if FLAGS.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    timing = [r for r in rows if r["phase"] == "timing"]
    rows = [r for r in rows if r["phase"] != "timing"]
    print(f"State: {rows[0]['state_mib']:.0f} MiB over {FLAGS.devices} CPU devices; peak = "
          f"VmHWM during the save (reset before it), delta = peak - RSS before.\n")
    print("| phase | RSS before (MiB) | peak (MiB) | delta (MiB) | delta / state | seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['phase']} | {r['rss_before_mib']:.0f} | {r['peak_mib']:.0f} | "
              f"{r['delta_mib']:.0f} | {r['x_state']:.2f} | {r['seconds']:.2f} |")
    for r in rows:
        if "after_read_mib" in r:
            print(f"\n{r['phase']}: RSS grew by {r['after_read_mib']:.0f} MiB once the version "
                  f"was read into host buffers (before Orbax started writing).")
    for t in timing:
        print(f"\ncapricorn CheckpointManager.save of a persistent step held the training "
              f"thread {t['save_blocked_s']:.3f} s (median of {t['repeats']}): memory tier "
              f"{t['memory_s']:.3f} s + Orbax's part {t['persistent_s']:.3f} s; one "
              f"device-to-host copy of the state into fresh host memory takes "
              f"{t['d2h_s']:.3f} s: {t['save_blocked_s'] / t['d2h_s']:.2f}x.")
    if not all(r["peak_reset"] for r in rows):
        print("\n(/proc/self/clear_refs was not writable: peaks are since process start)")
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(rows + timing, f, indent=1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
