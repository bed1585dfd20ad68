"""The single-GPU measurements in one run and one JSON summary (``launch/gpu_bench.sh``).

    python -m launch.gpu_bench --out=OUT [--platform=gpu|cpu]

Parts, each in its own process with its own time limit (a failed part is
recorded and the next one runs; the exit code is 1 if any failed):

* ``env``: versions, devices and memory kinds, transparent huge pages, the
  XLA flags the in-graph path needs (``xla_flags.set_overlap_flags``);
* ``arena``: a store slot mapped 2 MiB-aligned and registered with the runtime
  (``pinned.SlotRegistry``): registration seconds per GB, the copy path chosen
  and why, the zero-copy check (a slot viewed as a jax array and donated to a
  program whose output is the slot: is the output's address the slot's?), the
  device-to-slot bandwidth of the chosen path, bytes checked;
* ``schedule``: the in-graph step of the executor tests' setup (``tiny``, two
  hosts of two devices) compiled and its schedule checked
  (``hlo_schedule.check_windows``), with the compiled program's memory: for
  the CPU devices, and compile-only for a CUDA H100-class target wherever the
  jax CUDA plugin is installed (no GPU needed);
* ``bench_small``, ``bench_big``: ``launch.bench`` with none, inmem, pec,
  orbax_async and orbax_emergency (one process, fixed dispatch);
* ``recovery``: ``launch.train`` with the in-memory tier and a persistent
  step every 2, then a resume from the arena, then (store deleted) one from
  the persistent tier; the recovery events' tier and seconds.

``--platform=cpu`` runs the same parts at small sizes (model ``tiny``, a few
steps): the dry run CI runs (``tests/test_gpu_bench_dryrun.py``). The parts'
stores live under ``--store_root`` (default: a new folder in /dev/shm), which
the run removes at its end.
Alternative not taken: one process doing everything, which would let one
part's device memory, XLA flags or a crash spoil the others.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from absl import app, flags

from launch import strategies

FLAGS = flags.FLAGS


# launch.cli_flags groups (and their flags) the command takes: it passes
# --platform and --store_root on to the benches and training jobs of its parts.
SHARED_FLAGS = {"cluster": ("platform",), "checkpoint": ("store_root",), "output": ("out",)}
GPU_BENCH_DEFAULTS = {"platform": "gpu", "store_root": ""}
"""Its own defaults: the real run on the GPU (cpu: the dry run, small sizes),
and its stores in a new folder in /dev/shm ('') removed at the end."""


def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """The command's flags, defined only when run as a command (as launch.bench),
    or by a test on a fresh ``fv``."""
    from launch import cli_flags

    cli_flags.define(fv, SHARED_FLAGS, GPU_BENCH_DEFAULTS)
    flags.adopt_module_key_flags(cli_flags, flag_values=fv)
    flags.DEFINE_string("part", "", "Internal: run one part in this process.", flag_values=fv)
    return fv


PARTS = ("env", "arena", "schedule", "bench_small", "bench_big", "recovery")
STRATEGIES = ",".join(n for n in strategies.STRATEGIES
                      if n not in strategies.PEER_ONLY and n != "blocking")
"""Every strategy of the registry that runs on one host (the scheduled ones
and the control send to a peer), less ``blocking`` (left out of the run's 8
minutes when the run was written; the CPU benches measure it)."""
# The dry run's big bench rehearses the part with none alone: the small bench
# runs them all, and tests/test_bench.py runs every strategy of launch.bench.
DRY_RUN_BIG_STRATEGIES = "none"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each part runs on a platform (time limits in seconds)."""

    arena_mib: int
    repeats: int
    small: tuple[str, ...]
    big: tuple[str, ...]
    train: tuple[str, ...]
    limits: dict


SIZES = {
    "gpu": Sizes(
        1024, 5,
        ("--model=small", "--steps=6", "--reps=2", "--warmup=2"),
        ("--model=gpt_moe_125m_8e", "--global_batch=16", "--steps=4", "--reps=2",
         "--warmup=2"),
        ("--model=small",),
        # 460 s in all: inside the script's 8 minutes, with the summary written.
        {"env": 30, "arena": 50, "schedule": 80, "bench_small": 90, "bench_big": 150,
         "recovery": 60}),
    "cpu": Sizes(
        8, 2,
        ("--model=tiny", "--steps=2", "--reps=1", "--warmup=1", "--bandwidth_mib=4"),
        ("--model=tiny", "--global_batch=8", "--steps=2", "--reps=1", "--warmup=1",
         "--bandwidth_mib=4"),
        ("--model=tiny", "--devices_per_host=2"),
        {"env": 60, "arena": 60, "schedule": 120, "bench_small": 120, "bench_big": 120,
         "recovery": 120}),
}


