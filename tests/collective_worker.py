"""A 2-process job for the collective-bound test: both join through
``launch.runtime.init_distributed`` (peer timeout 2 s, so gloo's bound is 6
s); process 1 stays alive (its heartbeat goes on) but never enters the second
sum; process 0 reports how its sum ended."""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    args = json.loads(sys.argv[1])
    from launch.runtime import init_distributed

    init_distributed(2, f"127.0.0.1:{args['port']}", args["process"], peer_timeout_s=2.0)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.make_array_from_callback((2,), NamedSharding(mesh, P("d")),
                                     lambda i: np.ones(1, np.float32))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    jax.block_until_ready(total(x))  # both take part once
    if args["process"] == 1:
        time.sleep(args["sleep"])
        return
    start = time.monotonic()
    try:
        jax.block_until_ready(total(x + 1))
        outcome = "finished"
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = f"{type(e).__name__}: {str(e)[:300]}"
    print("RESULT " + json.dumps({"seconds": time.monotonic() - start, "outcome": outcome}),
          flush=True)


if __name__ == "__main__":
    main()
