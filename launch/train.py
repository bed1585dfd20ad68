"""Trains a GPT-MoE on the simulated multi-host cluster (or one GPU).

    python -m launch.train --hosts=2 --devices_per_host=2 --model=tiny \
        --steps=20 --workdir=/tmp/run

With ``--hosts=H`` (CPU) this process is the supervisor: it checks the flags,
starts H worker processes joined by jax.distributed on 127.0.0.1 (gloo CPU
collectives), forwards their logs, and prints a short report. Each worker
runs the same script with ``--process_id``. ``--platform=gpu --hosts=1`` runs
the training in this process on the local GPUs; on a real cluster, start one
worker per host with ``--process_id`` and ``--coordinator`` yourself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags, logging

from capricorn_jax import (
    DetectorOptions,
    DynamicityDetector,
    FirstNProfiler,
    ProfilePolicy,
    gpt_moe_all_to_alls,
    make_profiled_step,
    should_profile,
)
from capricorn_jax._src.profiling.detector import CACHE_GRANULARITIES, CacheOptions, ProfileCache
from capricorn_jax._src.profiling.detector import METRICS as DRIFT_METRICS
from capricorn_jax._src.scheduling.transfers import agree_profile, moe_durations, moe_segments
from launch import cluster as cluster_lib
from launch import runtime
from launch.metrics import MetricsWriter, read_metrics, summarize
from models.config import CONFIGS, DISPATCH_MODES, get_config

# The profiling policy a --ckpt strategy runs when --profile is not given; off
# for any strategy not named here.
STRATEGY_PROFILE = {"capricorn": "speculative", "gemini": "first_n"}
# Strategies built on the in-memory tier (recoverable); the last two move
# chunks inside the step on a schedule.
IN_MEMORY = ("inmem", "gemini", "capricorn")
SCHEDULED = ("gemini", "capricorn")

def _default_store_root() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "capricorn_jax")


FLAGS = flags.FLAGS
flags.DEFINE_integer("hosts", 2, "Simulated hosts (processes).")
flags.DEFINE_integer("devices_per_host", 2, "CPU devices per simulated host.")
flags.DEFINE_boolean("pin_hosts", False,
                     "Run each simulated host's process on its own CPUs (this process's CPUs "
                     "split round robin): steadier timings, e.g. for profiling measurements.")
flags.DEFINE_string("model", "tiny", f"Model config: {', '.join(CONFIGS)}.")
flags.DEFINE_integer("steps", 20, "Training steps.")
flags.DEFINE_string("workdir", None, "Directory for metrics.jsonl and checkpoints.")
flags.DEFINE_integer("seed", 0, "Seed of the parameters, dropout and data order.")
flags.DEFINE_enum("workload", "steady", ["steady", "dynamic", "synthetic"],
                  "steady: one domain; dynamic: domain shift every --shift_every steps; "
                  "synthetic: random bytes (explicit opt-in).")
flags.DEFINE_integer("shift_every", 50, "Steps between domain shifts (dynamic workload).")
flags.DEFINE_enum("ckpt", "none", ["none", *IN_MEMORY],
                  "Checkpoint strategy: none; inmem (every step to host RAM + m-1 peers, "
                  "moved after the step); gemini (moved inside the step on a schedule from the "
                  "first --profile_first_n steps' profile, kept); capricorn (layer-level "
                  "schedule, re-partitioned when the expert load drifts).")
flags.DEFINE_string("profile", "",
                    "Layer profiling: off | every | first_n (the first --profile_first_n steps "
                    "once, Gemini) | speculative (when the dynamicity detector asks, Capricorn); "
                    "'' = the --ckpt strategy's policy (off for none and inmem).")
flags.DEFINE_boolean("timeline", False,
                     "Write WORKDIR/timeline.json (Chrome/Perfetto trace) and timeline.png: host "
                     "0's last profiled iteration (layers, all-to-alls) with the checkpoint chunks "
                     "of the schedule in force in it (gemini/capricorn), overflowing windows red. "
                     "Needs a profiling policy.")
flags.DEFINE_integer("profile_first_n", 20, "--profile=first_n: the steps profiled at the start.")
flags.DEFINE_float("drift_threshold", DetectorOptions().threshold,
                   "--profile=speculative: a layer's drift score of the expert load (since the "
                   "last profile) above which the next step is profiled.")
flags.DEFINE_enum("drift_metric", DetectorOptions().metric, list(DRIFT_METRICS),
                  "--profile=speculative: the drift score (see capricorn_jax.drift_score).")
flags.DEFINE_integer("profile_cache_max_age", 0,
                     "--profile=speculative with --dispatch=bucketed: profile each capacity "
                     "tuple once and reuse its profile, for up to this many steps, when the load "
                     "flips back to it (a profile only when the detector drifts or the tuple "
                     "changes, and the tuple has no cached profile that young); 0 = no cache "
                     "(every drift profiles). Fixed dispatch: ignored.")
flags.DEFINE_integer("profile_cache_samples", CacheOptions().samples,
                     "--profile_cache_max_age > 0: warm profiles of a capacity tuple (each "
                     "younger than the max age) the cache needs before it answers for the tuple; "
                     "it answers with their per-segment median (steadier than one profile).")
flags.DEFINE_enum("profile_cache_granularity", "tuple", list(CACHE_GRANULARITIES),
                  "--profile_cache_max_age > 0: file a profile under its whole capacity tuple, "
                  "or under each MoE layer's capacity factor (a layer's segments are then "
                  "answered from any profile in which it ran at that factor).")
flags.DEFINE_integer("replicas", 2, "m: copies of each host's checkpoint (own + m-1 peers).")
flags.DEFINE_integer("chunk_bytes", 4 << 20, "Transfer chunk size of the in-memory tier.")
flags.DEFINE_string("store_root", _default_store_root(),
                    "Base directory of the host RAM stores (tmpfs).")
flags.DEFINE_float("replication_timeout_s", 30.0,
                   "A version not confirmed by every replica after this is under-replicated.")
flags.DEFINE_boolean("resume", False,
                     "Resume a previous job of this workdir from its stores; default: the job "
                     "starts fresh and only recovers from failures that happen inside it.")
flags.DEFINE_integer("kill_host", -1, "Fault injection: SIGKILL this host's process...")
flags.DEFINE_integer("kill_at_step", -1, "...when host 0 has finished this step...")
flags.DEFINE_enum("kill_mode", "process", ["process", "host"],
                  "...process: its RAM store survives; host: its store is wiped (machine loss).")
flags.DEFINE_integer("persist_every", 0,
                     "Persistent tier (in-memory strategies): every this many steps, write the "
                     "in-memory version to WORKDIR/checkpoints as a standard Orbax step, in the "
                     "background, from host RAM; 0: no persistent tier.")
flags.DEFINE_integer("max_to_keep", 3, "Persistent steps kept in WORKDIR/checkpoints.")
flags.DEFINE_integer("kill_every", 0,
                     "Fault injection: kill --kill_host again every this many steps after "
                     "--kill_at_step (0: once); each time all hosts restart and recover.")
flags.DEFINE_integer("pec_k", 0,
                     "Partial expert checkpointing (in-memory strategies): experts per MoE "
                     "layer in each version (0: all, no PEC).")
flags.DEFINE_enum("pec_policy", "sequential", ["sequential", "load_aware"],
                  "PEC: which experts a version carries.")
flags.DEFINE_float("pec_plt_threshold", 0.0375,
                   "PEC: dynamic K doubles K when the portion of lost tokens would pass this.")
flags.DEFINE_boolean("pec_dynamic", True, "PEC: adapt K to the portion of lost tokens.")
flags.DEFINE_integer("pec_k_persist", 0,
                     "PEC with --persist_every: experts per MoE layer in each persistent step "
                     "(<= --pec_k, a multiple of the expert-parallel size; each step carries the "
                     "least recently persisted experts); 0: all experts (full steps).")
flags.DEFINE_boolean("corrupt_store", False,
                     "Fault injection: after the kill, flip bytes in a chunk of the killed host's "
                     "own newest version (RAM bit rot); it must then recover from a peer.")
flags.DEFINE_enum("kill_point", "after_step", ["after_step", "mid_replication"],
                  "after_step: when the step is logged; mid_replication: while the host is "
                  "halfway through writing the replicas it received for that step.")
flags.DEFINE_integer("stall_host", -1, "Fault injection: this host's replica writer stalls...")
flags.DEFINE_integer("stall_at_step", -1, "...at this step...")
flags.DEFINE_float("stall_seconds", 0.0, "...for this long (a peer that stops answering).")
flags.DEFINE_integer("pause_mid_replication_at", -1, "Internal: set by the supervisor.")
flags.DEFINE_integer("pause_after_step_at", -1, "Internal: set by the supervisor.")
flags.DEFINE_integer("expert_parallel", 0,
                     "Size of the expert mesh axis; 0 = all devices (capped at num_experts).")
flags.DEFINE_enum("dispatch", "", ["", *DISPATCH_MODES],
                  "MoE dispatch: fixed capacity or bucketed (load-dependent); '' = model's.")
flags.DEFINE_integer("global_batch", 0, "Sequences per step over all hosts; 0 = model's.")
flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW learning rate.")
flags.DEFINE_integer("warmup_steps", 10, "Linear warmup steps.")
flags.DEFINE_integer("log_every", 10, "Steps between log lines.")
flags.DEFINE_integer("eval_sequences", 8, "Validation sequences per domain at the end; 0 = none.")
flags.DEFINE_enum("platform", "cpu", ["cpu", "gpu"],
                  "cpu: simulated hosts; gpu: this process on the local GPU(s).")
flags.DEFINE_float("timeout_s", 3600.0, "Deadline of the whole job; hosts are stopped past it.")
flags.DEFINE_integer("process_id", -1,
                     "Internal: this worker's host index (set by the supervisor).")
flags.DEFINE_string("coordinator", "", "Internal: jax.distributed coordinator address.")


def job_name(workdir: str) -> str:
    """The store's job name: stable for a workdir across restarts."""
    return "job-" + hashlib.sha1(os.path.abspath(workdir).encode()).hexdigest()[:12]


