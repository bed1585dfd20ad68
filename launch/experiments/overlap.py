"""Does moving checkpoint bytes overlap computation? In-graph permutes against a side channel.

    python -m launch.experiments.overlap --link_gbps=0.2 --mib=2 --json=overlap.json

The question behind the scheduled strategies on the simulated cluster: a step
that moves a window's worth of chunks should cost about max(compute, link
time), not their sum. Two simulated hosts (``--devices_per_host`` CPU devices
each, behind shaped links with ``--link_gbps``, ``launch.cluster.netns``) measure, each
repetition starting at a barrier and ending when the slower host is done:

- ``compute``: a jitted chain of ``--matmuls`` float32 products of
  ``--matmul_dim`` matrices on every device (a shard_map over all devices);
- ``permute``: a jitted shard_map ``ppermute`` of ``--mib`` MiB per device,
  every host's rows to the other host (the replication exchange);
- ``in_graph``: ONE jitted program holding both, independent of each other,
  the way the scheduled strategies place chunks inside the step today;
- ``threaded``: the compute program in the main thread while a second thread
  runs the permute program (two XLA programs in flight at once; the bytes
  move outside the compute program but over the same collectives);
- ``transfer``: the same bytes over ``jax.experimental.transfer`` (a transfer
  server per process on its link's address; each host pulls the other's rows);
- ``side_channel``: the compute program in the main thread while a second
  thread pulls the peer's rows over the transfer server (the sender only
  registers them): the bytes move outside the XLA program.

Reported per mode: median and IQR of the slowest host's seconds, and for the
two combined modes their ratio to max(compute, link) and to their sum.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from absl import app, flags, logging

from launch import runtime
from launch.cluster import processes as cluster_lib
from launch.cluster.netns import LinkOptions

FLAGS = flags.FLAGS
HOSTS = 2
MODES = ("compute", "permute", "in_graph", "threaded", "transfer", "side_channel")
# The modes that use jax.experimental.transfer (--side_channel).
TRANSFER_MODES = ("transfer", "side_channel")


def define_flags() -> None:
    """The command's flags, defined only when run as a command: a test or
    another launcher importing this module for its logic must not define
    flags of the same names twice."""
    flags.DEFINE_integer("devices_per_host", 2, "CPU devices per host.")
    flags.DEFINE_float("link_gbps", 0.0, "Shaped links of this many Gbit/s (0: loopback).")
    flags.DEFINE_float("mib", 2.0, "MiB moved per device per repetition.")
    flags.DEFINE_integer("matmuls", 24, "Matrix products in the compute chain.")
    flags.DEFINE_integer("matmul_dim", 384, "Side of the square matrices.")
    flags.DEFINE_integer("repeats", 7, "Timed repetitions per mode (after one untimed).")
    flags.DEFINE_float("op_timeout_s", 120.0, "Bound on one transfer or barrier.")
    flags.DEFINE_boolean("side_channel", True,
                         "Also measure jax.experimental.transfer (modes transfer, side_channel).")
    flags.DEFINE_string("json", None, "Write the result here.")
    flags.DEFINE_float("timeout_s", 900.0, "Deadline of the job.")
    flags.DEFINE_string("workdir", None, "Scratch directory; default: a temporary one.")
    flags.DEFINE_integer("process_id", -1, "Internal: worker host index.")
    flags.DEFINE_string("coordinator", "", "Internal: coordinator address.")


class _Host:
    def __init__(self, pid: int):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.experimental import multihost_utils
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        from capricorn_jax.experimental import distributed_client

        self.jax, self.np, self.pid, self.peer = jax, np, pid, 1 - pid
        self.sync = multihost_utils.sync_global_devices
        self.allgather = multihost_utils.process_allgather
        self.kv = distributed_client()
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        self.local = [d for d in devices if d.process_index == pid]
        mesh = Mesh(np.array(devices), ("x",))
        rows = NamedSharding(mesh, P("x"))
        per = {h: [i for i, d in enumerate(devices) if d.process_index == h] for h in range(HOSTS)}
        pairs = [(a, b) for h in range(HOSTS) for a, b in zip(per[h], per[1 - h], strict=True)]
        n, dim, k = int(FLAGS.mib * (1 << 20)), FLAGS.matmul_dim, FLAGS.matmuls

        def chain(a):
            x = a[0]
            for _ in range(k):
                x = jnp.tanh(x @ a[0]) * (1.0 / dim)
            return x[None]

        def send(v):
            return jax.lax.ppermute(v, "x", pairs)

        def smap(f, nin):
            return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * nin,
                                         out_specs=P("x") if nin == 1 else (P("x"),) * nin))

        self.compute_fn = smap(chain, 1)
        self.permute_fn = smap(send, 1)
        self.both_fn = smap(lambda a, v: (chain(a), send(v)), 2)
        rng = np.random.default_rng(pid)
        local_a = rng.standard_normal((len(self.local), dim, dim)).astype(np.float32)
        self.payload = np.full((len(self.local), n), pid + 1, np.uint8)
        self.a = jax.make_array_from_process_local_data(rows, local_a)
        self.v = jax.make_array_from_process_local_data(rows, self.payload)
        self.uuid = 0
        self.rounds = 0
        if FLAGS.side_channel:
            self._start_server()

    def _start_server(self) -> None:
        """The side channel: a transfer server on this host's own link address."""
        from jax.experimental import transfer
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        jax, np = self.jax, self.np
        addr = socket.gethostbyname(socket.gethostname())
        self.server = transfer.start_transfer_server(
            self.local[0].client, f"{addr}:0", [f"{addr}:0"] * len(self.local))
        self.kv.key_value_set(f"overlap/address/{self.pid}", self.server.address())
        peer_addr = self.kv.blocking_key_value_get(f"overlap/address/{self.peer}",
                                                   int(FLAGS.op_timeout_s * 1000))
        self.conn = self.server.connect(peer_addr)
        local_rows = NamedSharding(Mesh(np.array(self.local), ("d",)), P("d"))
        self.xs = jax.device_put(self.payload, local_rows)
        self.spec = jax.ShapeDtypeStruct(self.payload.shape, self.payload.dtype,
                                         sharding=local_rows)

    def _pull(self, uuid: int):
        """The peer's rows under ``uuid``, bounded by --op_timeout_s (the pull's own
        deadline does not bound its completion: measured, a pull hung once in
        ~6 loopback runs, so the wait happens in a thread with a timeout)."""
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=FLAGS.op_timeout_s)
        got: list = []

        def pull():
            (y,) = self.conn.pull(uuid, [self.spec], timeout=deadline)
            y.block_until_ready()
            got.append(y)

        thread = threading.Thread(target=pull, daemon=True)
        thread.start()
        thread.join(FLAGS.op_timeout_s)
        if not got:
            raise TimeoutError(f"host {self.pid}: jax.experimental.transfer pull {uuid} from "
                               f"host {self.peer} did not complete within "
                               f"--op_timeout_s={FLAGS.op_timeout_s:g}")
        y = got[0]
        if not self.np.all(self.np.asarray(y.addressable_shards[0].data) == self.peer + 1):
            raise RuntimeError(f"host {self.pid}: pulled rows are not host {self.peer}'s")
        return y

    def _offer(self) -> tuple[int, int]:
        """Registers this host's rows for the peer; (my uuid, the peer's uuid)."""
        self.uuid += 2
        mine, theirs = self.uuid + self.pid, self.uuid + self.peer
        self.server.await_pull(mine, [self.xs])
        return mine, theirs

    def run_mode(self, mode: str) -> float:
        """One repetition of ``mode``: this host's seconds (both hosts call in step)."""
        self.rounds += 1
        theirs = self._offer()[1] if mode in ("transfer", "side_channel") else None
        self.sync(f"overlap/start/{self.rounds}")  # rows offered; both start together
        t0 = time.perf_counter()
        if mode == "compute":
            self.compute_fn(self.a).block_until_ready()
        elif mode == "permute":
            self.permute_fn(self.v).block_until_ready()
        elif mode == "in_graph":
            self.jax.block_until_ready(self.both_fn(self.a, self.v))
        elif mode == "transfer":
            assert theirs is not None  # offered above for the transfer modes
            self._pull(theirs)
        else:  # threaded, side_channel: the bytes move in a second thread
            errors: list[BaseException] = []

            def move():
                try:
                    if mode == "threaded":
                        self.permute_fn(self.v).block_until_ready()
                    else:
                        self._pull(theirs)
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            thread = threading.Thread(target=move, daemon=True)
            thread.start()
            self.compute_fn(self.a).block_until_ready()
            thread.join(FLAGS.op_timeout_s)
            if errors or thread.is_alive():
                raise RuntimeError(f"host {self.pid}: {mode}: the bytes did not arrive within "
                                   f"--op_timeout_s={FLAGS.op_timeout_s:g}") from (
                    errors[0] if errors else None)
        dt = time.perf_counter() - t0
        # The peer pulled my rows by now or soon: wait for it before the next mode.
        self.sync(f"overlap/done/{self.rounds}")
        return dt

    def run(self) -> dict:
        modes = [m for m in MODES if FLAGS.side_channel or m not in TRANSFER_MODES]
        times: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(FLAGS.repeats + 1):
            for mode in modes:  # interleaved: drift in the machine's load hits every mode
                dt = self.run_mode(mode)
                if r:
                    times[mode].append(dt)
        slowest = {m: self.np.asarray(self.allgather(self.np.array(t))).max(axis=0).tolist()
                   for m, t in times.items()}
        return slowest


