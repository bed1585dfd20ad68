"""The host store (a shared-memory arena): commit protocol, slot reuse, torn
versions, checksums, row reads, isolation."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capricorn_jax._src.memory.store.store import (
    ChecksumError,
    HostStore,
    StoreIsolationError,
    VersionGone,
)
from launch.train.faults import corrupt_newest_own_chunk


def _chunks(seed: int, sizes: list[int]) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    return {f"d0.c{i}": rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            for i, n in enumerate(sizes)}


def _write(store: HostStore, owner: int, step: int, chunks: dict[str, bytes],
           meta: dict | None = None, nbytes: int = 0) -> None:
    w = store.begin(owner, step, nbytes)
    for name, data in chunks.items():
        w.write_chunk(name, data)
    w.commit(meta or {"fingerprint": "x"})


def test_round_trip_and_metadata(tmp_path):
    store = HostStore(tmp_path / "h0")
    chunks = _chunks(0, [1000, 64, 1])
    _write(store, 1, 7, chunks, {"host_state": {"data": 3}})
    assert store.owners() == [1]
    assert store.versions(1) == [7]
    assert store.manifest(1, 7)["host_state"] == {"data": 3}
    for name, data in chunks.items():
        assert bytes(store.read_chunk(1, 7, name)) == data
    assert store.verify(1, 7)


def test_uncommitted_version_is_invisible_and_reported_on_reopen(tmp_path):
    store = HostStore(tmp_path / "h0")
    _write(store, 0, 1, _chunks(1, [100]))
    w = store.begin(0, 2)
    w.write_chunk("d0.c0", b"abc")  # the writer dies here: no commit
    assert store.versions(0) == [1]
    again = HostStore(tmp_path / "h0")
    assert again.versions(0) == [1]
    assert again.removed_partials == ["owner0/v000000000002 (slot 1)"]
    assert again.removed_partials == again.removed_partials  # listed once
    assert HostStore(tmp_path / "h0").removed_partials == []


def test_crash_after_the_head_keeps_the_version(tmp_path):
    store = HostStore(tmp_path / "h0")
    _write(store, 0, 4, _chunks(2, [10]))
    # The writer renamed the head into place and died before removing its marker.
    (tmp_path / "h0" / "owner0" / "slot0.writing").write_text("4")
    again = HostStore(tmp_path / "h0")
    assert again.versions(0) == [4] and again.removed_partials == []
    assert again.verify(0, 4)


def test_pruned_slots_are_reused_without_growing(tmp_path):
    store = HostStore(tmp_path / "h0")
    sizes = [4096, 4096]
    for step in range(3):
        _write(store, 0, step, _chunks(step, sizes), nbytes=8192)
    held = store.bytes_held()
    for step in range(3, 30):
        store.prune(0, keep={step - 1, step - 2})
        _write(store, 0, step, _chunks(step, sizes), nbytes=8192)
        assert store.versions(0) == [step - 2, step - 1, step]
    assert store.bytes_held() == held  # three slots, reused
    assert bytes(store.read_chunk(0, 29, "d0.c1")) == _chunks(29, sizes)["d0.c1"]


def test_flipped_byte_is_detected(tmp_path):
    store = HostStore(tmp_path / "h0")
    _write(store, 0, 1, _chunks(3, [256, 256]))
    entry = store.manifest(0, 1)["chunks"]["d0.c1"]
    path = tmp_path / "h0" / "owner0" / "slot0.data"
    data = bytearray(path.read_bytes())
    data[entry["offset"] + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    fresh = HostStore(tmp_path / "h0")
    assert not fresh.verify(0, 1)
    assert bytes(fresh.read_chunk(0, 1, "d0.c0")) == _chunks(3, [256, 256])["d0.c0"]
    with pytest.raises(ChecksumError, match="d0.c1"):
        fresh.read_chunk(0, 1, "d0.c1")


def test_rewriting_a_step_replaces_it(tmp_path):
    store = HostStore(tmp_path / "h0")
    _write(store, 0, 5, _chunks(4, [8]))
    _write(store, 0, 5, _chunks(5, [8]))
    assert store.versions(0) == [5]
    assert bytes(store.read_chunk(0, 5, "d0.c0")) == _chunks(5, [8])["d0.c0"]


def test_reading_a_version_whose_slot_was_reused_says_so(tmp_path):
    store = HostStore(tmp_path / "h0")
    _write(store, 0, 1, _chunks(6, [512]))
    manifest = store.manifest(0, 1)
    store.remove(0, 1)
    _write(store, 0, 2, _chunks(7, [512]))  # lands in the freed slot
    with pytest.raises(VersionGone):
        store.read_chunk(0, 1, "d0.c0", manifest)
    with pytest.raises(VersionGone):
        store.manifest(0, 1)


def test_parallel_chunk_writes(tmp_path):
    store = HostStore(tmp_path / "h0")
    chunks = _chunks(8, [1 << 16] * 16)
    w = store.begin(0, 1, nbytes=len(chunks) << 16)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda item: w.write_chunk(*item), chunks.items()))
    w.commit({})
    assert store.verify(0, 1)
    other = HostStore(tmp_path / "h0")  # e.g. the successor process
    assert all(bytes(other.read_chunk(0, 1, n)) == d for n, d in chunks.items())


def test_a_slot_grown_by_another_store_object_is_read_in_full(tmp_path):
    reader = HostStore(tmp_path / "h0")
    writer = HostStore(tmp_path / "h0")
    _write(writer, 0, 1, _chunks(9, [64]))
    assert bytes(reader.read_chunk(0, 1, "d0.c0")) == _chunks(9, [64])["d0.c0"]
    writer.remove(0, 1)
    _write(writer, 0, 2, _chunks(10, [1 << 20]))  # grows slot 0
    assert bytes(reader.read_chunk(0, 2, "d0.c0")) == _chunks(10, [1 << 20])["d0.c0"]


def test_paths_outside_the_root_are_refused(tmp_path):
    store = HostStore(tmp_path / "h0")
    with pytest.raises(StoreIsolationError):
        store._path("..", "h1", "owner0")
    w = store.begin(0, 1)
    with pytest.raises(ValueError, match="bad chunk name"):
        w.write_chunk("../../h1/evil", b"1")
    with pytest.raises(ValueError, match="negative offset"):
        w.write_chunk("d0.c0", b"1", offset=-1)
    assert not os.path.exists(tmp_path / "h1")


def test_wipe_empties_the_store(tmp_path):
    store = HostStore(tmp_path / "h0")
    _write(store, 0, 1, _chunks(11, [32]))
    store.wipe()
    assert store.owners() == [] and store.bytes_held() == 0
    assert os.path.isdir(tmp_path / "h0")


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["write", "abort", "prune"]),
                          st.integers(1, 5000)), min_size=1, max_size=25))
def test_what_is_read_is_what_was_committed(tmp_path_factory, ops):
    """Against a dict model: committed versions read back exactly; aborted
    ones never appear; pruning keeps the newest two."""
    store = HostStore(tmp_path_factory.mktemp("arena") / "h0")
    model: dict[int, bytes] = {}
    step = 0
    for op, size in ops:
        step += 1
        data = np.random.default_rng(step).integers(0, 256, size, dtype=np.uint8).tobytes()
        if op == "write":
            _write(store, 0, step, {"d0.c0": data})
            model[step] = data
        elif op == "abort":
            w = store.begin(0, step)
            w.write_chunk("d0.c0", data)
            w.abort()
        else:
            keep = set(sorted(model)[-2:])
            store.prune(0, keep)
            model = {k: v for k, v in model.items() if k in keep}
        assert store.versions(0) == sorted(model)
    for s, data in model.items():
        assert bytes(store.read_chunk(0, s, "d0.c0")) == data


def _flip(root, owner: int, slot: int, offset: int) -> None:
    """Flips one byte of a slot file behind the store's back (RAM bit rot)."""
    path = root / f"owner{owner}" / f"slot{slot}.data"
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_commit_makes_a_version_visible(tmp_path):
    store = HostStore(tmp_path / "h0")
    w = store.begin(0, 5, 7)
    w.write_chunk("d0.c0", b"abc")
    w.write_chunk("d0.c1", b"defg")
    assert store.versions(0) == []  # not committed yet: invisible
    w.commit({"host_state": {"x": 1}})
    assert store.versions(0) == [5]
    m = store.manifest(0, 5)
    assert m["host_state"] == {"x": 1} and set(m["chunks"]) == {"d0.c0", "d0.c1"}
    assert bytes(store.read_chunk(0, 5, "d0.c1")) == b"defg"
    assert store.bytes_held() == 128  # chunks placed by the store start 64-byte aligned