def store_dir(host: int) -> Path:
    return Path(FLAGS.store_root) / job_name(FLAGS.workdir) / f"host{host}"


class FlagError(ValueError):
    """A bad flag value; the message starts with the flag's name."""


def _config_overrides() -> dict:
    overrides = {}
    if FLAGS.dispatch:
        overrides["dispatch"] = FLAGS.dispatch
    if FLAGS.global_batch:
        overrides["global_batch"] = FLAGS.global_batch
    return overrides


def check_flags() -> None:
    """Raises FlagError naming the first bad flag."""
    if FLAGS.hosts < 1:
        raise FlagError(f"--hosts must be >= 1, got {FLAGS.hosts}")
    if FLAGS.devices_per_host < 1:
        raise FlagError(f"--devices_per_host must be >= 1, got {FLAGS.devices_per_host}")
    if FLAGS.steps < 1:
        raise FlagError(f"--steps must be >= 1, got {FLAGS.steps}")
    if FLAGS.model not in CONFIGS:
        raise FlagError(f"--model: unknown model {FLAGS.model!r}; known: {', '.join(CONFIGS)}")
    if FLAGS.shift_every < 1:
        raise FlagError(f"--shift_every must be >= 1, got {FLAGS.shift_every}")
    cfg = get_config(FLAGS.model, **_config_overrides())
    devices = FLAGS.hosts * FLAGS.devices_per_host
    if FLAGS.platform == "cpu":
        ep = runtime.expert_parallel(FLAGS.expert_parallel, cfg.num_experts, devices)
        if ep < 1 or devices % ep:
            raise FlagError(f"--expert_parallel={ep} does not divide the {devices} devices")
        if cfg.num_experts % ep:
            raise FlagError(
                f"--expert_parallel={ep}: the model's {cfg.num_experts} experts are not "
                f"divisible by the expert axis"
            )
        if cfg.global_batch % devices:
            raise FlagError(f"--global_batch={cfg.global_batch} not divisible by {devices} devices")
    _check_profile_flags()
    if FLAGS.ckpt in IN_MEMORY and not 1 <= FLAGS.replicas <= FLAGS.hosts:
        raise FlagError(f"--replicas={FLAGS.replicas} must be in [1, --hosts={FLAGS.hosts}]")
    if FLAGS.ckpt in SCHEDULED and FLAGS.replicas != 2:
        raise FlagError(f"--replicas={FLAGS.replicas}: --ckpt={FLAGS.ckpt} moves one peer "
                        f"replica inside the step; it needs --replicas=2")
    _check_pec_flags(cfg)
    if FLAGS.persist_every < 0 or FLAGS.max_to_keep < 1:
        raise FlagError(f"--persist_every must be >= 0 and --max_to_keep >= 1, got "
                        f"{FLAGS.persist_every}, {FLAGS.max_to_keep}")
    if FLAGS.persist_every and FLAGS.ckpt not in IN_MEMORY:
        raise FlagError(f"--persist_every writes the in-memory versions to disk: it needs "
                        f"--ckpt in {', '.join(IN_MEMORY)}, got --ckpt={FLAGS.ckpt}")
    _check_pec_persist_flags(cfg)
    if FLAGS.kill_every < 0 or (FLAGS.kill_every and FLAGS.kill_host < 0):
        raise FlagError(f"--kill_every={FLAGS.kill_every} needs --kill_host and must be >= 0")
    if FLAGS.kill_host >= 0:
        if FLAGS.kill_host >= FLAGS.hosts:
            raise FlagError(f"--kill_host={FLAGS.kill_host} is not a host (--hosts={FLAGS.hosts})")
        if not 0 <= FLAGS.kill_at_step < FLAGS.steps:
            raise FlagError(f"--kill_at_step={FLAGS.kill_at_step} must be in [0, --steps)")
        if FLAGS.ckpt == "none":
            raise FlagError("--kill_host needs a checkpoint strategy to recover (--ckpt)")
        if FLAGS.kill_point == "mid_replication" and FLAGS.replicas < 2:
            raise FlagError("--kill_point=mid_replication needs --replicas >= 2")
    if not FLAGS.workdir:
        raise FlagError("--workdir is required")
    try:
        Path(FLAGS.workdir).mkdir(parents=True, exist_ok=True)
        probe = Path(FLAGS.workdir) / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise FlagError(f"--workdir: cannot write to {FLAGS.workdir!r}: {e.strerror}") from None


