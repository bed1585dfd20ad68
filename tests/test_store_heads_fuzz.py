"""The store's commit records (heads) under damage: no head can make a reader
act on a wrong place (fuzzed with hypothesis).

A head is renamed into place whole by its own host, so damage means RAM or a
person editing the RAM disk; still, every field a reader acts on (step, owner,
slot, each chunk's offset, size and CRC32C) is checked on parse, the whole
record against its seal (``head_seal``), and a head that fails is no version
at all. Each example damages one committed head and
then asks the store what it holds and reads what it lists: the only outcomes
are the original version, read back exactly, or no version; never another
exception, never other bytes. (A head of another format is a named stop,
``StoreFormatError``: another build wrote the store.)
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from capricorn_jax._src.memory.store.head_seal import SEAL
from capricorn_jax._src.memory.store.store import (
    HEAD_FORMAT,
    ChecksumError,
    HostStore,
    StoreFormatError,
    VersionGone,
)

CHUNKS = {"d0.c0": b"a" * 100, "d0.c1": b"b" * 50}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                  max_size=3),
    max_leaves=8)

FIELDS = ["step", "owner", "slot", "generation", "chunks", "format", SEAL]
CHUNK_FIELDS = ["offset", "nbytes", "crc32c"]


def _store(tmp_path_factory):
    store = HostStore(tmp_path_factory.mktemp("store") / "h0")
    writer = store.begin(0, 7, sum(len(b) for b in CHUNKS.values()))
    for name, data in CHUNKS.items():
        writer.write_chunk(name, data)
    path = writer.commit({"fingerprint": "x"})
    return store, path


def _check(store: HostStore) -> None:
    store._head_steps.clear()  # re-parse the head whatever its stat says
    listed = store.versions(0)
    assert listed in ([], [7]), listed
    for step in listed:
        try:
            got = {name: bytes(store.read_chunk(0, step, name)) for name in CHUNKS}
        except (ChecksumError, VersionGone, KeyError):
            continue  # named: the read refused the damaged version
        assert got == CHUNKS


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=json_values)
# Another valid value passes every type and range check: before heads were
# sealed the store listed version 0 and served version 7's bytes for it.
@example(field="step", value=0)
@example(field="chunks", value={"d0.c0": {"offset": 0, "nbytes": 50, "crc32c": 0}})
def test_a_damaged_head_field_is_no_version_or_the_right_bytes(tmp_path_factory, field, value):
    store, path = _store(tmp_path_factory)
    head = json.loads(path.read_text())
    head[field] = value
    path.write_text(json.dumps(head))
    if field == "format" and value != HEAD_FORMAT:
        try:
            _check(store)
        except StoreFormatError as e:
            assert "another version of capricorn_jax wrote this store" in str(e)
    else:
        _check(store)
    store.close()


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(CHUNKS)), field=st.sampled_from(CHUNK_FIELDS),
       value=json_values | st.integers(-(1 << 64), 1 << 64))
def test_a_damaged_chunk_entry_is_refused_or_read_right(tmp_path_factory, name, field, value):
    store, path = _store(tmp_path_factory)
    head = json.loads(path.read_text())
    head["chunks"][name][field] = value
    path.write_text(json.dumps(head))
    _check(store)
    store.close()


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_head_bytes_are_no_version_or_the_right_bytes(tmp_path_factory, data):
    store, path = _store(tmp_path_factory)
    raw = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, 1 << 16)) % len(raw)  # heads differ in length
        raw[at] = data.draw(st.integers(0, 255))
    path.write_bytes(bytes(raw))
    try:
        _check(store)
    except StoreFormatError as e:  # the bytes of the format tag were hit
        assert "another version of capricorn_jax wrote this store" in str(e)
    store.close()


def test_a_chunk_size_past_its_slot_is_no_version_and_allocates_nothing(tmp_path_factory):
    """A size that parses (2**46 bytes) but lies past the slot's file: the
    reader used to allocate it before looking (a worker killed for memory)."""
    store, path = _store(tmp_path_factory)
    head = json.loads(path.read_text())
    head["chunks"]["d0.c0"]["nbytes"] = 1 << 46
    path.write_text(json.dumps(head))
    store._head_steps.clear()
    assert store.versions(0) == []
    store.close()
