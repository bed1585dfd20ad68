"""The in-memory tier inside one process: packing, replication, agreement, donation.

Four CPU devices are split into two simulated hosts (devices 0,1 and 2,3) for
the packing and transport layout; the multi-process behaviour is covered by
tests/test_recovery.py.
"""

import re

import jax
import numpy as np
import pytest

from capricorn_jax._src.memory.store.store import HostStore
from capricorn_jax._src.memory.tier.recovery import choose_version, serve_rounds
from capricorn_jax._src.memory.wire.host_arrays import global_arrays
from capricorn_jax._src.memory.wire.packing import (
    check_compatible,
    decode_trailer,
    encode_trailer,
    make_plan,
    unpack,
)
from capricorn_jax._src.memory.wire.placement import send_rounds
from capricorn_jax._src.memory.wire.transport import Transport, local_rows
from launch.trainer import OptimizerOptions, Trainer, make_mesh
from models import get_config
from tests.tree_utils import assert_trees_equal


@pytest.fixture(scope="module", params=[4, 2], ids=["ep4", "ep2_dp2"])
def trainer(request):
    return Trainer(get_config("tiny"), make_mesh(request.param), OptimizerOptions())


def test_pack_replicate_unpack_roundtrip(trainer):
    state = trainer.init_state(0)
    plan = make_plan(trainer.abstract_state, trainer.state_shardings, trainer.mesh,
                     chunk_bytes=100_000, device_host=[0, 0, 1, 1])
    assert plan.num_chunks > 1  # the transfer really is chunked
    transport = Transport(plan, trainer.mesh, trainer.state_shardings, send_rounds(2, 2), 2)
    own, received, statuses, corrupt = transport.replicate(state, encode_trailer({"h": 7}),
                                                           np.array([3, 4]))
    assert not np.asarray(corrupt[0]).any()  # every chunk passed its end-to-end check
    own_rows, recv_rows = local_rows(own), local_rows(received[0])
    # Host 0's devices received host 1's payloads and vice versa, byte for byte.
    for j in range(2):
        np.testing.assert_array_equal(recv_rows[j], own_rows[2 + j])
        np.testing.assert_array_equal(recv_rows[2 + j], own_rows[j])
    np.testing.assert_array_equal(np.asarray(statuses), [[3, 4]] * 4)
    assert decode_trailer(plan, own_rows[1]) == {"h": 7}
    blocks = {**unpack(plan, 0, own_rows[:2]), **unpack(plan, 1, own_rows[2:])}
    restored = global_arrays(blocks, trainer.abstract_state, trainer.state_shardings, trainer.mesh)
    assert_trees_equal(restored, state, check_sharding=True)


