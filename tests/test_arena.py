"""The shared-memory arena store: commit protocol, reuse, torn versions, isolation."""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capricorn_jax._src.memory.arena import (
    ChecksumError,
    HostStore,
    StoreIsolationError,
    VersionGone,
)


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
        w.write_chunk("../x", b"1")


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
