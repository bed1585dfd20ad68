"""Measures the rejected transport: jax.experimental.transfer against collective-permutes.

    python -m launch.experiments.transfer_alt --sizes_mb=1,4,16 --repeats=5 \
        --json=/tmp/transfer_alt.json

The in-memory checkpointer moves payload chunks between hosts as collective-permutes
(``jax.lax.ppermute`` in a ``shard_map`` over the whole mesh, capricorn_jax's
``memory/transport.py``).
The alternative not taken is a host-side sender: every process runs a
``jax.experimental.transfer`` server, the sender schedules its arrays with
``server.await_pull(uuid, arrays)`` and the receiver fetches them with
``server.connect(address).pull(uuid, specs)``. This script measures both on the
simulated cluster (two local processes joined by jax.distributed, gloo CPU
collectives, ``--devices_per_host`` CPU devices each).

Per payload size (``--sizes_mb``, the uint8 row held by EACH local device, as in
the project's payloads, so a host sends ``devices_per_host`` rows):

  (a) ``ppermute``: one jitted shard_map program over a mesh of all devices;
      ``one-way`` sends host 0's rows to host 1's devices, ``swap`` also sends
      host 1's rows back in the same program (a replication round of two hosts).
  (b) ``transfer``: ``one-way`` = host 1 pulls host 0's rows from host 0's
      transfer server; ``swap`` = both hosts pull from each other at once.
      Server start and connection set-up are timed apart (``setup``), and the
      first pull of each size (``first call``) is left out of the statistics,
      as the first, compiling, ppermute call is.
  (c) interference: a thread on every host runs a jitted matmul loop
      (``--matmuls`` products of ``--matmul_dim`` square float32 matrices per
      call) alone, then while the main thread runs one-way transfers
      back-to-back with each transport; the slowdown is the median compute call
      time under load over the median alone.

Times of a repeat: every host enters it at a jax.distributed barrier; a
ppermute repeat lasts until the slower host has its output, a pull until the
receiver has its arrays. MB means 2**20 bytes; MB/s = bytes a host sends in one
direction / seconds. Every received row is checked against the sender's SHA-256
(published through the jax.distributed key-value store) inside the workers.

Output: markdown tables on stdout and ``--json``. Exits non-zero, reporting no
numbers, when a host fails, a check fails, or ``--timeout_s`` passes (the
hosts are then killed).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from absl import app, flags, logging

from launch import runtime
from launch.cluster import processes as cluster_lib

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined only when run as a command: a test or
    another launcher importing this module for its logic must not define
    flags of the same names twice."""
    flags.DEFINE_list("sizes_mb", ["1", "4", "16"],
                      "Row size per local device, in MB (2**20 bytes).")
    flags.DEFINE_integer("repeats", 5, "Timed transfers per size, transport and pattern.")
    flags.DEFINE_integer("devices_per_host", 2, "CPU devices per simulated host.")
    flags.DEFINE_float("window_s", 1.0, "Length of each interference window (seconds, about).")
    flags.DEFINE_integer("matmul_dim", 512, "Side of the square matrices of the compute loop.")
    flags.DEFINE_integer("matmuls", 4, "Matrix products per compute call.")
    flags.DEFINE_string("json", None, "Write the results here as JSON.")
    flags.DEFINE_string("workdir", None, "Scratch directory; default: a temporary one.")
    flags.DEFINE_float("timeout_s", 600.0,
                       "Deadline of the whole run; the hosts are killed after it.")
    flags.DEFINE_float("op_timeout_s", 120.0, "Deadline of one barrier or one pull inside a host.")
    flags.DEFINE_integer("process_id", -1, "Internal: worker host index.")
    flags.DEFINE_string("coordinator", "", "Internal: coordinator address.")


HOSTS = 2
MB = 1 << 20
PATTERNS = ("one-way", "swap")
TRANSPORTS = ("ppermute", "transfer")


def _sha(rows) -> str:
    h = hashlib.sha256()
    for row in rows:
        h.update(memoryview(row).cast("B"))
    return h.hexdigest()