def test_a_byte_flipped_in_transit_fails_exactly_that_chunks_check(trainer):
    """The in-graph exchange checks every chunk end to end: a byte XORed into
    each device's first chunk after its sums were taken (the fault hook's
    input, here on both hosts' rows) fails that chunk's check on the
    receiving device, and only that chunk's; the received bytes differ from
    the sent ones in exactly that byte."""
    state = trainer.init_state(0)
    plan = make_plan(trainer.abstract_state, trainer.state_shardings, trainer.mesh,
                     chunk_bytes=100_000, device_host=[0, 0, 1, 1])
    transport = Transport(plan, trainer.mesh, trainer.state_shardings, send_rounds(2, 2), 2,
                          flip_input=True)
    trailer = encode_trailer({"h": 7})
    own, received, _, corrupt = transport.replicate(state, trailer, np.array([3, 4]), flip=0x10)
    bad = np.stack(local_rows(corrupt[0]))
    assert bad.shape == (4, plan.num_chunks)
    assert bad[:, 0].all() and not bad[:, 1:].any()
    own_rows, recv_rows = local_rows(own), local_rows(received[0])
    lo, hi = plan.chunk_range(0)
    for j, src in ((0, 2), (1, 3), (2, 0), (3, 1)):
        diff = np.flatnonzero(recv_rows[j] != own_rows[src])
        assert diff.tolist() == [lo + (hi - lo) // 2]
        assert recv_rows[j][diff[0]] == own_rows[src][diff[0]] ^ 0x10
    _, _, _, clean = transport.replicate(state, trailer, np.array([3, 4]))
    assert not np.asarray(clean[0]).any()
    with pytest.raises(ValueError, match="flip needs a transport built with flip_input"):
        Transport(plan, trainer.mesh, trainer.state_shardings, send_rounds(2, 2), 2).replicate(
            state, trailer, np.array([3, 4]), flip=1)


def test_each_host_payload_holds_each_unique_byte_once(trainer):
    plan = make_plan(trainer.abstract_state, trainer.state_shardings, trainer.mesh,
                     chunk_bytes=1 << 20, device_host=[0, 0, 1, 1])
    params = trainer.abstract_state["params"]
    expert = sum(x.size * 4 for p, x in jax.tree_util.tree_leaves_with_path(params)
                 if "w_" in jax.tree_util.keystr(p)) * 3  # params + two Adam moments
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_state))
    non_expert = total - expert
    ep = trainer.mesh.shape["expert"]
    # A host stores all non-expert bytes once, plus its share of the experts.
    per_host_state = non_expert + expert * min(2, ep) // ep
    payload_data = 2 * plan.trailer_offset  # two devices per host
    assert per_host_state <= payload_data <= per_host_state + 2 * len(plan.leaves) * 2


def test_restore_into_a_different_tree_names_the_leaf(trainer):
    plan = make_plan(trainer.abstract_state, trainer.state_shardings, trainer.mesh, 1 << 20)
    table = plan.leaf_table()
    bad = [dict(x) for x in table]
    i = next(i for i, x in enumerate(bad) if "w_in" in x["path"])
    bad[i]["shape"] = [1, 2, 3]
    with pytest.raises(ValueError, match=r"w_in.*shape"):
        check_compatible(plan, bad)
    bad = [dict(x) for x in table]
    bad[0]["dtype"] = "float16"
    with pytest.raises(ValueError, match=re.escape(table[0]["path"]) + ".*dtype"):
        check_compatible(plan, bad)
    with pytest.raises(ValueError, match="leaves"):
        check_compatible(plan, table[:-1])
    check_compatible(plan, table)


def test_choose_version_prefers_newest_covered_step_and_own_store():
    # Host 1 lost its store: its data at step 7 lives only on host 0.
    inv = [{0: [6, 7], 1: [6, 7]}, {}]
    assert choose_version(inv, 2) == (7, {0: 0, 1: 0})
    # Host 0 wrote step 8 but nobody else did: 8 is not covered for owner 1.
    inv = [{0: [7, 8], 1: [7]}, {1: [7], 0: [7]}]
    assert choose_version(inv, 2) == (7, {0: 0, 1: 1})
    inv = [{0: [8], 1: [7]}, {1: [8], 0: [7]}]
    assert choose_version(inv, 2) == (8, {0: 0, 1: 1})
    assert choose_version([{0: [3]}, {}], 2) is None
    assert choose_version([{}, {}], 2) is None


def test_serve_rounds_send_once_per_host_per_round():
    rounds = serve_rounds({0: 1, 1: 1, 2: 1, 3: 3})
    assert rounds == [{1: 0}, {1: 2}]
    assert serve_rounds({0: 0, 1: 1}) == []