def test_corrupted_chunk_is_named(tmp_path):
    store = HostStore(tmp_path / "h0")
    _write(store, 1, 3, {"d0.c0": b"x" * 100})
    _flip(tmp_path / "h0", 1, 0, 10)
    with pytest.raises(ChecksumError, match="owner1/v000000000003/d0.c0: checksum mismatch"):
        store.read_chunk(1, 3, "d0.c0")
    assert not store.verify(1, 3)


def test_prune_keeps_what_is_asked(tmp_path):
    store = HostStore(tmp_path / "h0")
    for step in (1, 2, 3):
        _write(store, 0, step, _chunks(step, [16]))
    store.prune(0, {1, 3})
    assert store.versions(0) == [1, 3]
    assert len(list((tmp_path / "h0" / "owner0").glob("slot*.data"))) == 3  # kept for reuse
    _write(store, 0, 4, _chunks(4, [16]))
    assert store.versions(0) == [1, 3, 4]
    assert len(list((tmp_path / "h0" / "owner0").glob("slot*.data"))) == 3  # the freed one


def test_aborted_version_frees_its_slot(tmp_path):
    store = HostStore(tmp_path / "h0")
    w = store.begin(0, 1, 64)
    w.write_chunk("d0.c0", b"x" * 64)
    w.abort()
    assert store.versions(0) == []
    _write(store, 0, 2, {"d0.c0": b"y" * 64})
    assert store.manifest(0, 2)["slot"] == 0