class _Worker:
    """One simulated host's side of the measurement."""

    def __init__(self, pid: int):
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        from capricorn_jax.experimental import distributed_client

        self.jax, self.np, self.pid, self.peer = jax, np, pid, 1 - pid
        self.kv = distributed_client()  # the jax.distributed key-value store
        if self.kv is None:
            raise RuntimeError("jax.distributed is not initialized")
        self.timeout_ms = int(FLAGS.op_timeout_s * 1000)
        self._barriers = 0
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        self.local = [d for d in devices if d.process_index == pid]
        self.nlocal = len(self.local)
        self.mesh = Mesh(np.array(devices), ("x",))
        self.rows = NamedSharding(self.mesh, P("x"))
        self.local_rows = NamedSharding(Mesh(np.array(self.local), ("d",)), P("d"))
        self.positions = {d: i for i, d in enumerate(devices)}
        self.host_pos = {h: [i for i, d in enumerate(devices) if d.process_index == h]
                         for h in range(HOSTS)}
        self.records: list[dict] = []
        self.interference: list[dict] = []
        self.setup: dict = {}
        # (transport, size) -> {"sent": n, "received": n, "verified": n}
        self.bytes: dict[tuple[str, float], dict[str, int]] = {}
        self._ppermute_cache: dict = {}  # (pattern, size) -> (jitted fn, input, bytes sent)
        self._transfer_cache: dict = {}  # size -> (local array, pull spec)

    # --- coordination -------------------------------------------------------------------------

    def barrier(self) -> None:
        self._barriers += 1
        self.kv.wait_at_barrier(f"transfer_alt/b{self._barriers}", self.timeout_ms)

    def publish(self, key: str, value: str) -> None:
        self.kv.key_value_set(f"transfer_alt/{key}/{self.pid}", value)

    def read_peer(self, key: str) -> str:
        return self.kv.blocking_key_value_get(f"transfer_alt/{key}/{self.peer}", self.timeout_ms)

    def _count(self, transport: str, size: float, sent: int = 0, received: int = 0,
               verified: int = 0) -> None:
        c = self.bytes.setdefault((transport, size), {"sent": 0, "received": 0, "verified": 0})
        c["sent"] += sent
        c["received"] += received
        c["verified"] += verified

    def _receive(self, transport: str, size: float, array, expected: str, verify: bool) -> None:
        """Counts the bytes of ``array`` on this host; with ``verify`` checks their SHA-256."""
        self._last = array
        self._count(transport, size, received=sum(s.data.nbytes for s in array.addressable_shards))
        if verify:
            self._verify(transport, size, array, expected)

    def _verify(self, transport: str, size: float, array, expected: str) -> None:
        rows = self._my_rows(array)
        got = _sha(rows)
        if got != expected:
            raise RuntimeError(f"{transport} {size} MB: received rows do not match the sender's "
                               f"checksum ({got[:12]} != {expected[:12]})")
        self._count(transport, size, verified=sum(r.nbytes for r in rows))

    def _my_rows(self, array):
        """This host's rows of a global [devices, n] array, in local device order."""
        shards = sorted(array.addressable_shards, key=lambda s: self.positions[s.device])
        return [self.np.asarray(s.data)[0] for s in shards]

    # --- (a) collective-permute ---------------------------------------------------------------

    def _ppermute_fn(self, pattern: str):
        jax = self.jax
        from jax.sharding import PartitionSpec as P

        pairs = list(zip(self.host_pos[0], self.host_pos[1], strict=True))
        if pattern == "swap":
            pairs += [(b, a) for a, b in pairs]
        return jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "x", pairs), mesh=self.mesh,
                                     in_specs=P("x"), out_specs=P("x")))

    def _ppermute_once(self, fn, x, pattern: str, size: float, expected: str,
                       sent_bytes: int, sync: bool = True, verify: bool = True) -> float:
        if sync:  # back-to-back runs need none: the collective itself waits for the peer
            self.barrier()
        t0 = time.perf_counter()
        y = fn(x)
        y.block_until_ready()
        dt = time.perf_counter() - t0
        if self.pid == 0 or pattern == "swap":
            self._count("ppermute", size, sent=sent_bytes)
        if self.pid == 1 or pattern == "swap":
            self._receive("ppermute", size, y, expected, verify)
        return dt

    def measure_ppermute(self, size: float, data, expected: str) -> None:
        jax = self.jax
        x = jax.make_array_from_process_local_data(self.rows, data)
        for pattern in PATTERNS:
            fn = self._ppermute_fn(pattern)
            first = self._ppermute_once(fn, x, pattern, size, expected, data.nbytes)
            times = [self._ppermute_once(fn, x, pattern, size, expected, data.nbytes)
                     for _ in range(FLAGS.repeats)]
            self.records.append({"transport": "ppermute", "pattern": pattern, "size_mb": size,
                                 "times": times, "first_s": first, "timed": True})
            self._ppermute_cache[(pattern, size)] = (fn, x, data.nbytes)

    # --- (b) jax.experimental.transfer --------------------------------------------------------

    def start_server(self) -> None:
        from jax.experimental import transfer

        t0 = time.perf_counter()
        self.server = transfer.start_transfer_server(
            self.local[0].client, "127.0.0.1:0", ["127.0.0.1:0"] * self.nlocal)
        started = time.perf_counter() - t0
        self.publish("address", self.server.address())
        peer_address = self.read_peer("address")
        t0 = time.perf_counter()
        self.conn = self.server.connect(peer_address)
        connected = time.perf_counter() - t0
        self.setup = {"server_start_s": started, "connect_s": connected}
        self._uuid = 0

    def _uuids(self, n: int) -> list[int]:
        """The next n transfer ids; the same on every host (both call in step)."""
        out = list(range(self._uuid + 1, self._uuid + 1 + n))
        self._uuid += n
        return out

    def _pull(self, uuid: int, spec, size: float, expected: str, verify: bool = True) -> float:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=FLAGS.op_timeout_s)
        t0 = time.perf_counter()
        (y,) = self.conn.pull(uuid, [spec], timeout=deadline)
        y.block_until_ready()
        dt = time.perf_counter() - t0
        self._receive("transfer", size, y, expected, verify)
        return dt

    def _serve(self, uuids: list[int], xs, size: float, sending: bool) -> None:
        """Schedules xs under every uuid (their pulls come later); the sender counts them."""
        if not sending:
            return
        for u in uuids:
            self.server.await_pull(u, [xs])
            self._count("transfer", size, sent=xs.nbytes)

    def measure_transfer(self, size: float, data, expected: str) -> None:
        jax = self.jax
        xs = jax.device_put(data, self.local_rows)
        xs.block_until_ready()
        spec = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=self.local_rows)
        for pattern in PATTERNS:
            sending = self.pid == 0 or pattern == "swap"
            receiving = self.pid == 1 or pattern == "swap"
            # Mine are the ids my peer pulls from my server; theirs, the ids I pull from its.
            ids = self._uuids(2 * (FLAGS.repeats + 1))
            mine, theirs = ids[self.pid::2], ids[self.peer::2]
            self._serve(mine, xs, size, sending)
            self.barrier()  # every await_pull is in place before any pull
            first, times = None, []
            for r in range(FLAGS.repeats + 1):
                self.barrier()
                if not receiving:
                    continue
                dt = self._pull(theirs[r], spec, size, expected)
                if r == 0:
                    first = dt  # the first pull of all also opens the connection
                else:
                    times.append(dt)
            self.barrier()
            self.records.append({"transport": "transfer", "pattern": pattern, "size_mb": size,
                                 "times": times, "first_s": first, "timed": receiving})
        self._transfer_cache[size] = (xs, spec)

    # --- (c) interference with compute --------------------------------------------------------

    def _compute_fn(self):
        jax, jnp = self.jax, self.jax.numpy
        k, n = FLAGS.matmuls, FLAGS.matmul_dim

        def body(a):
            x = a
            for _ in range(k):
                x = jnp.tanh(x @ a) * (1.0 / n)
            return x

        a = jax.device_put(self.np.random.default_rng(0).standard_normal((n, n), self.np.float32),
                           self.local[0])
        fn = jax.jit(body)
        fn(a).block_until_ready()
        return lambda: fn(a).block_until_ready()

    def _window(self, compute, load) -> tuple[list[float], list[float]]:
        """Compute calls in a thread while ``load`` runs here; their and load's durations."""
        stop = threading.Event()
        calls: list[float] = []
        errors: list[BaseException] = []

        def loop():
            try:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    compute()
                    calls.append(time.perf_counter() - t0)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        self.barrier()
        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            loaded = load()
        finally:
            stop.set()
            thread.join(FLAGS.op_timeout_s)
        if errors:
            raise RuntimeError("compute loop failed") from errors[0]
        if thread.is_alive():
            raise RuntimeError("compute loop did not stop")
        if not calls:
            raise RuntimeError("no compute call completed in the window; raise --window_s")
        return calls, loaded

    def _agreed_count(self, key: str, median_s: float) -> int:
        """Transfers per window so they last about --window_s; the same on both hosts."""
        self.publish(key, repr(median_s))
        slowest = max(median_s, float(self.read_peer(key)))
        return max(3, min(500, math.ceil(FLAGS.window_s / max(slowest, 1e-6))))

    def measure_interference(self, size: float, expected: str, compute) -> None:
        medians = {}
        for r in self.records:
            if r["size_mb"] == size and r["pattern"] == "one-way":
                medians[r["transport"]] = statistics.median(r["times"]) if r["times"] else 0.0
        counts = {t: self._agreed_count(f"count/{t}/{size}", medians[t]) for t in TRANSPORTS}

        def idle():
            time.sleep(FLAGS.window_s)
            return []

        def ppermute_load():
            fn, x, nbytes = self._ppermute_cache[("one-way", size)]
            return [self._ppermute_once(fn, x, "one-way", size, expected, nbytes, sync=False,
                                        verify=False) for _ in range(counts["ppermute"])]

        def transfer_load():
            xs, spec = self._transfer_cache[size]
            ids = self._uuids(counts["transfer"])
            self._serve(ids, xs, size, self.pid == 0)
            self.barrier()
            # On host 0 the main thread has nothing to do: its server's threads send.
            times = ([self._pull(u, spec, size, expected, verify=False) for u in ids]
                     if self.pid == 1 else [])
            self.barrier()
            return times

        base1, _ = self._window(compute, idle)
        loaded = {}
        for transport, load in (("ppermute", ppermute_load), ("transfer", transfer_load)):
            loaded[transport] = self._window(compute, load)
            if self.pid == 1:  # hashing inside the window would load the CPU: the last one here
                self._verify(transport, size, self._last, expected)
        base2, _ = self._window(compute, idle)
        self.interference.append({
            "size_mb": size, "counts": counts, "alone_calls": base1 + base2,
            "loaded": {t: {"calls": c, "transfers": n} for t, (c, n) in loaded.items()}})

    # --- all of it ----------------------------------------------------------------------------

    def run(self) -> dict:
        np = self.np
        self.start_server()
        compute = self._compute_fn()
        for size in [float(s) for s in FLAGS.sizes_mb]:
            n = int(round(size * MB))
            rng = np.random.default_rng([self.pid, n])
            data = rng.integers(0, 256, (self.nlocal, n), dtype=np.uint8)
            self.publish(f"sha/{size}", _sha(list(data)))
            expected = self.read_peer(f"sha/{size}")
            self.measure_ppermute(size, data, expected)
            self.measure_transfer(size, data, expected)
            self.measure_interference(size, expected, compute)
            if self.pid == 0:
                print(f"size {size} MB done", flush=True)
        self.barrier()
        return {"host": self.pid, "devices": self.nlocal, "records": self.records,
                "interference": self.interference, "setup": self.setup,
                "bytes": [{"transport": t, "size_mb": s, **c} for (t, s), c in self.bytes.items()]}


