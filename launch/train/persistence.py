"""launch.train's checkpoint tiers: the in-memory checkpointer, the persistent
tier over it, and where a restarted worker resumes from.

``make_checkpointer`` builds the strategies' ``InMemoryCheckpointer`` from
the checkpoint config (stores, replicas, chunk size, PEC) and the fault
config (a stalled replica writer, the pause for a kill halfway through the
replicas). ``PersistentTier`` adds ``--persist_every``: the library's
``CheckpointManager`` over that checkpointer, writing WORKDIR/checkpoints.
``resume`` restores the newest version across tiers and logs the
``recovery`` event.

Design choice: the strategy saves to memory itself (after the step, or inside
it) and the persistent tier only hands each committed version to the
manager, which writes it from the host store. Alternative not taken: the
persistent tier saving the training state on its own schedule, which would
copy the state from the devices a second time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from absl import logging

from launch.metrics import MetricsWriter
from launch.strategies import uses_channel
from launch.tiers import host_tiers, memory_options, memory_tier
from launch.train import faults as faults_lib
from launch.train.config import CheckpointConfig, Config

if TYPE_CHECKING:
    from capricorn_jax import RestoreInfo

# The tiers a recovery may reach for, nearest first.
TIER_ORDER = ("local", "peer", "persistent")


def make_checkpointer(config: Config, trainer: Any, mesh: Any, host: int, hosts: int) -> Any:
    """This host's ``capricorn_jax.InMemoryCheckpointer`` for the --ckpt strategy."""
    import jax

    import capricorn_jax
    from capricorn_jax.experimental import SECRET_NAME, FaultHooks

    ckpt_cfg, faults = config.checkpoint, config.faults
    pause = faults.pause_mid_replication_at if faults.pause_mid_replication_at >= 0 else None
    workdir = config.train.workdir

    def on_pause(version: int) -> None:  # halfway through the replicas of ``version``
        faults_lib.reached(faults, workdir, host, "mid_replication", version - 1)

    def on_flip(version: int) -> None:  # a byte of a frame corrupted in transit
        what = "chunk frame" if channel else "chunk in the exchange"
        print(f"fault: host {host} flipped a byte of its first {what} of version {version} "
              f"after its checksum (its fault point)", flush=True)

    def on_stall(version: int) -> None:  # the chunk channel hangs
        seconds = faults.stall_channel_at[1] if faults.stall_channel_at else 0
        print(f"fault: host {host}'s chunk channel hangs for {seconds:g} s before its first "
              f"frame of version {version} (its fault point)", flush=True)

    def on_serve(version: int) -> None:  # about to serve a peer's payload in a recovery
        faults_lib.reached(faults, workdir, host, "mid_serve", version)

    # A corrupted frame strikes the path the strategy's versions take: the
    # chunk channel, or the in-graph exchange (the registry's answer for this
    # path on this backend: on GPU auto is in-graph for every strategy).
    channel = uses_channel(ckpt_cfg.strategy, ckpt_cfg.chunk_path, jax.default_backend())
    hooks = FaultHooks(stall_replica_writer_at=faults.stall(host),
                       pause_mid_replication_at=pause, on_pause=on_pause,
                       flip_frame_at=faults.flip_frame_at if channel else None,
                       flip_exchange_at=None if channel else faults.flip_frame_at,
                       on_flip=on_flip,
                       stall_channel_at=faults.stall_channel_at, on_stall=on_stall,
                       on_serve=on_serve)
    options = memory_options(
        store_root=ckpt_cfg.store_root, job=ckpt_cfg.job, replicas=ckpt_cfg.replicas,
        chunk_bytes=ckpt_cfg.chunk_bytes, replication_timeout_s=ckpt_cfg.replication_timeout_s,
        budget_s=ckpt_cfg.budget_s,
        pec=capricorn_jax.PecOptions(k=ckpt_cfg.pec_k, k_persist=ckpt_cfg.pec_k_persist or None,
                                     policy=ckpt_cfg.pec_policy,
                                     plt_threshold=ckpt_cfg.pec_plt_threshold,
                                     dynamic=ckpt_cfg.pec_dynamic) if ckpt_cfg.pec_k else None,
        traffic_class=config.cluster.link.traffic_class,
        # The chunk channel's secret (the environment's wins): the supervisor made
        # it; hosts started by hand read it, the first one creating it.
        channel_secret_file=str(Path(workdir).absolute() / SECRET_NAME),
    )
    return memory_tier(options, trainer, mesh, host, hosts, hooks)