def h100_target() -> str:
    """A GpuTargetConfigProto (text) of an H100 SXM (compute capability 9.0, as
    the H200): what XLA compiles for without a GPU attached."""
    info = {"threads_per_block_limit": 1024, "threads_per_warp": 32,
            "shared_memory_per_block": 49152, "shared_memory_per_core": 233472,
            "threads_per_core_limit": 2048, "core_count": 132, "fpus_per_core": 128,
            "block_dim_limit_x": 2147483647, "block_dim_limit_y": 65535,
            "block_dim_limit_z": 65535, "memory_bandwidth": 3352320000000,
            "l2_cache_size": 52428800, "clock_rate_ghz": 1.98,
            "device_memory_size": 84978434048, "shared_memory_per_block_optin": 232448,
            "registers_per_core_limit": 65536, "registers_per_block_limit": 65536}
    body = "\n".join(f"  {k}: {v}" for k, v in info.items())
    return ("gpu_device_info {\n" + body + "\n  cuda_compute_capability { major: 9 }\n}\n"
            'platform_name: "CUDA"\ndnn_version_info { major: 9 }\n'
            'device_description_str: "NVIDIA H100 80GB HBM3"\n')


# ----------------------------------------------------------------- parts
def part_env(platform: str, out: Path) -> dict:
    from capricorn_jax.experimental import pinned, xla_flags

    problems = xla_flags.set_overlap_flags()
    import flax
    import jax
    import optax
    import orbax.checkpoint as ocp

    d = jax.devices()[0]
    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "orbax": ocp.__version__, "platform": d.platform, "device_kind": d.device_kind,
            "devices": len(jax.devices()),
            "memory_kinds": sorted(m.kind for m in d.addressable_memories()),
            "hugepages": pinned.hugepage_modes(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "xla_flag_problems": problems}


def _alias_check(jax, np, dev, view) -> dict:
    """A slot viewed as a jax array (no copy) and donated to a program whose
    output is the slot's bytes: where the output landed."""
    from capricorn_jax.experimental import pinned

    accelerator = dev.platform != "cpu"
    out: dict[str, str | bool | None] = {
        "import_zero_copy": None, "output_aliases_slot": None, "bytes_landed": None}
    try:
        arr = pinned.slot_array(view, dev, accelerator)
    except Exception as e:  # noqa: BLE001 - recorded: the check's answer is "no"
        out["error"] = f"{type(e).__name__}: {e}"[:300]
        return out
    out["import_zero_copy"] = pinned.zero_copy(arr, view)
    src = jax.device_put(np.arange(view.size, dtype=np.uint32).astype(np.uint8), dev)
    program = jax.jit(lambda dst, s: s, donate_argnums=0, out_shardings=arr.sharding)
    result = program(arr, src)
    result.block_until_ready()
    out["output_aliases_slot"] = pinned.zero_copy(result, view)
    out["bytes_landed"] = bool(np.array_equal(view, np.asarray(src)))
    return out