def test_donated_state_is_not_read_after_donation(trainer, tmp_path):
    """Save, then the next step donates the state: the version holds the right bytes."""
    import capricorn_jax

    opts = capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="j", replicas=1)
    ckpt = capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1)
    batch = trainer.global_batch(np.random.default_rng(0).integers(0, 256, (16, 65), np.int32))
    step = trainer.step_fn((2.0, 2.0))
    state, _ = step(trainer.init_state(0), batch)
    expected = jax.tree.map(np.array, state)
    ckpt.save(1, state, {"data": {"step": 1}})
    old_leaves = jax.tree.leaves(state)
    state, _ = step(state, batch)  # donates the saved state's buffers
    assert all(x.is_deleted() for x in old_leaves)
    ckpt.wait_until_finished(60)
    rows = [np.frombuffer(b"".join(ckpt.store.read_chunk(0, 1, f"d{j}.c{k}")
                                   for k in range(ckpt.plan.num_chunks)), np.uint8)
            for j in range(4)]
    restored = global_arrays(unpack(ckpt.plan, 0, rows), trainer.abstract_state,
                        trainer.state_shardings, trainer.mesh)
    assert_trees_equal(restored, expected)
    ckpt.close()


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host", "device"])
def test_payload_leaves_through_each_host_memory_kind_in_parallel_chunks(trainer, tmp_path,
                                                                         kind):
    """The payload put in pinned or unpinned host memory (the accelerator path,
    forced on CPU) or copied from device memory, written as many chunk files by
    3 threads: every chunk's CRC matches and recover() returns the state bitwise."""
    import capricorn_jax

    opts = capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="j", replicas=1,
                                         chunk_bytes=64 << 10, host_memory_kind=kind,
                                         write_threads=3)
    ckpt = capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1)
    assert ckpt._memory_kind == (None if kind == "device" else kind)
    state = trainer.init_state(3)
    expected = jax.tree.map(np.array, state)
    ckpt.save(5, state, {"data": {"step": 5}})
    ckpt.wait_until_finished(60)
    assert ckpt.plan.num_chunks > 8
    assert ckpt.store.verify(0, 5)
    ckpt.close()
    again = capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1)
    got, info = capricorn_jax.recover(again)
    again.close()
    assert info.step == 5 and info.host_state == {"data": {"step": 5}}
    assert info.tier == "memory" and info.memory_tiers == ["local"]
    assert_trees_equal(got, expected)


def test_host_memory_options_name_the_bad_value(tmp_path):
    import capricorn_jax

    with pytest.raises(ValueError, match="host_memory_kind.*'gpu'"):
        capricorn_jax.InMemoryOptions(str(tmp_path), "j", host_memory_kind="gpu")
    with pytest.raises(ValueError, match="write_threads must be >= 1, got 0"):
        capricorn_jax.InMemoryOptions(str(tmp_path), "j", write_threads=0)


@pytest.mark.parametrize("window", [1, 2])
def test_safe_version_and_the_versions_kept_follow_the_saves(trainer, tmp_path, window):
    """One host, writers drained after each save: save k adopts the versions
    held at save k-1, so the safe version is k-2 and the store keeps k-2, k-1
    and k (the window only matters while writers lag). A recovery abandons
    the versions after the one it restores (here the newest fails its
    checksum)."""
    import capricorn_jax

    opts = capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="j", replicas=1,
                                         window=window)

    def checkpointer():
        return capricorn_jax.InMemoryCheckpointer(
            opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1)

    ckpt, state = checkpointer(), trainer.init_state(0)
    for k in range(1, 8):
        report = ckpt.save(k, state, {"data": {"step": k}})
        ckpt.wait_until_finished(60)
        assert report.safe_version == report.replicated == (k - 2 if k >= 3 else -1)
        assert ckpt.store.versions(0) == [v for v in (k - 2, k - 1, k) if v >= 1]
    ckpt.close()
    store = HostStore(tmp_path / "j" / "host0")
    store.chunk_view(0, 7, "d0.c0")[0] ^= 0xFF  # the newest version's first byte
    store.close()
    fresh = checkpointer()
    _, recovered = capricorn_jax.recover(fresh)
    assert recovered.step == 6 and fresh.store.versions(0) == [5, 6]
    fresh.close()