class PersistentTier:
    """The persistent tier of launch.train: capricorn_jax.CheckpointManager over
    the strategy's InMemoryCheckpointer, writing WORKDIR/checkpoints.

    The strategy saves to memory itself (after the step, or inside it);
    ``offer`` hands each committed version to the manager, which writes
    it from the host store when ``--persist_every`` says so.
    """

    def __init__(self, ckpt: Any, trainer: Any, metrics: MetricsWriter,
                 checkpoint: CheckpointConfig, workdir: str,
                 temporary_path_class: type | None = None):
        import orbax.checkpoint as ocp

        import capricorn_jax

        self.ocp, self.cj, self.trainer, self.metrics = ocp, capricorn_jax, trainer, metrics
        self.pec = bool(checkpoint.pec_k)
        self.handler = capricorn_jax.CapricornHandler(
            ckpt, read_timeout_s=checkpoint.persist_timeout_s)
        self.manager = capricorn_jax.CheckpointManager(
            Path(workdir).absolute() / "checkpoints",
            options=ocp.CheckpointManagerOptions(
                save_interval_steps=checkpoint.persist_every, max_to_keep=checkpoint.max_to_keep,
                temporary_path_class=temporary_path_class),
            handler_registry=self.handler.registry("state"))
        self._errors = 0
        # Called with each version whose persistent write started (fault injection).
        self.on_write: Callable[[int], None] | None = None

    def restore(self) -> tuple[Any, int, dict | None]:
        """(state, step, host_state) of the newest step across tiers, or Nones."""
        import jax

        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              self.trainer.abstract_state, self.trainer.state_shardings)
        try:
            restored = self.manager.restore(args=self.ocp.args.Composite(
                state=self.cj.CapricornRestore(target)))
        except self.cj.NoCheckpoint:  # nothing in any tier: a fresh start (any other
            return None, 0, None     # missing file is an error, not step 0)
        info = self.manager.last_restore
        assert info is not None, "CheckpointManager.restore records last_restore"
        log_recovery(self.metrics, jax.process_index(), info)
        return restored.state, info.step, info.host_state

    def offer(self, version: int, state: Any) -> None:
        args = self.ocp.args.Composite(state=self.cj.CapricornSave(state))
        if self.manager.persist(version, args):
            if self.on_write is not None:
                self.on_write(version)
            pec = self.manager.last_persist if self.pec else None
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


def resume(strategy: Any, persistent: PersistentTier | None, metrics: MetricsWriter,
           host: int) -> tuple[Any, int, dict | None]:
    """(state, step, host_state) of the newest version across the tiers (the
    persistent tier's, or the strategy's own ``restore``), or (None, 0, None)
    when there is none; logs the recovery."""
    if persistent is not None:
        return persistent.restore()
    import capricorn_jax

    try:
        state, info = strategy.restore()
    except capricorn_jax.NoCheckpoint:  # a fresh start
        return None, 0, None
    log_recovery(metrics, host, info)
    return state, info.step, info.host_state


def log_recovery(metrics: MetricsWriter, host: int, info: RestoreInfo) -> None:
    """The ``recovery`` event of a restore (its ``tier``: the farthest any host
    reached for; ``tiers``: ``host_tiers``)."""
    step, seconds, bytes_moved, tiers = info.step, info.seconds, info.bytes_moved, host_tiers(info)
    metrics.write({"event": "recovery", "step": step,
                   "tier": max(tiers, key=TIER_ORDER.index), "seconds": seconds,
                   "tiers": tiers, "bytes_moved": bytes_moved, **pec_fields(info)})
    if host == 0:  # the job's line on the console (host 0 knows every host's tier)
        moved = "" if bytes_moved is None else f", {bytes_moved} bytes from peers"
        logging.info("recovery: resumed from step %d via tier %s (hosts: %s) in %.2fs%s", step,
                     max(tiers, key=TIER_ORDER.index), ", ".join(tiers), seconds, moved)
    else:
        logging.info("host %d: recovered version %d from tier %s in %.2fs", host, step,
                     tiers[host], seconds)


def pec_fields(info: RestoreInfo) -> dict:
    """A PEC restore's portion of lost tokens and where each expert came from."""
    pec = info.pec
    if pec is None:
        return {}
    fields = {"plt": pec.plt, "accumulated_plt": pec.accumulated_plt, "pec_k": pec.k,
              "versions": pec.versions, "expert_source_steps": pec.source}
    if pec.data_steps is not None:  # persistent tier: the training step of each expert's values
        fields["expert_data_steps"] = pec.data_steps
    return fields


def quiet_orbax_info() -> None:
    """Orbax logs every save step at INFO through absl; keep its warnings only."""
    import logging as pylogging

    class QuietOrbax(pylogging.Filter):
        def filter(self, record: pylogging.LogRecord) -> bool:
            return record.levelno >= pylogging.WARNING or "/orbax/" not in record.pathname

    pylogging.getLogger("absl").addFilter(QuietOrbax())