def _check_pec_flags(cfg) -> None:
    pec_flags = ("pec_policy", "pec_plt_threshold", "pec_dynamic")
    if FLAGS.pec_k == 0:
        for flag in pec_flags:
            if FLAGS[flag].present:
                raise FlagError(f"--{flag} is only used with --pec_k > 0")
        return
    if FLAGS.ckpt not in IN_MEMORY:
        raise FlagError(f"--pec_k needs an in-memory strategy ({', '.join(IN_MEMORY)}), "
                        f"got --ckpt={FLAGS.ckpt}")
    if not 1 <= FLAGS.pec_k <= cfg.num_experts:
        raise FlagError(f"--pec_k={FLAGS.pec_k} must be in [1, {cfg.num_experts}] "
                        f"(experts of {cfg.name})")
    if not 0.0 < FLAGS.pec_plt_threshold < 1.0:
        raise FlagError(f"--pec_plt_threshold must be in (0, 1), got {FLAGS.pec_plt_threshold}")


def _check_pec_persist_flags(cfg) -> None:
    kp = FLAGS.pec_k_persist
    if not FLAGS["pec_k_persist"].present:
        return
    if kp < 0:
        raise FlagError(f"--pec_k_persist={kp} must be >= 0 (0: all experts)")
    if not FLAGS.pec_k:
        raise FlagError(f"--pec_k_persist={kp} is only used with --pec_k > 0")
    if not FLAGS.persist_every:
        raise FlagError(f"--pec_k_persist={kp} is only used with --persist_every > 0")
    if kp > FLAGS.pec_k:
        raise FlagError(f"--pec_k_persist={kp} exceeds --pec_k={FLAGS.pec_k} (K_persist <= K)")
    if 0 < kp < cfg.num_experts and FLAGS.platform == "cpu":
        devices = FLAGS.hosts * FLAGS.devices_per_host
        ep = runtime.expert_parallel(FLAGS.expert_parallel, cfg.num_experts, devices)
        if kp % ep:
            raise FlagError(f"--pec_k_persist={kp} is not a multiple of the expert-parallel "
                            f"size {ep}: every rank persists the same number of experts of "
                            f"each MoE layer (use --expert_parallel or another value)")


def profile_policy() -> ProfilePolicy:
    """--profile, or the strategy's policy when it is not given."""
    return ProfilePolicy(FLAGS.profile or STRATEGY_PROFILE.get(FLAGS.ckpt, "off"))


def _check_profile_flags() -> None:
    names = [p.value for p in ProfilePolicy]
    if FLAGS.profile and FLAGS.profile not in names:
        raise FlagError(f"--profile must be one of {', '.join(names)}, got {FLAGS.profile!r}")
    policy = profile_policy()
    if FLAGS.ckpt in SCHEDULED and policy.value != STRATEGY_PROFILE[FLAGS.ckpt]:
        raise FlagError(f"--profile={FLAGS.profile}: --ckpt={FLAGS.ckpt} schedules from its own "
                        f"profiling policy, {STRATEGY_PROFILE[FLAGS.ckpt]}")
    if FLAGS.timeline and policy is ProfilePolicy.OFF:
        raise FlagError("--timeline draws a profiled iteration: it needs --profile (or "
                        "--ckpt=gemini|capricorn)")
    if FLAGS.profile_first_n < 1:
        raise FlagError(f"--profile_first_n must be >= 1, got {FLAGS.profile_first_n}")
    if not 0.0 <= FLAGS.drift_threshold <= 1.0:
        raise FlagError(f"--drift_threshold must be in [0, 1], got {FLAGS.drift_threshold}")
    if FLAGS.profile_cache_max_age < 0:
        raise FlagError(f"--profile_cache_max_age must be >= 0, got "
                        f"{FLAGS.profile_cache_max_age}")
    if FLAGS.profile_cache_samples < 1:
        raise FlagError(f"--profile_cache_samples must be >= 1, got "
                        f"{FLAGS.profile_cache_samples}")
    for flag in ("profile_cache_samples", "profile_cache_granularity"):
        if FLAGS[flag].present and not FLAGS.profile_cache_max_age:
            raise FlagError(f"--{flag} is only used with --profile_cache_max_age > 0")
    # Set explicitly for a policy that does not read them, they would mislead.
    for flag, user in (("profile_first_n", ProfilePolicy.FIRST_N),
                       ("drift_threshold", ProfilePolicy.SPECULATIVE),
                       ("drift_metric", ProfilePolicy.SPECULATIVE),
                       ("profile_cache_max_age", ProfilePolicy.SPECULATIVE),
                       ("profile_cache_samples", ProfilePolicy.SPECULATIVE),
                       ("profile_cache_granularity", ProfilePolicy.SPECULATIVE)):
        if FLAGS[flag].present and policy is not user:
            raise FlagError(f"--{flag} is only used with --profile={user.value} "
                            f"(profiling policy here: {policy.value})")


