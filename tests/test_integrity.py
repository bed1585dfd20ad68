"""One integrity rule on every path (``native.integrity``): a corrupt frame
header, a payload flip, a corrupt byte on the in-step (GPU) path, two
flips that cancel in word sums, and received ranges that are not the
schedule's are each detected, and the version is not taken.

The channel tests run real loopback connections; the in-graph ones run the
exchange and the in-step sender on the 4 forced CPU devices as 2 hosts,
with a transport whose ``permute`` corrupts what it carries."""

import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from capricorn_jax._src.memory.wire.packing import encode_trailer
from capricorn_jax._src.memory.wire.transport import Transport, local_rows
from capricorn_jax._src.native import integrity
from capricorn_jax._src.scheduling.threaded.chunk_channel import CorruptFrame
from capricorn_jax._src.scheduling.threaded.versions import VersionDropped
from tests.test_deadline_sender import _close, _marks, _schedule, _senders, _start
from tests.test_threaded import _pair


@given(st.binary(min_size=0, max_size=300))
@settings(max_examples=40, deadline=None)
def test_the_in_graph_crc_is_crc32c(data):
    rows = np.frombuffer(data * 2, np.uint8).reshape(2, -1) if data else np.zeros((2, 0),
                                                                                   np.uint8)
    got = np.asarray(integrity.crc32c_rows(jnp.asarray(rows)))
    assert list(got) == [integrity.crc32c(r.tobytes()) for r in rows]


def _old_sums(chunk: np.ndarray) -> tuple[int, int]:
    """The in-graph check before this rule: the sum of the chunk's 32-bit
    words and of each word times its position (from 1), mod 2**32."""
    words = np.frombuffer(np.pad(chunk, (0, -chunk.size % 4)).tobytes(), "<u4").astype(np.uint64)
    at = np.arange(1, words.size + 1, dtype=np.uint64)
    return int(words.sum() % 2**32), int((words * at).sum() % 2**32)


def _cancelling(chunk: np.ndarray) -> np.ndarray:
    """``chunk`` with the top bit of words 0 and 2 flipped (same parity)."""
    out = chunk.copy()
    out[3] ^= 0x80
    out[11] ^= 0x80
    return out


def test_two_top_bits_flipped_at_indices_of_the_same_parity_are_caught():
    chunk = np.random.default_rng(0).integers(0, 256, 4096, np.uint8)
    bad = _cancelling(chunk)
    assert _old_sums(chunk) == _old_sums(bad)  # the word sums could not see it
    before, after = integrity.crc32c_chunks(jnp.asarray(np.stack([chunk, bad]).reshape(-1)),
                                            chunk.size)
    assert int(before) != int(after)


class _Corrupting(Transport):
    """A transport whose ``permute`` flips two top bits (``_cancelling``) of the first uint8
    array it carries in each traced program (a NIC that corrupts one
    chunk), after the sender's checksum was taken."""

    def permute(self, x, perm):
        y = super().permute(x, perm)
        if x.dtype == jnp.uint8 and not getattr(self, "_hit", False):
            self._hit = True
            y = y.at[..., 3].set(y[..., 3] ^ 0x80).at[..., 11].set(y[..., 11] ^ 0x80)
        return y


@pytest.fixture(scope="module")
def tiny():
    from tests.helpers import two_host_transport

    trainer, plan, _ = two_host_transport()
    from capricorn_jax._src.memory.wire.placement import send_rounds

    corrupting = _Corrupting(plan, trainer.mesh, trainer.state_shardings, send_rounds(2, 2), 3)
    clean = Transport(plan, trainer.mesh, trainer.state_shardings, send_rounds(2, 2), 3)
    return trainer, plan, corrupting, clean


def test_two_cancelling_flips_in_the_in_graph_exchange_fail_that_chunks_check(tiny):
    trainer, plan, corrupting, _ = tiny
    _, received, _, corrupt = corrupting.replicate(trainer.init_state(0),
                                                   encode_trailer({}), np.zeros(3))
    bad = np.stack(local_rows(corrupt[0]))
    assert bad[:, 0].all() and not bad[:, 1:].any()


def _in_step(trainer, transport, plan):
    """The in-step sender's begin and finish alone (no train step): its
    start window's chunks and the tail, as the GPU path moves them."""
    from capricorn_jax._src.scheduling.in_graph.executor import InStepSender
    from capricorn_jax._src.scheduling.plan.partitioner import LinkModel, Window, partition

    schedule = partition(plan.payload_bytes, [Window("block0", "fwd", 1e-3)],
                         LinkModel(0.0, 2e8), chunk_cap=100_000)
    assert schedule.tail and schedule.chunks[0]
    sender = InStepSender(transport, trainer.state_shardings, schedule, trainer.boundaries)
    trailer = transport.rows_of(encode_trailer({"data": 7}), np.uint8)

    @jax.jit
    def move(state, trailer):
        return sender.finish(sender.begin(state, trailer), [], [])

    return move(trainer.init_state(0), trailer)


