"""The threaded chunk path (scheduling.threaded), one process.

The sender and receiver run for real (threads, a TCP connection on
loopback, the marks of a jitted function's layer boundaries on the 4 CPU
devices); the one stand-in is the key-value store that exchanges the
channel's address (a dict instead of jax.distributed's client). The two-host
path runs in the kill tests (tests/test_strategies.py, --ckpt=capricorn on
CPU takes it) and in tests/test_strategies.py's path comparison.
"""

import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from capricorn_jax._src.memory.wire.transport import local_rows
from capricorn_jax._src.multihost.secret import SECRET_ENV
from capricorn_jax._src.native import frames as native_frames
from capricorn_jax._src.profiling.boundary import (
    boundary_hooks,
    collective_boundary,
    layer_boundary,
)
from capricorn_jax._src.scheduling.plan.partition_search import spread
from capricorn_jax._src.scheduling.plan.partitioner import LinkModel, Window, partition
from capricorn_jax._src.scheduling.plan.sites import START
from capricorn_jax._src.scheduling.threaded import channel_hello, chunk_channel
from capricorn_jax._src.scheduling.threaded.chunk_channel import ChunkChannel
from capricorn_jax._src.scheduling.threaded.sender import ThreadedSender
from capricorn_jax._src.scheduling.threaded.versions import VersionDropped
from capricorn_jax._src.scheduling.threaded.window_marks import WindowMarks
from capricorn_jax._src.strategies.channel_loss import ChannelKeeper

SECRET = b"a secret for the threaded tests"
"""The job's secret the channels here prove (tests/test_channel_auth.py: the hello)."""


@pytest.fixture(autouse=True)
def _channel_secret(monkeypatch):
    """The channels built here without ``secret=`` take the environment's."""
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())


def raw_hello(host, token, identity=b"", nonce=None):
    """A connecting side's first message, as a stranger would send it."""
    import secrets

    return channel_hello._HELLO.pack(channel_hello.MAGIC, host, nonce or secrets.token_bytes(32),
                                     len(identity), len(token)) + identity + token


class _DictStore:
    """The address exchange of ChunkChannel without a coordinator."""

    def __init__(self):
        self.values, self.cond = {}, threading.Condition()

    def key_value_set(self, key, value):
        with self.cond:
            self.values[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.values, timeout_ms / 1000), key
            return self.values[key]


