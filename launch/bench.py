"""Checkpoint strategies side by side, in one run, on the simulated cluster.

    python -m launch.bench --strategies=none,inmem --model=tiny --steps=10 --reps=5 \
        --json=/tmp/bench.json

Every host process builds the model once and then runs the strategies in
interleaved blocks (A B C, B C A, C A B, ...) of ``--steps`` steps each,
``--reps`` times; within a repetition every strategy replays the same steps
from the same state (a copy taken when the repetition starts, with the data
position and the routing maxima), so all meet the same batches and capacity
buckets (recorded in the JSON's ``buckets``), and the run fails if two
strategies' losses differ at a step (a checkpoint must not change training;
``steps_compared`` counts the steps checked); all after a warm-up block per
strategy (the warm-up common to all strategies: their first compiles). Every
step of a block is timed except its first (which absorbs the previous
strategy's tail, for every strategy alike), the steps the strategy profiles
and the steps during which anything compiled (a new variant for a new
capacity bucket, a program a strategy's save needs) included: they are its
cost. Per strategy the report gives the median and spread (IQR) of all its
timed steps and the ratio of that median to ``none``'s; ``steps_timed``,
``steps_profiled``, ``steps_compiled`` and the profiled / compiled steps'
own medians; and, labelled as such, the steady state (plain steps only)
beside it. After the timed steps, each block runs ``--a2a_steps`` steps
(not timed) of the variant with ``capricorn_jax.CollectiveProbe`` attached:
ordered per-device callbacks at the edges of every MoE all-to-all (dispatch
and combine, forward and backward), under the strategy's own checkpoint
traffic (for gemini and capricorn, the scheduled step with its chunks); the
all-to-all time of a step is the sum of its phases, each the slowest
device's, and includes the wait for the slowest peer and the probe's own
callbacks: compare it across strategies, not to a step time. With ``inmem``
and ``pec`` it then measures recovery: from the local RAM store, and from a
peer after host 1's store is wiped.

Every strategy is built by ``launch.strategies.make_strategy`` and every step
runs through ``capricorn_jax.ProfilingDriver``, as in launch.train: a
strategy profiles the same steps here as in training (gemini its first
``--profile_first_n``, capricorn when its trigger asks (``--profile_trigger``:
the next step's capacity tuple lacks warm profiles, or the expert load drifted
past ``--drift_threshold``) and its schedule is at risk; the defaults are the
library's). A profiled step is timed like any other (issue 15: the
published ratios before it left out capricorn's profiled steps).

Output: a markdown table on stdout, ``--json`` (contract in DESIGN.md), and a
PNG bar chart with ``--png``. Exits non-zero, and reports no number, when any
host or strategy fails.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from absl import app, flags, logging

from capricorn_jax import DetectorOptions
from capricorn_jax.experimental import xla_flags
from launch import runtime, step_stats
from launch.bench_recovery import baseline_recovery, recovery_times
from launch.bench_report import VARIANTS, markdown, plot, summarize
from launch.bench_runner import Runner
from launch.cluster import cpu_account
from launch.cluster import processes as cluster_lib
from launch.cluster.netns import LinkOptions, links_for
from launch.config import AcceleratorConfig
from launch.strategies import IN_MEMORY, PEC, STRATEGIES, STRATEGY_PROFILE

FLAGS = flags.FLAGS


def _chunk_path(name: str) -> str:
    """The chunk path of a row: its variant's, else --chunk_path, where auto
    is threaded for every in-memory row on CPU with --replicas=2 (inmem and
    pec too: one transport per comparison)."""
    if name.endswith("_in_graph"):
        return "in_graph"
    if FLAGS.chunk_path == "auto" and FLAGS.platform != "gpu" and FLAGS.replicas == 2:
        return "threaded"
    return FLAGS.chunk_path


def _transport(name: str) -> str | None:
    """How an in-memory row's versions travel (None: not an in-memory row)."""
    if VARIANTS.get(name, name) not in IN_MEMORY:
        return None
    path = _chunk_path(name)
    return "in_graph" if path == "auto" and FLAGS.platform == "gpu" else path