def _worker_argv(host: int, coordinator: str, extra: tuple[str, ...] = ()) -> list[str]:
    internal = ("--process_id", "--coordinator", "--pause_mid_replication_at",
                "--pause_after_step_at")
    passed = [a for a in sys.argv[1:] if not a.startswith(internal)]
    return ["-m", "launch.train", *passed, f"--process_id={host}", f"--coordinator={coordinator}",
            *extra]


class _FaultInjector:
    """Kills host K at the requested point of the first attempt (supervisor side)."""

    def __init__(self):
        self.marker = Path(FLAGS.workdir) / f".paused_host{FLAGS.kill_host}"
        self.fired = False
        self.cluster: cluster_lib.LocalCluster | None = None
        every = FLAGS.kill_every or FLAGS.steps
        self.kill_steps = list(range(FLAGS.kill_at_step, FLAGS.steps, every))
        self.kills = 0  # kills done so far

    @property
    def pending(self) -> bool:
        return self.kills < len(self.kill_steps)

    def arm(self, cluster) -> None:
        """The next attempt's cluster: it will be killed at the next kill step."""
        self.cluster, self.fired = cluster, False

    def extra_args(self, host: int) -> tuple[str, ...]:
        if host != FLAGS.kill_host or not self.pending:
            return ()
        at = self.kill_steps[self.kills]
        if FLAGS.kill_point == "mid_replication":
            return (f"--pause_mid_replication_at={at + 1}",)
        return (f"--pause_after_step_at={at}",)

    def _due(self) -> bool:
        # Host K writes the marker and waits at the kill point, so the kill lands
        # there however fast the steps are (a job must not finish before it).
        return self.marker.exists()

    def tick(self) -> None:
        if self.fired or self.cluster is None or not self._due():
            return
        self.fired = True
        self.cluster.kill_host(FLAGS.kill_host, signal.SIGKILL)
        print(f"fault: SIGKILLed host {FLAGS.kill_host} at step {self.kill_steps[self.kills]} "
              f"({FLAGS.kill_point}, mode {FLAGS.kill_mode})", flush=True)
        self.kills += 1


def _corrupt_newest_own_chunk(root: Path, host: int) -> None:
    versions = sorted((root / f"owner{host}").glob("v*[0-9]"))
    if not versions:
        print(f"fault: host {host} has no own version to corrupt", flush=True)
        return
    chunk = versions[-1] / "d0.c0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    print(f"fault: flipped a byte in {chunk.relative_to(root)} of host {host}", flush=True)


def _report(metrics_path: Path, injector: _FaultInjector | None) -> None:
    records = read_metrics(metrics_path)
    print("report:", json.dumps(summarize(records)), flush=True)
    for r in records:
        if r.get("event") == "recovery":
            moved = ("" if r.get("bytes_moved") is None
                     else f", {r['bytes_moved']} bytes from peers")
            print(f"recovery: resumed from step {r['step']} via tier {r['tier']} "
                  f"(hosts: {', '.join(r['tiers'])}) in {r['seconds']:.2f}s{moved}", flush=True)
    if injector is not None and not any(r.get("event") == "recovery" for r in records):
        print("recovery: none happened", flush=True)


def supervise() -> int:
    """Runs the simulated cluster (restarting it after an injected failure)."""
    metrics_path = Path(FLAGS.workdir) / "metrics.jsonl"
    if not FLAGS.resume:
        metrics_path.unlink(missing_ok=True)
        shutil.rmtree(Path(FLAGS.store_root) / job_name(FLAGS.workdir), ignore_errors=True)
        shutil.rmtree(Path(FLAGS.workdir) / "checkpoints", ignore_errors=True)
    injector = _FaultInjector() if FLAGS.kill_host >= 0 else None
    deadline = time.monotonic() + FLAGS.timeout_s
    while True:
        coordinator = f"127.0.0.1:{cluster_lib.free_port()}"
        armed = injector is not None and injector.pending
        cluster = cluster_lib.LocalCluster(
            lambda h, c=coordinator, a=armed: _worker_argv(
                h, c, injector.extra_args(h) if a else ()),
            FLAGS.hosts, FLAGS.devices_per_host,
            cpu_sets=cluster_lib.cpu_sets_per_host(FLAGS.hosts) if FLAGS.pin_hosts else None)
        if armed:
            injector.arm(cluster)
        code = cluster_lib.run(cluster, max(1.0, deadline - time.monotonic()),
                               on_tick=injector.tick if armed else None)
        if not (armed and injector.fired):
            break
        if FLAGS.kill_mode == "host":
            shutil.rmtree(store_dir(FLAGS.kill_host), ignore_errors=True)
            print(f"fault: wiped host {FLAGS.kill_host}'s RAM store (machine loss)", flush=True)
        if FLAGS.corrupt_store:
            _corrupt_newest_own_chunk(store_dir(FLAGS.kill_host), FLAGS.kill_host)
        injector.marker.unlink(missing_ok=True)
        print("fault: restarting all hosts; they recover from the in-memory tier", flush=True)
    if code == 0 and metrics_path.exists():
        _report(metrics_path, injector)
    elif code != 0:
        print(f"train: job failed with exit code {code}", file=sys.stderr, flush=True)
    return code