def _pair(timeout_s=10.0, job="t"):
    """Channels of hosts 0 and 1, each sending to the other."""
    store, out = _DictStore(), {}

    def make(h):
        out[h] = ChunkChannel(h, 1 - h, 1 - h, job, store, timeout_s, secret=SECRET)

    threads = [threading.Thread(target=make, args=(h,)) for h in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out[0], out[1]


def test_a_site_opens_when_every_local_device_passed_it():
    marks = WindowMarks(local_devices=2)
    epoch = marks.reset()
    site = ("b0", "fwd")
    marks.record("b0", "fwd", np.array([0.0, 0.0], np.float32))
    marks.record("b0", "fwd", np.array([0.0, 1.0], np.float32))  # device 0 again
    assert not marks.wait_open(site, epoch, 0.01)
    marks.record("b0", "fwd", np.array([1.0, 0.0], np.float32))
    assert marks.wait_open(site, epoch, 0.01)
    # A new step closes every site; a wait of the old step ends at once.
    assert marks.reset() == epoch + 1
    assert not marks.wait_open(site, epoch, 5.0)
    assert not marks.wait_open(site, epoch + 1, 0.01)


def test_channel_moves_frames_both_ways_and_refuses_one_that_does_not_fit():
    a, b = _pair()
    try:
        rows = np.arange(2 * 300, dtype=np.uint8).reshape(2, 300)
        a.send(7, 100, rows)
        b.send(7, 0, rows[:, :50])
        got_b = np.zeros((2, 400), np.uint8)
        assert b.receive_into(lambda v: got_b) == (7, 100, 300)
        assert (got_b[:, 100:] == rows).all() and not got_b[:, :100].any()
        got_a = np.zeros((2, 50), np.uint8)
        assert a.receive_into(lambda v: got_a) == (7, 0, 50)
        assert (got_a == rows[:, :50]).all()
        a.send(8, 390, rows[:, :20])  # 390 + 20 > 400
        with pytest.raises(ValueError, match="does not fit version 8"):
            b.receive_into(lambda v: np.zeros((2, 400), np.uint8))
    finally:
        a.close()
        b.close()


def test_channel_to_a_host_that_never_connects_times_out_naming_it():
    """Host 1 listens (so host 0's connection succeeds) but never connects
    back: host 0's wait for its source ends at the bound, naming host 1."""
    store = _DictStore()
    with socket.create_server(("127.0.0.1", 0)) as silent:
        store.key_value_set("capricorn/chunk_channel/t/1",
                            f"127.0.0.1:{silent.getsockname()[1]}")
        with pytest.raises(TimeoutError, match=r"^host 0: host 1 did not connect its chunk "
                                               r"channel within 0.5s"):
            ChunkChannel(0, 1, 1, "t", store, timeout_s=0.5, address="127.0.0.1")


def test_channel_to_a_host_that_does_not_listen_raises():
    store = _DictStore()
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed now: nothing listens there
    store.key_value_set("capricorn/chunk_channel/t/1", f"127.0.0.1:{port}")
    with pytest.raises(ConnectionRefusedError):
        ChunkChannel(0, 1, 1, "t", store, timeout_s=1.0, address="127.0.0.1")


def test_channel_accepts_only_its_jobs_source_host_and_logs_why(caplog):
    """Three strangers connect to host 0's listener first: one without a
    hello, one naming another channel, one claiming host 5; each is refused
    with a logged reason and its address, and host 1 (the source) then gets
    through."""
    store = _DictStore()
    out = {}
    zero = threading.Thread(target=lambda: out.setdefault(
        0, ChunkChannel(0, 1, 1, "job-a", store, 10.0, address="127.0.0.1")))
    with caplog.at_level("WARNING", logger=chunk_channel.log.name):
        zero.start()
        host, port = store.blocking_key_value_get("capricorn/chunk_channel/job-a/0", 10_000
                                                  ).rsplit(":", 1)
        strangers = [socket.create_connection((host, int(port))) for _ in range(3)]
        strangers[0].sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(64))
        strangers[1].sendall(raw_hello(1, b"job-b"))
        strangers[2].sendall(raw_hello(5, b"job-a"))

        def refusals():
            return sorted(r.getMessage() for r in caplog.records if "refused" in r.getMessage())

        deadline = time.monotonic() + 10
        while len(refusals()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        one = ChunkChannel(1, 0, 0, "job-a", store, 10.0, address="127.0.0.1")
        zero.join(20)
    try:
        got_refusals = refusals()
        assert len(got_refusals) == 3, got_refusals
        assert all(f"from 127.0.0.1:{s.getsockname()[1]}" in " ".join(got_refusals)
                   for s in strangers)
        text = " | ".join(got_refusals)
        assert "not a chunk channel hello (b'GET ')" in text
        assert "another channel's token (b'job-b')" in text
        assert "host 5, not this host's source host 1" in text
        assert len(out[0].refusals) == 3
        one.send(1, 0, np.full((1, 8), 7, np.uint8))
        got = np.zeros((1, 8), np.uint8)
        assert out[0].receive_into(lambda v: got) == (1, 0, 8) and (got == 7).all()
    finally:
        for s in strangers:
            s.close()
        one.close()
        out[0].close()


def test_the_advertised_address_is_the_one_the_coordinator_is_reached_from():
    assert chunk_channel.job_address("127.0.0.1:1234") == "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # any routed address: this machine's own
            own = probe.getsockname()[0]
        except OSError:
            own = "127.0.0.1"
    if own.startswith("127."):
        pytest.skip("no non-loopback address on this machine")
    assert chunk_channel.job_address(f"{own}:1234") == own  # not a loopback alias


def _model(x):
    x = layer_boundary(jnp.tanh(x * 1.5), "b0")
    x = layer_boundary(jnp.tanh(x @ jnp.ones((16, 16)) / 16), "b1")
    return jnp.sum(x ** 2)


def _log_sends(channel, sender):
    """(offset, the sites open then) of every frame ``channel`` sends, in order."""
    sent, send = [], channel.send

    def logging_send(version, offset, data):
        sent.append((offset, set(sender.marks.opened_at)))
        send(version, offset, data)

    channel.send = logging_send
    return sent


def test_sender_sends_each_window_after_its_mark_and_the_peer_gets_every_byte():
    devices = jax.devices()[:4]
    mesh = Mesh(np.array(devices), ("x",))
    rows = NamedSharding(mesh, P("x"))
    payload_bytes = 50_000
    own_np = np.random.default_rng(0).integers(0, 256, (4, payload_bytes), dtype=np.uint8)
    own = jax.device_put(own_np, rows)
    assert (np.stack(local_rows(own)) == own_np).all()

    store = _DictStore()
    channel = ChunkChannel(0, 0, 0, "self", store, timeout_s=20.0)  # host 0 to itself
    sender = ThreadedSender(channel, ["b0", "b1"], local_devices=4, mesh=mesh, timeout_s=20.0)
    opened_at_send = _log_sends(channel, sender)
    windows = [Window("b0", "fwd", 1e-3), Window("b1", "fwd", 1e-3), Window("head", "fwd", 1e-3),
               Window("b1", "bwd", 1e-3), Window("tail", "bwd", 1e-3)]
    link = LinkModel(alpha_s=0.0, bytes_per_s=8e6)  # 8 kB per window: a tail too
    schedule = partition(payload_bytes, windows, link, chunk_cap=4096)
    assert schedule.tail and all(schedule.chunks)
    try:
        grad = jax.jit(jax.grad(_model), in_shardings=rows, out_shardings=rows)
        x = jax.device_put(np.ones((8, 16), np.float32), rows)
        # One hook for every schedule: marks at every boundary a window can
        # use, so a re-partition compiles no new step.
        assert sender.hook() is sender.hook()
        assert sender.hook().sites == {("b0", "fwd"), ("b1", "fwd"), ("b1", "bwd"),
                                       ("b0", "bwd")}
        with boundary_hooks(sender.hook()):
            lowered = grad.lower(x)
        step = lowered.compile()
        t_issue = time.perf_counter()
        sender.start(3, own, schedule)
        jax.block_until_ready(step(x))
        t_done = time.perf_counter()
        received = sender.wait(3)
        opened = dict(sender.marks.opened_at)
    finally:
        sender.close()
    assert (received == own_np).all()
    # The closing boundaries are marked too, and each filled window's span runs
    # from its opening mark (the packed payload for the first) to its closing
    # one; the tail window closes after the step (no mark): not timed.
    assert set(opened) == {("b0", "fwd"), ("b1", "fwd"), ("b1", "bwd"), ("b0", "bwd")}
    order = [opened[s] for s in (("b0", "fwd"), ("b1", "fwd"), ("b1", "bwd"), ("b0", "bwd"))]
    assert t_issue <= order[0] and order == sorted(order) and order[-1] <= t_done
    starts = [None, ("b0", "fwd"), ("b1", "fwd"), ("b1", "bwd")]
    ends = [("b0", "fwd"), ("b1", "fwd"), ("b1", "bwd"), ("b0", "bwd")]
    assert set(sender.last_spans) == {0, 1, 2, 3}
    for i, (a, b) in enumerate(zip(starts, ends, strict=True)):
        begun = sender.last_spans[i] if a is None else opened[b] - opened[a]
        assert sender.last_spans[i] == begun >= 0.0
    # Window 0 opens when the payload was packed (the pack's time is no idle
    # link time of the step), after the step's issue.
    packed = sender.last_times["packed_s"]
    # On a busy box the sender may see the payload after the first mark: 0 then.
    assert packed > 0.0 and 0.0 <= sender.last_spans[0] <= max(0.0, order[0] - t_issue - packed)
    # When each window's last frame left, from its opening (the tail window
    # too: its opening is marked); none before its window opened.
    assert set(sender.last_sends) == {0, 1, 2, 3, 4}
    assert all(v >= 0.0 for v in sender.last_sends.values())
    # Every window's frames left after the mark of its site: (b0, fwd)'s window
    # opens at the start, (b1, fwd) at b0's forward mark, head at b1's, (b1,
    # bwd) at b1's backward mark, the tail window at b0's backward mark.
    site_of_offset = {}
    needs = [None, ("b0", "fwd"), ("b1", "fwd"), ("b1", "bwd"), ("b0", "bwd")]
    for needed, chunks in zip(needs, schedule.chunks, strict=True):
        for c in chunks:
            site_of_offset[c.start] = needed
    sent = {offset for offset, _ in opened_at_send}
    assert sent == {c.start for cs in schedule.chunks for c in cs} | {
        c.start for c in schedule.tail}
    for offset, opened in opened_at_send:
        needed = site_of_offset.get(offset, ("b0", "bwd"))  # the tail goes after the last
        assert needed is None or needed in opened, (offset, needed, opened)
    assert START not in site_of_offset.values()




def _model_with_all_to_all(mesh):
    """b0, then an all-to-all inside a shard_map (its edges marked with
    ``collective_boundary``, as GPTMoE's), then b1."""
    def exchange(y):
        y = collective_boundary(y, "b1", "dispatch.begin", ("x",))
        y = jax.lax.all_to_all(y, "x", 0, 0, tiled=True)
        y = collective_boundary(y, "b1", "dispatch.end", ("x",))
        return jnp.tanh(y * 1.1)

    def model(x):
        x = layer_boundary(jnp.tanh(x * 1.5), "b0")
        x = jax.shard_map(exchange, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(x)
        x = layer_boundary(jnp.tanh(x @ jnp.ones((16, 16)) / 16), "b1")
        return jnp.sum(x ** 2)

    return model


def test_span_windows_open_at_the_edge_that_ends_their_all_to_all():
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    rows = NamedSharding(mesh, P("x"))
    payload_bytes = 40_000
    own_np = np.random.default_rng(1).integers(0, 256, (4, payload_bytes), dtype=np.uint8)
    own = jax.device_put(own_np, rows)
    channel = ChunkChannel(0, 0, 0, "spans", _DictStore(), timeout_s=20.0)
    sender = ThreadedSender(channel, ["b0", "b1"], local_devices=4, mesh=mesh, timeout_s=20.0)
    opened_at_send = _log_sends(channel, sender)
    edge_fwd, edge_bwd = ("b1", "fwd:dispatch.end"), ("b1", "bwd:dispatch.begin")
    windows = [Window("b0", "fwd", 1e-3), Window("b1", "fwd", 1e-3),
               Window("b1", "fwd", 1e-3, edge_fwd[1]), Window("head", "fwd", 1e-3),
               Window("b1", "bwd", 1e-3), Window("b1", "bwd", 1e-3, edge_bwd[1]),
               Window("tail", "bwd", 1e-3)]
    schedule = partition(payload_bytes, windows, LinkModel(0.0, 4e6), chunk_cap=4096)
    assert all(schedule.chunks)
    try:
        grad = jax.jit(jax.grad(_model_with_all_to_all(mesh)), in_shardings=rows,
                       out_shardings=rows)
        x = jax.device_put(np.ones((16, 16), np.float32), rows)
        with boundary_hooks(sender.hook()):
            step = grad.lower(x).compile()
        sender.start(5, own, schedule)
        jax.block_until_ready(step(x))
        received = sender.wait(5)
        opened = dict(sender.marks.opened_at)
        native = sender.marks.table.native
    finally:
        sender.close()
    assert (received == own_np).all()
    # The edges that end the all-to-all (forward .end, backward .begin) open
    # windows; with native marks the ones that begin it are marked too (the
    # step's marks are its profile), with host callbacks they are not.
    order = [("b0", "fwd"), edge_fwd, ("b1", "fwd"), ("b1", "bwd"), edge_bwd, ("b0", "bwd")]
    others = {("b1", "fwd:dispatch.begin"), ("b1", "bwd:dispatch.end")}
    assert set(opened) == set(order) | (others if native else set())
    assert [opened[s] for s in order] == sorted(opened[s] for s in order)
    if native:
        assert opened[("b1", "fwd:dispatch.begin")] <= opened[edge_fwd]
        # backward: the cotangent passes the edges in reverse (.end, then .begin)
        assert opened[("b1", "bwd:dispatch.end")] <= opened[edge_bwd]
    # Each span window's frames left after its edge's mark; it closes at the next site.
    for i, edge in ((2, edge_fwd), (5, edge_bwd)):
        for c in schedule.chunks[i]:
            assert all(edge in sites for offset, sites in opened_at_send if offset == c.start)
        after = order[order.index(edge) + 1]
        assert sender.last_spans[i] == opened[after] - opened[edge]
    # The window before an edge closes at it.
    assert sender.last_spans[1] == opened[edge_fwd] - opened[("b0", "fwd")]


def test_a_steps_own_marks_are_the_profile_the_instrumented_variant_measures():
    """Issue 38 part 4: the program a scheduled strategy runs every step
    (the sender's native marks at every boundary and collective edge, and
    the step's start and end) gives the profile a separately compiled
    instrumented variant gives: the same segments, the same idle spans, and
    the same values as the plain step."""
    from capricorn_jax._src.profiling.layer_profile import build_profile
    from capricorn_jax._src.profiling.profiler import make_profiled_step, step_marks
    from launch import runtime

    job = runtime.build_job("tiny", {}, 1, 4, 1e-3, 1, "steady", 4, 0, "none", "")
    trainer = job.trainer
    factors = (1.25,) * len(trainer.moe_layers)
    batch = trainer.global_batch(job.data.next_batch())
    channel = ChunkChannel(0, 0, 0, "own-marks", _DictStore(), timeout_s=20.0)
    sender = ThreadedSender(channel, trainer.boundaries, local_devices=4, mesh=trainer.mesh,
                            timeout_s=20.0)
    try:
        assert sender.marks.table.native  # gcc is there: the marks are native
        wrap = step_marks(trainer, sender.marks, ordered=False)
        program = trainer.step_fn(factors, (sender.hook(),), wrap)
        jax.block_until_ready(program(trainer.init_state(0), batch))  # compiles
        assert trainer.has_step(factors, (sender.hook(),), wrap)
        state = trainer.init_state(0)
        jax.block_until_ready(state)
        sender.marks.reset()
        t0 = time.perf_counter()
        marked_state, _ = program(state, batch)
        jax.block_until_ready(marked_state)
        total = time.perf_counter() - t0
        own = build_profile(0, total, sender.hook().names, sender.marks.step_times(),
                            measured_collectives=True)
    finally:
        sender.close()
    plain_state, _ = trainer.step_fn(factors)(trainer.init_state(0), batch)
    variant_state, _, variant = make_profiled_step(trainer, factors)(trainer.init_state(0), batch)
    for a, b in zip(jax.tree.leaves(marked_state), jax.tree.leaves(plain_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    keys = [(s.name, s.direction) for s in own.segments]
    assert keys == [(s.name, s.direction) for s in variant.segments]
    assert own.devices == variant.devices == 4
    for mine, theirs in zip(own.segments, variant.segments, strict=True):
        assert mine.duration_s >= 0
        assert (mine.spans is None) == (theirs.spans is None), (mine.name, mine.direction)
        if mine.spans is not None:
            assert [s.edge for s in mine.spans] == [s.edge for s in theirs.spans]
    assert any(s.spans for s in own.segments)  # the MoE layers' idle spans are measured
    for seg in own.segments:  # and their all-to-alls' time, between the edges
        assert seg.collective_s == (None if seg.spans is None else
                                    sum(span.busy_s for span in seg.spans))
        assert seg.spans is None or seg.collective_s > 0
    assert sum(s.duration_s for s in own.segments) <= total


# ------------------------------------------------------------------ failures
# Two ThreadedSenders (hosts 0 and 1, one device each) over real sockets; no
# step runs, so the test fires (or withholds) the boundary marks itself.

PAYLOAD = 20_000


def _senders(timeout_s, native_receive=True):
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    a, b = _pair(20.0)
    return mesh, [ThreadedSender(c, ["b0", "b1"], 1, mesh, timeout_s,
                                 native_receive=native_receive) for c in (a, b)]


def _own(mesh, version, host):
    data = np.random.default_rng(version * 2 + host).integers(0, 256, (1, PAYLOAD), np.uint8)
    return data, jax.device_put(data, NamedSharding(mesh, P("x")))


def _schedule(split: bool):
    """Everything in the step's first window (no mark), or half of it in the
    window the (b0, fwd) mark opens."""
    if not split:
        return partition(PAYLOAD, [Window("b0", "fwd", 1.0)], LinkModel(0.0, 1e9), 4096)
    windows = [Window("b0", "fwd", 1e-5), Window("b1", "fwd", 1.0)]
    schedule = partition(PAYLOAD, windows, LinkModel(0.0, 1e9), 4096)
    assert all(schedule.chunks) and not schedule.tail
    return schedule


def _round(mesh, senders, version, schedule, wait_s=20.0):
    """Both hosts move ``version``; each gets exactly the other's payload."""
    data = {}
    for h, sender in enumerate(senders):
        data[h], own = _own(mesh, version, h)
        sender.start(version, own, schedule)
    for h, sender in enumerate(senders):
        assert (sender.wait(version, wait_s) == data[1 - h]).all()


def test_a_mark_that_never_fires_sends_its_window_at_the_bound_and_the_version_completes():
    mesh, senders = _senders(timeout_s=0.3)
    try:
        _round(mesh, senders, 1, _schedule(split=True))  # (b0, fwd) never marked
        for s in senders:  # the window was sent, not its span measured
            assert s.last_spans == {} and s.failure is None
        _round(mesh, senders, 2, _schedule(split=True))
    finally:
        for s in senders:
            s.close()


def _fire(sender, site):
    sender.marks.record(site[0], site[1], np.zeros(2, np.float32))  # device 0: all local


def test_a_spread_version_sends_one_steps_windows_per_part_and_completes_after_the_last():
    mesh, senders = _senders(timeout_s=20.0)
    windows = [Window("b0", "fwd", 1e-5), Window("b1", "fwd", 1.0)]
    schedule, parts = spread(PAYLOAD, windows, LinkModel(0.0, 8e3), 4096, max_steps=8)
    assert parts == 3 and not schedule.tail  # 1 s per step holds 8 KB: 3 steps for 20 KB
    try:
        data = {}
        for h, sender in enumerate(senders):
            data[h], own = _own(mesh, 7, h)
            sender.start(7, own, schedule, parts)
            assert sender.parts_left(7) == 2
        for part in range(parts):
            if part:
                for sender in senders:
                    sender.resume(7)
            time.sleep(0.2)  # no part completes the version before its last
            assert not any(s._versions[7].complete.is_set() for s in senders) or part == 2
            for sender in senders:
                _fire(sender, ("b0", "fwd"))  # opens this step's second window
        for h, sender in enumerate(senders):
            assert (sender.wait(7, 20.0) == data[1 - h]).all()
            assert 7 not in sender._versions  # finished: forgotten
        # flush: every part left goes at once, no mark needed.
        for h, sender in enumerate(senders):
            data[h], own = _own(mesh, 8, h)
            sender.start(8, own, schedule, parts)
            sender.resume(8, flush=True)
            assert sender.parts_left(8) == 0
            with pytest.raises(ValueError, match="all 3 parts were sent"):
                sender.resume(8)
        for h, sender in enumerate(senders):
            assert (sender.wait(8, 20.0) == data[1 - h]).all()
    finally:
        for s in senders:
            s.close()


def test_a_wait_that_times_out_names_the_peer_drops_the_version_and_the_next_goes():
    mesh, (a, b) = _senders(timeout_s=0.5)
    try:
        _, own = _own(mesh, 1, 0)
        a.start(1, own, _schedule(split=False))  # host 1 never starts version 1
        with pytest.raises(TimeoutError, match=r"^host 0: version 1: receiving from host 1 did "
                                               r"not finish within 0.2s"):
            a.wait(1, 0.2)
        # Host 1 dropped version 1 after its bound (its frames discarded); a
        # late start of it on host 1 drops that version at once (it used to
        # wait out its bound, and a caller counted the channel lost).
        time.sleep(1.0)  # past host 1's 0.5 s bound for a version it has not started
        _, own1 = _own(mesh, 1, 1)
        b.start(1, own1, _schedule(split=False))
        with pytest.raises(VersionDropped, match="arrived before this host started it"):
            b.wait(1, 3.0)
        _round(mesh, (a, b), 2, _schedule(split=False))
        assert a.failure is None and b.failure is None
    finally:
        a.close()
        b.close()


# The receive loop's two paths: runs of frames in native code (where a
# compiler is there; every other test of the sender takes it) and Python's.
@pytest.mark.parametrize("native_receive", [True, False], ids=["native", "python"])
def test_a_frame_that_arrives_early_late_or_twice_counts_once(native_receive):
    mesh, (a, b) = _senders(timeout_s=5.0, native_receive=native_receive)
    assert a.native_receive == (native_receive and native_frames.available())
    schedule = _schedule(split=False)
    try:
        _round(mesh, (a, b), 1, schedule)
        # Frames of version 1 again, after both finished it: discarded.
        a.channel.send(1, 0, np.zeros((1, 4096), np.uint8))
        # Version 2: host 0's first chunk goes twice, and all of host 0's
        # frames go before host 1 starts the version.
        data0, own0 = _own(mesh, 2, 0)
        first = schedule.chunks[0][0]
        a.channel.send(2, first.start, [data0[0, first.start:first.stop]])
        a.start(2, own0, schedule)
        data1, own1 = _own(mesh, 2, 1)
        b.start(2, own1, schedule)
        assert (b.wait(2, 20.0) == data0).all() and (a.wait(2, 20.0) == data1).all()
        _round(mesh, (a, b), 3, schedule)
        assert a.failure is None and b.failure is None
    finally:
        a.close()
        b.close()


def test_a_peer_that_dies_mid_window_fails_the_version_naming_it_within_the_bound():
    mesh, (a, b) = _senders(timeout_s=5.0)
    try:
        _, own = _own(mesh, 1, 0)
        a.start(1, own, _schedule(split=True))  # window 0 goes at once
        b.close()  # host 1 dies before the (b0, fwd) mark opens window 1
        a.marks.record("b0", "fwd", np.zeros(1, np.float32))
        with pytest.raises((RuntimeError, TimeoutError),
                           match=r"^host 0: version 1: (sending to|receiving from) host 1 "):
            a.wait(1, 20.0)
        # Nothing of version 1 is handed on, and a version started on the
        # failed channel is lost at once (its wait raises without waiting),
        # never half-replicated: the strategy's lost-channel rule
        # (strategies.channel_loss) takes it from there.
        assert a.failure is not None
        a.start(2, own, _schedule(split=True))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"^host 0: version 2: sending to host 1 failed"):
            a.wait(2, 20.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        a.close()


def test_a_hung_channel_times_out_then_both_hosts_reconnect_and_move_every_byte_again():
    """Host 1's channel hangs (sends nothing for 30 s) at version 2: both
    waits end at the bound; the hosts abandon what was in flight, move to
    new connections, and the next versions arrive bit for bit, while the
    hung thread, woken by the old channel's close, records no failure on the
    new one."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    senders = [ThreadedSender(c, ["b0", "b1"], 1, mesh, 0.5)
               for c in _pair(20.0, "hung")]
    stalls = []
    senders[1].channel.stall_at = (2, 30.0)
    senders[1].channel.on_stall = stalls.append
    schedule = _schedule(split=False)
    try:
        _round(mesh, senders, 1, schedule)
        for h, sender in enumerate(senders):
            sender.start(2, _own(mesh, 2, h)[1], schedule)
        with pytest.raises(TimeoutError, match="host 0: version 2: receiving from host 1 did "
                                               "not finish within 0.5s"):
            senders[0].wait(2)
        with pytest.raises(TimeoutError, match="host 1: version 2: sending to host 0 did not "
                                               "finish within 0.5s"):
            senders[1].wait(2)
        assert stalls == [2]
        for h, sender in enumerate(senders):
            sender.start(3, _own(mesh, 3, h)[1], schedule)  # in flight when the hosts agree
        old = [s.channel for s in senders]
        fresh = _pair(20.0, "hung/r1")
        t0 = time.monotonic()
        for sender, channel in zip(senders, fresh, strict=True):
            assert sender.abandon() == [3]
            with pytest.raises(ConnectionError, match=r"version 3 is not in flight on the chunk "
                                                      r"channel \(abandoned with it\)"):
                sender.wait(3)  # a loss the keeper counts, never a KeyError
            sender.reconnect(channel)
        assert time.monotonic() - t0 < 5.0  # the hung send woke with its channel's close
        assert all(s.channel is c for s, c in zip(senders, fresh, strict=True))
        assert old[1]._closed.is_set()
        for version in (4, 5):
            _round(mesh, senders, version, schedule)
        assert all(s.failure is None for s in senders)
    finally:
        for s in senders:
            s.close()


class _Flag:
    """The status flag a keeper notes (the memory tier's, alone)."""

    host = 0

    def note_channel(self, lost):
        self.lost = lost


@pytest.mark.parametrize("native_receive", [True, False])
@pytest.mark.parametrize("via_keeper", [False, True])
def test_a_version_that_arrived_whole_is_kept_when_the_peer_closes_before_it_is_waited_for(
        native_receive, via_keeper):
    """Soak seed 66 trial 15: the job's last version arrived whole on both
    hosts; host 1 waited, committed and closed its channel (its status round
    is dispatched, not waited for), and host 0's receiver, seeing the peer
    go, failed every version still in its book, the one already complete
    too, before host 0's training thread (behind on a busy box) checked it:
    "version 12: receiving from host 1 failed", a version lost that was
    there. A version whose bytes all arrived keeps them: the wait returns it,
    the keeper's wait (its host now knows the channel lost) too; the channel
    is still lost for what comes after."""
    mesh, (a, b) = _senders(timeout_s=5.0, native_receive=native_receive)
    try:
        schedule, data = _schedule(split=False), {}
        for h, sender in enumerate((a, b)):
            data[h], own = _own(mesh, 1, h)
            sender.start(1, own, schedule)
        assert (b.wait(1, 20.0) == data[0]).all()
        b.close()
        deadline = time.monotonic() + 10.0
        while a.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.failure is not None  # host 0's receiver saw the peer go
        if via_keeper:
            keeper = ChannelKeeper(_Flag(), a, lambda attempt: None)
            assert keeper.lost_here()
            received = keeper.wait(1)
        else:
            received = a.wait(1, 20.0)
        assert (received == data[1]).all()
        a.start(2, _own(mesh, 2, 0)[1], schedule)  # what comes after is lost at once
        with pytest.raises(RuntimeError, match=r"^host 0: version 2: sending to host 1 failed"):
            a.wait(2, 20.0)
    finally:
        a.close()
        b.close()


def test_a_measurement_that_does_not_grow_with_size_is_taken_again_then_raised():
    class Measured:
        host = 0

        def __init__(self, *runs):
            self.runs = list(runs)

        def measure(self, rows):
            return [1000, 2000], self.runs.pop(0)

    noisy, good = [0.5, 0.1], [0.001, 0.002]
    link = chunk_channel.measure_channel(Measured(noisy, noisy, good), rows=1)
    assert link.bytes_per_s == pytest.approx(1e6)
    with pytest.raises(ValueError, match="times do not grow with size"):
        chunk_channel.measure_channel(Measured(noisy, noisy, noisy, good), rows=1)


def test_channel_sends_in_the_traffic_class_it_is_given():
    store, out = _DictStore(), {}

    def make(h):
        out[h] = ChunkChannel(h, 1 - h, 1 - h, "tos", store, 10.0, tos=0x08 if h == 0 else 0)

    threads = [threading.Thread(target=make, args=(h,)) for h in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    try:
        assert out[0].out.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 0x08
        assert out[1].out.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 0
        # Little of what it sends waits unsent in the kernel.
        assert out[0].out.getsockopt(socket.IPPROTO_TCP, chunk_channel._TCP_NOTSENT_LOWAT) == \
            chunk_channel.NOTSENT_LOWAT
    finally:
        for c in out.values():
            c.close()


def test_the_chunk_channels_class_is_an_ip_tos_byte():
    import capricorn_jax

    assert capricorn_jax.InMemoryOptions(store_root="/tmp/x", job="j", chunk_tos=8).chunk_tos == 8
    with pytest.raises(ValueError, match="chunk_tos must be an IP TOS byte in \\[0, 255\\], "
                                         "got 256"):
        capricorn_jax.InMemoryOptions(store_root="/tmp/x", job="j", chunk_tos=256)


def test_a_receive_wakes_only_once_its_bytes_are_queued():
    """``_recv_exact`` sets SO_RCVLOWAT to the rest of the view (capped): the
    reader's thread wakes once per frame, not once per arriving packet."""
    import socket

    from capricorn_jax._src.scheduling.threaded.chunk_channel import RCVLOWAT_CAP, _recv_exact

    a, b = socket.socketpair()
    b.settimeout(10.0)  # the channel's frame bodies: a blocking socket keeps the mark at 1
    try:
        a.sendall(bytes(range(100)))
        view = bytearray(100)
        _recv_exact(b, memoryview(view))
        assert bytes(view) == bytes(range(100))
        assert b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 100
        a.sendall(bytes(RCVLOWAT_CAP + 10))
        _recv_exact(b, memoryview(bytearray(RCVLOWAT_CAP + 10)))
        assert b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) <= RCVLOWAT_CAP
        b.settimeout(None)
        a.sendall(bytes(50))
        _recv_exact(b, memoryview(bytearray(50)))
        assert b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        a.close()
        b.close()