# launch.cli_flags groups (and their flags) that the bench takes, and its own
# defaults of some (same meaning as in launch.train): it wipes its store root
# before and after a run, and its published results use bucketed dispatch
# and K=2 for the pec rows.
SHARED_FLAGS = {
    "cluster": ("hosts", "devices_per_host", "platform", "timeout_s", "process_id",
                "coordinator"),
    "links": None, "model": None, "accelerator": None,
    "data": ("steps", "workdir", "seed", "workload", "shift_every"),
    "checkpoint": ("replicas", "chunk_bytes", "chunk_path", "store_root", "ckpt_budget",
                   "persist_every", "pec_k"),
    "profiling": ("profile_first_n", "profile_trigger", "drift_threshold"),
}
BENCH_DEFAULTS = {"steps": 10, "dispatch": "bucketed", "pec_k": 2,
                  "store_root": "/dev/shm/capricorn_jax_bench"}


def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """The command's flags, defined only when run as a command (or by a test
    on a fresh ``fv``): a module importing this one for its logic defines none."""
    from launch import cli_flags

    cli_flags.define(fv, SHARED_FLAGS, BENCH_DEFAULTS)
    flags.adopt_module_key_flags(cli_flags, flag_values=fv)
    flags.DEFINE_list("strategies", ["none", "inmem"],
                      f"Strategies, from {', '.join(STRATEGIES)}, and {', '.join(VARIANTS)} "
                      f"(blocking writing to the scratch directory's disk instead of the RAM "
                      f"disk; a *_in_graph row on the in-graph path).", flag_values=fv)
    flags.DEFINE_integer("reps", 5, "Repetitions; strategies interleave within each.",
                         flag_values=fv)
    flags.DEFINE_integer("a2a_steps", 2,
                         "Steps per block (after the timed ones, not timed) that run with the "
                         "all-to-all probe: per-device stamps around each MoE all-to-all, under "
                         "the strategy's own checkpoint traffic; 0 = no all-to-all column.",
                         flag_values=fv)
    flags.DEFINE_integer("warmup", 3, "Warm-up steps per strategy (compilation), not measured.",
                         flag_values=fv)
    flags.DEFINE_string("json", None, "Write the results here as JSON.", flag_values=fv)
    flags.DEFINE_string("png", None, "Write a bar chart (median step time, error bars) here.",
                        flag_values=fv)
    flags.DEFINE_integer("bandwidth_mib", 64,
                         "After the strategies: this host's memcpy, store ingest and store restore "
                         "bandwidth on this many MiB (the JSON's \"bandwidth\"; 0: skip).",
                         flag_values=fv)
    flags.DEFINE_float("link_probe_mib", 8.0,
                       "Before the strategies: the link each host gets, measured with a "
                       "collective-permute of this many MiB per device, one way and as an "
                       "exchange (the JSON's \"link\"; 0: skip).", flag_values=fv)
    return fv


def _checkpointer(name: str, job):
    """An in-memory strategy's InMemoryCheckpointer (its own job in the store root)."""
    import capricorn_jax

    cfg = job.trainer.cfg
    options = capricorn_jax.InMemoryOptions(
        store_root=FLAGS.store_root, job=f"bench-{name}", replicas=FLAGS.replicas,
        chunk_bytes=FLAGS.chunk_bytes,
        # A strategy's statuses refresh only when it saves; interleaved blocks of
        # the other strategies must not read as replicas that stopped answering.
        replication_timeout_s=FLAGS.timeout_s,
        max_wait_s=None if FLAGS.ckpt_budget < 0 else FLAGS.ckpt_budget,
        pec=capricorn_jax.PecOptions(k=FLAGS.pec_k, k_persist=FLAGS.pec_k, dynamic=False)
        if VARIANTS.get(name, name) in PEC else None)
    return capricorn_jax.InMemoryCheckpointer(
        options, job.mesh, job.trainer.abstract_state, job.trainer.state_shardings,
        job.host, job.hosts, model=cfg, tokens_per_step=cfg.global_batch * cfg.seq_len)