def test_a_corrupt_byte_on_the_in_step_path_fails_its_crc_and_the_writer_stores_nothing(tiny):
    from capricorn_jax._src.memory.tier.writers import _failed_chunks

    trainer, plan, corrupting, clean = tiny
    good = _in_step(trainer, clean, plan)
    assert not np.asarray(good["corrupt"]).any()
    np.testing.assert_array_equal(np.asarray(local_rows(good["received"])[0]),
                                  np.asarray(local_rows(good["own"])[2]))
    corrupting._hit = False
    out = _in_step(trainer, corrupting, plan)
    assert np.asarray(out["corrupt"]).all()  # every device's peer payload, both hosts
    # The verdict the strategy hands to save_transferred: the replica writer
    # reads it as the exchange's and stores no replica of that version.
    assert _failed_chunks(out["corrupt"]) == [(0, 0), (1, 0), (2, 0), (3, 0)]


def test_save_transferred_hands_the_in_step_verdict_to_the_replica_writer():
    import inspect

    from capricorn_jax._src.memory.tier.checkpointer import InMemoryCheckpointer
    from capricorn_jax._src.strategies import scheduled

    assert "corrupt" in inspect.signature(InMemoryCheckpointer.save_transferred).parameters
    assert "corrupt=None if moved.corrupt is None else [moved.corrupt]" in \
        inspect.getsource(scheduled)


class _HeaderFlipper:
    """A socket whose ``sendmsg`` flips bit ``bit`` of header field
    ``field`` (0 version, 1 offset, 2 length, 3 rows) of the ``nth`` header
    sent, and sends every byte."""

    def __init__(self, sock, nth, field=1, bit=3):
        self.sock, self.nth, self.count = sock, nth, 0
        self.at = 8 * field + bit // 8
        self.mask = 1 << (bit % 8)

    def sendmsg(self, buffers):
        sent = 0
        for data in buffers:
            view = memoryview(data).cast("B")
            if len(view) == integrity.HEADER_BYTES:
                self.count += 1
                if self.count == self.nth:
                    view = memoryview(bytearray(view))
                    view[self.at] ^= self.mask
            self.sock.sendall(view)
            sent += len(view)
        return sent

    def __getattr__(self, name):
        return getattr(self.sock, name)


@pytest.mark.parametrize("native_receive", [False, True], ids=["python", "native"])
def test_a_flipped_offset_bit_in_a_frame_header_is_caught_and_the_version_not_taken(
        native_receive):
    """Before: the frame's rows landed 8 bytes off, its checksum (of the rows
    alone) passed, the byte count added up and ``wait`` returned a payload
    with a range never written."""
    from capricorn_jax._src.native import frames as native_frames

    if native_receive and not native_frames.available():
        pytest.skip("no C++ compiler")
    mesh, senders = _senders()
    try:
        senders[1].native_receive = native_receive
        senders[0].native_send = False  # the flipper corrupts what Python's socket sends
        senders[0].channel.out = _HeaderFlipper(senders[0].channel.out, nth=2)
        _start(mesh, senders, 1, _schedule(10.0, 10.0))
        _marks(senders, 0.05)
        with pytest.raises((RuntimeError, VersionDropped)) as e:
            senders[1].wait(1, 20.0)
        assert isinstance(e.value.__cause__, integrity.CorruptHeader)
        assert "header fails its checksum" in str(e.value.__cause__)
    finally:
        _close(senders)


def test_a_flipped_payload_bit_is_caught_by_the_crc32c_over_header_and_rows():
    a, b = _pair(10.0)
    try:
        rows = np.random.default_rng(3).integers(0, 256, (2, 1000), np.uint8)
        header = integrity.pack_header(7, 0, 1000, [r.tobytes() for r in rows])
        fields = header[:integrity.FIELD_BYTES]
        assert struct.unpack_from("<I", header, integrity.FIELD_BYTES)[0] == integrity.crc32c(
            fields + rows.tobytes())  # the header's fields are inside the frame's check
        a.flip_version = 7
        a.send(7, 0, rows)
        sink = np.zeros((2, 1000), np.uint8)
        with pytest.raises(CorruptFrame, match="fails its checksum \\(CRC32C"):
            b.receive_into(lambda v: sink)
    finally:
        a.close()
        b.close()


def test_a_version_whose_ranges_are_not_the_schedules_is_refused_though_its_bytes_add_up():
    """Frames [0, 1000) and [500, 1500) of a version scheduled as [0, 2000):
    2000 bytes arrived (the count of before), [1500, 2000) never did."""
    from capricorn_jax._src.scheduling.plan.partitioner import LinkModel, Window, partition

    mesh, senders = _senders()
    try:
        schedule = partition(2000, [Window("b0", "fwd", 1.0)], LinkModel(0.0, 1e9), 4096)
        data = np.random.default_rng(0).integers(0, 256, (1, 2000), np.uint8)
        senders[1].start(1, jax.device_put(data, NamedSharding(mesh, P("x"))), schedule)
        channel = senders[0].channel
        channel.send(1, 0, data[:, :1000])
        channel.send(1, 500, data[:, 500:1500])
        _marks(senders[1:], 0.05)  # host 1 sends its own (host 0 discards them)
        with pytest.raises(VersionDropped, match="overlap a range already received"):
            senders[1].wait(1, 10.0)
    finally:
        _close(senders)


def test_coverage_counts_ranges_not_bytes():
    cover = integrity.Coverage([(0, 100), (200, 300)])
    assert cover.add(0, 100) and not cover.add(0, 100)  # a resend counts once
    with pytest.raises(ValueError, match="not in the schedule"):
        cover.add(100, 200)  # the count would add up; the range is not scheduled
    assert not cover.complete and cover.missing == 100
    assert cover.add(200, 250) and cover.add(250, 300) and cover.complete
