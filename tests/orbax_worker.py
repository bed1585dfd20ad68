"""Worker processes for tests/test_orbax_handler.py, and the README's Orbax snippet.

Run as ``python tests/orbax_worker.py MODE ARGS_JSON`` with XLA_FLAGS and
JAX_PLATFORMS set by the caller. Modes:

* ``train``: one host of a job that saves every step (memory tier) and
  persists every ``interval`` steps; with ``kill_step``, host 1 stops inside
  the persistent write of that step (files written, not committed) and prints
  ``WRITTEN <step>`` so that the test can SIGKILL the job there.
* ``resume``: one host of the restarted job: restores the newest step across
  tiers, then an explicit persistent step, then trains on.
* ``plain``: restores the newest persistent step with plain Orbax, in a
  process that never imports capricorn_jax.
* ``readonly``: one process whose persistent directory is not writable.
* ``snippet``: runs README_SNIPPET (the one-object form);
* ``three_objects``: runs THREE_OBJECT_SNIPPET (the tiers built by hand, as
  docs/guide.md shows them).

Each mode prints JSON lines prefixed with ``RESULT `` for the test to read.
capricorn_jax is imported inside the modes that use it, never at module level.
"""

from __future__ import annotations

import json
import os
import sys
import time

README_SNIPPET = '''\
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import capricorn_jax

mesh = Mesh(np.array(jax.devices()), ("data",))
shardings = {"w": NamedSharding(mesh, P("data")), "step": NamedSharding(mesh, P())}
abstract = {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=shardings["w"]),
            "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings["step"])}

# Both tiers in one object, with the methods of Orbax's emergency manager: every step in host
# RAM (a tmpfs, e.g. under /dev/shm) here and on `replicas` peers (capped at the host count);
# a standard Orbax step on disk every persistent.save_interval_steps steps.
options = capricorn_jax.TwoTierOptions(
    persistent=capricorn_jax.PersistentCheckpointOptions(save_interval_steps=2, max_to_keep=2))
with capricorn_jax.TwoTierCheckpointManager("demo/shm", "demo/ckpt", mesh, abstract,
                                            options) as manager:
    try:  # resume from the newest step of either tier
        state = manager.restore().state
        start = manager.last_restore.step + 1
    except capricorn_jax.NoCheckpoint:  # nothing saved yet
        state = jax.device_put({"w": jnp.zeros((16, 4)), "step": jnp.int32(0)}, shardings)
        start = 1

    for step in range(start, start + 5):
        state = {"w": state["w"] + 1, "step": state["step"] + 1}  # the training step
        manager.save(step, args=ocp.args.Composite(  # this host's JSON state rides along
            state=ocp.args.PyTreeSave(state),
            host_state=ocp.args.JsonSave({"data_position": step})))
    manager.wait_until_finished()
    print("persistent steps:", manager.persistent_steps, "errors:", manager.persistent_errors)
    manager.restore()
    info = manager.last_restore
    print(f"restored step {info.step} from the {info.tier} tier, host state {info.host_state}")

# Any Orbax program restores a persistent step without capricorn_jax:
plain = ocp.CheckpointManager(os.path.abspath("demo/ckpt"))
step = plain.latest_step()
restored = plain.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
print(f"plain Orbax step {step}: w[0, 0] = {float(restored.state['w'][0, 0])}")
'''

