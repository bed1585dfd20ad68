"""Cross-host agreement on small values: every host takes the same decision.

The library's multi-host decisions (which version to recover, whether the
persistent root is writable, which experts a persisted step carries, the
durations a schedule is built from) are taken by every host from the same
inputs, so that the collectives each host then runs match. The primitives:

* ``allgather_json``: every host's JSON document, in process order (each host
  sees all the answers, e.g. to refuse together when one host has a problem);
* ``broadcast_json`` / ``agree_floats``: host 0's document or numbers on every
  host (one host decides, e.g. the primary host's view of the persistent steps,
  or the measured durations a schedule is partitioned from);
* ``allgather_floats``: every host's numbers (measurements to report, or a
  barrier).

A JSON document travels as its UTF-8 bytes: the lengths are exchanged first,
then the bytes, padded to the longest; so a document has no size limit and
costs two small collectives. On one process nothing is exchanged.

Design choice: collectives over the processes (``multihost_utils``), which
every host must call in the same order, rather than the ``jax.distributed``
key-value store: its client is a private JAX API, and the hosts run
collectives at the same points anyway. Alternative not taken: a fixed-size
buffer per document (one collective instead of two, but a size limit, and
every call moving the limit's bytes).

Every function takes ``hosts``, the number of processes taking part (default
``jax.process_count()``); with ``hosts == 1`` nothing is exchanged, which is
how a single-process caller that simulates several hosts stays local.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def _hosts(hosts: int | None) -> int:
    return jax.process_count() if hosts is None else hosts


def _utils():
    from jax.experimental import multihost_utils

    return multihost_utils


def _padded(raw: bytes, size: int) -> np.ndarray:
    buf = np.zeros(max(size, 1), np.uint8)
    buf[: len(raw)] = np.frombuffer(raw, np.uint8)
    return buf


def allgather_json(doc: Any, hosts: int | None = None) -> list[Any]:
    """Every host's JSON-able ``doc``, in process order (collective).

    Args:
      doc: this host's document (anything ``json.dumps`` takes).
      hosts: the processes taking part (default: all); 1 exchanges nothing.

    Returns:
      [host 0's doc, host 1's doc, ...] as ``json.loads`` gives them back (the
      local doc itself when ``hosts`` is 1).
    """
    if _hosts(hosts) == 1:
        return [doc]
    raw = json.dumps(doc).encode()
    utils = _utils()
    sizes = np.asarray(utils.process_allgather(np.array([len(raw)], np.int32))).reshape(-1)
    gathered = np.asarray(utils.process_allgather(_padded(raw, int(sizes.max()))))
    return [json.loads(row[:n].tobytes().decode()) for row, n in zip(gathered, sizes, strict=True)]


def broadcast_json(doc: Any, hosts: int | None = None) -> Any:
    """Host 0's JSON-able ``doc`` on every host (collective; every host passes
    its own, only host 0's travels)."""
    if _hosts(hosts) == 1:
        return doc
    raw = json.dumps(doc).encode()
    utils = _utils()
    size = int(np.asarray(utils.broadcast_one_to_all(np.array([len(raw)], np.int32)))[0])
    mine = raw if jax.process_index() == 0 else b""
    got = np.asarray(utils.broadcast_one_to_all(_padded(mine, size)))
    return json.loads(got[:size].tobytes().decode())


def agree_floats(values: Sequence[float | None], hosts: int | None = None
                 ) -> list[float | None]:
    """Host 0's ``values`` on every host, as float32 (collective).

    Every host passes as many values. Each value is rounded to float32 on
    every host, host 0 included and on one process too, so that a decision
    taken from the agreed values is the same whatever the process count. None
    travels as NaN and comes back None (e.g. a duration not measured).
    """
    arr = np.array([np.nan if v is None else v for v in values], np.float32)
    if _hosts(hosts) > 1:
        arr = np.asarray(_utils().broadcast_one_to_all(arr))
    return [None if math.isnan(v) else float(v) for v in arr]


def allgather_floats(values: Sequence[float], hosts: int | None = None) -> list[list[float]]:
    """Every host's ``values`` (float64, as many on every host), in process
    order (collective); also a barrier: it returns once every host called it."""
    if _hosts(hosts) == 1:
        return [list(map(float, values))]
    return np.asarray(_utils().process_allgather(np.asarray(values, np.float64))).tolist()
