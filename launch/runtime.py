"""What every worker process sets up: jax.distributed, the mesh, the trainer, the data.

Shared by launch.train and launch.bench so both run the same job.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any

from absl import logging

from models.config import ModelConfig, get_config


def expert_parallel(requested: int, num_experts: int, devices: int) -> int:
    """The expert axis size: ``requested``, or gcd(experts, devices) when 0."""
    return requested or math.gcd(num_experts, devices)


def init_distributed(hosts: int, coordinator: str, process_id: int,
                     single_process: bool = False, peer_timeout_s: float = 100.0) -> None:
    """Joins the jax.distributed job (gloo CPU collectives) when hosts > 1;
    with ``single_process`` a job of one process (Orbax's emergency manager
    needs a distributed client even on one host), on a free local port.

    ``peer_timeout_s`` (``--peer_timeout_s``) is jax.distributed's heartbeat
    and shutdown timeout: a host silent that long (SIGSTOP, a hung kernel, a
    cut link) is declared dead by the coordination service, and every other
    host's process ends with an error naming it, wherever it waits (an
    in-graph collective, a barrier). A host that is alive but never reaches a
    collective (its heartbeat goes on) is bounded by gloo's own timeout,
    ``--xla_cpu_collective_timeout_seconds``, set here to
    ``COLLECTIVE_TIMEOUT_FACTOR`` x ``peer_timeout_s`` (room for a peer that
    compiles a new program before it arrives) while no backend exists yet
    (XLA reads it when it creates the CPU client). Measured (jax 0.10.2, 2
    processes): a sum whose peer never came failed after 5.0 s at a 5 s bound,
    naming gloo's timed-out receive."""
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
        bound = max(1, math.ceil(peer_timeout_s))
        bound_collectives(COLLECTIVE_TIMEOUT_FACTOR * bound)
        jax.distributed.initialize(coordinator, num_processes=hosts, process_id=process_id,
                                   initialization_timeout=120, heartbeat_timeout_seconds=bound,
                                   shutdown_timeout_seconds=bound)


COLLECTIVE_TIMEOUT_FACTOR = 3
"""Gloo's collective bound over the peer timeout (``init_distributed``)."""


def bound_collectives(seconds: int) -> bool:
    """Sets gloo's collective timeout (``--xla_cpu_collective_timeout_seconds``
    in ``XLA_FLAGS``, unless the user set it) before the CPU backend exists;
    whether the bound is in force (False, logged: a backend came first)."""
    from jax._src import xla_bridge

    flag = "--xla_cpu_collective_timeout_seconds"
    given = os.environ.get("XLA_FLAGS", "")
    if flag in given:
        return True
    if xla_bridge.backends_are_initialized():
        logging.warning("gloo's collective timeout not set: the CPU backend exists already")
        return False
    os.environ["XLA_FLAGS"] = f"{given} {flag}={int(seconds)}".strip()
    return True


ORBAX_BARRIER_S = 300
"""Orbax's bound on its synchronous barriers once they run on the distributed
client (``multihost.coordination_timeout()`` in orbax-checkpoint 0.12.8, a
constant): below the agreements' bound (``capricorn_jax`` 1800 s)."""


def bound_orbax_barriers(fv: Any) -> None:
    """Orbax's synchronous barriers (a save's start, a deleted step's, ...)
    through the jax.distributed client, bounded (``ORBAX_BARRIER_S``), instead
    of collectives that wait for ever on a host that is alive but never comes
    (a dead or silent one is ended by the heartbeat, ``--peer_timeout_s``):
    Orbax's ``experimental_orbax_use_distributed_barrier`` flag, set in this
    command's parsed absl flags ``fv`` (its main calls this). Alternative not
    taken: the project's own barrier around Orbax's calls (they are inside
    ``CheckpointManager.save``)."""
    from orbax.checkpoint._src.multihost import multihost  # defines the flag

    del multihost
    fv["experimental_orbax_use_distributed_barrier"].value = True


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
              seed: int, accelerator: str = "none", accelerator_profile: str = "",
              time_scale: float = 1.0) -> Job:
    """The model, mesh, trainer and this host's data iterator (``accelerator``,
    ``time_scale``: launch.accelerator's ``AcceleratorConfig``)."""
    import jax

    from launch.data import Corpus, DataIterator, DataOptions
    from launch.trainer import OptimizerOptions, Trainer, make_mesh

    cfg = get_config(model, **overrides)
    devices = jax.devices()
    mesh = make_mesh(expert_parallel(expert_parallel_flag, cfg.num_experts, len(devices)),
                     devices)
    from launch import accelerator as accel

    host, hosts = jax.process_index(), jax.process_count()
    options = DataOptions(seq_len=cfg.seq_len, batch_per_host=cfg.global_batch // hosts,
                          workload=workload, shift_every=shift_every, seed=seed)
    corpus = None if workload == "synthetic" else Corpus.load(options.max_bytes_per_domain)
    data = DataIterator(options, host, hosts, corpus)
    trainer = Trainer(cfg, mesh, OptimizerOptions(learning_rate, warmup_steps, steps),
                      accel.emulation(accelerator, accelerator_profile, cfg, time_scale),
                      routing_bias_table(cfg, workload, shift_every, corpus, seed))
    return Job(cfg, mesh, trainer, data, options, corpus, host, hosts)