class _Persistent:
    """The persistent tier of launch.train: capricorn_jax.CheckpointManager over
    the strategy's InMemoryCheckpointer, writing WORKDIR/checkpoints.

    The strategy saves to memory itself (after the step, or inside it);
    ``maybe_persist`` hands each committed version to the manager, which writes
    it from the host store when ``--persist_every`` says so.
    """

    def __init__(self, ckpt, trainer, metrics: MetricsWriter):
        import orbax.checkpoint as ocp

        import capricorn_jax

        self.ocp, self.cj, self.trainer, self.metrics = ocp, capricorn_jax, trainer, metrics
        self.handler = capricorn_jax.CapricornHandler(ckpt)
        self.manager = capricorn_jax.CheckpointManager(
            Path(FLAGS.workdir).absolute() / "checkpoints",
            options=ocp.CheckpointManagerOptions(save_interval_steps=FLAGS.persist_every,
                                                 max_to_keep=FLAGS.max_to_keep),
            handler_registry=self.handler.registry("state"))
        self._errors = 0

    def restore(self):
        """(state, step, host_state) of the newest step across tiers, or Nones."""
        import jax

        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              self.trainer.abstract_state, self.trainer.state_shardings)
        try:
            restored = self.manager.restore(args=self.ocp.args.Composite(
                state=self.cj.CapricornRestore(target)))
        except FileNotFoundError:
            return None, 0, None
        info = self.manager.last_restore
        tiers = info.memory_tiers or ["persistent"] * jax.process_count()
        _log_recovery(self.metrics, jax.process_index(), info.step, tiers, info.seconds,
                      info.bytes_moved, **_pec_fields(info))
        return restored.state, info.step, info.host_state

    def maybe_persist(self, version: int, state) -> None:
        args = self.ocp.args.Composite(state=self.cj.CapricornSave(state))
        if self.manager.persist(version, args):
            pec = self.manager.last_persist if FLAGS.pec_k else None
            extra = {} if pec is None or pec["step"] != version else {
                "pec_k_persist": pec["k_persist"], "plt": pec["plt"],
                "accumulated_plt": pec["accumulated_plt"], "experts": pec["experts"]}
            self.metrics.write({"event": "persist", "step": version,
                                "directory": str(self.manager.directory), **extra})
        self._report_errors()

    def _report_errors(self) -> None:
        for error in self.manager.persistent_errors[self._errors:]:
            self.metrics.write({"event": "persist_error", **error})
            logging.warning("persistent tier: step %s failed: %s; training goes on with the "
                            "memory tier", error.get("step"), error.get("error"))
        self._errors = len(self.manager.persistent_errors)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self._report_errors()
        self.manager.close()


def _log_recovery(metrics: MetricsWriter, host: int, step: int, tiers: list[str],
                  seconds: float, bytes_moved: int | None, **extra) -> None:
    """The ``recovery`` event (its ``tier``: the farthest any host reached for)."""
    metrics.write({"event": "recovery", "step": step,
                   "tier": max(tiers, key=_TIER_ORDER.index), "seconds": seconds,
                   "tiers": tiers, "bytes_moved": bytes_moved, **extra})
    logging.info("host %d: recovered version %d from tier %s in %.2fs", host, step, tiers[host],
                 seconds)


def _quiet_orbax_info() -> None:
    """Orbax logs every save step at INFO through absl; keep its warnings only."""
    import logging as pylogging

    class QuietOrbax(pylogging.Filter):
        def filter(self, record: pylogging.LogRecord) -> bool:
            return record.levelno >= pylogging.WARNING or "/orbax/" not in record.pathname

    pylogging.getLogger("absl").addFilter(QuietOrbax())


def _pec_fields(recovered) -> dict:
    """A PEC restore's portion of lost tokens and where each expert came from."""
    pec = getattr(recovered, "pec", None)
    if pec is None:
        return {}
    fields = {"plt": pec.plt, "accumulated_plt": pec.accumulated_plt, "pec_k": pec.k,
              "versions": pec.versions, "expert_source_steps": pec.source}
    if pec.data_steps is not None:  # persistent tier: the training step of each expert's values
        fields["expert_data_steps"] = pec.data_steps
    return fields


def _make_checkpointer(trainer, mesh, host: int, hosts: int):
    import capricorn_jax

    stall = None
    if FLAGS.stall_host == host and FLAGS.stall_at_step >= 0:
        stall = (FLAGS.stall_at_step, FLAGS.stall_seconds)
    pause = FLAGS.pause_mid_replication_at if FLAGS.pause_mid_replication_at >= 0 else None
    options = capricorn_jax.InMemoryOptions(
        store_root=FLAGS.store_root, job=job_name(FLAGS.workdir), replicas=FLAGS.replicas,
        chunk_bytes=FLAGS.chunk_bytes, replication_timeout_s=FLAGS.replication_timeout_s,
        stall_replica_writer_at=stall, pause_mid_replication_at=pause,
        pec=capricorn_jax.PecOptions(k=FLAGS.pec_k, k_persist=FLAGS.pec_k_persist or None,
                                     policy=FLAGS.pec_policy,
                                     plt_threshold=FLAGS.pec_plt_threshold,
                                     dynamic=FLAGS.pec_dynamic) if FLAGS.pec_k else None,
    )
    cfg = trainer.cfg
    ckpt = capricorn_jax.InMemoryCheckpointer(
        options, mesh, trainer.abstract_state, trainer.state_shardings, host, hosts,
        model=cfg, tokens_per_step=cfg.global_batch * cfg.seq_len)

    def on_pause(step: int) -> None:
        _pause_for_kill(host, f"halfway through writing replicas of version {step}")

    ckpt.on_pause = on_pause
    return ckpt


def _pause_for_kill(host: int, where: str) -> None:
    """Fault injection: mark the kill point and wait for the supervisor's SIGKILL."""
    logging.warning("host %d: paused %s", host, where)
    sys.stdout.flush()
    sys.stderr.flush()
    (Path(FLAGS.workdir) / f".paused_host{host}").write_text(where)
    time.sleep(120)
    logging.error("host %d: not killed within 120 s of pausing", host)
    os._exit(1)


