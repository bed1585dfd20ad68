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

from capricorn_jax import DetectorOptions, ProfilingOptions
from capricorn_jax.experimental import TRIGGERS, xla_flags
from launch import cluster as cluster_lib
from launch import cpu_account, runtime, step_stats
from launch.metrics import different_work
from launch.netns import LinkOptions, links_for
from launch.strategies import IN_MEMORY, PEC, STRATEGIES, STRATEGY_PROFILE

FLAGS = flags.FLAGS
# Bench-only rows: a strategy on other media or another chunk path (name ->
# the strategy it runs).
VARIANTS = {"blocking_disk": "blocking", "gemini_in_graph": "gemini",
            "capricorn_in_graph": "capricorn"}


def _chunk_path(name: str) -> str:
    """The chunk path of a row: its variant's, else --chunk_path."""
    return "in_graph" if name.endswith("_in_graph") else FLAGS.chunk_path


def define_flags() -> None:
    """The command's flags, defined only when run as a command: a test or
    another launcher importing this module for its logic must not define
    flags of the same names twice."""
    from launch import accelerator

    accelerator.define_flags()
    flags.DEFINE_list("strategies", ["none", "inmem"],
                      f"Strategies, from {', '.join(STRATEGIES)}, and {', '.join(VARIANTS)} "
                      f"(blocking writing to the scratch directory's disk instead of the RAM disk).")
    flags.DEFINE_string("model", "tiny", "Model config.")
    flags.DEFINE_enum("workload", "steady", ["steady", "dynamic", "synthetic"], "Data workload.")
    flags.DEFINE_integer("shift_every", 50, "Steps between domain shifts (dynamic workload).")
    flags.DEFINE_integer("steps", 10, "Steps per block (one strategy, one repetition).")
    flags.DEFINE_integer("reps", 5, "Repetitions; strategies interleave within each.")
    flags.DEFINE_integer("a2a_steps", 2,
                         "Steps per block (after the timed ones, not timed) that run with the "
                         "all-to-all probe: per-device stamps around each MoE all-to-all, under "
                         "the strategy's own checkpoint traffic; 0 = no all-to-all column.")
    flags.DEFINE_integer("warmup", 3, "Warm-up steps per strategy (compilation), not measured.")
    flags.DEFINE_integer("hosts", 2, "Simulated hosts.")
    flags.DEFINE_integer("devices_per_host", 2, "CPU devices per host.")
    flags.DEFINE_integer("expert_parallel", 0, "Expert axis size; 0 = all devices.")
    flags.DEFINE_enum("dispatch", "bucketed", ["", "fixed", "bucketed"],
                      "MoE dispatch; bucketed (load-dependent) by default; '' = the model's.")
    flags.DEFINE_integer("global_batch", 0, "Sequences per step over all hosts; 0 = the model's.")
    flags.DEFINE_integer("replicas", 2, "In-memory replicas m.")
    flags.DEFINE_integer("chunk_bytes", 4 << 20, "In-memory transfer chunk size.")
    flags.DEFINE_enum("chunk_path", "auto", ["auto", "in_graph", "threaded"],
                      "gemini/capricorn: chunks inside the jitted step (in_graph) or from a "
                      "sender thread started by boundary marks (threaded); auto: in_graph "
                      "on GPU, threaded otherwise.")
    flags.DEFINE_integer("pec_k", 2, "Strategy pec: experts per MoE layer in each version (fixed K).")
    flags.DEFINE_integer("persist_every", 10,
                         "orbax_emergency: its persistent tier's interval (steps); its local tier "
                         "saves every step.")
    flags.DEFINE_integer("profile_first_n", ProfilingOptions().first_n,
                         "gemini: the profiled steps its fixed schedule is built from.")
    flags.DEFINE_enum("profile_trigger", ProfilingOptions().trigger, list(TRIGGERS),
                      "capricorn: what asks for a profile (launch.train's --profile_trigger).")
    flags.DEFINE_float("drift_threshold", DetectorOptions().threshold,
                       "capricorn, --profile_trigger=drift: the drift score of the expert load above "
                       "which the next step is profiled (when the schedule in force is at risk).")
    flags.DEFINE_string("store_root", "/dev/shm/capricorn_jax_bench", "RAM disk for the stores.")
    flags.DEFINE_string("workdir", None, "Scratch directory; default: a temporary one.")
    flags.DEFINE_string("json", None, "Write the results here as JSON.")
    flags.DEFINE_string("png", None, "Write a bar chart (median step time, error bars) here.")
    flags.DEFINE_integer("seed", 0, "Seed.")
    flags.DEFINE_float("timeout_s", 3600.0, "Deadline of the whole benchmark.")
    flags.DEFINE_float("ckpt_budget", -1.0,
                       "In-memory strategies: the tier's cost budget in seconds "
                       "(InMemoryOptions.max_wait_s; -1: none, a version every step).")
    flags.DEFINE_integer("bandwidth_mib", 64,
                         "After the strategies: this host's memcpy, store ingest and store restore "
                         "bandwidth on this many MiB (the JSON's \"bandwidth\"; 0: skip).")
    flags.DEFINE_enum("platform", "cpu", ["cpu", "gpu"],
                      "cpu: the simulated cluster (--hosts processes); gpu: this process on the "
                      "local GPU(s), --hosts=1, strategies without peers (--replicas=1).")
    flags.DEFINE_float("link_gbps", 0.0,
                       "Each simulated host in its own network namespace behind a link of this "
                       "many Gbit/s each way (launch.netns; needs root); 0 = unshaped loopback.")
    flags.DEFINE_float("link_latency_ms", 0.0,
                       "One-way latency between two hosts on the shaped links (netem).")
    flags.DEFINE_float("link_probe_mib", 8.0,
                       "Before the strategies: the link each host gets, measured with a "
                       "collective-permute of this many MiB per device, one way and as an "
                       "exchange (the JSON's \"link\"; 0: skip).")
    flags.DEFINE_integer("process_id", -1, "Internal: worker host index.")
    flags.DEFINE_string("coordinator", "", "Internal: coordinator address.")


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
            persist_every=FLAGS.persist_every)
        strategies[name].name = name  # a variant's row keeps its own name
        options = capricorn_jax.ProfilingOptions(
            STRATEGY_PROFILE.get(base, "off"), FLAGS.profile_first_n,
            DetectorOptions(threshold=FLAGS.drift_threshold), trigger=FLAGS.profile_trigger)
        drivers[name] = capricorn_jax.ProfilingDriver(job.trainer, strategies[name], options,
                                                      collectives=job.trainer.all_to_alls,
                                                      next_factors=job.trainer.next_factors)
    return strategies, drivers, ckpts


