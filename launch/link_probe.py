"""The link a simulated host actually gets, measured with the transfers the job uses.

Run inside every worker of a job (after jax.distributed is up): each host's
devices hold a ``mib``-MiB uint8 row each, and a jitted ``shard_map``
``ppermute`` over a mesh of all devices moves them

- ``one_way``: host 0's rows to host 1's devices (the others idle);
- ``exchange``: every host's rows to the next host's devices at once (ring),
  the pattern of a replication round.

Each repetition starts at a barrier and ends when the slowest host has its
output; the first call (compilation) is left out. The rate is the bytes one
host sends divided by the median time, in Gbit/s (1e9 bits). With
``--link_gbps`` the shaped rate is what a host may send (and receive) per
direction, so both figures are comparable to the flag; the frames' headers,
TCP's ramp and tc's one-frame token bucket (each frame waits for a kernel
timer, whose lateness is lost: ``launch.cluster.netns.LinkOptions``) give less
than the nominal rate, the more so the faster the link, which is why the bench
records the measured figure beside the requested one.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from absl import app, flags


def measure_link(mib: float = 8.0, repeats: int = 5) -> dict:
    """{"one_way_gbps", "exchange_gbps", "one_way_s", "exchange_s", "mib", "repeats"}
    (medians; every host returns the same dict once every host is done)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    hosts = jax.process_count()
    if hosts < 2:
        raise ValueError("measure_link needs >= 2 processes (jax.distributed)")
    if not (mib > 0 and repeats >= 1):
        raise ValueError(f"measure_link: mib must be > 0 and repeats >= 1, got {mib}, {repeats}")
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    per_host = {h: [i for i, d in enumerate(devices) if d.process_index == h]
                for h in range(hosts)}
    counts = {len(v) for v in per_host.values()}
    if len(counts) != 1:
        raise ValueError(f"measure_link: hosts hold different device counts {per_host}")
    mesh = Mesh(np.array(devices), ("x",))
    n = int(mib * (1 << 20))
    local = np.full((len(per_host[jax.process_index()]), n), jax.process_index() + 1, np.uint8)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
    sent_per_host = local.nbytes

    def program(pairs):
        return jax.jit(jax.shard_map(lambda v: jax.lax.ppermute(v, "x", pairs), mesh=mesh,
                                     in_specs=P("x"), out_specs=P("x")))

    one_way = list(zip(per_host[0], per_host[1], strict=True))
    ring = [(a, b) for h in range(hosts)
            for a, b in zip(per_host[h], per_host[(h + 1) % hosts], strict=True)]
    out = {"mib": mib, "repeats": repeats, "hosts": hosts}
    for name, pairs in (("one_way", one_way), ("exchange", ring)):
        fn = program(pairs)
        y = fn(x)  # compiles; and checks the bytes arrived where they should
        receivers = {b for _, b in pairs}
        for shard in y.addressable_shards:
            pos = devices.index(shard.device)
            want = (devices[pos - len(local)].process_index + 1) if pos in receivers else 0
            if pos in receivers and not np.all(np.asarray(shard.data) == want):
                raise RuntimeError(f"measure_link {name}: device {shard.device} did not receive "
                                   f"host {want - 1}'s row")
        times = []
        for r in range(repeats):
            multihost_utils.sync_global_devices(f"link_probe/{name}/{r}")
            t0 = time.perf_counter()
            fn(x).block_until_ready()
            times.append(time.perf_counter() - t0)
        # The slowest host's time: a transfer is done when its receiver has it.
        slowest = np.asarray(multihost_utils.process_allgather(np.array(times))).max(axis=0)
        med = float(statistics.median(slowest.tolist()))
        out[f"{name}_s"] = med
        out[f"{name}_gbps"] = sent_per_host * 8 / med / 1e9
    return out


# --- the command -------------------------------------------------------------------------------
#
#   python -m launch.link_probe --hosts=2 --devices_per_host=2 --link_gbps=0.4 --json=link.json
#
# Starts the simulated hosts (behind shaped links with --link_gbps, launch.cluster.netns),
# runs measure_link in each and prints one line; exits non-zero on a failure.

FLAGS = flags.FLAGS

# launch.cli_flags groups (and their flags) the probe takes, and its own default of one.
SHARED_FLAGS = {"cluster": ("hosts", "devices_per_host", "timeout_s", "process_id",
                            "coordinator"),
                "links": None, "data": ("workdir",), "output": ("json",)}
LINK_PROBE_DEFAULTS = {"timeout_s": 300.0}


def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """The command's flags, defined only when run as a command (or by a test on
    a fresh ``fv``): launch.bench imports ``measure_link``."""
    from launch import cli_flags

    cli_flags.define(fv, SHARED_FLAGS, LINK_PROBE_DEFAULTS)
    flags.adopt_module_key_flags(cli_flags, flag_values=fv)
    flags.DEFINE_float("mib", 8.0, "MiB per device per transfer.", flag_values=fv)
    flags.DEFINE_integer("repeats", 5, "Timed transfers per pattern.", flag_values=fv)
    return fv


def _worker(process_id: int, workdir: Path, hosts: int, coordinator: str, mib: float,
            repeats: int) -> None:
    from launch import runtime

    runtime.init_distributed(hosts, coordinator, process_id)
    result = measure_link(mib, repeats)
    if process_id == 0:
        (workdir / "link.json").write_text(json.dumps(result))


def main(argv: list[str]) -> None:
    del argv
    from launch import runtime
    from launch.cluster import processes as cluster_lib
    from launch.cluster.netns import link_from_flags

    try:
        link = link_from_flags(FLAGS)
        if FLAGS.hosts < 2:
            raise ValueError(f"--hosts must be >= 2 to measure a link, got {FLAGS.hosts}")
    except ValueError as e:
        print(f"link_probe: error: {e}", file=sys.stderr)
        sys.exit(2)
    workdir = cluster_lib.scratch_dir(FLAGS.workdir, "capricorn_link_")
    if FLAGS.process_id >= 0:
        runtime.exit_now_on_failure(_worker, FLAGS.process_id, workdir, FLAGS.hosts,
                                    FLAGS.coordinator, FLAGS.mib, FLAGS.repeats)
        return
    measured = cluster_lib.run_tool_workers("link_probe", "launch.link_probe", sys.argv[1:],
                                            FLAGS.hosts, FLAGS.devices_per_host, workdir,
                                            FLAGS.timeout_s, link, "link.json")
    result = {**link.record(), **measured}
    print(f"link: {link.describe()}; measured one way {result['one_way_gbps']:.3f} Gbit/s, "
          f"exchange {result['exchange_gbps']:.3f} Gbit/s per host "
          f"({FLAGS.mib:g} MiB per device, {FLAGS.hosts} hosts)", flush=True)
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    define_flags()
    app.run(main)
