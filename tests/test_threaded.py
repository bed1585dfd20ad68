"""The threaded chunk path (scheduling.threaded), one process.

The sender and receiver run for real (threads, a TCP connection on
loopback, the marks of a jitted function's layer boundaries on the 4 CPU
devices); the one stand-in is the key-value store that exchanges the
channel's address (a dict instead of jax.distributed's client). The two-host
path runs in the kill tests (tests/test_strategies.py, --ckpt=capricorn on
CPU takes it) and in tests/test_strategies.py's path comparison.
"""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from capricorn_jax._src.memory.transport import local_rows
from capricorn_jax._src.profiling.boundary import boundary_hooks, layer_boundary
from capricorn_jax._src.scheduling.executor import START
from capricorn_jax._src.scheduling.partitioner import LinkModel, Window, partition
from capricorn_jax._src.scheduling.threaded import (
    ChunkChannel,
    ThreadedSender,
    WindowMarks,
)


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


def _pair(timeout_s=10.0):
    """Channels of hosts 0 and 1, each sending to the other."""
    store, out = _DictStore(), {}

    def make(h):
        out[h] = ChunkChannel(h, 1 - h, 1 - h, "t", store, timeout_s)

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
    store = _DictStore()
    store.key_value_set("capricorn/chunk_channel/t/1", "127.0.0.1:9")  # nothing listens
    with pytest.raises(OSError):
        ChunkChannel(0, 1, 1, "t", store, timeout_s=1.0)


def _model(x):
    x = layer_boundary(jnp.tanh(x * 1.5), "b0")
    x = layer_boundary(jnp.tanh(x @ jnp.ones((16, 16)) / 16), "b1")
    return jnp.sum(x ** 2)


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
    opened_at_send = []
    send = channel.send

    def logging_send(version, offset, data):
        with sender.marks._cond:
            opened_at_send.append((offset, set(sender.marks._open)))
        send(version, offset, data)

    channel.send = logging_send
    windows = [Window("b0", "fwd", 1e-3), Window("b1", "fwd", 1e-3), Window("head", "fwd", 1e-3),
               Window("b1", "bwd", 1e-3), Window("tail", "bwd", 1e-3)]
    link = LinkModel(alpha_s=0.0, bytes_per_s=8e6)  # 8 kB per window: a tail too
    schedule = partition(payload_bytes, windows, link, chunk_cap=4096)
    assert schedule.tail and all(schedule.chunks)
    try:
        grad = jax.jit(jax.grad(_model), in_shardings=rows, out_shardings=rows)
        x = jax.device_put(np.ones((8, 16), np.float32), rows)
        with boundary_hooks(sender.hook(schedule)):
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
    # from its opening mark (the step's issue for the first) to its closing
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
    assert 0.0 <= sender.last_spans[0] <= order[0] - t_issue
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


