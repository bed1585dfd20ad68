"""The copy into the arena (memory/pinned.py): alignment, registration, the path
decision (pure, property-tested), the copies' byte ranges, and the CPU path's
bytes landing in the slot exactly, checksummed in place."""

import dataclasses
import itertools
import os

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capricorn_jax._src.memory.store.copy_path import (
    COPY_PATHS,
    BackendCaps,
    CopyPath,
    choose_copy_path,
    row_copies,
)
from capricorn_jax._src.memory.store.pinned import (
    HUGE_PAGE,
    SlotCopier,
    SlotRegistry,
    align_up,
    hugepage_modes,
    probe_backend,
    slot_array,
    wants_madvise,
    zero_copy,
)
from capricorn_jax._src.memory.store.store import HostStore


@given(st.integers(0, 1 << 40), st.integers(0, 30))
def test_align_up_is_the_smallest_multiple_at_or_above(n, log2):
    a = 1 << log2
    r = align_up(n, a)
    assert r % a == 0 and n <= r < n + a


def test_align_up_refuses_a_non_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        align_up(5, 3)


def test_hugepage_modes_read_the_selected_word(tmp_path):
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    (tmp_path / "shmem_enabled").write_text("always within_size [advise] never deny force\n")
    assert hugepage_modes(tmp_path) == {"anon": "madvise", "shmem": "advise"}
    assert hugepage_modes(tmp_path / "missing") == {"anon": None, "shmem": None}


def test_madvise_applies_per_kind_of_memory():
    assert [m for m in ("always", "madvise", "never", None) if wants_madvise(m, False)] == [
        "always", "madvise"]
    assert [m for m in ("always", "within_size", "advise", "never", "deny", "force", None)
            if wants_madvise(m, True)] == ["always", "within_size", "advise", "force"]


def test_map_file_is_aligned_shared_and_sized_in_huge_pages(tmp_path):
    registry = SlotRegistry()
    path = tmp_path / "slot0.data"
    with open(path, "w+b") as f:
        f.truncate(align_up(3 * HUGE_PAGE + 5))
        m = registry.map_file(f.fileno(), 3 * HUGE_PAGE + 5)
        assert m.address % HUGE_PAGE == 0 and m.size == 4 * HUGE_PAGE
        assert m.view.ctypes.data == m.address and m.view.size == m.size
        m.view[HUGE_PAGE + 7] = 42  # shared: the file sees it
        f.seek(HUGE_PAGE + 7)
        assert f.read(1) == b"\x2a"
        with pytest.raises(ValueError, match="grow it"):
            registry.map_file(f.fileno(), 5 * HUGE_PAGE)
    registry.close()


class FakeClient:
    """Records dma_map calls (a unit fake of the GPU client's registration)."""

    def __init__(self, error=None):
        self.mapped, self.unmapped, self.error = [], [], error

    def dma_map(self, addr, size):
        if self.error:
            raise RuntimeError(self.error)
        self.mapped.append((addr, size))

    def dma_unmap(self, addr):
        self.unmapped.append(addr)


def test_each_slot_is_registered_once_and_unregistered_on_close(tmp_path):
    client = FakeClient()
    store = HostStore(tmp_path / "h0", registry=SlotRegistry(client))
    w = store.begin(0, 1, 3 * HUGE_PAGE + 1)
    assert w.slot.capacity == 4 * HUGE_PAGE  # whole huge pages
    assert w.slot.view.ctypes.data % HUGE_PAGE == 0
    w.write_chunk("d0.c0", b"x" * 100)
    w.commit({})
    w2 = store.begin(0, 2, 100)  # a second slot: registered once too
    w2.write_chunk("d0.c0", b"y" * 100)
    w2.commit({})
    store.prune(0, [2])
    w3 = store.begin(0, 3, 100)  # reuses slot 0: no new registration
    w3.abort()
    assert [s for _, s in client.mapped] == [4 * HUGE_PAGE, HUGE_PAGE]
    assert store.registry.registered_bytes == 5 * HUGE_PAGE
    assert bytes(store.read_chunk(0, 2, "d0.c0")) == b"y" * 100
    store.close()
    store.registry.close()
    assert sorted(client.unmapped) == sorted(a for a, _ in client.mapped)


