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
(not timed) of the variant with ``capricorn_jax.experimental.CollectiveProbe`` attached:
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

``--time_scale=k`` (emulated runs) dilates time: every emulated wait k times
longer, every shaped link k times slower (``config.dilated_link``) and the
workers' wall-clock bounds k times longer, with the same bytes: the step's
emulated and link-bound parts last k times longer, its fixed-time work (CPU,
GIL, the kernel's per-packet work) does not, so R would stay but for that
work's share of none's idle link time, and points at k = 1, 2, 4 split the two.

Output: a markdown table on stdout, ``--json`` (contract in DESIGN.md), and a
PNG bar chart with ``--png``. Exits non-zero, and reports no number, when any
host or strategy fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from absl import app, flags, logging

from capricorn_jax import DetectorOptions
from capricorn_jax.experimental import xla_flags
from launch import runtime
from launch.bench import records, step_stats, stores
from launch.bench.config import BenchConfig, BenchSetup
from launch.bench.recovery import baseline_recovery, recovery_times
from launch.bench.report import VARIANTS, markdown, plot, summarize
from launch.bench.runner import Runner
from launch.cluster import cpu_account
from launch.cluster import processes as cluster_lib
from launch.cluster.netns import links_for
from launch.errors import FlagError
from launch.strategies import IN_MEMORY, PEC, SCHEDULED, STRATEGIES, STRATEGY_PROFILE
from launch.tiers import memory_options, memory_tier

FLAGS = flags.FLAGS


# launch.cli_flags groups (and their flags) that the bench takes, and its own
# defaults of some (same meaning as in launch.train): its stores live in a
# folder of the run's own under the store root, removed after the run
# (launch.bench.stores), and its published results use bucketed dispatch
# and K=2 for the pec rows.
SHARED_FLAGS = {
    "cluster": ("hosts", "devices_per_host", "platform", "timeout_s", "process_id",
                "coordinator"),
    "links": None, "model": None, "accelerator": None,
    "data": ("steps", "workdir", "seed", "workload", "shift_every"),
    "checkpoint": ("replicas", "chunk_bytes", "chunk_path", "store_root", "ckpt_budget",
                   "persist_every", "pec_k"),
    "profiling": ("profile_first_n", "profile_trigger", "drift_threshold"),
    "output": ("json", "png"),
}
BENCH_DEFAULTS = {"steps": 10, "dispatch": "bucketed", "pec_k": 2,
                  "store_root": "/dev/shm/capricorn_jax_bench"}
# Wall-clock bounds of the workers (seconds at --time_scale=1; each is
# multiplied by --time_scale): jax.distributed's heartbeat (the runtime's
# default; the bench takes no --peer_timeout_s) and the wait for the last
# versions' commits after the timed steps.
PEER_TIMEOUT_S = 100.0
CONFIRM_S = 120.0


def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """The command's flags, defined only when run as a command (or by a test
    on a fresh ``fv``): a module importing this one for its logic defines none."""
    from launch import cli_flags

    cli_flags.define(fv, SHARED_FLAGS, BENCH_DEFAULTS)
    flags.adopt_module_key_flags(cli_flags, flag_values=fv)
    flags.DEFINE_list("strategies", ["none", "inmem"],
                      f"Strategies, from {', '.join(STRATEGIES)}, and {', '.join(VARIANTS)} "
                      f"(blocking writing to the scratch directory's disk instead of the RAM "
                      f"disk; a *_in_graph row on the in-graph path; capricorn_paced: its "
                      f"chunk socket paced at the link probe's rate).", flag_values=fv)
    flags.DEFINE_integer("reps", 5, "Repetitions; strategies interleave within each.",
                         flag_values=fv)
    flags.DEFINE_integer("a2a_steps", 0,
                         "Steps per block (after the timed ones, not timed) that run with the "
                         "all-to-all probe: per-device stamps around each MoE all-to-all, under "
                         "the strategy's own checkpoint traffic (with --nocollectives: the "
                         "all-to-all column's only samples).", flag_values=fv)
    flags.DEFINE_boolean("collectives", True,
                         "The all-to-all probe on every step of every strategy (its timed "
                         "steps' records: the JSON's \"collectives\" and \"expert_spans\"; "
                         "the all-to-all column from them); its callbacks cost every "
                         "strategy alike.", flag_values=fv)
    flags.DEFINE_integer("warmup", 3, "Warm-up steps per strategy (compilation), not measured.",
                         flag_values=fv)
    flags.DEFINE_integer("bandwidth_mib", 64,
                         "After the strategies: this host's memcpy, store ingest and store restore "
                         "bandwidth on this many MiB (the JSON's \"bandwidth\"; 0: skip).",
                         flag_values=fv)
    flags.DEFINE_float("link_probe_mib", 8.0,
                       "Before the strategies: the link each host gets, measured with a "
                       "collective-permute of this many MiB per device, one way and as an "
                       "exchange (the JSON's \"link\"; 0: skip).", flag_values=fv)
    flags.DEFINE_float("time_scale", 1.0,
                       "Time dilation, k >= 1 (k != 1 needs --accelerator=emulated): every "
                       "emulated wait k times longer and every shaped link's rate divided by k "
                       "(its latency k times longer, its bucket the same bytes), and the "
                       "bench's wall-clock bounds that follow the step or the link (--timeout_s, "
                       "the in-memory tier's timeouts and --ckpt_budget, the peer timeout, its "
                       "own waits) k times longer. The bytes stay and the step's emulated and "
                       "link-bound parts last k times longer, its fixed-time work (CPU, GIL, "
                       "the kernel's per-packet work) does not: points at k = 1, 2, 4 split "
                       "the two (R would stay but for that work's share of the idle link "
                       "time). The JSON's \"time_scale\".", flag_values=fv)
    return fv


def _checkpointer(name: str, job, config: BenchConfig, link: dict | None = None):
    """An in-memory strategy's InMemoryCheckpointer (its own job in the store
    root); a ``*_paced`` row's chunk socket paced at ``link``'s (the probe's)
    one-way rate."""
    import dataclasses

    import capricorn_jax

    options = memory_options(
        store_root=config.store_root, job=f"bench-{name}", replicas=config.replicas,
        chunk_bytes=config.chunk_bytes,
        # A strategy's statuses refresh only when it saves; interleaved blocks of
        # the other strategies must not read as replicas that stopped answering.
        replication_timeout_s=config.setup.timeout_s, budget_s=config.ckpt_budget,
        pec=capricorn_jax.PecOptions(k=config.pec_k, k_persist=config.pec_k, dynamic=False)
        if VARIANTS.get(name, name) in PEC else None,
        traffic_class=config.setup.link.traffic_class, time_scale=config.setup.time_scale)
    if name.endswith("_paced"):
        if link is None:
            raise ValueError(f"{name} paces at the link probe's rate: it needs --hosts > 1 "
                             f"and --link_probe_mib > 0")
        options = dataclasses.replace(options, chunk_pacing_gbps=link["one_way_gbps"])
    return memory_tier(options, job.trainer, job.mesh, job.host, job.hosts)


def _strategies(job, workdir: Path, config: BenchConfig,
                link: dict | None = None) -> tuple[dict, dict, dict]:
    """({name: strategy}, {name: its ProfilingDriver}, {name: its checkpointer});
    ``link``: the link probe's measurement (``*_paced`` rows pace at it)."""
    import capricorn_jax
    from launch.strategies import make_strategy

    strategies, drivers, ckpts = {}, {}, {}
    ram = Path(config.store_root)
    # Every strategy writes to the RAM disk of the stores, but blocking_disk
    # (the scratch directory, a disk) and orbax_emergency's persistent tier.
    directories = {"blocking": ram / "blocking" / f"host{job.host}",
                   "blocking_disk": workdir / "blocking" / f"host{job.host}",
                   "orbax_async": ram / "orbax",
                   "orbax_emergency": workdir / "orbax_emergency"}
    for name in config.strategies:
        base = VARIANTS.get(name, name)
        # Its own step cache: it compiles what it would compile in its own run.
        trainer = job.trainer.with_own_steps()
        if base in IN_MEMORY:
            ckpts[name] = _checkpointer(name, job, config, link)
        strategies[name] = make_strategy(
            base, trainer, checkpointer=ckpts.get(name),
            directory=directories.get(name), first_n=config.profile_first_n,
            chunk_cap=config.chunk_bytes, chunk_path=config.chunk_path_of(name),
            span_windows=not name.endswith("_layers"), tier="local",
            local_directory=ram / "orbax_local",
            persist_every=config.persist_every or 10,
            traffic_class=config.setup.link.traffic_class, replicas=config.replicas,
            time_scale=config.setup.time_scale)
        strategies[name].name = name  # a variant's row keeps its own name
        options = capricorn_jax.ProfilingOptions(
            capricorn_jax.ProfilePolicy(STRATEGY_PROFILE.get(base, "off")),
            config.profile_first_n,
            DetectorOptions(threshold=config.drift_threshold), trigger=config.profile_trigger)
        drivers[name] = capricorn_jax.ProfilingDriver(trainer, strategies[name], options,
                                                      collectives=trainer.all_to_alls,
                                                      reductions=trainer.gradient_reductions,
                                                      next_factors=trainer.next_factors)
    return strategies, drivers, ckpts


def bench_worker(config: BenchConfig, process_id: int, workdir: Path) -> None:
    import jax

    from capricorn_jax.experimental import allgather_floats

    setup = config.setup
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    runtime.init_distributed(setup.hosts, setup.coordinator, process_id,
                             single_process="orbax_emergency" in config.strategies,
                             peer_timeout_s=PEER_TIMEOUT_S * setup.time_scale)
    job = runtime.build_job(setup.model, setup.overrides(), setup.expert_parallel,
                            config.total_steps(), 3e-3, 10, setup.workload, setup.shift_every,
                            setup.seed, setup.accelerator.accelerator,
                            setup.accelerator.profile, setup.time_scale)
    link = None
    if config.link_probe_mib > 0 and job.hosts > 1:
        from launch.link_probe import measure_link

        link = measure_link(config.link_probe_mib)
    strategies, drivers, ckpts = _strategies(job, workdir, config, link)
    runner = Runner(job, setup.seed, every_step=config.collectives)
    probed = config.a2a_steps
    warmup = {}
    # Every strategy warms up on the same steps (from the same state): each
    # meets the same capacity buckets there, so no strategy's timed steps
    # compile a bucket that another's warm-up happened to cover (the first
    # long-run sweep's warm-ups ran on consecutive steps: none compiled 5
    # buckets in its timed steps, pec 4, on the same trajectory).
    warm_start = runner.snapshot()
    for k, (name, strategy) in enumerate(strategies.items()):
        if k:
            runner.rewind(warm_start)
        # Compiles the probed variant too.
        compiles, t0 = runner.compiles, time.perf_counter()
        runner.block(strategy, drivers[name], config.warmup + probed, probed)
        warmup[name] = {"seconds": time.perf_counter() - t0, "steps": config.warmup + probed,
                        "compiles": runner.compiles - compiles}
        if job.host == 0:
            print(f"warm-up of {name} done ({warmup[name]['seconds']:.1f} s, "
                  f"{warmup[name]['compiles']} compiles)", flush=True)
    # (seconds, profiled, compiled) per step
    samples: dict[str, list[tuple[float, bool, bool]]] = {name: [] for name in strategies}
    a2a: dict[str, list[float]] = {name: [] for name in strategies}
    names = list(strategies)
    runner.record = True
    for rep in range(config.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        start = runner.snapshot()  # every strategy replays the same steps from here
        for k, name in enumerate(order):
            if k:
                runner.rewind(start)
            # The last repetition's blocks end with one step more, not timed:
            # an in-memory version is committed on its replicas by the save
            # after it (the replication is pipelined), which the last timed
            # step's version has nowhere else; earlier blocks' last versions
            # are committed by the strategy's next block.
            tail = probed + (rep == config.reps - 1 and probed == 0)
            times, phases = runner.block(strategies[name], drivers[name], setup.steps + tail,
                                         tail)
            samples[name] += times
            a2a[name] += phases
        if job.host == 0:
            print(f"repetition {rep + 1}/{config.reps}: " + ", ".join(
                f"{n} {statistics.median(t for t, _, _ in samples[n]) * 1e3:.1f} ms"
                for n in order if samples[n]), flush=True)
    for name, ckpt in ckpts.items():  # one more status round: the last versions' commits
        runner.save_index[name] = runner.save_index.get(name, 0) + 1
        confirmed = ckpt.confirm(CONFIRM_S * setup.time_scale)
        runner.committed(name, [{"newly_committed": confirmed.newly_committed}])
    ram = {}
    for name, strategy in strategies.items():
        held = float(ckpts[name].store.bytes_held()) if name in ckpts else 0.0
        ram[name] = allgather_floats([held, float(strategy.bytes_per_step)], job.hosts)
    zeros = [0.0] * len(cpu_account.GROUPS)
    cpu = {name: {"all": allgather_floats(runner.cpu.get(name, zeros), job.hosts),
                  "steady": allgather_floats(runner.steady_cpu.get(name, zeros), job.hosts)}
           for name in strategies}
    schedules = {name: {**summary, "profiled_steps": drivers[name].profiled_steps,
                        "cache_replan_steps": drivers[name].cache_replans,
                        "model_replan_steps": drivers[name].model_replans}
                 for name, strategy in strategies.items()
                 if (summary := strategy.schedule_summary()) is not None}
    recovery = {name: recovery_times(ckpts[name], job, config.replicas, setup.time_scale)
                for name in strategies if name in IN_MEMORY and name not in SCHEDULED}
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
                  "transport": {name: config.transport_of(name) for name in strategies},
                  "blocked": runner.blocked, "emulation_checks": runner.emulation,
                  "warmup": warmup, "records": runner.records,
                  # Profiling that a strategy does once (gemini's first steps):
                  # a one-time cost; capricorn's re-profiles recur.
                  "one_time_profiling": [n for n in strategies if STRATEGY_PROFILE.get(
                      VARIANTS.get(n, n)) == "first_n"],
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


def _bandwidth(mib: int, store_root: str) -> dict:
    """This host's copy bandwidths (launch.experiments.bandwidth) for the JSON."""
    from launch.experiments.bandwidth import measure

    copies = measure(mib << 20, 5, os.path.dirname(store_root.rstrip("/")) or "/dev/shm")
    backend = copies.pop("backend")
    return {"memcpy_gbps": copies["host memcpy"]["median_gb_s"],
            "store_ingest_gbps": copies["store ingest"]["median_gb_s"],
            "restore_gbps": copies["store restore"]["median_gb_s"],
            "mib": mib, "backend": backend["platform"], "copies": copies}


def _machine(raw: dict) -> str:
    """The machine in words, for the tables' captions."""
    import platform
    from importlib.metadata import version  # the installed JAX's, without starting it

    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    where = raw.get("device_kind") or f"{os.cpu_count()}-core CPU"
    return (f"{where}, {pages / 2**30:.0f} GiB RAM, {platform.system()}, python "
            f"{platform.python_version()}, jax {version('jax')}")


def _run_cluster(setup: BenchSetup, workdir: Path, argv: list[str]) -> int:
    """The workers' job (flags ``argv``: the run's store folder as their
    ``--store_root``), behind shaped links with --link_gbps (``launch.cluster.netns``)."""
    with links_for("bench", setup.hosts, setup.link) as network:
        return cluster_lib.run_workers("launch.bench", argv, setup.hosts,
                                       setup.devices_per_host, workdir,
                                       setup.timeout_s * setup.time_scale, network=network)


def _version_link(results: dict, link: dict, setup: BenchSetup) -> tuple[float, float | None]:
    """(the largest version any strategy sends per host, the measured one-way
    link rate, else the requested one): R's numerator."""
    per_host = max((r["ckpt_bytes_per_step"] for r in results.values()), default=0) / setup.hosts
    return per_host, link.get("one_way_gbps") or (setup.link.gbps or None)


def _link_idle_share(results: dict, link: dict, setup: BenchSetup) -> float | None:
    """R of this run: the version's link time (``_version_link``) over none's
    idle link."""
    none = results.get("none", {})
    per_host, rate = _version_link(results, link, setup)
    return step_stats.link_idle_share(per_host, rate,
                                      none.get("steady_median_s") or none.get("median_step_s"),
                                      none.get("a2a_median_s"))


def _span_idle_share(results: dict, link: dict, setup: BenchSetup) -> float | None:
    """R over the time a schedule can plan: the same version link time over
    none's steady step less every collective its marks bracket (the gradient
    all-reduce too, ``records.idle_outside_collectives``); None without none's
    collective records (``--collectives`` off)."""
    idle = records.idle_outside_collectives(results.get("none", {}))
    return step_stats.link_idle_share(*_version_link(results, link, setup), idle, 0.0)


def header(config: BenchConfig) -> str:
    """The console's first line: what runs, behind which link, at which time scale."""
    s = config.setup
    k = s.time_scale
    dilation = "time scale 1"
    if k != 1:
        rate = f" of {s.link.gbps * k:g} Gbit/s" if s.link.shaped else ""
        dilation = (f"time scale {k:g} (emulated waits {k:g}x longer, link rate 1/{k:g}{rate}, "
                    f"the same bytes)")
    return (f"bench: {','.join(config.strategies)} on {s.hosts}x{s.devices_per_host} "
            f"({s.model}, accelerator {s.accelerator.accelerator}), link: {s.link.describe()}; "
            f"{dilation}")


def main(argv: list[str]) -> None:
    del argv
    try:
        config = BenchConfig.from_flags(FLAGS)
    except FlagError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        sys.exit(2)
    if config.setup.process_id >= 0 or config.setup.platform == "gpu":  # a trainer
        runtime.bound_orbax_barriers(FLAGS)  # (the supervisor imports no Orbax)
    run(config)


def run(config: BenchConfig) -> None:
    """The command on its configuration: the workers (or this process on a GPU),
    then the report."""
    setup = config.setup
    workdir = cluster_lib.scratch_dir(setup.workdir, "capricorn_bench_")
    if setup.process_id >= 0:
        runtime.exit_now_on_failure(bench_worker, config, setup.process_id, workdir)
        return
    print(header(config), flush=True)
    # The run's stores in a folder of its own; what another live run stores
    # under the same root stays (launch.bench.stores: issue 50).
    stores.clear_stale(config.store_root)
    run_root = stores.run_root(config.store_root)
    try:
        if setup.platform == "gpu":
            xla_flags.set_overlap_flags()  # before the GPU backend starts
            if setup.hosts != 1 or config.replicas != 1:
                print("bench: error: --platform=gpu runs in this process: --hosts=1 "
                      "--replicas=1", file=sys.stderr)
                sys.exit(2)
            code = 0
            bench_worker(dataclasses.replace(config, store_root=str(run_root)), 0, workdir)
        else:
            code = _run_cluster(setup, workdir, stores.worker_argv(sys.argv[1:], run_root))
    finally:
        stores.release(config.store_root, run_root)
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
    link = {**setup.link.record(), **(raw.get("link") or {})}  # asked for, then measured
    share = _link_idle_share(results, link, setup)
    span_share = _span_idle_share(results, link, setup)
    emulated = raw.get("emulation")
    if emulated:
        checks = {n: r["emulation_check"] for n, r in results.items() if r.get("emulation_check")}
        print(f"emulated accelerator: profile {emulated}; layer windows against the waits: "
              + (", ".join(f"{n} median |error| {c['median_abs_error']:.1%} over "
                           f"{c['windows']} windows" for n, c in checks.items())
                 or "no profiled step"))
    print("R (version link time / idle link time per step): "
          + (f"{share:.2f}" if share is not None else "unknown (needs --link_gbps and none's "
             "all-to-all time)")
          + (f"; over the spans outside every collective (the all-reduce too): "
             f"{span_share:.2f}" if span_share is not None else ""))
    print(f"link: {link['describe']}" + (
        f"; measured one way {link['one_way_gbps']:.3f} Gbit/s, exchange "
        f"{link['exchange_gbps']:.3f} Gbit/s per host ({link['mib']:g} MiB per device)"
        if "one_way_gbps" in link else ""))
    bandwidth = (_bandwidth(config.bandwidth_mib, config.store_root)
                 if config.bandwidth_mib > 0 else None)
    if bandwidth is not None:
        print(f"bandwidth ({config.bandwidth_mib} MiB): memcpy {bandwidth['memcpy_gbps']:.2f} "
              f"GB/s, store ingest {bandwidth['store_ingest_gbps']:.2f} GB/s, store restore "
              f"{bandwidth['restore_gbps']:.2f} GB/s")
    if config.json:
        Path(config.json).write_text(json.dumps({
            "strategies": results, "config": config.record(), "bandwidth": bandwidth,
            "time_scale": setup.time_scale,
            "link": link, "link_idle_share": share, "span_idle_share": span_share,
            "accelerator": setup.accelerator.accelerator,
            "accelerator_profile": emulated,
            # step -> strategy -> capacity factors
            "buckets": raw.get("buckets", {}), "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["python -m launch.bench",
                                 *(a for a in sys.argv[1:] if not a.startswith("--json"))]),
            "machine": _machine(raw)}, indent=1))
    if config.png:
        plot(results, config.png,
             f"{setup.model}, {setup.hosts}x{setup.devices_per_host} CPU, {setup.workload}")


def _run() -> None:
    """The command (``python -m launch.bench``, its ``__main__``)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    define_flags()
    app.run(main)