def routing_bias_table(cfg: ModelConfig, workload: str, shift_every: int, corpus,
                       seed: int):
    """The job's routing bias table (``models.routing_bias``), or None when
    ``cfg.routing_bias`` is "none". Its rotation is the data's: the corpus's
    domains every ``shift_every`` steps.

    Raises:
      ValueError: a bias without the dynamic workload.
    """
    from models import routing_bias

    if cfg.routing_bias == routing_bias.NONE:
        return None
    if workload != "dynamic":
        raise ValueError(f"routing bias {cfg.routing_bias!r} follows the dynamic workload's "
                         f"domains; the job runs --workload={workload}")
    return routing_bias.build(cfg.routing_bias, num_experts=cfg.num_experts, top_k=cfg.top_k,
                              n_moe=len(cfg.moe_layers), n_domains=len(corpus.names),
                              shift_every=shift_every, seed=seed)


def exit_now_on_failure(fn, *args) -> None:
    """Runs fn; on any exception logs it and exits at once with code 1; when
    it returns, ends the process with ``exit_in_order``.

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
    exit_in_order()


EXIT_KEY = "launch/exit/{host}"
EXIT_BARRIER = "launch/exit"
EXIT_GRACE_S = 0.5
"""How long host 0 keeps the job's key-value store up after the last other
host said it is leaving (each leaves right after saying so)."""


def exit_in_order(timeout_s: float = 60.0) -> None:
    """Ends a worker whose work is done, host 0 (whose process serves the
    job's key-value store) last: every host first waits (bounded) at a
    barrier until all have arrived, i.e. finished their collectives; then
    every other host says it is leaving and exits at once (``os._exit(0)``);
    host 0 waits (bounded) until all have said so, then ``EXIT_GRACE_S``,
    then exits.

    Why not the interpreter's exit: it runs jax.distributed's shutdown while
    background threads may still poll the store (Orbax's write of a
    persistent step that another host's failure dropped waits for the
    primary's files and signals until its own timeout), and a poll that meets
    the store already gone aborts the process inside jaxlib (SIGABRT, exit
    134, after a job that trained to its end: chaos seed 34, trial 15).
    ``os._exit`` ends those threads with the process, and the order keeps
    the store up while any other host can still poll it. One process: the
    interpreter's exit.
    """
    import jax
    from absl import logging

    from capricorn_jax.experimental import distributed_client

    client = distributed_client()
    if client is None or jax.process_count() == 1:
        return
    host, hosts = jax.process_index(), jax.process_count()
    try:
        # No host leaves while another is still inside a collective: a host
        # whose part of an all-gather is done could otherwise exit while its
        # peer still reads that collective's socket, and the peer's read
        # fails with "connection reset by peer" (seen once in CI: host 0 in
        # release()'s status round, host 1 already gone).
        client.wait_at_barrier(EXIT_BARRIER, int(timeout_s * 1000))
        client.key_value_set(EXIT_KEY.format(host=host), "leaving")
        if host == 0:
            import time

            deadline = time.monotonic() + timeout_s
            for other in range(1, hosts):
                left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                client.blocking_key_value_get(EXIT_KEY.format(host=other), left_ms)
            time.sleep(EXIT_GRACE_S)
    except Exception as e:  # noqa: BLE001 - a host that never said so: leave anyway
        logging.warning("host %d: leaving without every host's word (%s)", host, e)
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