_TIER_ORDER = ("local", "peer", "persistent")
_AUDITED_EVENTS = {"open", "os.listdir", "os.scandir", "os.rename", "os.replace", "os.remove",
                   "os.rmdir", "os.mkdir", "shutil.rmtree", "os.unlink"}


def _install_store_audit(host: int) -> None:
    """Test aid (CAPRICORN_AUDIT_STORE=1): ends the process if it touches another
    host's store; data from peers may reach this host only through the transport."""
    job_root = os.path.abspath(os.path.join(FLAGS.store_root, job_name(FLAGS.workdir)))
    own = os.path.join(job_root, f"host{host}")

    def hook(event: str, args: tuple) -> None:
        if event not in _AUDITED_EVENTS:
            return
        for arg in args[:2]:
            if isinstance(arg, (str, bytes, os.PathLike)):
                path = os.path.abspath(os.fsdecode(arg))
                if path.startswith(job_root + os.sep) and not (
                        path == own or path.startswith(own + os.sep)):
                    os.write(2, f"STORE ISOLATION VIOLATION: host {host} {event} {path}\n"
                             .encode())
                    os._exit(3)

    sys.addaudithook(hook)


def _r6(x: float | None) -> float | None:
    return None if x is None else round(float(x), 6)


class StepProfiling:
    """Which steps run the instrumented (layer-profiled) step, and their events.

    One per worker, on every host: all hosts take the same decisions (the
    detector reads the replicated tokens_per_expert, and a new profiled variant
    times its all-to-alls collectively), while only host 0's ``metrics``
    writes. Per policy (``capricorn_jax.should_profile``): off; every step;
    the first n steps, whose step times become one fixed ``IterationProfile``
    (Gemini, ``iteration_profile`` event); speculative, the step after one
    whose expert load drifted from the load at the last profile (Capricorn,
    ``detector`` event per step). A profiled step that ran a variant for the
    first time (compile, cold first run) is no duration measurement: the
    detector takes its load as the new reference but not its durations, and
    profiles the next step again.

    ``plain_step(step, factors, state, batch)`` runs a step that is not
    profiled (default: the trainer's plain step; the scheduled strategies pass
    theirs, which moves a checkpoint version inside the step). ``start`` is the
    first step this process runs: first_n counts from it, so a restarted
    process profiles again. ``gate(tokens_per_expert)``, when given, may
    veto a speculative activation (capricorn: only when the schedule in force
    is at risk at this load, ``scheduling.schedule_at_risk``).

    ``cache_options`` (speculative, load-dependent dispatch): a
    ``ProfileCache`` keyed by the capacity tuple stands in front of the
    detector: the next step is profiled only when the detector drifted, its
    tuple differs from this step's or it lacks ``samples`` profiles, and the
    cache cannot answer for it (``ProfileCache.decide``); a hit runs no
    instrumented step, and the detector event names the cached profiles that
    stand for the step (``cache_steps``). Their durations feed nothing else
    yet (capricorn's schedule is planned only on real profiles). ``log``
    then needs this step's and the next step's capacity factors.
    """

    def __init__(self, policy: ProfilePolicy, trainer, metrics: MetricsWriter, first_n: int,
                 detector_options: DetectorOptions, plain_step=None, start: int = 0,
                 gate=None, cache_options: CacheOptions | None = None):
        self.policy, self.trainer, self.metrics, self.first_n = policy, trainer, metrics, first_n
        self.plain_step = plain_step or (
            lambda step, factors, state, batch: trainer.step_fn(factors)(state, batch))
        self.start = start
        self.gate = gate
        speculative = policy is ProfilePolicy.SPECULATIVE
        self.detector = DynamicityDetector(detector_options) if speculative else None
        self.cache = (ProfileCache(cache_options)
                      if speculative and cache_options is not None else None)
        self.iterations = FirstNProfiler(first_n) if policy is ProfilePolicy.FIRST_N else None
        self.decision = None  # the detector's, about the previous step
        self._reprofile = False
        self._profiled_variants: set[tuple[float, ...]] = set()

    def run(self, step: int, factors: tuple[float, ...], state, batch):
        """One train step, instrumented or not (same state and metrics bitwise).

        Returns:
          (new state, step metrics, LayerProfile or None, whether the step ran
          its variant for the first time in this process).
        """
        if not self.will_profile(step):
            first = not self.trainer.has_step(factors)
            state, out = self.plain_step(step, factors, state, batch)
            return state, out, None, first
        first = factors not in self._profiled_variants
        self._profiled_variants.add(factors)
        profiled = make_profiled_step(self.trainer, factors,
                                      gpt_moe_all_to_alls(self.trainer, factors))
        state, out, profile = profiled(state, batch)
        return state, out, profile, first

    def will_profile(self, step: int) -> bool:
        """Whether step ``step`` (the next one) runs instrumented."""
        counted = step - self.start if self.policy is ProfilePolicy.FIRST_N else step
        return self._reprofile or should_profile(self.policy, counted, self.decision,
                                                 self.first_n)

    def moe_layer_of(self, profile) -> dict[tuple[str, str], int]:
        """{(segment name, direction): MoE layer index} of the MoE layers' segments."""
        return moe_segments(profile, self.trainer.cfg.moe_layers)

    def log(self, step: int, tpe, profile, first: bool, factors=None,
            next_factors=None) -> None:
        """The step's profiling events; feeds the detector / first-n profiler.

        ``factors`` / ``next_factors``: the capacity tuples of this step and
        of the next (needed with the profile cache only).
        """
        if profile is not None:
            moe = self.moe_layer_of(profile)
            self.metrics.write({
                "event": "profile", "step": step, "total_s": _r6(profile.total_s),
                "compiled": first, "devices": profile.devices,
                "layers": [{"name": s.name, "direction": s.direction, "start_s": _r6(s.start_s),
                            "duration_s": _r6(s.duration_s), "collective_s": _r6(s.collective_s),
                            "moe_layer": moe.get((s.name, s.direction))}
                           for s in profile.segments],
            })
            if self.iterations is not None and self.iterations.profile is None:
                done = self.iterations.observe(step - self.start, profile.total_s)
                if done is not None:
                    collective = sum(s.collective_s or 0.0 for s in profile.segments)
                    self.metrics.write({
                        "event": "iteration_profile", "step": step,
                        "iterations": done.iterations, "median_s": _r6(done.median_s),
                        "step_times_s": [_r6(t) for t in done.step_times_s],
                        "collective_s": _r6(collective),
                    })
        if self.detector is None:
            return
        if profile is not None:
            durations = {} if first else moe_durations(profile, self.trainer.cfg.moe_layers)
            self.detector.record_profile(step, tpe, durations)
            if self.cache is not None and not first:
                self.cache.record(tuple(factors), step, durations)
        self.decision = self.detector.observe(step, tpe)
        cache, sources = None, None
        if self.cache is not None:
            key = tuple(next_factors)
            cache = self.cache.decide(step + 1, key, tuple(factors), self.decision.profile_next)
            self.decision = dataclasses.replace(self.decision, profile_next=cache.profile)
            if cache.cached:
                sources = sorted(set().union(*self.cache.sources(key, step + 1).values()))
        gated = False
        if self.decision.profile_next and self.gate is not None and not self.gate(tpe):
            # The load drifted but the schedule in force still fits its windows.
            self.decision = dataclasses.replace(self.decision, profile_next=False)
            gated = True
        self._reprofile = profile is not None and first
        self.metrics.write({
            "event": "detector", "step": step,
            "scores": [None if s == float("inf") else round(s, 5) for s in self.decision.scores],
            "profile_next": self.decision.profile_next, "repartition": self.decision.repartition,
            "gated": gated,
            # Profile cache (None without it): a profile was asked for and the
            # next step's capacity tuple has enough young cached profiles;
            # cache_steps: the steps those profiles were measured at (their
            # median stands for the next step), cache_step: the newest.
            "cache_hit": None if cache is None else cache.hit,
            "cache_step": sources[-1] if sources else None,
            "cache_steps": sources or None,
        })