def test_the_store_holds_a_bounded_number_of_slots(trainer, tmp_path):
    """Many saves through the real checkpointer: every owner's arena stays at
    the versions the keep rule keeps (the safe one, ``window`` candidates, the
    newest) plus the one being written, each slot sized to one version and
    reused, so the store's size stops growing after the first saves."""
    import capricorn_jax

    opts = capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="j", replicas=1)
    ckpt = capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1)
    state = trainer.init_state(0)
    owner_dir = tmp_path / "j" / "host0" / "owner0"
    slot_size = -(-4 * ckpt.plan.payload_bytes // 64) * 64  # four device rows, aligned
    slots, sizes = [], []
    for step in range(1, 13):
        report = ckpt.save(step, state, {"data": {"step": step}})
        ckpt.wait_until_finished(60)
        slots.append(len(list(owner_dir.glob("slot*.data"))))
        sizes.append(report.store_bytes)
        assert len(ckpt.store.versions(0)) <= opts.window + 2
    # The bound: window + 2 kept versions, one being written. One host holds
    # at most the safe version and the newest (no candidates lag between
    # them) plus the one being written: three slots, reused from save 3 on.
    assert max(slots) <= opts.window + 3
    assert slots == [1, 2] + [3] * 10
    # store_bytes is sampled as a save begins, before its version is written.
    assert sizes == [0, slot_size, 2 * slot_size] + [3 * slot_size] * 9
    assert ckpt.store.bytes_held() == 3 * slot_size
    ckpt.close()


def test_a_cost_budget_skips_whole_versions_while_the_writer_lags(trainer, tmp_path):
    """InMemoryOptions.max_wait_s: a save after one whose statuses showed a busy
    writer takes no version (nothing written, ``skipped``); the versions taken
    are whole, and ``interval`` is the steps between them. The writer is held
    on an event, so the schedule is exact."""
    import threading

    import capricorn_jax

    opts = capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="j", replicas=1,
                                         max_wait_s=0.0)
    ckpt = capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1)
    release, entered, begin = threading.Event(), threading.Event(), ckpt.store.begin

    def held_begin(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        return begin(*args, **kwargs)

    ckpt.store.begin = held_begin
    state = trainer.init_state(0)
    reports = {}
    for step in (1, 2, 3, 4):  # 1 is being written (held); 2 waits in the queue
        reports[step] = ckpt.save(step, state, {"data": {"step": step}})
        if step == 1:  # the writer holds 1 before 2 is queued (else 2 finds it full)
            assert entered.wait(60)
    release.set()
    ckpt.wait_until_finished(60)
    for step in (5, 6):  # 5 reads 4's statuses (busy); 6 reads 5's (idle)
        reports[step] = ckpt.save(step, state, {"data": {"step": step}})
    ckpt.wait_until_finished(60)
    assert {s: r.skipped for s, r in reports.items()} == {
        1: False, 2: False, 3: True, 4: True, 5: True, 6: False}
    assert {s: r.interval for s, r in reports.items()} == {
        1: None, 2: 1, 3: None, 4: None, 5: None, 6: 4}
    assert ckpt.store.versions(0) == [2, 6]  # the keep rule: safe (2) and newest
    assert all(r.bytes == 0 for s, r in reports.items() if r.skipped)
    # Commit accounting: each version taken is reported committed once, after
    # its writer finished (1 and 2 at save 6, which reads save 5's statuses;
    # 6 at the final status round).
    assert {s: r.newly_committed for s, r in reports.items()} == {
        1: [], 2: [], 3: [], 4: [], 5: [], 6: [1, 2]}
    final = ckpt.confirm(60)
    assert final.newly_committed == [6] and final.safe_version == 6
    ckpt.close()
    fresh = capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1)
    assert capricorn_jax.recover(fresh)[1].step == 6
    fresh.close()