THREE_OBJECT_SNIPPET = '''\
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import capricorn_jax

mesh = Mesh(np.array(jax.devices()), ("data",))
shardings = {"w": NamedSharding(mesh, P("data")), "step": NamedSharding(mesh, P())}
abstract = {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32),
            "step": jax.ShapeDtypeStruct((), jnp.int32)}

# Memory tier: every step, in host RAM (tmpfs, e.g. /dev/shm) and on `replicas` peers.
inmem = capricorn_jax.InMemoryCheckpointer(
    capricorn_jax.InMemoryOptions(store_root=os.path.abspath("demo/shm"), job="demo",
                                  replicas=1),
    mesh, abstract, shardings, host=jax.process_index(), hosts=jax.process_count())
handler = capricorn_jax.CapricornHandler(inmem)
# Persistent tier: standard Orbax steps, every save_interval_steps steps.
manager = capricorn_jax.CheckpointManager(
    os.path.abspath("demo/ckpt"),
    options=ocp.CheckpointManagerOptions(save_interval_steps=2, max_to_keep=2),
    handler_registry=handler.registry("state"))

target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)
try:  # resume from the newest step of either tier
    state = manager.restore(
        args=ocp.args.Composite(state=capricorn_jax.CapricornRestore(target))).state
    start = manager.last_restore.step + 1
except FileNotFoundError:  # nothing saved yet
    state = jax.device_put({"w": jnp.zeros((16, 4)), "step": jnp.int32(0)}, shardings)
    start = 1

for step in range(start, start + 5):
    state = {"w": state["w"] + 1, "step": state["step"] + 1}  # the training step
    persisted = manager.save(step, args=ocp.args.Composite(
        state=capricorn_jax.CapricornSave(state, host_state={"data_position": step})))
manager.wait_until_finished()
print("persistent steps:", manager.all_steps(), "errors:", manager.persistent_errors)

restored = manager.restore(
    args=ocp.args.Composite(state=capricorn_jax.CapricornRestore(target))).state
info = manager.last_restore
print(f"restored step {info.step} from the {info.tier} tier, host state {info.host_state}")
manager.close()

# Any Orbax program restores a persistent step without capricorn_jax:
plain = ocp.CheckpointManager(os.path.abspath("demo/ckpt"))
step = plain.latest_step()
state = plain.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))).state
print(f"plain Orbax step {step}: w[0, 0] = {float(state['w'][0, 0])}")
'''

INTERVAL = 2
SHAPES = {  # name: (shape, dtype, partition spec over the (data, expert) mesh)
    "w": ((8, 6), "float32", ("expert", None)),
    "e": ((16,), "int32", (("data", "expert"),)),
    "b": ((5,), "bfloat16", ()),
    "step": ((), "int32", ()),
}


def expected_state(step: int) -> dict:
    """The (numpy) train state of ``step``: every host computes the same."""
    import ml_dtypes
    import numpy as np

    out = {}
    for i, (name, (shape, dtype, _)) in enumerate(SHAPES.items()):
        n = int(np.prod(shape)) if shape else 1
        values = np.arange(n, dtype=np.float64) * (i + 1) + step * 1000 + 0.25
        dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
        out[name] = values.astype(dt).reshape(shape)
    return out


def _mesh_and_shardings():
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "expert"))
    shardings = {k: NamedSharding(mesh, P(*spec)) for k, (_, _, spec) in SHAPES.items()}
    abstract = {k: jax.ShapeDtypeStruct(shape, np.dtype(expected_state(0)[k].dtype))
                for k, (shape, _, _) in SHAPES.items()}
    return mesh, shardings, abstract


def _state(step: int, shardings):
    import jax

    host = expected_state(step)
    return {k: jax.make_array_from_callback(v.shape, shardings[k], v.__getitem__)
            for k, v in host.items()}


def _bitwise_equal(restored: dict, step: int) -> bool:
    import numpy as np

    want = expected_state(step)
    if sorted(restored) != sorted(want):
        return False
    for k, v in want.items():
        array = restored[k]
        if array.dtype != v.dtype or array.shape != v.shape:
            return False
        for shard in array.addressable_shards:  # this process's part of the global array
            if np.asarray(shard.data).tobytes() != np.ascontiguousarray(v[shard.index]).tobytes():
                return False
    return True


def _result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def _init(args: dict) -> None:
    if args.get("processes", 1) > 1:
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{args['port']}", num_processes=args["processes"],
                                   process_id=args["process"], initialization_timeout=60)