def test_read_chunk_into_fills_the_buffer_and_checks_it(tmp_path):
    store = HostStore(tmp_path / "h0")
    _write(store, 0, 3, {"d0.c0": b"abc", "d0.c1": b"defg"})
    out = bytearray(b"xx" + b"\0" * 4 + b"yy")
    store.read_chunk_into(0, 3, "d0.c1", memoryview(out)[2:6])
    assert bytes(out) == b"xxdefgyy"
    with pytest.raises(ChecksumError, match="d0.c1: size 3 != 4"):  # a buffer of the wrong size
        store.read_chunk_into(0, 3, "d0.c1", memoryview(bytearray(3)))
    _flip(tmp_path / "h0", 0, 0, store.manifest(0, 3)["chunks"]["d0.c1"]["offset"] + 1)
    with pytest.raises(ChecksumError, match="d0.c1: checksum mismatch"):
        store.read_chunk_into(0, 3, "d0.c1", memoryview(bytearray(4)))


def test_rows_placed_by_offset_are_read_with_one_copy(tmp_path):
    """The checkpointer's placement: row j at j * payload, its chunks back to
    back, written out of order from several threads."""
    store = HostStore(tmp_path / "h0")
    payload, chunk = 1000, 300
    rows = [np.random.default_rng(j).integers(0, 256, payload, dtype=np.uint8) for j in range(3)]
    names = [(j, k) for j in range(3) for k in range(4)]
    w = store.begin(0, 1, 3 * payload)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda n: w.write_chunk(
            f"d{n[0]}.c{n[1]}", rows[n[0]][n[1] * chunk:(n[1] + 1) * chunk],
            offset=n[0] * payload + n[1] * chunk), reversed(names)))
    w.commit({})
    assert store.bytes_held() == 3008  # sized once by begin, never grown
    for j in range(3):
        row_names = [f"d{j}.c{k}" for k in range(4)]
        out = np.empty(payload, np.uint8)
        store.read_span_into(0, 1, row_names, out)
        assert np.array_equal(out, rows[j])
        view = store.span_view(0, 1, row_names)
        assert np.array_equal(view, rows[j]) and not view.flags.owndata
        store.check_span(0, 1, row_names, view)
    with pytest.raises(ValueError, match="d0.c2 is not contiguous"):
        store.span_view(0, 1, ["d0.c0", "d0.c2"])
    with pytest.raises(ChecksumError, match="d1.c0: size 999 != 1000"):
        store.read_span_into(0, 1, [f"d1.c{k}" for k in range(4)], np.empty(999, np.uint8))
    _flip(tmp_path / "h0", 0, 0, payload + 2 * chunk + 7)
    with pytest.raises(ChecksumError, match="owner0/v000000000001/d1.c2: checksum mismatch"):
        store.read_span_into(0, 1, [f"d1.c{k}" for k in range(4)], np.empty(payload, np.uint8))