def worker(process_id: int, workdir: Path) -> None:
    logging.set_verbosity(logging.WARNING)
    runtime.init_distributed(HOSTS, FLAGS.coordinator, process_id)
    result = _Worker(process_id).run()
    out = workdir / f"worker_{process_id}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(out)
    sys.stdout.flush()
    # Skip jax.distributed's shutdown barrier and the transfer server's teardown: both
    # hosts have written their results, and the supervisor only needs the exit code.
    os._exit(0)


# --- supervisor side ------------------------------------------------------------------------


def _stats(times: list[float], nbytes: int) -> dict:
    med, lo = statistics.median(times), min(times)
    return {"median_s": med, "min_s": lo, "mb_per_s": nbytes / MB / med,
            "max_mb_per_s": nbytes / MB / lo, "samples": len(times)}


def summarize(parts: list[dict]) -> dict:
    """Combines the hosts' raw timings into the report (raises on an inconsistency)."""
    devices = parts[0]["devices"]
    results = []
    keys = [(r["transport"], r["pattern"], r["size_mb"]) for r in parts[0]["records"]]
    for transport, pattern, size in keys:
        per_host = [next(r for r in p["records"] if (r["transport"], r["pattern"], r["size_mb"])
                         == (transport, pattern, size)) for p in parts]
        timed = [r for r in per_host if r["timed"]]
        # A repeat ends when the slowest timing host is done.
        times = [max(ts) for ts in zip(*(r["times"] for r in timed), strict=True)]
        if not times:
            raise RuntimeError(f"{transport} {pattern} {size} MB: no timed repeats")
        nbytes = int(round(size * MB)) * devices
        results.append({"transport": transport, "pattern": pattern, "size_mb": size,
                        "bytes_per_host": nbytes, **_stats(times, nbytes),
                        "first_call_s": max(r["first_s"] for r in timed)})
    checks = []
    zero = {"sent": 0, "received": 0, "verified": 0}
    for t, s in sorted({(b["transport"], b["size_mb"]) for p in parts for b in p["bytes"]}):
        both = [next((b for b in p["bytes"] if (b["transport"], b["size_mb"]) == (t, s)), zero)
                for p in parts]
        sent = sum(b["sent"] for b in both)
        received = sum(b["received"] for b in both)
        verified = sum(b["verified"] for b in both)
        # Every timed transfer is hashed; of each interference window only the last one.
        if sent != received or not 0 < verified <= received:
            raise RuntimeError(f"{t} {s} MB: sent {sent} bytes, received {received}, "
                               f"checksum-verified {verified}")
        checks.append({"transport": t, "size_mb": s, "bytes_sent": sent,
                       "bytes_received": received, "bytes_verified": verified,
                       "checksums_match": True})
    interference = []
    for i, entry in enumerate(parts[0]["interference"]):
        hosts = [p["interference"][i] for p in parts]
        alone = [statistics.median(h["alone_calls"]) for h in hosts]
        for t in TRANSPORTS:
            loaded = [statistics.median(h["loaded"][t]["calls"]) for h in hosts]
            transfers = [x for h in hosts for x in h["loaded"][t]["transfers"]]
            interference.append({
                "size_mb": entry["size_mb"], "transport": t,
                "transfers": entry["counts"][t],
                "compute_alone_s": alone, "compute_loaded_s": loaded,
                "slowdown": [lo / al for lo, al in zip(loaded, alone, strict=True)],
                "compute_calls_loaded": [len(h["loaded"][t]["calls"]) for h in hosts],
                "transfer_median_loaded_s": statistics.median(transfers) if transfers else None,
                "mb_per_s_loaded": (round(entry["size_mb"] * MB) * parts[0]["devices"] / MB
                                    / statistics.median(transfers)) if transfers else None,
            })
    setup = {"transfer_server_start_s": max(p["setup"]["server_start_s"] for p in parts),
             "transfer_connect_s": max(p["setup"]["connect_s"] for p in parts)}
    return {"results": results, "checks": checks, "interference": interference, "setup": setup}