def _manager(args: dict, hooks=None, **options):
    import jax
    import orbax.checkpoint as ocp

    import capricorn_jax

    mesh, shardings, abstract = _mesh_and_shardings()
    inmem = capricorn_jax.InMemoryCheckpointer(
        capricorn_jax.InMemoryOptions(store_root=args["store"], job="job",
                                      replicas=jax.process_count(),
                                      chunk_bytes=1024),
        mesh, abstract, shardings, host=jax.process_index(), hosts=jax.process_count(),
        hooks=hooks)
    handler = capricorn_jax.CapricornHandler(inmem)
    manager = capricorn_jax.CheckpointManager(
        args["ckpt"], options=ocp.CheckpointManagerOptions(
            save_interval_steps=INTERVAL, max_to_keep=2, **options),
        handler_registry=handler.registry("state"))
    return manager, handler, shardings, abstract


def _target(shardings, abstract):
    import jax

    return {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings[k])
            for k, a in abstract.items()}


def train(args: dict) -> None:
    import jax
    import orbax.checkpoint as ocp

    import capricorn_jax

    _init(args)
    manager, handler, shardings, _ = _manager(args)
    host, kill_step = jax.process_index(), args.get("kill_step")

    def hook(step: int, phase: str) -> None:
        if step == kill_step and phase == "written" and host == 1:
            print(f"WRITTEN {step}", flush=True)
            time.sleep(3600)  # the test SIGKILLs the job here

    handler.on_persist = hook
    for step in range(args["steps"]):
        persisted = manager.save(step, args=ocp.args.Composite(state=capricorn_jax.CapricornSave(
            _state(step, shardings), {"pos": step, "host": host})))
        _result(step=step, persisted=persisted)
    manager.wait_until_finished()
    _result(all_steps=list(manager.all_steps()), errors=manager.persistent_errors)
    manager.close()


def resume(args: dict) -> None:
    import jax
    import orbax.checkpoint as ocp

    import capricorn_jax

    _init(args)
    manager, _, shardings, abstract = _manager(args, cleanup_tmp_directories=True)
    target = _target(shardings, abstract)
    out = {}
    for name, step in (("newest", None), ("explicit", args["explicit_step"])):
        state = manager.restore(step, args=ocp.args.Composite(
            state=capricorn_jax.CapricornRestore(target))).state
        info = manager.last_restore
        out[name] = {"step": info.step, "tier": info.tier, "host_state": info.host_state,
                     "bitwise": _bitwise_equal(state, info.step),
                     "sharded_as_target": all(state[k].sharding == target[k].sharding
                                              for k in state)}
    start = out["newest"]["step"] + 1
    persisted = []
    for step in range(start, start + 2):
        persisted.append(manager.save(step, args=ocp.args.Composite(
            state=capricorn_jax.CapricornSave(_state(step, shardings),
                                              {"pos": step, "host": jax.process_index()}))))
    manager.wait_until_finished()
    _result(**out, persisted=persisted, all_steps=list(manager.all_steps()),
            errors=manager.persistent_errors)
    manager.close()


def serve(args: dict) -> None:
    """Restores the newest version where host 1 lost its store: host 0
    serves host 1's rows, flipping a byte in its first ``flip_serve`` tries."""
    import jax
    import orbax.checkpoint as ocp

    import capricorn_jax
    from capricorn_jax.experimental import FaultHooks

    _init(args)
    hooks = FaultHooks(flip_serve=args["flip_serve"] if jax.process_index() == 0 else 0)
    manager, _, shardings, abstract = _manager(args, hooks=hooks)
    try:
        state = manager.restore(None, args=ocp.args.Composite(
            state=capricorn_jax.CapricornRestore(_target(shardings, abstract)))).state
    except capricorn_jax.ChecksumError as e:
        _result(error=str(e))
    else:
        info = manager.last_restore
        _result(step=info.step, tier=info.tier, tiers=info.memory_tiers,
                bitwise=_bitwise_equal(state, info.step))
    manager.close()