def _stats(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median_s": statistics.median(values), "iqr_s": q[2] - q[0], "times": values}


def summarize(slowest: dict) -> dict:
    out = {m: _stats(v) for m, v in slowest.items()}
    compute = out["compute"]["median_s"]
    for combined, link in (("in_graph", "permute"), ("threaded", "permute"),
                           ("side_channel", "transfer")):
        if combined not in out:
            continue
        link_s = out[link]["median_s"]
        both = out[combined]["median_s"]
        out[combined]["over_max"] = both / max(compute, link_s)
        out[combined]["over_sum"] = both / (compute + link_s)
    return out


def markdown(summary: dict) -> str:
    lines = ["| mode | median (ms) | IQR (ms) | / max(compute, link) | / (compute + link) |",
             "|---|---|---|---|---|"]
    for mode in [m for m in MODES if m in summary]:
        r = summary[mode]
        ratios = (f"{r['over_max']:.2f} | {r['over_sum']:.2f}" if "over_max" in r else "- | -")
        lines.append(f"| {mode} | {r['median_s'] * 1e3:.1f} | {r['iqr_s'] * 1e3:.1f} | {ratios} |")
    return "\n".join(lines)


def _worker(process_id: int, workdir: Path) -> None:
    logging.set_verbosity(logging.WARNING)
    runtime.init_distributed(HOSTS, FLAGS.coordinator, process_id)
    slowest = _Host(process_id).run()
    if process_id == 0:
        (workdir / "overlap.json").write_text(json.dumps(slowest))


def main(argv: list[str]) -> None:
    del argv
    try:
        link = LinkOptions(gbps=FLAGS.link_gbps)
    except ValueError as e:
        print(f"overlap: error: {e}", file=sys.stderr)
        sys.exit(2)
    workdir = cluster_lib.scratch_dir(FLAGS.workdir, "capricorn_overlap_")
    if FLAGS.process_id >= 0:
        runtime.exit_now_on_failure(_worker, FLAGS.process_id, workdir)
        return
    summary = summarize(cluster_lib.run_tool_workers(
        "overlap", "launch.experiments.overlap", sys.argv[1:], HOSTS, FLAGS.devices_per_host,
        workdir, FLAGS.timeout_s, link, "overlap.json"))
    print(markdown(summary))
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps({
            "modes": summary, "link": link.describe(), "date": time.strftime("%Y-%m-%d"),
            "config": {k: getattr(FLAGS, k) for k in ("devices_per_host", "link_gbps", "mib",
                                                      "matmuls", "matmul_dim", "repeats")},
            "command": " ".join(["python -m launch.experiments.overlap",
                                 *(a for a in sys.argv[1:] if not a.startswith("--json"))])},
            indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    define_flags()
    app.run(main)
