"""The host store: commit protocol, checksums, partial versions, isolation."""

import os
import threading

import pytest

from capricorn_jax._src.memory.store import ChecksumError, HostStore
from capricorn_jax._src.memory.store import MANIFEST, StoreIsolationError


def _write(store, owner, step, chunks=(b"abc", b"defg")):
    w = store.begin(owner, step)
    for i, c in enumerate(chunks):
        w.write_chunk(f"d0.c{i}", c)
    return w


def test_commit_makes_a_version_visible(tmp_path):
    store = HostStore(tmp_path / "h0")
    w = _write(store, 0, 5)
    assert store.versions(0) == []  # not committed yet: invisible
    w.commit({"host_state": {"x": 1}})
    assert store.versions(0) == [5]
    m = store.manifest(0, 5)
    assert m["host_state"] == {"x": 1} and set(m["chunks"]) == {"d0.c0", "d0.c1"}
    assert store.read_chunk(0, 5, "d0.c1") == b"defg"
    assert store.verify(0, 5)
    assert store.bytes_held() > 7


def test_torn_version_is_never_listed_and_is_removed_on_open(tmp_path):
    store = HostStore(tmp_path / "h0")
    _write(store, 0, 1).commit({})
    _write(store, 0, 2)  # the process dies here: chunks written, no manifest
    torn = tmp_path / "h0" / "owner0" / "v000000000002.partial"
    assert torn.is_dir()
    assert store.versions(0) == [1]
    # A manifest written but the directory not yet renamed: still not a version.
    (torn / MANIFEST).write_text("{}")
    assert store.versions(0) == [1]
    reopened = HostStore(tmp_path / "h0")
    assert not torn.exists()
    assert reopened.removed_partials == ["owner0/v000000000002.partial"]
    assert reopened.versions(0) == [1]


def test_corrupted_chunk_is_detected(tmp_path):
    store = HostStore(tmp_path / "h0")
    _write(store, 1, 3, (b"x" * 100,)).commit({})
    path = tmp_path / "h0" / "owner1" / "v000000000003" / "d0.c0"
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="owner1/v000000000003/d0.c0"):
        store.read_chunk(1, 3, "d0.c0")
    assert not store.verify(1, 3)


def test_prune_keeps_what_is_asked(tmp_path):
    store = HostStore(tmp_path / "h0")
    for step in (1, 2, 3):
        _write(store, 0, step).commit({})
    store.prune(0, {1, 3})
    assert store.versions(0) == [1, 3]


def test_paths_outside_the_root_are_refused(tmp_path):
    store = HostStore(tmp_path / "h0")
    with pytest.raises(StoreIsolationError):
        store._path("..", "h1", "owner0")
    with pytest.raises(ValueError):
        _write(store, 0, 1).write_chunk("../../h1/evil", b"x")
    assert not os.path.exists(tmp_path / "h1")


def test_wipe_forgets_everything(tmp_path):
    store = HostStore(tmp_path / "h0")
    _write(store, 0, 1).commit({})
    store.wipe()
    assert store.versions(0) == [] and store.owners() == []


def test_bytes_held_while_a_writer_prunes(tmp_path):
    """The training thread walks the store while a writer commits and prunes:
    never an error, never more than the versions that can coexist (the kept
    one, the one being committed, its partial directory)."""
    import time

    store = HostStore(tmp_path / "h0")
    stop = threading.Event()
    cycles = [0]

    def churn():
        step = 0
        while not stop.is_set():
            step += 1
            _write(store, 0, step, (b"x" * 512,) * 4).commit({})
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
    one_version = store.bytes_held()  # the writer stopped: exactly the kept version
    assert store.versions(0) == [cycles[0]] and one_version > 2048
    assert all(0 <= size <= 3 * one_version for size in sizes)


def test_read_chunk_into_fills_the_buffer_and_checks_it(tmp_path):
    store = HostStore(tmp_path / "h0")
    _write(store, 0, 3).commit({})
    out = bytearray(b"xx" + b"\0" * 4 + b"yy")
    store.read_chunk_into(0, 3, "d0.c1", memoryview(out)[2:6])
    assert bytes(out) == b"xxdefgyy"
    with pytest.raises(ChecksumError, match="d0.c1"):  # a buffer of the wrong size
        store.read_chunk_into(0, 3, "d0.c1", memoryview(bytearray(3)))
    chunk = tmp_path / "h0" / "owner0" / "v000000000003" / "d0.c1"
    chunk.write_bytes(b"defgh")  # grown on disk
    with pytest.raises(ChecksumError, match="d0.c1"):
        store.read_chunk_into(0, 3, "d0.c1", memoryview(bytearray(4)))
    chunk.write_bytes(b"dxfg")  # same size, other bytes
    with pytest.raises(ChecksumError, match="d0.c1"):
        store.read_chunk_into(0, 3, "d0.c1", memoryview(bytearray(4)))