def _make_strategy(ckpt, trainer):
    """The --ckpt strategy over the in-memory checkpointer (None for none)."""
    from launch import strategies

    if ckpt is None:
        return None
    if FLAGS.ckpt in SCHEDULED:
        return strategies.Scheduled(FLAGS.ckpt, ckpt, trainer, first_n=FLAGS.profile_first_n,
                                    drift_threshold=FLAGS.drift_threshold,
                                    chunk_cap=FLAGS.chunk_bytes)
    return strategies.InMemory(ckpt)


def _repartition(metrics: MetricsWriter, host: int, step: int, event: dict | None) -> None:
    """The ``repartition`` event, when the scheduled strategy re-partitioned."""
    if event is None:
        return
    metrics.write({"event": "repartition", "step": step, "strategy": FLAGS.ckpt, **event})
    logging.info("host %d: %s re-partitioned after step %d: %d bytes in windows, %d in the "
                 "tail", host, FLAGS.ckpt, step, sum(event["window_bytes"]), event["tail_bytes"])


def _write_timeline(timeline) -> None:
    """WORKDIR/timeline.json and .png from host 0's last warm profile."""
    from capricorn_jax._src.scheduling import timeline as timeline_lib
    from launch.plot_timeline import render

    if timeline is None:
        logging.warning("--timeline: no warm profiled step in this run; nothing written")
        return
    profile, schedule = timeline
    doc = timeline_lib.trace(profile, schedule, 0, title=f"{FLAGS.ckpt} {FLAGS.model}")
    path = timeline_lib.write_trace(Path(FLAGS.workdir) / "timeline.json", doc)
    png = render(doc, path.with_suffix(".png"))
    over = doc["metadata"]["overflows"]
    logging.info("timeline of step %d written to %s and %s; windows overflowed: %s",
                 profile.step, path, png, [o["window"] for o in over] or "none")


def _log_checkpoint(metrics: MetricsWriter, host: int, saved: dict) -> None:
    """The ``checkpoint`` event of a save (its ``step`` is the version saved)."""
    metrics.write({"event": "checkpoint", "step": saved["version"],
                   **{k: v for k, v in saved.items() if k != "version"}})
    for u in saved["under_replicated"]:
        logging.warning("host %d: version %d under-replicated (missing on hosts %s)",
                        host, u["step"], u["missing"])


