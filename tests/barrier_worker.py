"""A library-only program (no absl parse) for the barrier-bound test: process 0
builds a ``capricorn_jax.CheckpointManager`` with ``barrier_timeout_s``;
process 1 is alive but never builds one (it builds the memory tier, a
collective, then sleeps and exits)."""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    args = json.loads(sys.argv[1])
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args['port']}", num_processes=2,
                               process_id=args["process"], initialization_timeout=60)
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import capricorn_jax

    mesh = Mesh(np.array(jax.devices()).reshape(2, 1), ("data", "model"))
    abstract = {"w": jax.ShapeDtypeStruct((4,), np.float32)}
    shardings = {"w": NamedSharding(mesh, P())}
    root = args["root"]
    ckpt = capricorn_jax.InMemoryCheckpointer(
        capricorn_jax.InMemoryOptions(store_root=root + "/shm", job="j", replicas=1),
        mesh, abstract, shardings, args["process"], 2)
    if args["process"] == 1:  # the memory tier is built (collective), the manager never
        time.sleep(args["sleep"])
        print("RESULT " + json.dumps({"slept": args["sleep"]}), flush=True)
        return
    start = time.monotonic()
    try:
        capricorn_jax.CheckpointManager(
            root + "/ckpt", options=ocp.CheckpointManagerOptions(),
            handler_registry=capricorn_jax.CapricornHandler(ckpt).registry("state"),
            barrier_timeout_s=args["bound"])
        outcome = "built"
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = f"{type(e).__name__}: {str(e)[:300]}"
    print("RESULT " + json.dumps({"seconds": time.monotonic() - start, "outcome": outcome}),
          flush=True)


if __name__ == "__main__":
    main()
