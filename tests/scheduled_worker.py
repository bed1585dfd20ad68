"""One host of a 2-host job on ``TwoTierCheckpointManager(schedule=...)``, for
tests/test_emergency_scheduled.py; ``tiny_loss`` for the in-process tests.

Run as ``python tests/scheduled_worker.py ARGS_JSON`` (XLA_FLAGS and
JAX_PLATFORMS set by the caller: 2 CPU devices per process). ARGS: port,
process, root (the job's directory: ``local{machine}`` and ``ckpt`` under
it), machine (this process's local directory), steps, schedule,
persist_every. The loop is the Orbax emergency manager's, with the step
made by ``manager.train_step`` from the tiny GPT-MoE's loss: restore the
newest step if any, then train, ``save(step, state, host_state)`` after each
step. It prints, flushed, ``RESTORED <json>`` after a restore, ``STEP <step>
<digest>`` after each save (this host's shards of the saved state),
``MOVED <version>`` for each version committed as moved inside a step, and
``RESULT <json>`` at the end.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any


def tiny_loss(trainer: Any) -> Any:
    """The loss of launch's trainer's model at its configured capacity, in
    the form ``make_train_step`` takes: dropout from the state's RNG folded
    with its step; aux: the cross-entropy and the expert load."""
    import jax
    import optax

    cfg = trainer.cfg
    factors = (cfg.capacity_factor,) * len(cfg.moe_layers)

    def loss_fn(params: Any, state: Any, batch: Any) -> Any:
        rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        logits, stats = trainer.model.apply({"params": params}, batch[:, :-1], factors,
                                            deterministic=False, rngs={"dropout": rng})
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return ce + cfg.aux_loss_coef * stats.aux_loss, {
            "ce": ce, "tokens_per_expert": stats.tokens_per_expert}

    return loss_fn


def digest(state: Any) -> str:
    """SHA-256 of this host's shards of ``state``, in device order."""
    import jax
    import numpy as np

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        for shard in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
            h.update(np.asarray(shard.data).tobytes())
    return h.hexdigest()[:16]


def main(args: dict[str, Any]) -> None:
    import os

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args['port']}", num_processes=2,
                               process_id=args["process"], initialization_timeout=120)
    import numpy as np

    import capricorn_jax
    from launch.trainer import OptimizerOptions, Trainer, make_mesh
    from models import get_config

    trainer = Trainer(get_config("tiny"), make_mesh(4), OptimizerOptions())
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            trainer.abstract_state, trainer.state_shardings)
    root = args["root"]
    options = capricorn_jax.TwoTierOptions(
        persistent=capricorn_jax.PersistentCheckpointOptions(
            save_interval_steps=args["persist_every"], max_to_keep=2),
        schedule=args["schedule"])
    manager = capricorn_jax.TwoTierCheckpointManager(
        os.path.join(root, f"local{args['machine']}"), os.path.join(root, "ckpt"),
        trainer.mesh, abstract, options)
    step_fn = manager.train_step(tiny_loss(trainer), optimizer=trainer.optimizer)
    try:
        state = manager.restore().state
        info = manager.last_restore
        assert info is not None
        start = info.step + 1
        print("RESTORED " + json.dumps({"step": info.step, "tiers": info.memory_tiers,
                                        "tier": info.tier, "host_state": info.host_state,
                                        "digest": digest(state)}), flush=True)
    except capricorn_jax.NoCheckpoint:
        state, start = trainer.init_state(0), 0
    rows = trainer.cfg.global_batch // 2
    seen = 0
    for step in range(start, args["steps"]):
        local = np.random.default_rng(100 * step + jax.process_index()).integers(
            0, 256, (rows, trainer.cfg.seq_len + 1)).astype(np.int32)
        state, metrics = step_fn(state, trainer.global_batch(local))
        manager.save(step, state, {"position": step + 1})
        print(f"STEP {step} {digest(state)}", flush=True)
        for event in manager.events[seen:]:
            if "moved_in_step" in event:
                print(f"MOVED {event['moved_in_step']}", flush=True)
        seen = len(manager.events)
    manager.wait_until_finished()
    strategy = manager.strategy
    result = {"summary": None if strategy is None else strategy.schedule_summary(),
              "persistent_steps": manager.persistent_steps,
              "persistent_errors": manager.persistent_errors,
              "profiled": [e["step"] for e in manager.events if e.get("event") == "profile"],
              "boundaries": step_fn.train.boundaries if step_fn.train else None,
              "moe_layers": list(step_fn.train.moe_layers) if step_fn.train else None}
    manager.close()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