class _Runner:
    """Steps the job under a given strategy, timing each step."""

    def __init__(self, job):
        import jax

        import capricorn_jax
        from models.capacity import choose_capacity_factors

        self.job, self.choose = job, choose_capacity_factors
        self.state = job.trainer.init_state(FLAGS.seed)
        self.max_routed, self.step = None, 0
        self.probe = capricorn_jax.CollectiveProbe()
        # Every XLA compile in this process (a step variant, or a program a
        # strategy's save compiles, e.g. PEC's packing for a new K): a step
        # during which one ran is not timed.
        self.compiles = 0
        self.saves: dict[str, list[int]] = {}  # strategy -> [versions saved, skipped]
        # Commit accounting (in-memory strategies): the versions of timed steps
        # with the strategy's save index, and the save index at which each
        # version was first reported on every holder of every owner.
        self.timed_versions: dict[str, list[tuple[int, int]]] = {}
        self.save_index: dict[str, int] = {}  # saves and status rounds, per strategy
        # Identical work: step -> {strategy: loss} and {strategy: capacity factors}
        # of the timed repetitions, where every strategy replays the same steps.
        self.losses: dict[int, dict[str, float]] = {}
        self.buckets: dict[int, dict[str, list[float]]] = {}
        self.record = False
        self.committed_at: dict[str, dict[int, int]] = {}
        # strategy -> CPU seconds of this process in its timed steps, per
        # launch.cpu_account group (sampled outside the timed span); and in
        # its steady-state steps only (neither profiled nor compiled).
        self.cpu: dict[str, list[float]] = {}
        self.steady_cpu: dict[str, list[float]] = {}
        # strategy -> per timed step, seconds the training thread spent in the
        # step call and in the strategy's save (launch.step_stats.blocked);
        # and the emulated windows' check records (step_stats.emulation_errors).
        self.blocked: dict[str, list[dict[str, float]]] = {}
        self.emulation: dict[str, list[dict]] = {}

        def on_event(event: str, seconds: float, **_) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                self.compiles += 1

        jax.monitoring.register_event_duration_secs_listener(on_event)

    def snapshot(self) -> tuple:
        """The trajectory's position: a copy of the state, the data position,
        the last step's routing maxima and the step."""
        import jax

        return (jax.tree.map(lambda x: x.copy(), self.state), self.job.data.state(),
                self.max_routed, self.step)

    def rewind(self, snapshot: tuple) -> None:
        """Back to ``snapshot`` (its state copied again: a block donates it)."""
        import jax

        state, data, max_routed, step = snapshot
        self.state = jax.tree.map(lambda x: x.copy(), state)
        self.job.data.restore(data)
        self.max_routed, self.step = max_routed, step

    def block(self, strategy, driver, n: int, probed: int = 0
              ) -> tuple[list[tuple[float, bool, bool]], list[float]]:
        """Runs ``n`` steps under ``strategy`` through its ``driver``; the last
        ``probed`` of them run the variant with the all-to-all probe
        (CollectiveProbe) attached.

        Returns:
          ((seconds, profiled, compiled) of each timed step: unprobed, not the
           block's first; all-to-all seconds of each warm probed step: the sum
           of its phases).
        """
        import jax
        import numpy as np

        trainer, times, a2a = self.job.trainer, [], []
        for i in range(n):
            hooks = (self.probe,) if i >= n - probed else ()
            factors = self.choose(self.job.cfg, self.max_routed, trainer.tokens_per_group)
            compiles = self.compiles
            cpu_before = cpu_account.sample()
            t0 = time.perf_counter()
            batch = trainer.global_batch(self.job.data.next_batch())
            run = driver.step(self.step, factors, self.state, batch, hooks)
            self.state, out = run.state, run.metrics
            loss = float(out["loss"])
            t_stepped = time.perf_counter()
            if self.record:
                self.losses.setdefault(self.step, {})[strategy.name] = loss
                self.buckets.setdefault(self.step, {})[strategy.name] = list(factors)
            cached = not run.compiled and run.profile is None and self.compiles == compiles
            if hooks:
                jax.block_until_ready(self.state)  # the backward pass's stamps are in
                phases = self.probe.phase_seconds()
                if cached and phases:
                    a2a.append(sum(phases.values()))
            self.max_routed = [int(v) for v in np.asarray(out["max_routed"])]
            strategy.resume_at(self.step)  # the other strategies ran the steps in between
            events = strategy.save(self.step + 1, self.state,
                                   {"data": self.job.data.state(), "max_routed": self.max_routed},
                                   tokens_per_expert=np.asarray(out["tokens_per_expert"]),
                                   next_step_profiled=driver.profile_next)
            t_saved = time.perf_counter()
            if run.profile is not None and trainer.emulation is not None and self.record:
                self.emulation.setdefault(strategy.name, []).extend(step_stats.emulation_errors(
                    trainer.emulation, run.profile.segments,
                    np.asarray(out["tokens_per_expert"]), trainer.moe_layers))
            count = self.saves.setdefault(strategy.name, [0, 0])
            count[0] += 1
            count[1] += any(e.get("skipped") for e in events)
            index = self.save_index[strategy.name] = self.save_index.get(strategy.name, 0) + 1
            self.committed(strategy.name, events)
            if i > 0 and not hooks:
                self.timed_versions.setdefault(strategy.name, []).append((self.step + 1, index))
            # Checked after the save: it may compile too (e.g. PEC packing).
            if i > 0 and not hooks:
                compiled = run.compiled or self.compiles != compiles
                times.append((time.perf_counter() - t0, run.profile is not None, compiled))
                if self.record:
                    self.blocked.setdefault(strategy.name, []).append(
                        {"step": t_stepped - t0, "save": t_saved - t_stepped})
                if self.record:  # the timed repetitions, as the step times
                    used = cpu_account.delta(cpu_before, cpu_account.sample())
                    _add(self.cpu, strategy.name, used)
                    if run.profile is None and not compiled:
                        _add(self.steady_cpu, strategy.name, used)
            self.step += 1
        return times, a2a

    def committed(self, name: str, events: list[dict]) -> None:
        """Notes the versions these events report committed everywhere for the first time."""
        index = self.save_index.get(name, 0)
        for event in events:
            for version in event.get("newly_committed", ()):
                self.committed_at.setdefault(name, {}).setdefault(version, index)


