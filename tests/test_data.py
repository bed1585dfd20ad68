"""Tests for launch.data: stdlib byte corpus, sharding, resumption, validation split."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launch import data
from launch.data import Corpus, DataIterator, DataOptions, validation_batch

FAST = settings(max_examples=20, deadline=None)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.load()


def random_corpus(n: int = 120_000, names: tuple[str, ...] = ("code", "tests")) -> Corpus:
    """Random bytes: any window of >= 16 bytes occurs at one place only."""
    rng = np.random.default_rng(1234)
    return Corpus({name: rng.integers(0, 256, n, dtype=np.uint8) for name in names})


def occurs_in(row: np.ndarray, haystack: np.ndarray) -> bool:
    return row.astype(np.uint8).tobytes() in haystack.tobytes()


def wrapped(region: np.ndarray, seq_len: int) -> np.ndarray:
    """The region plus its first seq_len bytes, so wrapped windows are substrings."""
    return np.concatenate([region, region[:seq_len]])


def test_domains_found_and_non_empty(corpus: Corpus) -> None:
    names = data.available_domains()
    assert names == corpus.names
    assert "code" in names and "decimal" in names
    assert list(names) == [d for d in data.DOMAIN_NAMES if d in names]  # fixed order
    for name in names:
        assert corpus[name].dtype == np.uint8
        assert data.MIN_DOMAIN_BYTES <= corpus[name].size <= 8 << 20
    assert Corpus.load() is corpus  # cached, not re-read


def test_cap_takes_prefix_in_sorted_order(corpus: Corpus) -> None:
    small = Corpus.load(data.MIN_DOMAIN_BYTES * 2)
    for name in small.names:
        assert small[name].size == data.MIN_DOMAIN_BYTES * 2
        np.testing.assert_array_equal(small[name], corpus[name][: small[name].size])
    assert b"\x00" not in corpus["code"][:10_000].tobytes().replace(data.SEPARATOR, b"")


@FAST
@given(seq_len=st.integers(1, 300), batch=st.integers(1, 8), hosts=st.integers(1, 4),
       workload=st.sampled_from(data.WORKLOADS), data_=st.data())
def test_batch_shape_dtype_range(seq_len, batch, hosts, workload, data_) -> None:
    host = data_.draw(st.integers(0, hosts - 1))
    opts = DataOptions(seq_len=seq_len, batch_per_host=batch, workload=workload, shift_every=2)
    it = DataIterator(opts, host, hosts)
    for _ in range(5):
        b = it.next_batch()
        assert b.shape == (batch, seq_len + 1) and b.dtype == np.int32
        assert b.min() >= 0 and b.max() < 256


def test_host_regions_disjoint() -> None:
    corpus, seq_len, hosts = random_corpus(), 32, 3
    opts = DataOptions(seq_len=seq_len, batch_per_host=16, workload="steady")
    train = corpus.train("code", seq_len)
    bounds = [DataIterator.region_bounds(train.size, h, hosts) for h in range(hosts)]
    regions = [train[lo:hi] for lo, hi in bounds]
    assert sum(r.size for r in regions) == train.size
    for h in range(hosts):
        it = DataIterator(opts, h, hosts, corpus)
        for _ in range(300):  # > one full pass over the region, so wrapping happens
            for row in it.next_batch():
                assert occurs_in(row, wrapped(regions[h], seq_len))
                for other in range(hosts):
                    if other != h:
                        assert not occurs_in(row, wrapped(regions[other], seq_len))


def test_batches_are_consecutive_windows_that_wrap() -> None:
    corpus, seq_len, batch = random_corpus(20_000), 24, 5
    opts = DataOptions(seq_len=seq_len, batch_per_host=batch, workload="steady", seed=3)
    it = DataIterator(opts, 1, 2, corpus)
    train = corpus.train("code", seq_len)
    region = train[slice(*DataIterator.region_bounds(train.size, 1, 2))]
    start = it.state()["cursors"]["code"]
    batches = [it.next_batch() for _ in range(100)]  # 12_000 bytes > region: wraps
    stream = np.concatenate([b[:, :-1].ravel() for b in batches] + [batches[-1][-1, -1:]])
    expected = region[(start + np.arange(stream.size)) % region.size]
    np.testing.assert_array_equal(stream, expected)
    assert it.state()["cursors"]["code"] == (start + 100 * batch * seq_len) % region.size


@pytest.mark.parametrize("workload", ["steady", "dynamic", "synthetic"])
def test_deterministic_and_hosts_differ(workload: str) -> None:
    opts = DataOptions(seq_len=64, batch_per_host=4, workload=workload, shift_every=3)
    a, b, other = DataIterator(opts, 0, 2), DataIterator(opts, 0, 2), DataIterator(opts, 1, 2)
    for _ in range(10):
        x = a.next_batch()
        np.testing.assert_array_equal(x, b.next_batch())
        assert not np.array_equal(x, other.next_batch())
    reseeded = DataIterator(dataclasses.replace(opts, seed=7), 0, 2)
    assert not np.array_equal(DataIterator(opts, 0, 2).next_batch(), reseeded.next_batch())


@FAST
@given(before=st.integers(0, 40), workload=st.sampled_from(data.WORKLOADS),
       shift_every=st.integers(1, 5), host=st.integers(0, 2))
def test_state_restore_round_trip(before, workload, shift_every, host) -> None:
    opts = DataOptions(seq_len=16, batch_per_host=3, workload=workload,
                       shift_every=shift_every, seed=5)
    it = DataIterator(opts, host, 3)
    for _ in range(before):
        it.next_batch()
    state = json.loads(json.dumps(it.state()))
    expected = [(it.domain, it.next_batch()) for _ in range(8)]
    fresh = DataIterator(opts, host, 3)
    fresh.restore(state)
    assert fresh.state() == state
    for domain, batch in expected:
        assert fresh.domain == domain
        np.testing.assert_array_equal(fresh.next_batch(), batch)


def test_restore_rejects_unknown_domain() -> None:
    it = DataIterator(DataOptions(seq_len=8, batch_per_host=2, workload="steady"), 0, 1)
    state = it.state()
    state["cursors"]["klingon"] = 0
    with pytest.raises(ValueError, match="klingon"):
        it.restore(state)


def test_dynamic_switches_every_shift_every(corpus: Corpus) -> None:
    shift, names = 3, corpus.names
    it = DataIterator(DataOptions(seq_len=256, batch_per_host=8, workload="dynamic",
                                  shift_every=shift), 0, 2)
    hists: dict[str, np.ndarray] = {}
    for step in range(2 * shift * len(names)):
        assert it.domain == names[(step // shift) % len(names)]
        batch = it.next_batch()
        if step < shift * len(names):
            hists[names[step // shift]] = hists.get(names[step // shift], 0) + np.bincount(
                batch.ravel(), minlength=256)
    assert set(hists) == set(names)
    p = {k: v / v.sum() for k, v in hists.items()}
    for a in names:
        for b in names:
            if a != b:
                assert not np.array_equal(p[a], p[b])
                if "decimal" in (a, b):  # decimal test vectors look nothing like code or text
                    assert 0.5 * np.abs(p[a] - p[b]).sum() > 0.2


def test_dynamic_needs_two_domains() -> None:
    opts = DataOptions(seq_len=8, batch_per_host=2, workload="dynamic")
    with pytest.raises(ValueError, match="found 1"):
        DataIterator(opts, 0, 1, random_corpus(names=("code",)))


def test_steady_stays_on_one_domain(corpus: Corpus) -> None:
    opts = DataOptions(seq_len=64, batch_per_host=4, workload="steady",
                       steady_domain="decimal", shift_every=1)
    it = DataIterator(opts, 1, 2)
    region = wrapped(corpus.train("decimal", 64), 64)
    for _ in range(20):
        assert it.domain == "decimal"
        for row in it.next_batch():
            assert occurs_in(row, region)
    assert it.state()["cursors"].keys() == {"decimal"}


def test_validation_never_overlaps_train() -> None:
    corpus, seq_len = random_corpus(), 32
    opts = DataOptions(seq_len=seq_len, batch_per_host=8, workload="dynamic", shift_every=1)
    for name in corpus.names:
        train, val = corpus.train(name, seq_len), corpus.validation(name, seq_len)
        assert train.size + val.size == corpus[name].size
        assert val.size >= max(seq_len + 1, corpus[name].size // 20)
        for rows in (validation_batch(opts, corpus, name, 16, seq_len),
                     validation_batch(opts, corpus, name, 4, 8)):
            for row in rows:
                assert occurs_in(row, val) and not occurs_in(row, wrapped(train, seq_len))
    for h in range(2):
        it = DataIterator(opts, h, 2, corpus)
        for _ in range(100):
            name = it.domain
            for row in it.next_batch():
                assert not occurs_in(row, corpus.validation(name, seq_len))


def test_validation_batch_real_corpus(corpus: Corpus) -> None:
    opts = DataOptions(seq_len=128, batch_per_host=1, workload="steady")
    rows = validation_batch(opts, None, "code", 8, 128)
    assert rows.shape == (8, 129) and rows.dtype == np.int32
    np.testing.assert_array_equal(rows, validation_batch(opts, corpus, "code", 8, 128))
    assert all(occurs_in(r, corpus.validation("code", 128)) for r in rows)
    assert len({r.tobytes() for r in rows}) == 8


@pytest.mark.parametrize("field,kwargs", [
    ("seq_len", {"seq_len": 0}),
    ("batch_per_host", {"batch_per_host": -1}),
    ("workload", {"workload": "bursty"}),
    ("shift_every", {"shift_every": 0}),
    ("seed", {"seed": -3}),
    ("max_bytes_per_domain", {"max_bytes_per_domain": 10}),
    ("steady_domain", {"steady_domain": "poetry"}),
])
def test_bad_options_name_the_field(field: str, kwargs: dict) -> None:
    base = {"seq_len": 8, "batch_per_host": 2, "workload": "steady"}
    with pytest.raises(ValueError, match=field):
        DataOptions(**{**base, **kwargs})


def test_bad_host_index_and_missing_domain() -> None:
    opts = DataOptions(seq_len=8, batch_per_host=2, workload="steady", steady_domain="text")
    with pytest.raises(ValueError, match="host_index"):
        DataIterator(opts, 2, 2)
    with pytest.raises(ValueError, match="text"):
        DataIterator(opts, 0, 1, random_corpus(names=("code",)))