def test_a_span_read_racing_a_slot_reuse_says_so(tmp_path):
    store = HostStore(tmp_path / "h0")
    _write(store, 0, 1, _chunks(12, [256, 256]), nbytes=512)
    manifest = store.manifest(0, 1)
    view = store.span_view(0, 1, ["d0.c0", "d0.c1"], manifest)
    store.remove(0, 1)
    _write(store, 0, 2, _chunks(13, [256, 256]), nbytes=512)  # lands in the same slot
    with pytest.raises(VersionGone):  # a FileNotFoundError, like a missing version
        store.check_span(0, 1, ["d0.c0", "d0.c1"], view, manifest)


def test_fault_injection_corrupts_the_newest_own_version(tmp_path, capsys):
    store = HostStore(tmp_path / "h0")
    for step in (1, 2):
        _write(store, 0, step, _chunks(step, [128]))
    _write(store, 1, 2, _chunks(9, [128]))  # a peer's replica: left alone
    corrupt_newest_own_chunk(tmp_path / "h0", 0)
    assert capsys.readouterr().out == (
        "fault: flipped a byte in owner0/v000000000002/d0.c0 of host 0\n")
    assert [store.verify(0, 1), store.verify(0, 2), store.verify(1, 2)] == [True, False, True]
    corrupt_newest_own_chunk(tmp_path / "h0", 5)
    assert capsys.readouterr().out == "fault: host 5 has no own version to corrupt\n"


def test_bytes_held_while_a_writer_prunes(tmp_path):
    """The training thread sizes the store while a writer commits and prunes:
    never an error, and never more than two slots (the kept version's and the
    one being written)."""
    store = HostStore(tmp_path / "h0")
    stop = threading.Event()
    cycles = [0]

    def churn():
        step = 0
        while not stop.is_set():
            step += 1
            _write(store, 0, step, _chunks(step, [512] * 4), nbytes=2048)
            store.prune(0, {step})
            cycles[0] += 1

    writer = threading.Thread(target=churn)
    writer.start()
    sizes = []
    deadline = time.monotonic() + 120
    try:
        # Sample for as long as it takes the writer to commit and prune 30 versions.
        while cycles[0] < 30 and time.monotonic() < deadline:
            sizes.append(store.bytes_held())
    finally:
        stop.set()
        writer.join()
    assert cycles[0] >= 30 and sizes
    assert store.versions(0) == [cycles[0]]
    assert store.bytes_held() == 2 * 2048  # two slots, reused ever since
    assert all(0 <= size <= 2 * 2048 for size in sizes)


def test_a_damaged_commit_record_is_not_a_version(tmp_path, caplog):
    store = HostStore(tmp_path / "h0")
    _write(store, 0, 1, _chunks(14, [32]))
    _write(store, 0, 2, _chunks(15, [32]))
    (tmp_path / "h0" / "owner0" / "slot1.head").write_text('{"ste')  # bit rot in the head
    with caplog.at_level("WARNING", logger="capricorn_jax"):
        assert store.versions(0) == [1] and store.versions(0) == [1]
    assert caplog.text.count("owner0/slot1.head: unreadable commit record") == 1
    _write(store, 0, 3, _chunks(16, [32]))  # not into the damaged version's slot
    assert store.manifest(0, 3)["slot"] == 2 and store.versions(0) == [1, 3]


def test_a_store_written_in_another_head_format_is_refused_naming_it(tmp_path):
    import json

    from capricorn_jax._src.memory.store.store import StoreFormatError

    store = HostStore(tmp_path / "h0")
    _write(store, 0, 3, _chunks(5, [10]))
    head = tmp_path / "h0" / "owner0" / "slot0.head"
    record = json.loads(head.read_text())
    assert record["format"] == "cjx-head/2"
    del record["format"]  # as the code before formats wrote it
    head.write_text(json.dumps(record))
    with pytest.raises(StoreFormatError, match=r"owner0/slot0.head: a commit record of format "
                       r"none \(written before formats were recorded\), this code reads "
                       r"cjx-head/2: .* --fresh"):
        HostStore(tmp_path / "h0").versions(0)
