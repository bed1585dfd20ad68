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

import json
import math
import os
import sys
import time
from pathlib import Path

from absl import app, flags, logging

from launch import cluster as cluster_lib
from launch.metrics import MetricsWriter, read_metrics, summarize
from models.config import CONFIGS, DISPATCH_MODES, get_config

FLAGS = flags.FLAGS
flags.DEFINE_integer("hosts", 2, "Simulated hosts (processes).")
flags.DEFINE_integer("devices_per_host", 2, "CPU devices per simulated host.")
flags.DEFINE_string("model", "tiny", f"Model config: {', '.join(CONFIGS)}.")
flags.DEFINE_integer("steps", 20, "Training steps.")
flags.DEFINE_string("workdir", None, "Directory for metrics.jsonl and checkpoints.")
flags.DEFINE_integer("seed", 0, "Seed of the parameters, dropout and data order.")
flags.DEFINE_enum("workload", "steady", ["steady", "dynamic", "synthetic"],
                  "steady: one domain; dynamic: domain shift every --shift_every steps; "
                  "synthetic: random bytes (explicit opt-in).")
flags.DEFINE_integer("shift_every", 50, "Steps between domain shifts (dynamic workload).")
flags.DEFINE_enum("ckpt", "none", ["none"], "Checkpoint strategy.")
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
flags.DEFINE_integer("process_id", -1, "Internal: this worker's host index (set by the supervisor).")
flags.DEFINE_string("coordinator", "", "Internal: jax.distributed coordinator address.")


class FlagError(ValueError):
    """A bad flag value; the message starts with the flag's name."""


def _config_overrides() -> dict:
    overrides = {}
    if FLAGS.dispatch:
        overrides["dispatch"] = FLAGS.dispatch
    if FLAGS.global_batch:
        overrides["global_batch"] = FLAGS.global_batch
    return overrides


def _expert_parallel(num_experts: int, devices: int) -> int:
    return FLAGS.expert_parallel or math.gcd(num_experts, devices)


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
        ep = _expert_parallel(cfg.num_experts, devices)
        if ep < 1 or devices % ep:
            raise FlagError(f"--expert_parallel={ep} does not divide the {devices} devices")
        if cfg.num_experts % ep:
            raise FlagError(
                f"--expert_parallel={ep}: the model's {cfg.num_experts} experts are not "
                f"divisible by the expert axis"
            )
        if cfg.global_batch % devices:
            raise FlagError(f"--global_batch={cfg.global_batch} not divisible by {devices} devices")
    if not FLAGS.workdir:
        raise FlagError("--workdir is required")
    try:
        Path(FLAGS.workdir).mkdir(parents=True, exist_ok=True)
        probe = Path(FLAGS.workdir) / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise FlagError(f"--workdir: cannot write to {FLAGS.workdir!r}: {e.strerror}") from None


def _worker_argv(host: int, coordinator: str) -> list[str]:
    passed = [a for a in sys.argv[1:] if not a.startswith(("--process_id", "--coordinator"))]
    return ["-m", "launch.train", *passed, f"--process_id={host}", f"--coordinator={coordinator}"]


def supervise() -> int:
    """Runs the simulated cluster; returns the job's exit code."""
    coordinator = f"127.0.0.1:{cluster_lib.free_port()}"
    metrics_path = Path(FLAGS.workdir) / "metrics.jsonl"
    if metrics_path.exists():
        metrics_path.unlink()
    cluster = cluster_lib.LocalCluster(
        lambda h: _worker_argv(h, coordinator), FLAGS.hosts, FLAGS.devices_per_host
    )
    code = cluster_lib.run(cluster, FLAGS.timeout_s)
    if code == 0 and metrics_path.exists():
        print("report:", json.dumps(summarize(read_metrics(metrics_path))), flush=True)
    elif code != 0:
        print(f"train: job failed with exit code {code}", file=sys.stderr, flush=True)
    return code


def train_worker(process_id: int) -> None:
    """One host's training loop (imports JAX here, after the env is set)."""
    import jax
    import numpy as np

    from launch.data import Corpus, DataIterator, DataOptions, validation_batch
    from launch.trainer import OptimizerOptions, Trainer, make_mesh
    from models.capacity import choose_capacity_factors

    if FLAGS.hosts > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            FLAGS.coordinator, num_processes=FLAGS.hosts, process_id=process_id,
            initialization_timeout=120,
        )
    cfg = get_config(FLAGS.model, **_config_overrides())
    devices = jax.devices()
    mesh = make_mesh(_expert_parallel(cfg.num_experts, len(devices)), devices)
    opt = OptimizerOptions(FLAGS.learning_rate, FLAGS.warmup_steps, FLAGS.steps)
    trainer = Trainer(cfg, mesh, opt)
    host, num_hosts = jax.process_index(), jax.process_count()
    data_opts = DataOptions(seq_len=cfg.seq_len, batch_per_host=cfg.global_batch // num_hosts,
                            workload=FLAGS.workload, shift_every=FLAGS.shift_every,
                            seed=FLAGS.seed)
    corpus = None if FLAGS.workload == "synthetic" else Corpus.load(data_opts.max_bytes_per_domain)
    data = DataIterator(data_opts, host, num_hosts, corpus)
    metrics = MetricsWriter(Path(FLAGS.workdir) / "metrics.jsonl", enabled=host == 0)
    logging.info("host %d/%d: %d local devices, mesh %s, model %s", host, num_hosts,
                 jax.local_device_count(), dict(mesh.shape), cfg.name)
    state = trainer.init_state(FLAGS.seed)
    max_routed = None
    tokens_per_step = cfg.global_batch * cfg.seq_len
    window_start, window_tokens = time.perf_counter(), 0
    for step in range(FLAGS.steps):
        factors = choose_capacity_factors(cfg, max_routed, trainer.tokens_per_group)
        domain = data.domain
        t0 = time.perf_counter()
        batch = trainer.global_batch(data.next_batch())
        state, out = trainer.step_fn(factors)(state, batch)
        loss = float(out["loss"])
        step_time = time.perf_counter() - t0
        tpe = np.asarray(out["tokens_per_expert"])
        max_routed = [int(v) for v in np.asarray(out["max_routed"])]
        metrics.write({
            "step": step, "loss": loss, "step_time_s": step_time,
            "tokens_per_expert": tpe.tolist(), "domain": domain,
            "capacity_factors": list(factors), "dropped": np.asarray(out["dropped"]).tolist(),
        })
        window_tokens += tokens_per_step
        if host == 0 and ((step + 1) % FLAGS.log_every == 0 or step + 1 == FLAGS.steps):
            elapsed = time.perf_counter() - window_start
            imbalance = float(np.mean(tpe.max(axis=1) / np.maximum(tpe.mean(axis=1), 1e-9)))
            logging.info("step %d/%d loss %.4f tokens/s %.0f expert imbalance (max/mean) %.2f "
                         "domain %s", step + 1, FLAGS.steps, loss, window_tokens / elapsed,
                         imbalance, domain)
            window_start, window_tokens = time.perf_counter(), 0
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
        train_worker(FLAGS.process_id)
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