def _strategies(job, workdir: Path) -> tuple[dict, dict, dict]:
    """({name: strategy}, {name: its ProfilingDriver}, {name: its checkpointer})."""
    import capricorn_jax
    from launch.strategies import make_strategy

    strategies, drivers, ckpts = {}, {}, {}
    ram = Path(FLAGS.store_root)
    # Every strategy writes to the RAM disk of the stores, but blocking_disk
    # (the scratch directory, a disk) and orbax_emergency's persistent tier.
    directories = {"blocking": ram / "blocking" / f"host{job.host}",
                   "blocking_disk": workdir / "blocking" / f"host{job.host}",
                   "orbax_async": ram / "orbax",
                   "orbax_emergency": workdir / "orbax_emergency"}
    for name in FLAGS.strategies:
        base = VARIANTS.get(name, name)
        if base in IN_MEMORY:
            ckpts[name] = _checkpointer(name, job)
        strategies[name] = make_strategy(
            base, job.trainer, checkpointer=ckpts.get(name),
            directory=directories.get(name), first_n=FLAGS.profile_first_n,
            chunk_cap=FLAGS.chunk_bytes, chunk_path=_chunk_path(name), tier="local",
            local_directory=ram / "orbax_local",
            persist_every=FLAGS.persist_every or 10)
        strategies[name].name = name  # a variant's row keeps its own name
        options = capricorn_jax.ProfilingOptions(
            STRATEGY_PROFILE.get(base, "off"), FLAGS.profile_first_n,
            DetectorOptions(threshold=FLAGS.drift_threshold), trigger=FLAGS.profile_trigger)
        drivers[name] = capricorn_jax.ProfilingDriver(job.trainer, strategies[name], options,
                                                      collectives=job.trainer.all_to_alls,
                                                      next_factors=job.trainer.next_factors)
    return strategies, drivers, ckpts


