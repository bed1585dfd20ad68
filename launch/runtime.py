"""What every worker process sets up: jax.distributed, the mesh, the trainer, the data.

Shared by launch.train and launch.bench so both run the same job.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any

from models.config import ModelConfig, get_config


def expert_parallel(requested: int, num_experts: int, devices: int) -> int:
    """The expert axis size: ``requested``, or gcd(experts, devices) when 0."""
    return requested or math.gcd(num_experts, devices)


def init_distributed(hosts: int, coordinator: str, process_id: int,
                     single_process: bool = False) -> None:
    """Joins the jax.distributed job (gloo CPU collectives) when hosts > 1;
    with ``single_process`` a job of one process (Orbax's emergency manager
    needs a distributed client even on one host), on a free local port."""
    import jax

    if hosts == 1 and single_process:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0,
                                   initialization_timeout=120)
    if hosts > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes=hosts, process_id=process_id,
                                   initialization_timeout=120)


@dataclasses.dataclass
class Job:
    """One host's view of a training job."""

    cfg: ModelConfig
    mesh: Any
    trainer: Any
    data: Any
    data_options: Any
    corpus: Any
    host: int
    hosts: int


def build_job(model: str, overrides: dict, expert_parallel_flag: int, steps: int,
              learning_rate: float, warmup_steps: int, workload: str, shift_every: int,
              seed: int, accelerator: str = "none", accelerator_profile: str = "") -> Job:
    """The model, mesh, trainer and this host's data iterator (``accelerator``:
    launch.accelerator's flags)."""
    import jax

    from launch.data import Corpus, DataIterator, DataOptions
    from launch.trainer import OptimizerOptions, Trainer, make_mesh

    cfg = get_config(model, **overrides)
    devices = jax.devices()
    mesh = make_mesh(expert_parallel(expert_parallel_flag, cfg.num_experts, len(devices)),
                     devices)
    from launch import accelerator as accel

    trainer = Trainer(cfg, mesh, OptimizerOptions(learning_rate, warmup_steps, steps),
                      accel.emulation(accelerator, accelerator_profile, cfg))
    host, hosts = jax.process_index(), jax.process_count()
    options = DataOptions(seq_len=cfg.seq_len, batch_per_host=cfg.global_batch // hosts,
                          workload=workload, shift_every=shift_every, seed=seed)
    corpus = None if workload == "synthetic" else Corpus.load(options.max_bytes_per_domain)
    data = DataIterator(options, host, hosts, corpus)
    return Job(cfg, mesh, trainer, data, options, corpus, host, hosts)


def exit_now_on_failure(fn, *args) -> None:
    """Runs fn; on any exception logs it and exits at once with code 1.

    A normal exit would wait in jax.distributed's shutdown barrier for hosts
    that are still running, and never return.
    """
    from absl import logging

    try:
        fn(*args)
    except BaseException:  # noqa: BLE001
        logging.exception("worker failed")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