def test_a_status_round_run_by_the_caller_commits_and_skips_as_the_save_s_own(trainer,
                                                                              tmp_path):
    """save_transferred(status_round=...): the caller took begin_round's status
    vector and all-gathered it in a program of its own (ChannelReplication:
    inside the pack); the budget's skips, the intervals and the commit
    accounting are those of the cost-budget test above, where each save runs
    its own round, and the last version restores."""
    import threading

    import capricorn_jax
    from capricorn_jax._src.scheduling.threaded.sender import pack_program

    opts = capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="j", replicas=1,
                                         max_wait_s=0.0)
    ckpt = capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1)
    release, entered, begin = threading.Event(), threading.Event(), ckpt.store.begin

    def held_begin(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        return begin(*args, **kwargs)

    ckpt.store.begin = held_begin
    state = trainer.init_state(0)
    pack = pack_program(ckpt.transport, trainer.state_shardings)
    reports = {}

    def save(step):
        own = pack(state, ckpt.trailer_rows({"data": {"step": step}}))
        report, status = ckpt.begin_round()
        statuses = ckpt.transport.gather_status(status)  # the caller's round
        reports[step] = ckpt.save_transferred(step, own, [], status_round=(report, statuses))

    for step in (1, 2, 3, 4):
        save(step)
        if step == 1:  # the writer holds 1 before 2 is queued (else 2 finds it full)
            assert entered.wait(60)
    release.set()
    ckpt.wait_until_finished(60)
    for step in (5, 6):
        save(step)
    ckpt.wait_until_finished(60)
    assert {s: r.skipped for s, r in reports.items()} == {
        1: False, 2: False, 3: True, 4: True, 5: True, 6: False}
    assert {s: r.interval for s, r in reports.items()} == {
        1: None, 2: 1, 3: None, 4: None, 5: None, 6: 4}
    assert {s: r.newly_committed for s, r in reports.items()} == {
        1: [], 2: [], 3: [], 4: [], 5: [], 6: [1, 2]}
    final = ckpt.confirm(60)
    assert final.newly_committed == [6] and final.safe_version == 6
    ckpt.close()
    fresh = capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1)
    assert capricorn_jax.recover(fresh)[1].step == 6
    fresh.close()


def test_a_received_payload_of_the_wrong_shape_is_refused_by_name(trainer, tmp_path):
    """save_transferred takes the threaded path's receive buffer (numpy, this
    host's rows) as is; one that does not fit the plan is refused, nothing queued."""
    import capricorn_jax

    opts = capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="j", replicas=2)
    ckpt = capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 2,
        device_host=[0, 0, 1, 1])
    bad = np.zeros((2, ckpt.plan.payload_bytes + 1), np.uint8)
    with pytest.raises(ValueError, match=re.escape(
            f"shape (2, {ckpt.plan.payload_bytes + 1}); version 1 needs "
            f"(2, {ckpt.plan.payload_bytes})")):
        ckpt.save_transferred(1, None, [bad])
    assert ckpt.writers.own_q.unfinished_tasks == 0 and ckpt.writers.rep_q.unfinished_tasks == 0
    ckpt.close()


def test_the_status_note_of_host_0_is_agreed_one_save_later(trainer, tmp_path):
    """A caller's note (``note_status``) travels in the save's status round; agreed_note is
    host 0's note of the previous round (no collective of its own)."""
    import capricorn_jax

    opts = capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="j", replicas=1)
    ckpt = capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1)
    state = trainer.init_state(0)
    assert ckpt.agreed_note is None
    ckpt.note_status(2003)
    ckpt.save(1, state, {"data": {"step": 1}})
    assert ckpt.agreed_note is None  # the first round is read by the next save
    ckpt.note_status(2004)
    ckpt.save(2, state, {"data": {"step": 2}})
    assert ckpt.agreed_note == 2003
    ckpt.save(3, state, {"data": {"step": 3}})
    assert ckpt.agreed_note == 2004
    ckpt.close()