def test_cpu_client_refuses_registration_and_the_registry_says_so(tmp_path):
    registry = SlotRegistry(jax.devices()[0].client)
    store = HostStore(tmp_path / "h0", registry=registry)
    store.begin(0, 1, 10).abort()
    assert registry.dma_map == "unimplemented" and registry.registered_bytes == 0
    caps = probe_backend(jax.devices()[0], registry)
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    assert caps == BackendCaps("cpu", "pinned_host" in kinds, "unimplemented")
    assert choose_copy_path(caps).kind == "host_plain"
    store.close()
    registry.close()


def test_a_failed_registration_is_logged_and_the_slot_still_works(tmp_path, caplog):
    client = FakeClient(error="INTERNAL: cuMemHostRegister failed")
    registry = SlotRegistry(client)
    store = HostStore(tmp_path / "h0", registry=registry)
    w = store.begin(0, 1, 10)
    w.write_chunk("d0.c0", b"abc")
    w.commit({})
    assert bytes(store.read_chunk(0, 1, "d0.c0")) == b"abc"
    assert registry.dma_map == "failed" and registry.registered_bytes == 0
    assert "cuMemHostRegister failed" in caplog.text
    caps = BackendCaps("gpu", True, registry.dma_map, True, True, True)
    assert choose_copy_path(caps).kind == "pinned_pool"
    store.close()
    registry.close()
    assert client.unmapped == []


def test_probe_says_whether_registration_works():
    assert SlotRegistry(FakeClient()).probe() == "ok"
    assert SlotRegistry(FakeClient(error="UNIMPLEMENTED: no")).probe() == "unimplemented"
    assert SlotRegistry(FakeClient(error="INTERNAL: no")).probe() == "failed"
    assert SlotRegistry(None).probe() == "absent"


# ----------------------------------------------------------- the decision
caps_strategy = st.builds(
    BackendCaps, platform=st.sampled_from(["cpu", "gpu", "tpu"]), pinned_host=st.booleans(),
    dma_map=st.sampled_from(["ok", "unimplemented", "failed", "absent"]),
    dlpack_pinned=st.booleans(),
    alias_checked=st.booleans(), cudart=st.booleans())


def _allowed(caps: BackendCaps, kind: str) -> bool:
    if caps.platform == "cpu":
        return kind == "host_plain"
    return {
        "aliased_output": caps.dma_map == "ok" and caps.dlpack_pinned and caps.alias_checked,
        "async_copy": caps.dma_map == "ok" and caps.cudart,
        "pinned_pool": caps.pinned_host,
        "host_plain": False,
    }[kind]


@settings(max_examples=300)
@given(caps_strategy)
def test_the_choice_is_the_first_allowed_path(caps):
    path = choose_copy_path(caps)
    allowed = [k for k in COPY_PATHS if _allowed(caps, k)]
    assert path.kind == (allowed[0] if allowed else "pinned_pool")
    assert path.reason
    for kind in COPY_PATHS:  # forcing: allowed ones taken, others refused with a reason
        if _allowed(caps, kind):
            assert choose_copy_path(caps, kind) == CopyPath(kind, choose_copy_path(
                caps, kind).reason)
            assert choose_copy_path(caps, kind).reason.startswith("forced")
        else:
            with pytest.raises(ValueError, match=f"{kind}.*not possible"):
                choose_copy_path(caps, kind)


@given(caps_strategy, st.sampled_from(["pinned_host", "dlpack_pinned", "alias_checked",
                                       "cudart"]))
def test_a_capability_more_never_picks_a_slower_path(caps, field):
    better = dataclasses.replace(caps, **{field: True})
    assert COPY_PATHS.index(choose_copy_path(better).kind) <= COPY_PATHS.index(
        choose_copy_path(caps).kind)


def test_the_reason_names_the_paths_passed_over():
    caps = BackendCaps("gpu", pinned_host=True, dma_map="unimplemented", cudart=True)
    path = choose_copy_path(caps)
    assert path.kind == "pinned_pool"
    assert "aliased_output: slots not registered" in path.reason
    assert "async_copy: slots not registered" in path.reason
    with pytest.raises(ValueError, match="copy path must be"):
        choose_copy_path(caps, "memcpy")