def _recovery_times(ckpt, job) -> dict:
    import capricorn_jax
    from capricorn_jax.experimental import allgather_floats

    ckpt.wait_until_finished(120)
    out = {}
    local = capricorn_jax.recover(ckpt)
    out["local"] = {"seconds": local.seconds, "bytes_moved": local.bytes_moved,
                    "tiers": local.tiers}
    if job.hosts > 1 and FLAGS.replicas > 1:
        if job.host == 1:
            ckpt.store.wipe()
        allgather_floats([0.0], job.hosts)  # barrier: the wipe is done before anyone scans
        peer = capricorn_jax.recover(ckpt)
        out["peer"] = {"seconds": peer.seconds, "bytes_moved": peer.bytes_moved,
                       "tiers": peer.tiers}
    return out


def _drop_page_cache(job) -> bool:
    """Drops this machine's page cache (host 0; root only), so that a restore
    from disk reads the disk; whether it could (collective)."""
    from capricorn_jax.experimental import allgather_floats

    done = 0.0
    if job.host == 0:
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            done = 1.0
        except OSError:
            pass
    return bool(allgather_floats([done], job.hosts)[0][0])


def _timed_restore(strategy, job, cold: bool) -> dict:
    """Restores ``strategy``'s newest version (collective): the slowest host's
    seconds, the tier, and whether the page cache was dropped first."""
    from capricorn_jax.experimental import allgather_floats

    dropped = _drop_page_cache(job) if cold else False
    allgather_floats([0.0], job.hosts)  # everyone starts together
    t0 = time.perf_counter()
    recovered = strategy.restore()
    seconds = time.perf_counter() - t0
    slowest = max(x[0] for x in allgather_floats([seconds], job.hosts))
    if recovered is None:
        raise RuntimeError(f"{strategy.name}: nothing to restore after the benchmark")
    return {"seconds": slowest, "bytes_moved": recovered.bytes_moved or 0,
            "tiers": recovered.tiers, "step": recovered.step, "cold_cache": dropped}