def test_fault_hooks_pause_the_replica_writer_halfway_and_stall_it(trainer, tmp_path, caplog):
    """The test-only hooks reach the writers: at the pause version the replica
    writer stops halfway and calls on_pause (here it blocks there, so the
    next version queues and the one after is dropped, the writer being
    busy); the stall sleeps before its version's replicas. The options hold
    no fault field."""
    import logging
    import threading
    import time

    import capricorn_jax
    from capricorn_jax.experimental import FaultHooks

    assert not {"stall_replica_writer_at", "pause_mid_replication_at"} & {
        f.name for f in __import__("dataclasses").fields(capricorn_jax.InMemoryOptions)}
    release, paused = threading.Event(), []

    def on_pause(version):
        paused.append((version, threading.current_thread().name))
        release.wait(60)

    hooks = FaultHooks(stall_replica_writer_at=(2, 0.01), pause_mid_replication_at=1,
                       on_pause=on_pause)
    opts = capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="j", replicas=2,
                                         chunk_bytes=4096)
    ckpt = capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 2,
        device_host=[0, 0, 1, 1], hooks=hooks)
    assert ckpt.plan.num_chunks > 1  # so halfway is a point between chunks

    def rows():
        return np.zeros((2, ckpt.plan.payload_bytes), np.uint8)

    caplog.set_level(logging.WARNING)
    assert ckpt.save_transferred(1, rows(), [rows()]).dropped_replicas == 0
    deadline = time.monotonic() + 60
    while not paused and time.monotonic() < deadline:
        time.sleep(0.01)
    assert paused == [(1, "ckpt-replica-writer")]
    assert ckpt.save_transferred(2, rows(), [rows()]).dropped_replicas == 0  # queued
    assert ckpt.save_transferred(3, rows(), [rows()]).dropped_replicas == 1  # writer busy
    release.set()
    ckpt.wait_until_finished(60)
    assert paused == [(1, "ckpt-replica-writer")]
    assert ckpt.store.versions(1) == [1, 2]
    assert "replica writer stalls 0.0s at step 2" in caplog.text
    ckpt.close()


def test_fault_hooks_name_a_bad_value():
    from capricorn_jax.experimental import FaultHooks

    with pytest.raises(ValueError, match="pause_mid_replication_at=3 needs on_pause"):
        FaultHooks(pause_mid_replication_at=3)
    with pytest.raises(ValueError, match=r"stall_replica_writer_at must be \(step, seconds >= 0\)"):
        FaultHooks(stall_replica_writer_at=(1, -1.0))
    assert not FaultHooks(on_pause=print).pauses_at(3)


def test_a_dropped_version_is_never_committed_and_the_next_is(trainer, tmp_path):
    """drop(): a version whose peer payload failed its end-to-end check is
    not taken on this host; its status round still runs, the safe version
    stays the one before, and the next version commits (replicas=1: this
    host holds everything, so "everywhere" is here)."""
    import capricorn_jax
    from capricorn_jax._src.scheduling.threaded.sender import pack_program

    opts = capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="j", replicas=1)
    ckpt = capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1)
    state = trainer.init_state(0)
    pack = pack_program(ckpt.transport, trainer.state_shardings)
    first = ckpt.save_transferred(1, pack(state, ckpt.trailer_rows({"data": {"step": 1}})), [])
    ckpt.wait_until_finished(60)
    dropped = ckpt.drop(2)
    assert dropped.corrupt and dropped.skipped and not first.corrupt
    ckpt.wait_until_finished(60)
    third = ckpt.save_transferred(3, pack(state, ckpt.trailer_rows({"data": {"step": 3}})), [])
    ckpt.wait_until_finished(60)
    report = ckpt.confirm(60)
    committed = set(first.newly_committed + dropped.newly_committed + third.newly_committed
                    + report.newly_committed)
    assert 2 not in committed and {1, 3} <= committed
    assert report.safe_version == 3
    ckpt.close()