# ----------------------------------------------------------- the copies
@settings(max_examples=200)
@given(st.integers(0, 5), st.integers(0, 5000), st.integers(1, 3000), st.integers(0, 64))
def test_row_copies_move_every_byte_once_in_bounded_copies(rows, payload, cap, pad):
    copies = row_copies(rows, payload, cap, payload + pad)
    covered = np.zeros(rows * (payload + pad), np.int32)
    for j, lo, hi, off in copies:
        assert 0 <= lo < hi <= payload and hi - lo <= cap
        assert off == j * (payload + pad) + lo
        covered[off:off + hi - lo] += 1
    want = np.zeros_like(covered)
    for j in range(rows):
        want[j * (payload + pad):j * (payload + pad) + payload] = 1
    np.testing.assert_array_equal(covered, want)
    if payload and rows:  # the fewest copies per row, of equal size but the last
        per_row = [hi - lo for j, lo, hi, _ in copies if j == 0]
        assert len(per_row) == -(-payload // cap)
        assert len(set(per_row[:-1])) <= 1 and per_row[-1] <= per_row[0]
    assert copies == sorted(copies)


def test_row_copies_refuse_overlapping_rows():
    with pytest.raises(ValueError, match="rows overlap"):
        row_copies(2, 100, 10, 99)


def test_cpu_path_bytes_land_in_the_slot_exactly(tmp_path):
    devices = jax.devices()[:4]
    rng = np.random.default_rng(3)
    payload = 3 * HUGE_PAGE // 4 + 13
    data = rng.integers(0, 256, (4, payload), dtype=np.uint8)
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    own = jax.device_put(data, sharding)
    rows = [s.data for s in sorted(own.addressable_shards, key=lambda s: devices.index(s.device))]
    store = HostStore(tmp_path / "h0", registry=SlotRegistry())
    writer = store.begin(0, 5, 4 * payload)
    copier = SlotCopier(choose_copy_path(probe_backend(devices[0])), max_copy_bytes=100_000)
    copier.copy(rows, writer.slot.view, payload)
    copier.wait()
    for j, (lo, hi) in itertools.product(range(4), [(0, 100_000), (100_000, payload)]):
        writer.adopt_chunk(f"d{j}.c{lo}", j * payload + lo, hi - lo)
    writer.commit({})
    for j, lo in itertools.product(range(4), (0, 100_000)):
        hi = 100_000 if lo == 0 else payload
        assert bytes(store.read_chunk(0, 5, f"d{j}.c{lo}")) == data[j, lo:hi].tobytes()
    assert store.verify(0, 5)
    store.close()


def test_adopted_chunk_checksums_what_is_in_the_slot(tmp_path):
    store = HostStore(tmp_path / "h0")
    w = store.begin(0, 1, 1000)
    w.slot.view[:10] = np.arange(10, dtype=np.uint8)
    w.adopt_chunk("d0.c0", 0, 10)
    with pytest.raises(ValueError, match="twice"):
        w.adopt_chunk("d0.c0", 0, 10)
    with pytest.raises(ValueError, match="beyond the slot"):
        w.adopt_chunk("d0.c1", 1000, 64)
    w.commit({})
    assert bytes(store.read_chunk(0, 1, "d0.c0")) == bytes(range(10))
    store._slot(0, 0).view[3] = 99  # a flipped byte after the commit is caught
    with pytest.raises(OSError, match="checksum"):
        store.read_chunk(0, 1, "d0.c0")
    store.close()


def test_slot_imports_as_a_jax_array_without_a_copy(tmp_path):
    registry = SlotRegistry()
    with open(tmp_path / "s", "w+b") as f:
        f.truncate(HUGE_PAGE)
        m = registry.map_file(f.fileno(), HUGE_PAGE)
    view = m.view[:4096]
    view[:] = 7
    arr = slot_array(view, jax.devices()[0], pinned=False)
    assert zero_copy(arr, view) is True
    assert int(np.asarray(arr).sum()) == 7 * 4096
    del arr
    registry.close()
    assert not os.path.exists(tmp_path / "missing")


def test_copies_run_off_the_caller_and_their_errors_reach_wait():
    copier = SlotCopier(CopyPath("host_plain", "test"), max_copy_bytes=64)
    slot = np.zeros(256, np.uint8)
    copier.copy([np.arange(100, dtype=np.uint8)], slot, 128)  # a row shorter than its payload
    with pytest.raises(ValueError):
        copier.wait()
    copier.copy([np.full(128, 3, np.uint8), np.full(128, 4, np.uint8)], slot, 128)
    copier.wait()
    np.testing.assert_array_equal(slot, np.repeat([3, 4], 128).astype(np.uint8))
    with pytest.raises(ValueError, match="need 384"):
        copier.copy([slot[:128]] * 3, slot, 128)
    copier.close()
