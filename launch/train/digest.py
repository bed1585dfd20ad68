"""The train state's digest at the end of a job: the ``state_digest`` event.

Every host takes the CRC32 of each of its shards of each leaf of the final
train state (parameters, optimizer moments, step, RNG), one copy of each
shard (replica 0); the hosts all-gather these small lists (the library's
``allgather_json``) and host 0 writes one digest per leaf to metrics.jsonl:
``{"event": "state_digest", "step", "algorithm": "crc32", "leaves": {path:
hex}}``, a leaf's digest being the CRC32 of its shards' "index=crc" pairs
in index order. Two runs of the same job and topology whose final states
are equal bit for bit have equal digests; launch.chaos compares a PEC
trial's with those of a reference run that took the same roll-backs
(``launch.chaos.pec_reference``), and names the leaves that differ.

Design choice: per-shard checksums gathered as text, so no host ever holds
another host's bytes (the state may be larger than one host's memory).
Alternative not taken: ``multihost_utils.process_allgather`` of the state
and one hash on host 0, which copies the whole state to every host.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from launch.metrics import MetricsWriter

ALGORITHM = "crc32"


def _index_key(index: tuple, shape: tuple[int, ...]) -> str:
    """A shard's place in its leaf as text: "start:stop" per axis."""
    parts = []
    for axis, s in zip(range(len(shape)), index, strict=False):
        start, stop, _ = s.indices(shape[axis])
        parts.append(f"{start}:{stop}")
    return ",".join(parts)


def shard_digests(state: Any) -> dict[str, dict[str, str]]:
    """{leaf path: {shard index: CRC32 hex}} of this host's shards of
    ``state`` (one copy of each: replica 0)."""
    import jax
    import numpy as np

    out: dict[str, dict[str, str]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        shards = {}
        for shard in leaf.addressable_shards:
            if shard.replica_id != 0:
                continue
            data = np.ascontiguousarray(np.asarray(shard.data))
            shards[_index_key(shard.index, leaf.shape)] = f"{zlib.crc32(data.tobytes()):08x}"
        out[jax.tree_util.keystr(path)] = shards
    return out


def merge(docs: Sequence[dict[str, dict[str, str]]]) -> dict[str, str]:
    """One digest per leaf from every host's ``shard_digests`` (module docstring)."""
    leaves: dict[str, dict[str, str]] = {}
    for doc in docs:
        for name, shards in doc.items():
            leaves.setdefault(name, {}).update(shards)
    out = {}
    for name, shards in sorted(leaves.items()):
        pairs = ";".join(f"{k}={v}" for k, v in sorted(shards.items()))
        out[name] = f"{zlib.crc32(pairs.encode()):08x}"
    return out


def write(state: Any, metrics: MetricsWriter, step: int, hosts: int) -> None:
    """The ``state_digest`` event of ``state`` at ``step`` (every host calls it:
    an all-gather; host 0's ``metrics`` writes)."""
    from capricorn_jax.experimental import allgather_json

    docs = allgather_json(shard_digests(state), hosts, what="state_digest")
    metrics.write({"event": "state_digest", "step": step, "algorithm": ALGORITHM,
                   "leaves": merge(docs)})