def train_worker(process_id: int) -> None:
    """One host's training loop (imports JAX here, after the env is set)."""
    import jax
    import numpy as np

    import capricorn_jax
    from launch import strategies
    from launch.data import validation_batch
    from models.capacity import choose_capacity_factors

    if os.environ.get("CAPRICORN_AUDIT_STORE") == "1":
        _install_store_audit(process_id)
    _quiet_orbax_info()
    runtime.init_distributed(FLAGS.hosts, FLAGS.coordinator, process_id)
    job = runtime.build_job(FLAGS.model, _config_overrides(), FLAGS.expert_parallel, FLAGS.steps,
                            FLAGS.learning_rate, FLAGS.warmup_steps, FLAGS.workload,
                            FLAGS.shift_every, FLAGS.seed)
    cfg, mesh, trainer, data, corpus = job.cfg, job.mesh, job.trainer, job.data, job.corpus
    host, num_hosts, data_opts = job.host, job.hosts, job.data_options
    metrics = MetricsWriter(Path(FLAGS.workdir) / "metrics.jsonl", enabled=host == 0)
    logging.info("host %d/%d: %d local devices, mesh %s, model %s", host, num_hosts,
                 jax.local_device_count(), dict(mesh.shape), cfg.name)
    state, max_routed, start = None, None, 0
    ckpt = _make_checkpointer(trainer, mesh, host, num_hosts) if FLAGS.ckpt in IN_MEMORY else None
    persistent = _Persistent(ckpt, trainer, metrics) if FLAGS.persist_every else None
    if persistent is not None:
        state, start, host_state = persistent.restore()
        if state is not None:
            data.restore(host_state["data"])
            max_routed = host_state["max_routed"]
    elif ckpt is not None:
        recovered = capricorn_jax.recover(ckpt)
        if recovered is not None:
            state, start = recovered.state, recovered.step
            data.restore(recovered.host_state["data"])
            max_routed = recovered.host_state["max_routed"]
            _log_recovery(metrics, host, start, recovered.tiers, recovered.seconds,
                          recovered.bytes_moved, **_pec_fields(recovered))
    if state is None:
        state = trainer.init_state(FLAGS.seed)
    strategy = _make_strategy(ckpt, trainer)
    scheduled = isinstance(strategy, strategies.Scheduled)
    profiling = StepProfiling(
        profile_policy(), trainer, metrics, FLAGS.profile_first_n,
        DetectorOptions(threshold=FLAGS.drift_threshold, metric=FLAGS.drift_metric),
        plain_step=strategy.unprofiled_step if scheduled else None, start=start,
        cache_options=(CacheOptions(FLAGS.profile_cache_max_age, FLAGS.profile_cache_samples,
                                    FLAGS.profile_cache_granularity)
                       if FLAGS.profile_cache_max_age and cfg.dispatch == "bucketed" else None))
    if FLAGS.ckpt == "capricorn":
        profiling.gate = lambda tpe: strategy.at_risk(profiling.detector, tpe)
    tokens_per_step = cfg.global_batch * cfg.seq_len
    window_start, window_tokens = time.perf_counter(), 0
    timeline = None  # (last warm profile, schedule in force during it)
    for step in range(start, FLAGS.steps):
        factors = choose_capacity_factors(cfg, max_routed, trainer.tokens_per_group)
        domain = data.domain
        t0 = time.perf_counter()
        batch = trainer.global_batch(data.next_batch())
        state, out, profile, first_run = profiling.run(step, factors, state, batch)
        if scheduled and profile is not None and not first_run:
            profile = agree_profile(profile)  # host 0's durations drive every host
        loss = float(out["loss"])
        tpe = np.asarray(out["tokens_per_expert"])
        max_routed = [int(v) for v in np.asarray(out["max_routed"])]
        next_factors = choose_capacity_factors(cfg, max_routed, trainer.tokens_per_group)
        profiling.log(step, tpe, profile, first_run, factors, next_factors)
        if profile is not None and not first_run:
            in_force = strategy.transfers.schedule if scheduled else None
            timeline = (profile, in_force)
        if scheduled and profile is not None:
            _repartition(metrics, host, step, strategy.on_profile(step, profile, first_run))
            if timeline is not None and timeline[0] is profile and timeline[1] is None:
                timeline = (profile, strategy.transfers.schedule)
        saved = []
        if strategy is not None:
            if persistent is not None:
                persistent.handler.await_reader()  # no prune under the disk writer's read
            host_state = {"data": data.state(), "max_routed": max_routed}
            saved = (strategy.save(step + 1, state, host_state,
                                   next_profiled=profiling.will_profile(step + 1),
                                   tokens_per_expert=tpe)
                     if scheduled else strategy.save(step + 1, state, host_state,
                                                     tokens_per_expert=tpe))
        step_time = time.perf_counter() - t0
        metrics.write({
            "step": step, "loss": loss, "step_time_s": step_time,
            "tokens_per_expert": tpe.tolist(), "domain": domain,
            "capacity_factors": list(factors), "dropped": np.asarray(out["dropped"]).tolist(),
            "profiled": profile is not None, "compiled": first_run,
        })
        for event in saved:
            _log_checkpoint(metrics, host, event)
            if persistent is not None:
                persistent.maybe_persist(event["version"], state)
        if step == FLAGS.pause_after_step_at:
            _pause_for_kill(host, f"after step {step}")
        window_tokens += tokens_per_step
        if host == 0 and ((step + 1) % FLAGS.log_every == 0 or step + 1 == FLAGS.steps):
            elapsed = time.perf_counter() - window_start
            imbalance = float(np.mean(tpe.max(axis=1) / np.maximum(tpe.mean(axis=1), 1e-9)))
            logging.info("step %d/%d loss %.4f tokens/s %.0f expert imbalance (max/mean) %.2f "
                         "domain %s", step + 1, FLAGS.steps, loss, window_tokens / elapsed,
                         imbalance, domain)
            window_start, window_tokens = time.perf_counter(), 0
    if strategy is not None:
        final = strategy.finish(FLAGS.steps, state, {"data": data.state(),
                                                     "max_routed": max_routed})
        for event in final:
            _log_checkpoint(metrics, host, event)
            if persistent is not None:
                persistent.maybe_persist(event["version"], state)
        if persistent is not None:
            persistent.close()
        strategy.close()
    if FLAGS.timeline and host == 0:
        _write_timeline(timeline)
    if FLAGS.eval_sequences and corpus is not None:
        eval_fn = trainer.eval_loss_fn()
        per_domain = {}
        rows = FLAGS.eval_sequences * mesh.size // num_hosts
        for name in corpus.names:
            local = validation_batch(data_opts, corpus, name, rows * num_hosts, cfg.seq_len)
            batch = trainer.global_batch(local[host * rows:(host + 1) * rows])
            per_domain[name] = float(eval_fn(state, batch))
        metrics.write({"event": "eval", "step": FLAGS.steps, "val_loss": per_domain})
        if host == 0:
            logging.info("validation loss %s", json.dumps(per_domain))
    jax.block_until_ready(state)
    metrics.close()


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"train: error: unexpected arguments {argv[1:]}", file=sys.stderr)
        sys.exit(2)
    if FLAGS.process_id >= 0:
        runtime.exit_now_on_failure(train_worker, FLAGS.process_id)
        return
    try:
        check_flags()
    except FlagError as e:
        print(f"train: error: {e}", file=sys.stderr)
        sys.exit(2)
    if FLAGS.platform == "gpu" and FLAGS.hosts == 1:
        train_worker(0)
        return
    if FLAGS.platform == "gpu":
        print("train: error: --platform=gpu with --hosts>1: start one worker per host with "
              "--process_id and --coordinator", file=sys.stderr)
        sys.exit(2)
    sys.exit(supervise())


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    app.run(main)
