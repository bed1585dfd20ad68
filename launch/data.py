"""Byte-level language-modelling data built from the Python standard library.

Design choices:

* **No download.** The corpus is the interpreter's own stdlib, located with
  ``sysconfig.get_paths()["stdlib"]`` (``sys.prefix`` would point into a venv).
  ``site-packages``/``dist-packages``/``__pycache__`` are skipped, and so is any
  file containing a NUL byte (treated as binary).
* **Domains with different byte statistics**: library code, test code, decimal
  test vectors and assorted text files. Each domain is a sorted, deterministic
  list of files whose bytes are joined with ``SEPARATOR`` and capped at
  ``max_bytes_per_domain``; domains under ``MIN_DOMAIN_BYTES`` are dropped. The
  ``idlelib/idle_test`` files count as tests, never as code.
* **Split**: the last 5% of each domain (at least ``seq_len + 1`` bytes) is
  validation; the rest is the train stream.
* **Sharding without coordination**: host ``h`` of ``H`` owns the contiguous
  slice ``[h*n//H, (h+1)*n//H)`` of each train stream, so hosts never read the
  same bytes and need no communication. Within its slice a host keeps one
  cursor per domain; batches are consecutive windows (stride ``seq_len``,
  length ``seq_len + 1``) that wrap inside the slice.
* **Resumable**: the iterator's whole position is ``{"step", "cursors"}`` made of
  plain ints, so it can be stored in JSON next to a checkpoint.
* **Loaded once**: ``Corpus.load`` is cached, so many iterators share arrays
  (made read-only to keep that sharing safe).

This module deliberately uses only numpy so it can run in data-loading code
that never touches an accelerator.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sysconfig
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

DOMAIN_NAMES: tuple[str, ...] = ("code", "tests", "decimal", "text")
WORKLOADS: tuple[str, ...] = ("steady", "dynamic", "synthetic")
SEPARATOR = b"\n\x00\n"
MIN_DOMAIN_BYTES = 64 << 10
VALIDATION_FRACTION = 0.05
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_TEXT_EXTS = frozenset(
    {".txt", ".rst", ".xml", ".json", ".toml", ".html", ".csv", ".cfg", ".ini", ".pem"}
)


def _classify(rel_dir_parts: tuple[str, ...], filename: str) -> str | None:
    """Returns the domain of a stdlib file, or None if it belongs to none."""
    ext = os.path.splitext(filename)[1]
    if ext == ".py":
        return "tests" if _TEST_DIRS.intersection(rel_dir_parts) else "code"
    if ext == ".decTest":
        return "decimal"
    return "text" if ext in _TEXT_EXTS else None


def _read_domain(paths: list[str], cap: int) -> np.ndarray:
    """Concatenates text files (in the given order) with SEPARATOR, up to ``cap`` bytes."""
    chunks: list[bytes] = []
    total = 0
    for path in paths:
        if total >= cap:
            break
        try:
            with open(path, "rb") as f:
                content = f.read()
        except OSError:
            continue
        if b"\x00" in content:  # binary file
            continue
        piece = content + SEPARATOR
        chunks.append(piece)
        total += len(piece)
    return np.frombuffer(b"".join(chunks)[:cap], dtype=np.uint8)


@functools.lru_cache(maxsize=8)
def _load_cached(root: str, max_bytes_per_domain: int) -> Corpus:
    files: dict[str, list[tuple[str, str]]] = {name: [] for name in DOMAIN_NAMES}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = os.path.relpath(dirpath, root)
        parts = () if rel == os.curdir else tuple(rel.split(os.sep))
        for filename in filenames:
            domain = _classify(parts, filename)
            if domain is not None:
                key = "/".join((*parts, filename))
                files[domain].append((key, os.path.join(dirpath, filename)))
    domains = {}
    for name in DOMAIN_NAMES:
        data = _read_domain([p for _, p in sorted(files[name])], max_bytes_per_domain)
        if data.size >= MIN_DOMAIN_BYTES:
            domains[name] = data
    return Corpus(domains)


class Corpus:
    """Read-only uint8 byte streams, one per domain, in a fixed order."""

    def __init__(self, domains: Mapping[str, np.ndarray]) -> None:
        """Wraps existing byte arrays (e.g. a synthetic corpus in tests).

        Args:
            domains: Domain name -> 1-D array of bytes. Insertion order is kept.
        """
        self._domains: dict[str, np.ndarray] = {}
        for name, data in domains.items():
            arr = np.array(data, dtype=np.uint8).reshape(-1)
            arr.setflags(write=False)
            self._domains[name] = arr

    @classmethod
    def load(cls, max_bytes_per_domain: int = 8 << 20, root: str | None = None) -> Corpus:
        """Loads (once per arguments, cached) the stdlib corpus.

        Args:
            max_bytes_per_domain: Cap on each domain's size in bytes.
            root: Directory to scan; defaults to this interpreter's stdlib.
        """
        return _load_cached(root or sysconfig.get_paths()["stdlib"], int(max_bytes_per_domain))

    @property
    def names(self) -> tuple[str, ...]:
        """Domain names in their fixed order."""
        return tuple(self._domains)

    def __getitem__(self, domain: str) -> np.ndarray:
        """Returns a domain's whole byte stream; ValueError if unknown."""
        if domain not in self._domains:
            raise ValueError(f"unknown domain {domain!r}; have {self.names}")
        return self._domains[domain]

    def split_index(self, domain: str, seq_len: int) -> int:
        """First validation byte: the last 5% (at least seq_len + 1 bytes) is validation."""
        n = self[domain].size
        return max(0, n - max(int(n * VALIDATION_FRACTION), seq_len + 1))

    def train(self, domain: str, seq_len: int) -> np.ndarray:
        """Train bytes of ``domain`` (everything before ``split_index``)."""
        return self[domain][: self.split_index(domain, seq_len)]

    def validation(self, domain: str, seq_len: int) -> np.ndarray:
        """Validation bytes of ``domain`` (from ``split_index`` on)."""
        return self[domain][self.split_index(domain, seq_len) :]