def _baseline_recovery(name: str, strategy, job) -> dict:
    """Recovery per tier of a baseline (its own restore), on the same state as
    the in-memory strategies'. Disk reads start from a dropped page cache
    when the process may drop it (``cold_cache``)."""
    import shutil

    if name == "orbax_emergency":
        out = {}
        if strategy.local_tier:
            out["local"] = _timed_restore(strategy, job, cold=False)
            shutil.rmtree(strategy.local, ignore_errors=True)  # every host's RAM tier lost
            strategy.local.mkdir(parents=True)
            strategy.manager.reload()
        out["persistent"] = _timed_restore(strategy, job, cold=True)
        return out
    disk = name == "blocking_disk"
    return {"disk" if disk else "local": _timed_restore(strategy, job, cold=disk)}


def _add(totals: dict[str, list[float]], name: str, values: list[float]) -> None:
    total = totals.get(name, [0.0] * len(values))
    totals[name] = [a + b for a, b in zip(total, values, strict=True)]


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
    runner = _Runner(job)
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
    recovery = {name: _recovery_times(ckpts[name], job)
                for name in ("inmem", "pec") if name in strategies}
    for name, strategy in strategies.items():
        if name in ("blocking", "blocking_disk", "orbax_async", "orbax_emergency"):
            if name.startswith("orbax"):
                strategy.manager.wait_until_finished()  # its saves are on disk
            recovery[name] = _baseline_recovery(name, strategy, job)
    for strategy in strategies.values():
        strategy.close()
    if job.host == 0:
        result = {"samples": samples, "a2a": a2a, "ram": ram, "cpu": cpu, "recovery": recovery,
                  "link": link,
                  "losses": {str(s): v for s, v in runner.losses.items()},
                  "buckets": {str(s): v for s, v in runner.buckets.items()},
                  "schedules": schedules, "saves": runner.saves,
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


def summarize(raw: dict) -> dict:
    """The DESIGN.md JSON: per strategy median, spread, ratio, bytes, RAM.

    Raises RuntimeError when two strategies trained different work: a step
    whose losses differ between strategies (a checkpoint must not change
    training; every strategy replays the same steps from the same state)."""
    differ = different_work(raw.get("losses", {}))
    if differ:
        raise RuntimeError(f"strategies trained different work ({len(differ)} steps differ; "
                           f"first: {differ[0]})")
    out = {}
    for name, steps in raw["samples"].items():
        if not steps:
            raise RuntimeError(f"strategy {name}: no measured steps")
        times = [t for t, _, _ in steps]
        per_host = raw["ram"][name]
        out[name] = {
            "median_step_s": statistics.median(times),
            "spread_s": _iqr(times),
            **step_stats.distribution(times),
            **step_stats.blocked(raw.get("blocked", {}).get(name, [])),
            "min_step_s": min(times), "max_step_s": max(times),
            "samples": len(times), "steps_timed": len(times),
            "steps_profiled": sum(p for _, p, _ in steps),
            "steps_compiled": sum(c for _, _, c in steps),
            "ckpt_bytes_per_step": int(sum(h[1] for h in per_host)),
            "store_bytes_per_host": [int(h[0]) for h in per_host],
            # Every timed step in order (blocks of --steps, repetitions interleaved).
            "step_s": [round(t, 6) for t in times],
        }
        if name in raw.get("cpu", {}):
            steady = sum(not p and not c for _, p, c in steps)
            out[name]["cpu_ms_per_step"] = cpu_per_step(raw["cpu"][name]["all"], len(times))
            out[name]["steady_cpu_ms_per_step"] = cpu_per_step(raw["cpu"][name]["steady"],
                                                               steady)
        for key, chosen in (("profiled", [t for t, p, _ in steps if p]),
                            ("compiled", [t for t, _, c in steps if c]),
                            ("steady", [t for t, p, c in steps if not p and not c])):
            if chosen:
                out[name][f"{key}_median_s"] = statistics.median(chosen)
        a2a = raw.get("a2a", {}).get(name) or []
        if a2a:
            q = statistics.quantiles(a2a, n=4) if len(a2a) > 1 else [a2a[0]] * 3
            out[name].update(a2a_median_s=statistics.median(a2a), a2a_spread_s=q[2] - q[0],
                             a2a_samples=len(a2a))
    base = out.get("none", {}).get("median_step_s")
    steady = out.get("none", {}).get("steady_median_s")
    for row in out.values():
        row["ratio"] = row["median_step_s"] / base if base else None
        row["steady_ratio"] = (row["steady_median_s"] / steady
                               if steady and "steady_median_s" in row else None)
    for name, schedule in raw.get("schedules", {}).items():
        out[name]["schedule"] = schedule
    for name, records in raw.get("emulation_checks", {}).items():
        out[name]["emulation_check"] = step_stats.error_summary(records)
        out[name]["emulation_windows"] = records
    for name, recovery in raw.get("recovery", {}).items():
        out[name]["recovery"] = recovery
    for name, (saved, skipped) in raw.get("saves", {}).items():
        if name in out and (VARIANTS.get(name, name) in IN_MEMORY or skipped):
            out[name]["versions_skipped"] = skipped
            out[name]["versions_taken"] = (saved - skipped) / saved if saved else None
    for name in out:  # the steps at which its loss was checked against another strategy's
        out[name]["steps_compared"] = sum(
            name in by and len(by) > 1 for by in raw.get("losses", {}).values())
    for name, commits in raw.get("commits", {}).items():
        at = {int(v): i for v, i in commits["committed_at"].items()}
        timed = commits["timed"]
        lags = [at[v] - i for v, i in timed if v in at]
        out[name]["versions_committed"] = len(lags) / len(timed) if timed else None
        out[name]["max_commit_lag"] = max(lags, default=None)
    return out


def cpu_per_step(per_host: list[list[float]], steps: int) -> dict[str, float]:
    """CPU milliseconds per timed step, summed over the hosts' processes, per
    ``launch.cpu_account`` group, with their ``total`` (which the box's cores
    bound: cores x the step's wall time)."""
    groups = {g: sum(h[i] for h in per_host) * 1e3 / max(steps, 1)
              for i, g in enumerate(cpu_account.GROUPS)}
    return {**{g: round(v, 2) for g, v in groups.items()},
            "total": round(sum(groups.values()), 2)}


def _iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


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
    """The workers' job, behind shaped links with --link_gbps (``launch.netns``)."""
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


def markdown(results: dict) -> str:
    lines = ["| strategy | median step, all steps (ms) | spread IQR (ms) | ratio to none | "
             "steps timed / profiled / compiled | steady state only (ms, ratio) | all-to-all "
             "(ms, IQR) | ckpt bytes/step (all hosts) | store RAM per host (MB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "-"
        ram = ", ".join(f"{b / 1e6:.1f}" for b in r["store_bytes_per_host"]) or "-"
        a2a = (f"{r['a2a_median_s'] * 1e3:.1f} ({r['a2a_spread_s'] * 1e3:.1f})"
               if "a2a_median_s" in r else "-")
        steady = "-"
        if "steady_median_s" in r:
            steady = f"{r['steady_median_s'] * 1e3:.1f}" + (
                f", {r['steady_ratio']:.3f}" if r.get("steady_ratio") else "")
        counts = f"{r['steps_timed']} / {r['steps_profiled']} / {r['steps_compiled']}"
        if r.get("versions_committed") is not None:
            # "A version every step" only at 100%; else the share and the lag.
            name = (f"{name} (committed {r['versions_committed']:.0%}, lag <= "
                    f"{r['max_commit_lag']} saves)")
        elif r.get("versions_taken") is not None and r["versions_taken"] < 1:
            name = f"{name} (a version at {r['versions_taken']:.0%} of steps)"
        lines.append(f"| {name} | {r['median_step_s'] * 1e3:.1f} | {r['spread_s'] * 1e3:.1f} | "
                     f"{ratio} | {counts} | {steady} | {a2a} | {r['ckpt_bytes_per_step']:,} | "
                     f"{ram} |")
    for name, r in results.items():
        for key, label in (("cpu_ms_per_step", "timed step"),
                           ("steady_cpu_ms_per_step", "steady-state step")):
            if r.get(key):
                cpu = r[key]
                lines.append(f"\n{name}: CPU per {label}, all hosts: {cpu['total']:.0f} ms ("
                             + ", ".join(f"{g} {cpu[g]:.0f}" for g in cpu_account.GROUPS
                                         if cpu[g]) + ")")
    for name, r in results.items():
        for tier, rec in r.get("recovery", {}).items():
            cold = " (page cache dropped first)" if rec.get("cold_cache") else ""
            lines.append(f"\n{name}: recovery from {tier}: {rec['seconds']:.3f} s, "
                         f"{rec['bytes_moved']:,} bytes between hosts{cold}")
    return "\n".join(lines)


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    med = [results[n]["median_step_s"] * 1e3 for n in names]
    err = [[(results[n]["median_step_s"] - results[n]["min_step_s"]) * 1e3 for n in names],
           [(results[n]["max_step_s"] - results[n]["median_step_s"]) * 1e3 for n in names]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, med, yerr=err, capsize=4, color="#4c72b0")
    ax.set_ylabel("median step time (ms), min-max bars")
    ax.set_title(f"{FLAGS.model}, {FLAGS.hosts}x{FLAGS.devices_per_host} CPU, {FLAGS.workload}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> None:
    del argv
    unknown = [s for s in FLAGS.strategies if s not in STRATEGIES and s not in VARIANTS]
    if unknown:
        print(f"bench: error: --strategies: unknown {unknown}; known: {', '.join(STRATEGIES)}, "
              f"{', '.join(VARIANTS)}", file=sys.stderr)
        sys.exit(2)
    try:
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
        "global_batch", "platform", "a2a_steps", "ckpt_budget")}
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
        _plot(results, FLAGS.png)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    define_flags()
    app.run(main)
