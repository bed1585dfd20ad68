"""A MaxText-shaped training loop on Orbax's emergency checkpoint manager.

The loop is written as MaxText drives Orbax's emergency ``CheckpointManager``
(``create_checkpoint_manager``, ``maybe_save_checkpoint``, the preemption
check): build the manager from the local (RAM disk) and persistent
directories, the mesh and the abstract state; restore the newest step if
there is one; save every step with ``force`` at a preemption; on a
preemption wait for the save and exit 0. ``train_orbax.py`` beside it is the
same file on Orbax's manager; the two differ in the import of ``emergency``
and in the options line (a test diffs them). Each process is one host:

    python examples/maxtext_style/train_capricorn.py --coordinator=127.0.0.1:PORT \\
        --num_processes=2 --process_id=0 --local_dir=/dev/shm/run/h0 --persistent_dir=run/ckpt

The data iterator's position travels in the checkpoint as the host state
(``host_state=JsonSave``); a manager that does not give it back (Orbax's
emergency manager restores the state item only) resumes the data at the
restored step.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import app, flags
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from capricorn_jax import emergency

FLAGS = flags.FLAGS
flags.DEFINE_string("coordinator", "", "host:port of process 0 (empty: one process)")
flags.DEFINE_integer("num_processes", 1, "processes (hosts)")
flags.DEFINE_integer("process_id", 0, "this process")
flags.DEFINE_string("local_dir", "", "this host's local (RAM disk) checkpoint directory")
flags.DEFINE_string("persistent_dir", "", "the shared persistent checkpoint directory")
flags.DEFINE_integer("steps", 12, "train until this step")
flags.DEFINE_integer("persist_every", 5, "a persistent step every this many steps")
flags.DEFINE_float("step_s", 0.0, "sleep this long per step (a longer window for a signal)")

WIDTH, BATCH = 64, 32


def data_batch(position: int) -> tuple[np.ndarray, np.ndarray]:
    """The data iterator: batch ``position`` of a fixed synthetic dataset."""
    rng = np.random.default_rng(position)
    x = rng.standard_normal((BATCH, WIDTH), dtype=np.float32)
    return x, np.tanh(x[:, ::-1] * 0.5)


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(FLAGS.coordinator, num_processes=FLAGS.num_processes,
                                   process_id=FLAGS.process_id, initialization_timeout=120)
    hosts = jax.process_count()
    mesh = Mesh(np.array(jax.devices()).reshape(hosts, -1), ("data", "model"))
    shard = NamedSharding(mesh, P(None, "model"))  # replicated over the hosts' data axis
    whole = NamedSharding(mesh, P())
    optimizer = optax.adam(1e-2)

    def init() -> dict:
        params = {"w1": jnp.eye(WIDTH) * 0.1, "w2": jnp.eye(WIDTH) * 0.1}
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0)}

    shardings = jax.tree.map(lambda x: shard if x.ndim == 2 else whole, jax.eval_shape(init))
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            jax.eval_shape(init), shardings)

    @jax.jit
    def train_step(state: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
        def loss_fn(params: dict) -> jax.Array:
            return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state, "step": state["step"] + 1}, loss

    # create_checkpoint_manager
    persistent = emergency.PersistentCheckpointOptions(save_interval_steps=FLAGS.persist_every,
                                                       max_to_keep=2)
    options = emergency.CheckpointManagerOptions(local=emergency.LocalCheckpointOptions(save_interval_steps=1), persistent=persistent, replicas=2)  # noqa: E501
    manager = emergency.CheckpointManager(FLAGS.local_dir, FLAGS.persistent_dir,
                                          global_mesh=mesh, abstract_state=abstract,
                                          options=options)
    # load_state_if_possible
    latest = manager.latest_step()
    if latest is None:
        state, start = jax.jit(init, out_shardings=shardings)(), 0
        position = 0
    else:
        restored = manager.restore(latest, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=abstract), host_state=ocp.args.JsonRestore()))
        state, start = restored.state, latest + 1
        host = restored.host_state if "host_state" in restored.keys() else None
        position = host["position"] if host else start
        tier = getattr(manager, "last_restore", None)  # capricorn_jax says which tier
        print(f"host {jax.process_index()}: resumed at step {latest}, data position "
              f"{position}, tier {tier.memory_tiers if tier else '?'}", flush=True)

    for step in range(start, FLAGS.steps + 1):
        x, y = data_batch(position)
        state, loss = train_step(state, jax.device_put(x, whole), jax.device_put(y, whole))
        position += 1
        # maybe_save_checkpoint
        preempted = manager.reached_preemption(step)
        manager.save(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state),
            host_state=ocp.args.JsonSave({"position": position})), force=preempted)
        print(f"host {jax.process_index()}: step {step} loss {float(loss):.5f}", flush=True)
        if preempted:
            manager.wait_until_finished()
            print(f"host {jax.process_index()}: preempted: step {step} saved, exiting",
                  flush=True)
            manager.close()
            sys.exit(0)
        time.sleep(FLAGS.step_s)
    manager.wait_until_finished()
    manager.close()
    print(f"host {jax.process_index()}: done at step {FLAGS.steps}", flush=True)


if __name__ == "__main__":
    app.run(main)