def markdown(summary: dict) -> str:
    lines = ["| size/device (MB) | transport | pattern | bytes/host | median (ms) | min (ms) | "
             "MB/s (median) | MB/s (best) | first call (ms) |", "|---" * 9 + "|"]
    for r in summary["results"]:
        lines.append(f"| {r['size_mb']:g} | {r['transport']} | {r['pattern']} | "
                     f"{r['bytes_per_host']:,} | {r['median_s'] * 1e3:.2f} | "
                     f"{r['min_s'] * 1e3:.2f} | "
                     f"{r['mb_per_s']:.0f} | {r['max_mb_per_s']:.0f} | "
                     f"{r['first_call_s'] * 1e3:.1f} |")
    s = summary["setup"]
    lines.append(f"\ntransfer setup (not in the times above): server start "
                 f"{s['transfer_server_start_s'] * 1e3:.1f} ms, connect "
                 f"{s['transfer_connect_s'] * 1e3:.2f} ms (the connection itself is made by the "
                 f"first pull, in 'first call')\n")
    lines += ["| size/device (MB) | transport (one-way, back-to-back) | transfers | compute call "
              "alone (ms) h0 / h1 | under load (ms) h0 / h1 | slowdown h0 / h1 | transfer median "
              "under load (ms) | MB/s under load |", "|---|---|---|---|---|---|---|---|"]
    for r in summary["interference"]:
        tm = r["transfer_median_loaded_s"]
        lines.append(
            f"| {r['size_mb']:g} | {r['transport']} | {r['transfers']} | "
            + " / ".join(f"{x * 1e3:.1f}" for x in r["compute_alone_s"]) + " | "
            + " / ".join(f"{x * 1e3:.1f}" for x in r["compute_loaded_s"]) + " | "
            + " / ".join(f"{x:.2f}" for x in r["slowdown"]) + " | "
            + (f"{tm * 1e3:.2f} | {r['mb_per_s_loaded']:.0f}" if tm is not None else "- | -")
            + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    try:
        sizes = [float(s) for s in FLAGS.sizes_mb]
    except ValueError:
        sizes = []
    if not sizes or any(s <= 0 for s in sizes) or FLAGS.repeats < 1:
        print("transfer_alt: error: --sizes_mb needs positive numbers and --repeats >= 1",
              file=sys.stderr)
        sys.exit(2)
    workdir = cluster_lib.scratch_dir(FLAGS.workdir, "capricorn_transfer_alt_")
    if FLAGS.process_id >= 0:
        runtime.exit_now_on_failure(worker, FLAGS.process_id, workdir)
        return
    for stale in workdir.glob("worker_*.json"):
        stale.unlink()
    code = cluster_lib.run_workers("launch.experiments.transfer_alt", sys.argv[1:], HOSTS,
                                   FLAGS.devices_per_host, workdir, FLAGS.timeout_s, ("--json",))
    files = [workdir / f"worker_{h}.json" for h in range(HOSTS)]
    if code != 0 or not all(f.exists() for f in files):
        why = "timed out, hosts killed" if code == 124 else f"exit code {code}"
        print(f"transfer_alt: error: a host failed ({why}); no results reported",
              file=sys.stderr)
        sys.exit(code or 1)
    try:
        summary = summarize([json.loads(f.read_text()) for f in files])
    except (RuntimeError, KeyError, ValueError) as e:
        print(f"transfer_alt: error: {e}; no results reported", file=sys.stderr)
        sys.exit(1)
    print(markdown(summary))
    if FLAGS.json:
        from importlib import metadata

        config = {"sizes_mb": sizes, "repeats": FLAGS.repeats, "hosts": HOSTS,
                  "devices_per_host": FLAGS.devices_per_host, "window_s": FLAGS.window_s,
                  "matmul_dim": FLAGS.matmul_dim, "matmuls": FLAGS.matmuls,
                  "jax": metadata.version("jax"), "cpus": os.cpu_count()}
        Path(FLAGS.json).write_text(json.dumps({**summary, "config": config,
                                                "date": time.strftime("%Y-%m-%d")}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    define_flags()
    app.run(main)
