"""Trains a GPT-MoE on the simulated multi-host cluster (or one GPU).

    python -m launch.train --hosts=2 --devices_per_host=2 --model=tiny \
        --steps=20 --workdir=/tmp/run

With ``--hosts=H`` (CPU) this process is the supervisor: it checks the flags,
starts H worker processes joined by jax.distributed on 127.0.0.1 (gloo CPU
collectives), shows their progress, faults and recoveries (``--verbose``: every
line they print) and a short report. A WORKDIR holding checkpoints is resumed
from; ``--fresh`` starts over. Each worker
runs the same script with ``--process_id``. ``--platform=gpu --hosts=1`` runs
the training in this process on the local GPUs; on a real cluster, start one
worker per host with ``--process_id`` and ``--coordinator`` yourself.

Every process holds WORKDIR's lock as a process of its job, however it was
started (``launch.train.workdir_lock``): a second job on the same workdir is
refused with one line naming the holder, and ``--fresh`` deletes nothing
while another job runs there. A worker started by hand belongs to the job
``CAPRICORN_JOB_ID`` names, else to that of its ``--coordinator`` and
``--hosts`` (give every host the same ones).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from absl import app, flags, logging

import capricorn_jax
from capricorn_jax.experimental import xla_flags
from launch import cli_flags, runtime
from launch.metrics import MetricsWriter
from launch.train import digest, faults, lag_alarm, persistence
from launch.train.config import Config, FlagError, from_flags
from launch.train.supervisor import prepare_workdir, supervise
from launch.train.workdir_lock import WorkdirLock, WorkdirRefused, hold, job_identity

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """Defines launch.train's flags (every group of ``launch.cli_flags``) into
    ``fv``; the command calls it once before parsing, a test on a fresh one."""
    cli_flags.define(fv, {group: None for group in cli_flags.GROUPS})
    flags.adopt_module_key_flags(cli_flags, flag_values=fv)  # --help lists them
    return fv


def _make_strategy(config: Config, trainer, ckpt, host: int) -> capricorn_jax.Strategy:
    """The --ckpt strategy of this host (``ckpt``: its in-memory checkpointer, if any)."""
    from launch.strategies import make_strategy

    c = config.checkpoint
    checkpoints = Path(config.train.workdir) / "checkpoints"
    directory = {"blocking": c.store_dir(host) / "blocking",  # the RAM disk of the memory tier
                 "orbax_async": checkpoints, "orbax_emergency": checkpoints}.get(c.strategy)
    return make_strategy(c.strategy, trainer, checkpointer=ckpt, directory=directory,
                         first_n=config.profile.first_n, chunk_cap=c.chunk_cap,
                         chunk_path=c.chunk_path,
                         # Its local tier on the RAM disk, beside the stores.
                         local_directory=c.job_root / "orbax_local",
                         persist_every=c.persist_every or 10,
                         traffic_class=config.cluster.traffic_class, replicas=c.replicas)


def _make_driver(config: Config, trainer, strategy) -> capricorn_jax.ProfilingDriver:
    """The profiling driver of --profile (or the strategy's policy) and its knobs."""
    options = config.profile.options(trainer.cfg.dispatch)
    return capricorn_jax.ProfilingDriver(trainer, strategy, options,
                                         collectives=trainer.all_to_alls,
                                         reductions=trainer.gradient_reductions,
                                         next_factors=trainer.next_factors)


def _repartition(host: int, event: dict, last: tuple | None) -> tuple:
    """Logs a ``repartition`` event when the schedule's bytes moved (the
    bytes per window or in the tail differ from the last logged one: a
    re-partition that put every byte where it was is not news); returns what
    it logged against. The metrics file keeps every event."""
    now = (tuple(event["window_bytes"]), event["tail_bytes"])
    if now != last:
        logging.info("host %d: %s re-partitioned after step %d: %d bytes in windows, %d in "
                     "the tail", host, event["strategy"], event["step"],
                     sum(event["window_bytes"]), event["tail_bytes"])
    return now


def _write_timeline(config: Config, timeline) -> None:
    """WORKDIR/timeline.json and .png from host 0's last warm profile."""
    from launch import timeline as timeline_lib
    from launch.plot_timeline import render

    if timeline is None:
        logging.warning("--timeline: no warm profiled step in this run; nothing written")
        return
    profile, schedule = timeline
    doc = timeline_lib.trace(profile, schedule, 0,
                             title=f"{config.checkpoint.strategy} {config.train.model}")
    path = timeline_lib.write_trace(Path(config.train.workdir) / "timeline.json", doc)
    png = render(doc, path.with_suffix(".png"))
    over = doc["metadata"]["overflows"]
    logging.info("timeline of step %d written to %s and %s; windows overflowed: %s",
                 profile.step, path, png, [o["window"] for o in over] or "none")


def _log_checkpoint(metrics: MetricsWriter, host: int, saved: dict) -> None:
    """The ``checkpoint`` event of a save (its ``step`` is the version saved)."""
    metrics.write({"event": "checkpoint", "step": saved["version"],
                   **{k: v for k, v in saved.items() if k != "version"}})
    for u in saved.get("under_replicated", ()):
        logging.warning("host %d: version %d under-replicated (missing on hosts %s)",
                        host, u["step"], u["missing"])


def train_worker(config: Config, process_id: int) -> None:
    """One host's training loop (imports JAX here, after the env is set)."""
    import jax
    import numpy as np

    from models.capacity import choose_capacity_factors

    t, c = config.train, config.checkpoint
    faults.audit_store_if_asked(c, process_id)
    persistence.quiet_orbax_info()
    runtime.init_distributed(config.cluster.hosts, config.cluster.coordinator, process_id,
                             peer_timeout_s=config.cluster.peer_timeout_s)
    job = runtime.build_job(t.model, t.overrides, t.expert_parallel, t.steps, t.learning_rate,
                            t.warmup_steps, t.workload, t.shift_every, t.seed,
                            config.accelerator.accelerator, config.accelerator.profile)
    cfg, mesh, trainer, data = job.cfg, job.mesh, job.trainer, job.data
    host, num_hosts = job.host, job.hosts
    metrics = MetricsWriter(t.metrics_path, enabled=host == 0)
    logging.info("host %d/%d: %d local devices, mesh %s, model %s", host, num_hosts,
                 jax.local_device_count(), dict(mesh.shape), cfg.name)
    ckpt = (persistence.make_checkpointer(config, trainer, mesh, host, num_hosts)
            if c.in_memory else None)
    strategy = _make_strategy(config, trainer, ckpt, host)
    persistent = (persistence.PersistentTier(
        ckpt, trainer, metrics, c, t.workdir,
        temporary_path_class=faults.full_disk_path_class(config.faults, host))
        if c.persist_every and c.in_memory else None)
    if persistent is not None:
        persistent.on_write = lambda v: faults.reached(config.faults, t.workdir, host,
                                                       "mid_persist", v - 1)
        persistent.handler.on_persist = faults.persistent_write_fault(config.faults, host)
    faults.reached(config.faults, t.workdir, host, "recovery")
    state, start, resumed = persistence.resume(strategy, persistent, metrics, host)
    max_routed = None
    if state is not None:
        if resumed is None:
            raise RuntimeError(f"the version of step {start} came back without its host state")
        data.restore(resumed["data"])
        max_routed = resumed["max_routed"]
    else:
        state = trainer.init_state(t.seed)
    driver = _make_driver(config, trainer, strategy)
    meter = _Throughput(cfg.global_batch * cfg.seq_len, t.log_every, t.steps)
    timeline = None  # (last warm profile, schedule in force during it)
    logged_plan: tuple | None = None  # the schedule's bytes the console last reported
    alarm = (lag_alarm.LagAlarm(ckpt, strategy, metrics, host, c.max_version_lag, c.on_lag,
                                start) if ckpt is not None else None)
    for step in range(start, t.steps):
        factors = choose_capacity_factors(cfg, max_routed, trainer.tokens_per_group)
        domain, in_force = data.domain, strategy.schedule()
        t0 = time.perf_counter()
        faults.reached(config.faults, t.workdir, host, "mid_step", step)
        batch = trainer.global_batch(data.next_batch())
        run = driver.step(step, factors, state, batch)
        state, out = run.state, run.metrics
        loss, tpe = float(out["loss"]), np.asarray(out["tokens_per_expert"])
        max_routed = [int(v) for v in np.asarray(out["max_routed"])]
        for event in run.events:
            metrics.write(event)
            if event["event"] == "repartition":
                logged_plan = _repartition(host, event, logged_plan)
        if run.profile is not None and not run.compiled:
            timeline = (run.profile, in_force or strategy.schedule())
        if persistent is not None:
            persistent.handler.await_reader()  # no prune under the disk writer's read
        saved = strategy.save(step + 1, state, {"data": data.state(), "max_routed": max_routed},
                              tokens_per_expert=tpe, next_step_profiled=driver.profile_next)
        lag = alarm.observe(step + 1, saved) if alarm is not None else {}
        metrics.write({
            "step": step, "loss": loss, "step_time_s": time.perf_counter() - t0,
            "tokens_per_expert": tpe.tolist(), "domain": domain,
            "capacity_factors": list(factors), "dropped": np.asarray(out["dropped"]).tolist(),
            "profiled": run.profile is not None, "compiled": run.compiled, **lag,
        })
        _log_checkpoints(metrics, host, saved, persistent, state)
        if alarm is not None:
            alarm.check()  # --on_lag=fail past --max_version_lag: every host ends here
        faults.reached(config.faults, t.workdir, host, "after_step", step)
        faults.reached(config.faults, t.workdir, host, "rollback", step)
        for timed in ("pause", "partition", "slow_link"):  # the launcher acts after the step
            faults.reached(config.faults, t.workdir, host, timed, step)
        if host == 0:
            meter.tick(step, loss, tpe, domain)
    final = strategy.finish(t.steps, state, {"data": data.state(), "max_routed": max_routed})
    _log_checkpoints(metrics, host, final, persistent, state)
    if persistent is not None:
        persistent.close()
    strategy.close()
    if ckpt is not None:
        _release_store(ckpt, persistent, t.steps, host)
    if config.profile.timeline and host == 0:
        _write_timeline(config, timeline)
    _evaluate(config, job, state, metrics)
    jax.block_until_ready(state)
    digest.write(state, metrics, t.steps, num_hosts)
    metrics.close()


def _persisted(persistent, step: int) -> bool:
    """Whether the (closed) persistent tier holds ``step`` committed: the
    manager's newest step, renamed into place after its files were made
    durable, no failure recorded for it (``CheckpointManager.is_committed``);
    a directory that merely exists is not enough."""
    if persistent is None:
        return False
    manager = persistent.manager
    return manager.latest_step() == step and manager.is_committed(step)


def _release_store(ckpt, persistent, final_step: int, host: int) -> None:
    """After a clean finish: this host's RAM store is reclaimed when the
    persistent tier holds the final step, else shrunk to the safe version
    (one version per owner) for a later resume. Never after a failure: a
    worker that fails or is killed does not get here, and its store is what
    the restart recovers from."""
    if _persisted(persistent, final_step):
        ckpt.release("none")
        if host == 0:
            logging.info("RAM store: reclaimed (the persistent tier holds step %d)", final_step)
        return
    done = ckpt.release("final")
    if host == 0:
        kept = sorted({v for versions in done.versions.values() for v in versions})
        logging.info("RAM store: shrunk to version %s, %.1f MiB (%.1f MiB freed)",
                     ", ".join(map(str, kept)) or "none", done.bytes_held / (1 << 20),
                     done.bytes_freed / (1 << 20))


def _log_checkpoints(metrics: MetricsWriter, host: int, saved: list[dict], persistent,
                     state) -> None:
    """The checkpoint events of a save; each version every host has an event
    for goes on to the persistent tier (which writes it when --persist_every
    says so, collectively: every host must offer the same versions). A
    version abandoned in flight when the hosts agreed the chunk channel lost
    (``abandoned``) is not offered: which versions were in flight differs
    between hosts, and none of them is held anywhere."""
    for event in saved:
        _log_checkpoint(metrics, host, event)
        if persistent is not None and not event.get("abandoned"):
            persistent.offer(event["version"], state)


class _Throughput:
    """Host 0's log line every --log_every steps: loss, tokens/s, expert imbalance."""

    def __init__(self, tokens_per_step: int, every: int, steps: int) -> None:
        self.tokens_per_step, self.every, self.steps = tokens_per_step, every, steps
        self.start, self.tokens = time.perf_counter(), 0

    def tick(self, step: int, loss: float, tpe, domain: str) -> None:
        import numpy as np

        self.tokens += self.tokens_per_step
        if (step + 1) % self.every and step + 1 != self.steps:
            return
        elapsed = time.perf_counter() - self.start
        imbalance = float(np.mean(tpe.max(axis=1) / np.maximum(tpe.mean(axis=1), 1e-9)))
        logging.info("step %d/%d loss %.4f tokens/s %.0f expert imbalance (max/mean) %.2f "
                     "domain %s", step + 1, self.steps, loss, self.tokens / elapsed, imbalance,
                     domain)
        self.start, self.tokens = time.perf_counter(), 0


def _evaluate(config: Config, job, state, metrics: MetricsWriter) -> None:
    """The ``eval`` event: validation loss per domain at the end (--eval_sequences)."""
    from launch.data import validation_batch

    t = config.train
    if not t.eval_sequences or job.corpus is None:
        return
    trainer, host, hosts = job.trainer, job.host, job.hosts
    eval_fn = trainer.eval_loss_fn()
    per_domain = {}
    rows = t.eval_sequences * job.mesh.size // hosts
    for name in job.corpus.names:
        local = validation_batch(job.data_options, job.corpus, name, rows * hosts,
                                 job.cfg.seq_len)
        batch = trainer.global_batch(local[host * rows:(host + 1) * rows])
        per_domain[name] = float(eval_fn(state, batch))
    metrics.write({"event": "eval", "step": t.steps, "val_loss": per_domain})
    if host == 0:
        logging.info("validation loss %s", json.dumps(per_domain))


def _train_or_lag_exit(config: Config, process_id: int) -> None:
    """A worker's training; ``--on_lag=fail`` ends it with one error line
    and ``lag_alarm.LAG_EXIT_CODE`` (every other failure: a traceback)."""
    try:
        train_worker(config, process_id)
    except lag_alarm.VersionLagError as e:
        lag_alarm.exit_on_lag(e, process_id)


def _hold_workdir(config: Config, role: str, host: int) -> WorkdirLock:
    """This process's locks on the workdir, as host ``host`` of its job
    (``launch.train.workdir_lock``), kept until the process ends; a refusal
    (another job there, or no working flock) ends it with one error line and
    exit code 2, before anything in the workdir is read or deleted."""
    c = config.cluster
    try:
        return hold(config.train.workdir, job_identity(role, c.process_id, c.coordinator, c.hosts),
                    role, host)
    except WorkdirRefused as e:
        print(f"train: error: {e}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"train: error: unexpected arguments {argv[1:]}", file=sys.stderr)
        sys.exit(2)
    try:
        config = from_flags(FLAGS)
    except FlagError as e:
        print(f"train: error: {e}", file=sys.stderr)
        sys.exit(2)
    if config.cluster.process_id >= 0:
        runtime.bound_orbax_barriers(FLAGS)  # a trainer's; the supervisor imports no Orbax
        lock = _hold_workdir(config, "worker", config.cluster.process_id)
        runtime.exit_now_on_failure(_train_or_lag_exit, config, config.cluster.process_id)
        lock.release()  # one process: exit_now_on_failure returns
    elif config.cluster.platform == "gpu":  # --hosts=1 (ClusterConfig checks it)
        xla_flags.set_overlap_flags()  # before the GPU backend starts
        runtime.bound_orbax_barriers(FLAGS)
        lock = _hold_workdir(config, "single process", 0)
        try:
            prepare_workdir(config)
            train_worker(config, 0)
        except lag_alarm.VersionLagError as e:
            print(f"train: error: {e}", file=sys.stderr)
            sys.exit(lag_alarm.LAG_EXIT_CODE)
        finally:
            lock.release()
    else:
        try:
            sys.exit(supervise(config, sys.argv[1:]))
        except WorkdirRefused as e:
            print(f"train: error: {e}", file=sys.stderr)
            sys.exit(2)


def _run() -> None:
    """The command (``python -m launch.train``, its ``__main__``)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    define_flags()
    app.run(main)
