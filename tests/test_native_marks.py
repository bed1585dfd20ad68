"""The native window marks (capricorn_jax._src.native.marks): the threaded
sender's marks stamped by an FFI handler, no host callback, no GIL."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from capricorn_jax._src.native import frames as native_frames
from capricorn_jax._src.native import marks as native_marks
from capricorn_jax._src.profiling.profiler import mark
from capricorn_jax._src.scheduling.threaded.window_marks import WindowMarks

pytestmark = pytest.mark.skipif(not native_marks.available(),
                                reason="no C++ compiler: the marks run as host callbacks")


def _marked_program(mesh, marks, sites):
    sharding = NamedSharding(mesh, P("x"))

    def body(y):
        for name in sites:
            y = mark(y, P("x"), mesh, marks, name, "fwd", ordered=False)
            y = jnp.tanh(y)
        return y

    return jax.jit(body, in_shardings=sharding, out_shardings=sharding), sharding


def test_marks_in_the_step_are_native_stamps_that_open_their_sites_in_order():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    marks = WindowMarks(local_devices=2, devices=mesh.size)
    try:
        program, sharding = _marked_program(mesh, marks, ["b0", "b1"])
        hlo = program.lower(jnp.zeros((2, 8))).as_text()
        assert hlo.count(native_marks.TARGET) == 2 and "callback" not in hlo
        epoch = marks.reset()
        assert not marks.wait_open(("b0", "fwd"), epoch, 0.01)
        before = time.perf_counter()
        out = program(jax.device_put(np.zeros((2, 8), np.float32), sharding))
        out.block_until_ready()
        after = time.perf_counter()
        assert marks.wait_open(("b0", "fwd"), epoch, 5.0)
        assert marks.wait_open(("b1", "fwd"), epoch, 5.0)
        opened = marks.opened_at
        assert before <= opened[("b0", "fwd")] <= opened[("b1", "fwd")] <= after
        assert all(marks.open_time(site) == t for site, t in opened.items())
        assert marks.open_time(("b9", "fwd")) is None  # a site no program marks
        assert marks.queued_at == {("b0", "fwd"): None, ("b1", "fwd"): None}  # no socket bound
        # A new step: nothing open until its own marks.
        epoch = marks.reset()
        assert marks.opened_at == {} and not marks.wait_open(("b0", "fwd"), epoch, 0.01)
        assert marks.open_time(("b0", "fwd")) is None
    finally:
        marks.close()


@pytest.mark.parametrize("native_wait", [False, True])
def test_a_waiting_sender_wakes_at_the_mark_and_at_a_new_step(native_wait):
    if native_wait and not native_frames.available():
        pytest.skip("no native frame library")
    marks = WindowMarks(local_devices=1, devices=2, native_wait=native_wait)
    try:
        marks.native_slot("b0", "bwd")  # the sites a compiled step marks have slots
        marks.native_slot("b1", "bwd")
        epoch = marks.reset()
        got = {}

        def wait():
            got["open"] = marks.wait_open(("b0", "bwd"), epoch, 10.0)
            got["at"] = time.perf_counter()

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.05)
        marked = time.perf_counter()
        marks.record("b0", "bwd", np.array([1.0, 0.0], np.float32))
        t.join(5.0)
        assert got["open"] and got["at"] >= marked
        opened = marks.wait_opened(("b0", "bwd"), epoch, 0.0)  # open: no wait
        assert opened == marks.open_time(("b0", "bwd")) and marked <= opened <= got["at"]
        waiter = threading.Thread(target=lambda: got.update(stale=marks.wait_open(
            ("b1", "bwd"), epoch, 10.0)))
        waiter.start()
        time.sleep(0.05)
        marks.reset()  # the step it waited in is over
        waiter.join(5.0)
        assert got["stale"] is False and not waiter.is_alive()
    finally:
        marks.close()


def test_the_python_path_stamps_the_same_table():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    marks = WindowMarks(local_devices=2, devices=mesh.size, native=False)
    try:
        assert marks.native_slot("b0", "fwd") is None
        program, sharding = _marked_program(mesh, marks, ["b0"])
        assert native_marks.TARGET not in program.lower(jnp.zeros((2, 8))).as_text()
        epoch = marks.reset()
        program(jax.device_put(np.zeros((2, 8), np.float32), sharding)).block_until_ready()
        assert marks.wait_open(("b0", "fwd"), epoch, 5.0)
    finally:
        marks.close()


def test_tables_are_bounded_and_released():
    free = len(native_marks._FREE)  # other tests of this process may hold some
    tables = [native_marks.MarkTable(4, 2) for _ in range(free + 1)]
    try:
        assert [t.native for t in tables] == [True] * free + [False]
    finally:
        for t in tables:
            t.close()
    again = native_marks.MarkTable(4, 2)
    assert again.native
    again.close()
    with pytest.raises(ValueError, match="sites >= 1 and devices >= 1"):
        native_marks.MarkTable(0, 2)


def test_a_collective_start_edge_closes_what_opened_before_it():
    """``collective_started``: a collective's start edge (forward ``.begin``,
    backward ``.end``) stamped after ``since`` in this step; an edge that opens
    a span, a boundary or an earlier step's stamp does not count.
    ``collective_starts`` lists this step's start stamps with their queues."""
    marks = WindowMarks(local_devices=1, devices=1, native=False)
    tag = np.zeros(2, np.float32)
    try:
        marks.reset()
        marks.record("b0", "fwd:dispatch.begin", tag)  # an earlier step's
        marks.reset()
        since = time.perf_counter()
        for site in (("b0", "fwd"), ("b0", "fwd:dispatch.end"), ("b1", "bwd:combine.begin")):
            marks.record(*site, tag)
            assert not marks.collective_started(since), site
        assert marks.collective_starts() == []
        marks.record("b1", "bwd:combine.end", tag)  # the backward combine's start
        assert marks.collective_started(since)
        later = time.perf_counter()
        assert not marks.collective_started(later)
        marks._queued = lambda: 1234
        marks.record("b0", "fwd:combine.begin", tag)
        starts = marks.collective_starts()
        assert [q for _, q in starts] == [None, 1234] and starts[0][0] < later < starts[1][0]
    finally:
        marks.close()


def test_a_collective_starts_when_every_local_device_is_in_it():
    """Two local devices: one device at a collective's start edge does not
    close the window (its bytes wait for the other device); both do."""
    marks = WindowMarks(local_devices=2, devices=2, native=False)
    try:
        marks.reset()
        since = time.perf_counter()
        marks.record("b0", "fwd:dispatch.begin", np.array([0, 0], np.float32))
        assert not marks.collective_started(since) and marks.collective_starts() == []
        marks.record("b0", "fwd:dispatch.begin", np.array([1, 0], np.float32))
        assert marks.collective_started(since) and len(marks.collective_starts()) == 1
    finally:
        marks.close()