def plain(args: dict) -> None:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    target = {}
    for k, v in expected_state(0).items():
        spec = P("x") if v.ndim and v.shape[0] % mesh.size == 0 else P()
        target[k] = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, spec))
    manager = ocp.CheckpointManager(args["ckpt"])
    step = manager.latest_step()
    state = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target))).state
    _result(step=step, all_steps=list(manager.all_steps()), devices=len(jax.devices()),
            bitwise=_bitwise_equal(state, step),
            sharded_as_target=all(state[k].sharding == target[k].sharding for k in state),
            item_handler=manager.metadata(step).item_handlers["state"],
            capricorn_imported=any(m.startswith("capricorn_jax") for m in sys.modules))


def reshard(args: dict) -> None:
    """capricorn_jax's manager on another topology: an empty memory tier, so the
    newest step is the persistent one, read into this process's shardings."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import capricorn_jax

    mesh = Mesh(np.array(jax.devices()), ("x",))
    target = {}
    for k, v in expected_state(0).items():
        spec = P("x") if v.ndim and v.shape[0] % mesh.size == 0 else P()
        target[k] = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, spec))
    abstract = {k: jax.ShapeDtypeStruct(t.shape, t.dtype) for k, t in target.items()}
    inmem = capricorn_jax.InMemoryCheckpointer(
        capricorn_jax.InMemoryOptions(store_root=args["store"], job="reshard", replicas=1),
        mesh, abstract, {k: t.sharding for k, t in target.items()}, host=0, hosts=1)
    handler = capricorn_jax.CapricornHandler(inmem)
    manager = capricorn_jax.CheckpointManager(args["ckpt"],
                                              handler_registry=handler.registry("state"))
    state = manager.restore(args=ocp.args.Composite(
        state=capricorn_jax.CapricornRestore(target))).state
    info = manager.last_restore
    assert info is not None
    _result(step=info.step, tier=info.tier, devices=len(jax.devices()),
            bitwise=_bitwise_equal(state, info.step),
            sharded_as_target=all(state[k].sharding == target[k].sharding for k in state))
    manager.close()


def readonly(args: dict) -> None:
    import orbax.checkpoint as ocp

    import capricorn_jax

    os.makedirs(args["ckpt"], exist_ok=True)
    os.chmod(args["ckpt"], 0o555)
    try:
        probe = os.path.join(args["ckpt"], "probe")
        try:
            os.mkdir(probe)
        except PermissionError:
            pass
        else:
            os.rmdir(probe)
            _result(privileged=True)  # cannot simulate a permission error here
            return
        manager, _, shardings, _ = _manager(args)
        reports = []
        for step in range(5):
            persisted = manager.save(step, args=ocp.args.Composite(
                state=capricorn_jax.CapricornSave(_state(step, shardings), {"pos": step})))
            reports.append({"step": step, "persisted": persisted,
                            "memory_committed": manager.last_memory_report.committed})
        manager.wait_until_finished()
        manager.handler.checkpointer.wait_until_finished(30)
        store = manager.handler.checkpointer.store
        _result(privileged=False, reports=reports, errors=manager.persistent_errors,
                listing=sorted(os.listdir(args["ckpt"])), memory_versions=store.versions(0))
        manager.close()
    finally:
        os.chmod(args["ckpt"], 0o755)


def _without_dac_override() -> None:
    """Re-executes this process without root's right to ignore file permissions.

    A no-op for other users (file permissions apply to them anyway). Runs before
    JAX starts: the bounding set only takes effect at the next exec.
    """
    if os.geteuid() != 0 or os.environ.get("ORBAX_WORKER_NO_DAC") == "1":
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
    os.environ["ORBAX_WORKER_NO_DAC"] = "1"
    os.execv(sys.executable, [sys.executable, *sys.argv])


def main() -> None:
    mode = sys.argv[1]
    if mode == "readonly":
        _without_dac_override()
    if mode in ("snippet", "three_objects"):
        code = README_SNIPPET if mode == "snippet" else THREE_OBJECT_SNIPPET
        exec(compile(code, mode, "exec"), {"__name__": "__main__"})
        return
    args = json.loads(sys.argv[2])
    {"train": train, "resume": resume, "plain": plain, "readonly": readonly,
     "reshard": reshard, "serve": serve}[mode](args)


if __name__ == "__main__":
    main()