def bench_worker(process_id: int, workdir: Path) -> None:
    import jax

    from capricorn_jax.experimental import allgather_floats

    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    runtime.init_distributed(FLAGS.hosts, FLAGS.coordinator, process_id,
                             single_process="orbax_emergency" in FLAGS.strategies)
    overrides = {"dispatch": FLAGS.dispatch} if FLAGS.dispatch else {}
    if FLAGS.global_batch:
        overrides["global_batch"] = FLAGS.global_batch
    total_steps = ((FLAGS.warmup + FLAGS.steps * FLAGS.reps + FLAGS.a2a_steps * (FLAGS.reps + 1))
                   * len(FLAGS.strategies))
    job = runtime.build_job(FLAGS.model, overrides, FLAGS.expert_parallel, total_steps, 3e-3, 10,
                            FLAGS.workload, FLAGS.shift_every, FLAGS.seed,
                            FLAGS.accelerator, FLAGS.accelerator_profile)
    link = None
    if FLAGS.link_probe_mib > 0 and job.hosts > 1:
        from launch.link_probe import measure_link

        link = measure_link(FLAGS.link_probe_mib)
    strategies, drivers, ckpts = _strategies(job, workdir)
    runner = Runner(job, FLAGS.seed)
    probed = FLAGS.a2a_steps
    for name, strategy in strategies.items():
        # Compiles the probed variant too.
        runner.block(strategy, drivers[name], FLAGS.warmup + probed, probed)
        if job.host == 0:
            print(f"warm-up of {name} done", flush=True)
    samples = {name: [] for name in strategies}  # (seconds, profiled, compiled) per step
    a2a = {name: [] for name in strategies}
    names = list(strategies)
    runner.record = True
    for rep in range(FLAGS.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        start = runner.snapshot()  # every strategy replays the same steps from here
        for k, name in enumerate(order):
            if k:
                runner.rewind(start)
            times, phases = runner.block(strategies[name], drivers[name], FLAGS.steps + probed,
                                         probed)
            samples[name] += times
            a2a[name] += phases
        if job.host == 0:
            print(f"repetition {rep + 1}/{FLAGS.reps}: " + ", ".join(
                f"{n} {statistics.median(t for t, _, _ in samples[n]) * 1e3:.1f} ms"
                for n in order if samples[n]), flush=True)
    for name, ckpt in ckpts.items():  # one more status round: the last versions' commits
        runner.save_index[name] = runner.save_index.get(name, 0) + 1
        runner.committed(name, [{"newly_committed": ckpt.confirm(120).newly_committed}])
    ram = {}
    for name, strategy in strategies.items():
        held = float(ckpts[name].store.bytes_held()) if name in ckpts else 0.0
        ram[name] = allgather_floats([held, float(strategy.bytes_per_step)], job.hosts)
    zeros = [0.0] * len(cpu_account.GROUPS)
    cpu = {name: {"all": allgather_floats(runner.cpu.get(name, zeros), job.hosts),
                  "steady": allgather_floats(runner.steady_cpu.get(name, zeros), job.hosts)}
           for name in strategies}
    schedules = {name: {**summary, "profiled_steps": drivers[name].profiled_steps,
                        "cache_replan_steps": drivers[name].cache_replans}
                 for name, strategy in strategies.items()
                 if (summary := strategy.schedule_summary()) is not None}
    recovery = {name: recovery_times(ckpts[name], job, FLAGS.replicas)
                for name in ("inmem", "pec") if name in strategies}
    for name, strategy in strategies.items():
        if name in ("blocking", "blocking_disk", "orbax_async", "orbax_emergency"):
            if name.startswith("orbax"):
                strategy.manager.wait_until_finished()  # its saves are on disk
            recovery[name] = baseline_recovery(name, strategy, job)
    for strategy in strategies.values():
        strategy.close()
    if job.host == 0:
        result = {"samples": samples, "a2a": a2a, "ram": ram, "cpu": cpu, "recovery": recovery,
                  "link": link,
                  "losses": {str(s): v for s, v in runner.losses.items()},
                  "buckets": {str(s): v for s, v in runner.buckets.items()},
                  "schedules": schedules, "saves": runner.saves,
                  "transport": {name: _transport(name) for name in strategies},
                  "blocked": runner.blocked, "emulation_checks": runner.emulation,
                  "emulation": (None if job.trainer.emulation is None
                                else job.trainer.emulation.profile),
                  "device_kind": (None if jax.devices()[0].platform == "cpu"
                                  else f"{jax.device_count()}x {jax.devices()[0].device_kind}"),
                  "commits": {name: {"timed": runner.timed_versions.get(name, []),
                                     "committed_at": {str(v): i for v, i in
                                                      runner.committed_at.get(name, {}).items()}}
                              for name in ckpts},
                  "state_bytes": sum(x.size * x.dtype.itemsize
                                     for x in jax.tree.leaves(job.trainer.abstract_state))}
        (workdir / "worker_result.json").write_text(json.dumps(result))


def _bandwidth(mib: int) -> dict:
    """This host's copy bandwidths (launch.experiments.bandwidth) for the JSON."""
    from launch.experiments.bandwidth import measure

    copies = measure(mib << 20, 5, os.path.dirname(FLAGS.store_root.rstrip("/")) or "/dev/shm")
    backend = copies.pop("backend")
    return {"memcpy_gbps": copies["host memcpy"]["median_gb_s"],
            "store_ingest_gbps": copies["store ingest"]["median_gb_s"],
            "restore_gbps": copies["store restore"]["median_gb_s"],
            "mib": mib, "backend": backend["platform"], "copies": copies}


def _machine(raw: dict) -> str:
    """The machine in words, for the tables' captions."""
    import platform

    import jax

    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    where = raw.get("device_kind") or f"{os.cpu_count()}-core CPU"
    return (f"{where}, {pages / 2**30:.0f} GiB RAM, {platform.system()}, python "
            f"{platform.python_version()}, jax {jax.__version__}")


def _run_cluster(workdir: Path) -> int:
    """The workers' job, behind shaped links with --link_gbps (``launch.cluster.netns``)."""
    link = LinkOptions(gbps=FLAGS.link_gbps, latency_ms=FLAGS.link_latency_ms)
    with links_for("bench", FLAGS.hosts, link) as network:
        return cluster_lib.run_workers("launch.bench", sys.argv[1:], FLAGS.hosts,
                                       FLAGS.devices_per_host, workdir, FLAGS.timeout_s,
                                       network=network)


def _link_idle_share(results: dict, link: dict) -> float | None:
    """R of this run: the largest version any strategy sends per host, over the
    measured one-way link rate (else the requested one) and none's idle link."""
    none = results.get("none", {})
    per_host = max((r["ckpt_bytes_per_step"] for r in results.values()), default=0) / FLAGS.hosts
    rate = link.get("one_way_gbps") or (FLAGS.link_gbps or None)
    return step_stats.link_idle_share(per_host, rate, none.get("median_step_s"),
                                      none.get("a2a_median_s"))


def _link_record(measured: dict | None) -> dict:
    """The JSON's "link": what was asked for and what the hosts measured."""
    requested = LinkOptions(gbps=FLAGS.link_gbps, latency_ms=FLAGS.link_latency_ms)
    return {**requested.record(), **(measured or {})}


def main(argv: list[str]) -> None:
    del argv
    unknown = [s for s in FLAGS.strategies if s not in STRATEGIES and s not in VARIANTS]
    if unknown:
        print(f"bench: error: --strategies: unknown {unknown}; known: {', '.join(STRATEGIES)}, "
              f"{', '.join(VARIANTS)}", file=sys.stderr)
        sys.exit(2)
    if FLAGS.pec_k < 1 and any(VARIANTS.get(s, s) in PEC for s in FLAGS.strategies):
        print(f"bench: error: --pec_k={FLAGS.pec_k}: the pec rows checkpoint K experts per MoE "
              f"layer: they need --pec_k > 0", file=sys.stderr)
        sys.exit(2)
    try:
        AcceleratorConfig(accelerator=FLAGS.accelerator, profile=FLAGS.accelerator_profile)
        link = LinkOptions(gbps=FLAGS.link_gbps, latency_ms=FLAGS.link_latency_ms)
    except ValueError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        sys.exit(2)
    if link.shaped and FLAGS.platform == "gpu":
        print("bench: error: --link_gbps shapes the simulated CPU hosts' links; not with "
              "--platform=gpu", file=sys.stderr)
        sys.exit(2)
    workdir = cluster_lib.scratch_dir(FLAGS.workdir, "capricorn_bench_")
    if FLAGS.process_id >= 0:
        runtime.exit_now_on_failure(bench_worker, FLAGS.process_id, workdir)
        return
    import shutil

    shutil.rmtree(FLAGS.store_root, ignore_errors=True)
    if FLAGS.platform == "gpu":
        xla_flags.set_overlap_flags()  # before the GPU backend starts
        if FLAGS.hosts != 1 or FLAGS.replicas != 1:
            print("bench: error: --platform=gpu runs in this process: --hosts=1 --replicas=1",
                  file=sys.stderr)
            sys.exit(2)
        code = 0
        bench_worker(0, workdir)
    else:
        code = _run_cluster(workdir)
    shutil.rmtree(FLAGS.store_root, ignore_errors=True)
    result_file = workdir / "worker_result.json"
    if code != 0 or not result_file.exists():
        print(f"bench: error: a host failed (exit code {code}); no results reported",
              file=sys.stderr)
        sys.exit(code or 1)
    try:
        raw = json.loads(result_file.read_text())
        results = summarize(raw)
    except RuntimeError as e:
        print(f"bench: error: {e}; no results reported", file=sys.stderr)
        sys.exit(1)
    print(markdown(results))
    link = _link_record(raw.get("link"))
    share = _link_idle_share(results, link)
    emulated = raw.get("emulation")
    if emulated:
        checks = {n: r["emulation_check"] for n, r in results.items() if r.get("emulation_check")}
        print(f"emulated accelerator: profile {emulated}; layer windows against the waits: "
              + (", ".join(f"{n} median |error| {c['median_abs_error']:.1%} over "
                           f"{c['windows']} windows" for n, c in checks.items())
                 or "no profiled step"))
    print("R (version link time / idle link time per step): "
          + (f"{share:.2f}" if share is not None else "unknown (needs --link_gbps and none's "
             "all-to-all time)"))
    print(f"link: {link['describe']}" + (
        f"; measured one way {link['one_way_gbps']:.3f} Gbit/s, exchange "
        f"{link['exchange_gbps']:.3f} Gbit/s per host ({link['mib']:g} MiB per device)"
        if "one_way_gbps" in link else ""))
    bandwidth = _bandwidth(FLAGS.bandwidth_mib) if FLAGS.bandwidth_mib > 0 else None
    if bandwidth is not None:
        print(f"bandwidth ({FLAGS.bandwidth_mib} MiB): memcpy {bandwidth['memcpy_gbps']:.2f} "
              f"GB/s, store ingest {bandwidth['store_ingest_gbps']:.2f} GB/s, store restore "
              f"{bandwidth['restore_gbps']:.2f} GB/s")
    config = {k: getattr(FLAGS, k) for k in (
        "model", "workload", "steps", "reps", "hosts", "devices_per_host", "dispatch", "replicas",
        "global_batch", "platform", "a2a_steps", "ckpt_budget", "accelerator",
        "accelerator_profile")}
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps({
            "strategies": results, "config": config, "bandwidth": bandwidth, "link": link,
            "link_idle_share": share, "accelerator": FLAGS.accelerator,
            "accelerator_profile": emulated,
            # step -> strategy -> capacity factors
            "buckets": raw.get("buckets", {}), "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["python -m launch.bench",
                                 *(a for a in sys.argv[1:] if not a.startswith("--json"))]),
            "machine": _machine(raw)}, indent=1))
    if FLAGS.png:
        plot(results, FLAGS.png,
             f"{FLAGS.model}, {FLAGS.hosts}x{FLAGS.devices_per_host} CPU, {FLAGS.workload}")


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    define_flags()
    app.run(main)