def part_arena(platform: str, out: Path, store_root: Path) -> dict:
    import jax
    import numpy as np

    from capricorn_jax.experimental import HostStore, pinned

    sizes = SIZES[platform]
    dev = jax.devices()[0]
    nbytes = sizes.arena_mib << 20
    registry = pinned.SlotRegistry(dev.client)
    store = HostStore(store_root / "arena", registry=registry)
    writer = store.begin(0, 1, nbytes)
    view = writer.slot.view[:nbytes]
    mapping = writer.slot._maps[-1]
    caps = pinned.probe_backend(dev, registry, probe_view=view[: 2 << 20])
    alias = _alias_check(jax, np, dev, view[: 2 << 20])
    caps = dataclasses.replace(caps, alias_checked=alias["output_aliases_slot"] is True)
    path = pinned.choose_copy_path(caps)
    line = pinned.log_choice(path, caps)
    data = np.frombuffer(np.random.default_rng(0).bytes(nbytes), np.uint8).reshape(1, -1)
    src = jax.device_put(data, dev)
    src.block_until_ready()
    times = []
    if path.kind == "aliased_output":
        program = jax.jit(lambda dst, s: s.reshape(-1), donate_argnums=0)
        for _ in range(sizes.repeats):
            dst = pinned.slot_array(view, dev, True)
            t0 = time.perf_counter()
            program(dst, src).block_until_ready()
            times.append(time.perf_counter() - t0)
    else:
        copier = pinned.SlotCopier(path)
        for _ in range(sizes.repeats):
            t0 = time.perf_counter()
            copier.copy([src], view, nbytes)
            copier.wait()
            times.append(time.perf_counter() - t0)
    landed = bool(np.array_equal(view, np.asarray(src)[0]))
    median = float(np.median(times))
    stats = dev.memory_stats() or {}
    writer.abort()
    store.destroy()
    registry.close()
    gb = registry.registered_bytes / 1e9
    return {"copy_path": path.kind, "reason": path.reason, "log_line": line,
            "caps": dataclasses.asdict(caps), "mib": sizes.arena_mib,
            "d2h_gbps": nbytes / median / 1e9, "copy_seconds": times, "bytes_landed": landed,
            "registered_bytes": registry.registered_bytes, "dma_map": registry.dma_map,
            "registration_s_per_gb": registry.registration_s / gb if gb else None,
            "zero_copy": alias, "slot_address_aligned": view.ctypes.data % (2 << 20) == 0,
            "huge_pages_advised": getattr(mapping, "huge", None),
            "peak_device_bytes": stats.get("peak_bytes_in_use")}


def _scheduled(devices, jax, np):
    """The executor tests' scheduled step on ``devices`` (4: two hosts of two),
    abstract inputs; returns (traced step, schedule, boundaries)."""
    from capricorn_jax.experimental import (
        TRAILER_BYTES,
        InStepSender,
        LinkModel,
        Transport,
        Window,
        make_plan,
        partition,
        scheduled_step,
        send_rounds,
    )
    from launch.trainer import OptimizerOptions, Trainer, make_mesh
    from models import get_config

    trainer = Trainer(get_config("tiny"), make_mesh(4, devices), OptimizerOptions())
    plan = make_plan(trainer.abstract_state, trainer.state_shardings, trainer.mesh, 1 << 18,
                     device_host=[0, 0, 1, 1])
    transport = Transport(plan, trainer.mesh, trainer.state_shardings, send_rounds(2, 2), 3)
    boundaries = ["block0", "block1"]
    windows = [Window("block0", "fwd", 1e-3), Window("block1", "fwd", 1e-3),
               Window("head", "fwd", 1e-3), Window("block1", "bwd", 1e-3),
               Window("tail", "bwd", 1e-3)]
    schedule = partition(plan.payload_bytes, windows, LinkModel(0.0, 2e8), chunk_cap=100_000)
    sender = InStepSender(transport, trainer.state_shardings, schedule, boundaries)
    step = scheduled_step(trainer, sender, (2.0, 2.0))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         trainer.abstract_state, trainer.state_shardings)
    batch = jax.ShapeDtypeStruct((trainer.cfg.global_batch, trainer.cfg.seq_len + 1),
                                 np.int32, sharding=trainer.batch_sharding)
    rows = jax.ShapeDtypeStruct((4, TRAILER_BYTES), np.uint8, sharding=transport.rows)
    return step.trace(state, batch, rows), schedule, boundaries


def _check(traced, schedule, boundaries, platform: str) -> dict:
    from capricorn_jax.experimental import hlo_schedule as hs

    t0 = time.perf_counter()
    compiled = traced.lower(lowering_platforms=(platform,)).compile()
    text = compiled.as_text()
    checks = hs.check_windows(text, hs.window_specs(schedule, boundaries),
                              hs.layer_order(boundaries))
    return {**hs.summary(checks), "memory": hs.memory_report(compiled),
            "compile_s": time.perf_counter() - t0}