def available_domains(max_bytes_per_domain: int = 8 << 20) -> tuple[str, ...]:
    """Names of the stdlib domains found on this machine, in ``DOMAIN_NAMES`` order."""
    return Corpus.load(max_bytes_per_domain).names


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """What data a training run reads.

    Attributes:
        seq_len: Tokens (bytes) per input sequence; batches carry seq_len + 1.
        batch_per_host: Sequences per host per step.
        workload: "steady" (one domain), "dynamic" (domains rotate every
            ``shift_every`` steps) or "synthetic" (uniform random bytes).
        shift_every: Steps per domain in the dynamic workload.
        seed: Offsets starting cursors / seeds synthetic bytes.
        max_bytes_per_domain: Cap on each domain's size.
        steady_domain: Domain used by the steady workload.
    """

    seq_len: int
    batch_per_host: int
    workload: str
    shift_every: int = 50
    seed: int = 0
    max_bytes_per_domain: int = 8 << 20
    steady_domain: str = "code"

    def __post_init__(self) -> None:
        for field, low in (("seq_len", 1), ("batch_per_host", 1), ("shift_every", 1),
                           ("seed", 0), ("max_bytes_per_domain", MIN_DOMAIN_BYTES)):
            value = getattr(self, field)
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < low:
                raise ValueError(f"{field} must be an int >= {low}, got {value!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.steady_domain not in DOMAIN_NAMES:
            raise ValueError(
                f"steady_domain must be one of {DOMAIN_NAMES}, got {self.steady_domain!r}"
            )


class DataIterator:
    """Deterministic, resumable per-host batch stream."""

    def __init__(self, options: DataOptions, host_index: int, num_hosts: int,
                 corpus: Corpus | None = None) -> None:
        """Builds the iterator for one host.

        Args:
            options: Data options shared by all hosts.
            host_index: This host, in [0, num_hosts).
            num_hosts: Number of hosts sharing the train streams.
            corpus: Corpus to read; defaults to ``Corpus.load`` (unused for synthetic).

        Raises:
            ValueError: On bad host arguments, a missing domain, too few domains
                for the dynamic workload, or a host region shorter than a sequence.
        """
        if num_hosts < 1 or not 0 <= host_index < num_hosts:
            raise ValueError(f"host_index must be in [0, {num_hosts}), got {host_index}")
        self.options, self.host_index, self.num_hosts = options, host_index, num_hosts
        self._step = 0
        self._regions: dict[str, np.ndarray] = {}
        self._cursors: dict[str, int] = {}
        if options.workload == "synthetic":
            self._domains: tuple[str, ...] = ()
            return
        corpus = corpus if corpus is not None else Corpus.load(options.max_bytes_per_domain)
        if options.workload == "steady":
            self._domains = (options.steady_domain,)
            corpus[options.steady_domain]  # raises ValueError naming a missing domain
        else:
            self._domains = corpus.names
            if len(self._domains) < 2:
                raise ValueError(f"dynamic workload needs >= 2 domains, found "
                                 f"{len(self._domains)}: {self._domains}")
        for name in self._domains:
            train = corpus.train(name, options.seq_len)
            lo, hi = self.region_bounds(train.size, host_index, num_hosts)
            if hi - lo < options.seq_len + 1:
                raise ValueError(f"domain {name!r}: host region of {hi - lo} bytes is shorter "
                                 f"than seq_len + 1 = {options.seq_len + 1}")
            self._regions[name] = train[lo:hi]
            rng = np.random.default_rng([options.seed, zlib.crc32(name.encode())])
            self._cursors[name] = int(rng.integers(hi - lo))

    @staticmethod
    def region_bounds(n: int, host_index: int, num_hosts: int) -> tuple[int, int]:
        """Host ``host_index``'s slice [lo, hi) of an n-byte train stream."""
        return host_index * n // num_hosts, (host_index + 1) * n // num_hosts

    @property
    def domain(self) -> str:
        """Domain of the next batch ("synthetic" for the synthetic workload)."""
        if not self._domains:
            return "synthetic"
        return self._domains[(self._step // self.options.shift_every) % len(self._domains)]

    def next_batch(self) -> np.ndarray:
        """Returns int32 [batch_per_host, seq_len + 1]; inputs [:, :-1], targets [:, 1:]."""
        b, t = self.options.batch_per_host, self.options.seq_len
        name = self.domain
        if name == "synthetic":
            rng = np.random.default_rng((self.options.seed, self.host_index, self._step))
            batch = rng.integers(0, 256, size=(b, t + 1), dtype=np.int32)
        else:
            region, cursor = self._regions[name], self._cursors[name]
            starts = cursor + np.arange(b, dtype=np.int64) * t
            batch = region[(starts[:, None] + np.arange(t + 1)) % region.size].astype(np.int32)
            self._cursors[name] = (cursor + b * t) % region.size
        self._step += 1
        return batch

    def state(self) -> dict[str, Any]:
        """The iterator's position as JSON-able ints/strings."""
        return {"step": self._step, "cursors": dict(self._cursors)}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Puts the iterator back to a position returned by ``state``.

        Raises:
            ValueError: If the state names an unknown domain, misses one, or is malformed.
        """
        step, cursors = int(state["step"]), {k: int(v) for k, v in state["cursors"].items()}
        for name in cursors.keys() - self._cursors.keys():
            raise ValueError(f"state names unknown domain {name!r}; have {self._domains}")
        for name in self._cursors:
            if not 0 <= cursors.get(name, -1) < self._regions[name].size:
                raise ValueError(f"state has no valid cursor for domain {name!r}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._step, self._cursors = step, {name: cursors[name] for name in self._cursors}


def validation_batch(options: DataOptions, corpus: Corpus | None, domain: str,
                     num_sequences: int, seq_len: int) -> np.ndarray:
    """Deterministic evenly spaced windows of a domain's validation bytes.

    The train/validation boundary is the one ``options.seq_len`` gives, so the
    windows never overlap what a ``DataIterator`` with these options trains on.

    Args:
        options: Options of the training run (boundary and default corpus).
        corpus: Corpus to read; defaults to ``Corpus.load``.
        domain: Domain name.
        num_sequences: Rows to return.
        seq_len: Window length minus one.

    Returns:
        int32 array [num_sequences, seq_len + 1].
    """
    corpus = corpus if corpus is not None else Corpus.load(options.max_bytes_per_domain)
    val = corpus.validation(domain, options.seq_len)
    if num_sequences < 1 or seq_len < 1 or val.size < seq_len + 1:
        raise ValueError(f"cannot take {num_sequences} windows of seq_len {seq_len} from "
                         f"{val.size} validation bytes of domain {domain!r}")
    starts = np.linspace(0, val.size - seq_len - 1, num_sequences).astype(np.int64)
    return val[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