def part_schedule(platform: str, out: Path) -> dict:
    from capricorn_jax.experimental import xla_flags

    problems = xla_flags.set_overlap_flags()
    import jax
    import numpy as np

    result: dict = {"xla_flag_problems": problems}
    cpu = jax.devices("cpu")
    if len(cpu) >= 4:
        traced, schedule, boundaries = _scheduled(cpu[:4], jax, np)
        result["cpu"] = _check(traced, schedule, boundaries, "cpu")
    else:
        result["cpu"] = {"skipped": f"{len(cpu)} CPU devices (4 needed)"}
    try:
        from jax.experimental import topologies

        topo = topologies.get_topology_desc("1x2x2", platform="cuda",
                                            target_config=h100_target(), topology="1x2x2")
    except Exception as e:  # noqa: BLE001 - no CUDA plugin here: said in the summary
        result["cuda_compile_only"] = {"skipped": f"{type(e).__name__}: {e}"[:300]}
        return result
    traced, schedule, boundaries = _scheduled(list(topo.devices), jax, np)
    result["cuda_compile_only"] = _check(traced, schedule, boundaries, "cuda")
    result["cuda_compile_only"]["target"] = "NVIDIA H100 80GB HBM3 (sm_90), 2 hosts x 2"
    return result


# ----------------------------------------------------------------- subprocess parts
def _run(cmd: list[str], log: Path, limit: float, env: dict | None = None) -> int:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=limit,
                                  env=env).returncode
        except subprocess.TimeoutExpired:
            f.write(f"timed out after {limit:.0f} s\n")
            return 124


def part_bench(platform: str, out: Path, which: str, store_root: Path) -> dict:
    sizes = SIZES[platform]
    args = sizes.small if which == "bench_small" else sizes.big
    json_path = out / f"{which}.json"
    strategies = (DRY_RUN_BIG_STRATEGIES if platform == "cpu" and which == "bench_big"
                  else STRATEGIES)
    cmd = [sys.executable, "-m", "launch.bench", f"--platform={platform}", "--hosts=1",
           "--replicas=1", "--dispatch=fixed", f"--strategies={strategies}",
           "--persist_every=2", f"--store_root={store_root / which}",
           f"--workdir={store_root / (which + '_work')}", f"--json={json_path}", *args]
    if platform == "cpu":
        cmd.append("--devices_per_host=2")
    rc = _run(cmd, out / f"{which}.log", sizes.limits[which] - 10)
    if rc != 0 or not json_path.exists():
        raise RuntimeError(f"launch.bench exited {rc}; see {which}.log")
    bench = json.loads(json_path.read_text())
    return {"model": next(a for a in args if a.startswith("--model=")).split("=")[1],
            "args": args,
            "strategies": {k: {f: v.get(f) for f in ("median_step_s", "ratio", "spread_s",
                                                     "ckpt_bytes_per_step",
                                                     "versions_committed")}
                           for k, v in bench["strategies"].items()},
            "bandwidth": bench.get("bandwidth")}


def part_recovery(platform: str, out: Path, store_root: Path) -> dict:
    sizes = SIZES[platform]
    work = store_root / "recovery_work"
    store = store_root / "recovery_store"
    base = [sys.executable, "-m", "launch.train", f"--platform={platform}", "--hosts=1",
            "--replicas=1", "--dispatch=fixed", "--ckpt=inmem", "--persist_every=2",
            f"--store_root={store}", f"--workdir={work}", "--eval_sequences=0", *sizes.train]
    log = out / "recovery.log"
    limit = sizes.limits["recovery"] / 3
    # 5 steps: step 4 persisted, 5 only in RAM (kept: not persisted), then a
    # resume from the arena to 7 (6 persisted, 7 kept), then one from Orbax.
    for extra, wipe in (("--steps=5 --fresh", False), ("--steps=7 --resume", False),
                        ("--steps=8 --resume", True)):
        if wipe:
            shutil.rmtree(store, ignore_errors=True)
        rc = _run(base + extra.split(), log, limit)
        if rc != 0:
            raise RuntimeError(f"launch.train {extra} exited {rc}; see recovery.log")
    events = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    rec = [e for e in events if e.get("event") == "recovery"]
    by_tier: dict[str, list[dict[str, Any]]] = {}
    for e in rec:
        by_tier.setdefault(e["tier"], []).append({"step": e["step"], "seconds": e["seconds"]})
    return {"recoveries": by_tier,
            "arena_s": by_tier.get("local", [{}])[0].get("seconds"),
            "persistent_s": by_tier.get("persistent", [{}])[0].get("seconds")}


# ----------------------------------------------------------------- driver
def run_part(name: str, platform: str, out: Path, store_root: Path) -> dict:
    if name == "env":
        return part_env(platform, out)
    if name == "arena":
        return part_arena(platform, out, store_root)
    if name == "schedule":
        return part_schedule(platform, out)
    if name in ("bench_small", "bench_big"):
        return part_bench(platform, out, name, store_root)
    if name == "recovery":
        return part_recovery(platform, out, store_root)
    raise ValueError(f"unknown part {name!r}; parts: {PARTS}")


def _child_env(platform: str, name: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="1")
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    if name == "schedule":  # the executor tests' two hosts of two devices, on the CPU client
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            " --xla_force_host_platform_device_count=4").strip()
    return env


def drive(platform: str, out: Path, store_root: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "parts").mkdir(exist_ok=True)
    summary: dict = {"platform": platform, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                 time.gmtime()),
                     "command": f"bash launch/gpu_bench.sh OUT --platform={platform}",
                     "parts": {}}
    t_start = time.monotonic()
    for name in PARTS:
        limit = SIZES[platform].limits[name]
        result_file = out / "parts" / f"{name}.json"
        result_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "launch.gpu_bench", f"--part={name}",
               f"--platform={platform}", f"--out={out}", f"--store_root={store_root}"]
        t0 = time.monotonic()
        rc = _run(cmd, out / "gpu_bench.log", limit, _child_env(platform, name))
        seconds = time.monotonic() - t0
        if result_file.exists():
            entry = json.loads(result_file.read_text())
        else:
            entry = {"ok": False, "error": f"exit {rc}" + (" (time limit)" if rc == 124 else "")}
        entry["seconds"] = round(seconds, 2)
        summary["parts"][name] = entry
        print(f"gpu_bench: {name}: {'ok' if entry.get('ok') else 'FAILED'} in {seconds:.1f} s",
              flush=True)
    summary["seconds"] = round(time.monotonic() - t_start, 2)
    summary["ok"] = all(p.get("ok") for p in summary["parts"].values())
    summary.update(headline(summary["parts"]))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    shutil.rmtree(store_root, ignore_errors=True)
    return 0 if summary["ok"] else 1


def headline(parts: dict) -> dict:
    """The summary's top-level numbers (None where a part failed)."""
    arena = parts.get("arena", {})
    sched = parts.get("schedule", {})
    rec = parts.get("recovery", {})

    def steps(name):
        return {k: v["median_step_s"] for k, v in parts.get(name, {}).get(
            "strategies", {}).items()}

    cuda = sched.get("cuda_compile_only", {})
    return {
        "pinned_d2h_gbps": arena.get("d2h_gbps"),
        "copy_path": arena.get("copy_path"),
        "registration_s_per_gb": arena.get("registration_s_per_gb"),
        "zero_copy": arena.get("zero_copy", {}).get("output_aliases_slot"),
        "step_s_small": steps("bench_small"),
        "step_s_big": steps("bench_big"),
        "recovery_arena_s": rec.get("arena_s"),
        "recovery_persistent_s": rec.get("persistent_s"),
        "schedule_ok_cpu": sched.get("cpu", {}).get("ok"),
        "schedule_ok_cuda": cuda.get("ok"),
        "peak_device_bytes": arena.get("peak_device_bytes"),
        "scheduled_step_peak_bytes": (cuda.get("memory") or sched.get("cpu", {}).get(
            "memory") or {}).get("peak_bytes"),
    }


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if not FLAGS.out:
        raise app.UsageError("--out=OUT is required")
    out = Path(FLAGS.out).absolute()
    store_root = Path(FLAGS.store_root or tempfile.mkdtemp(
        prefix="capricorn_gpu_bench_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    if FLAGS.part:
        try:
            result = {"ok": True, **run_part(FLAGS.part, FLAGS.platform, out, store_root)}
        except Exception as e:  # noqa: BLE001 - recorded in the summary, then re-raised
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
            (out / "parts" / f"{FLAGS.part}.json").write_text(json.dumps(result, default=str))
            raise
        (out / "parts" / f"{FLAGS.part}.json").write_text(json.dumps(result, default=str))
        return
    sys.exit(drive(FLAGS.platform, out, store_root))


if __name__ == "__main__":
    define_flags()
    app.run(main)
