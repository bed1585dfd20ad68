"""Recovery: the hosts agree on a version, then each loads its shards.

1. Every host scans its own store and verifies each committed version's chunk
   checksums; versions with a bad chunk do not count.
2. The inventories ({owner: [steps]}) are all-gathered (a collective over the
   processes, ``multihost_utils.process_allgather``), so every host takes the
   same decision (``choose_version``, pure): the newest step at which every
   owner's shards are held by some host, preferring the owner's own store.
3. A host whose own store has the version reads it (tier ``local``); the
   others receive their payloads from a peer's replica through
   ``Transport.serve`` collective-permutes (tier ``peer``), in rounds in which
   each server sends one owner's payload.

Design choice: agreement through a collective rather than the jax.distributed
key-value store; the key-value client is a private JAX API, and every host
must run the serve collectives anyway.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any

import jax
import numpy as np

from capricorn_jax._src.packing import check_compatible, decode_trailer, unpack
from capricorn_jax._src.store import ChecksumError
from capricorn_jax._src.transport import assemble, local_rows

log = logging.getLogger("capricorn_jax")
_INVENTORY_BYTES = 1 << 16


@dataclasses.dataclass(frozen=True)
class Recovered:
    """A restored state and where it came from.

    Attributes:
      state: the train state (global arrays in the checkpointer's shardings).
      host_state: the JSON state saved with it by this host (data position...).
      step: the version restored.
      tier: how this host got its shards: "local" or "peer".
      tiers: the tier of every host.
      seconds: wall time of the recovery on the slowest host.
      bytes_moved: payload bytes moved between hosts, all hosts together.
    """

    state: Any
    host_state: dict[str, Any]
    step: int
    tier: str
    tiers: list[str]
    seconds: float
    bytes_moved: int


def choose_version(inventories: list[dict[int, list[int]]], hosts: int
                   ) -> tuple[int, dict[int, int]] | None:
    """The newest step recoverable for every owner, and who serves each owner.

    Args:
      inventories: inventories[x][o]: verified steps of owner o in host x's store.
      hosts: number of hosts (owners are 0..hosts-1).

    Returns:
      (step, {owner: serving host}) or None when no step covers every owner.
    """
    steps = sorted({s for inv in inventories for v in inv.values() for s in v}, reverse=True)
    for step in steps:
        sources = {}
        for owner in range(hosts):
            have = [x for x in range(hosts) if step in inventories[x].get(owner, [])]
            if not have:
                break
            sources[owner] = owner if owner in have else have[0]
        else:
            return step, sources
    return None


def serve_rounds(sources: dict[int, int]) -> list[dict[int, int]]:
    """Groups (server -> owner) transfers into rounds where each host sends once."""
    pending = sorted((server, owner) for owner, server in sources.items() if server != owner)
    rounds = []
    while pending:
        used_src, used_dst, this, rest = set(), set(), {}, []
        for server, owner in pending:
            if server in used_src or owner in used_dst:
                rest.append((server, owner))
            else:
                this[server] = owner
                used_src.add(server)
                used_dst.add(owner)
        rounds.append(this)
        pending = rest
    return rounds


def _inventory(ckpt) -> dict[int, list[int]]:
    out = {}
    for owner in ckpt.store.owners():
        good = []
        for step in ckpt.store.versions(owner):
            if ckpt.store.verify(owner, step):
                good.append(step)
            else:
                log.warning("host %d: version %d of owner %d fails its checksums; ignored",
                            ckpt.host, step, owner)
        out[owner] = good
    return out


def _allgather_json(doc: Any, hosts: int) -> list[Any]:
    raw = json.dumps(doc).encode()
    if len(raw) > _INVENTORY_BYTES:
        raise ValueError(f"inventory of {len(raw)} bytes exceeds {_INVENTORY_BYTES}")
    buf = np.zeros(_INVENTORY_BYTES, np.uint8)
    buf[: len(raw)] = np.frombuffer(raw, np.uint8)
    if hosts == 1:
        return [doc]
    from jax.experimental import multihost_utils

    gathered = np.asarray(multihost_utils.process_allgather(buf))
    return [json.loads(row.tobytes().rstrip(b"\0").decode()) for row in gathered]


def _read_rows(ckpt, owner: int, step: int) -> list[np.ndarray]:
    manifest = ckpt.store.manifest(owner, step)
    check_compatible(ckpt.plan, manifest["leaves"])
    if manifest["fingerprint"] != ckpt.plan.fingerprint():
        raise ValueError(f"version {step} of host {owner} was saved with another layout "
                         f"(mesh, sharding or chunk size) than the current one")
    rows = []
    for j in range(manifest["devices"]):
        parts = [ckpt.store.read_chunk(owner, step, f"d{j}.c{k}", manifest)
                 for k in range(ckpt.plan.num_chunks)]
        rows.append(np.frombuffer(b"".join(parts), np.uint8))
    return rows


def recover(ckpt) -> Recovered | None:
    """Restores the newest version every host can reach, or None if there is none."""
    start = time.perf_counter()
    inventory = _inventory(ckpt)
    gathered = _allgather_json({str(o): v for o, v in inventory.items()}, ckpt.hosts)
    inventories = [{int(o): v for o, v in inv.items()} for inv in gathered]
    decision = choose_version(inventories, ckpt.hosts)
    if decision is None:
        if any(any(inv.values()) for inv in inventories):
            log.warning("host %d: stored versions do not cover every host; starting fresh",
                        ckpt.host)
        return None
    step, sources = decision
    rows = _read_rows(ckpt, ckpt.host, step) if sources[ckpt.host] == ckpt.host else None
    moved = 0
    for perm in serve_rounds(sources):
        send = {}
        if ckpt.host in perm:
            send = dict(enumerate(_read_rows(ckpt, perm[ckpt.host], step)))
        received = ckpt.transport.serve(send, perm)
        if ckpt.host in perm.values():
            rows = local_rows(received, ckpt.plan)
            moved = sum(r.nbytes for r in rows)
    if rows is None:
        raise ChecksumError(f"host {ckpt.host}: no payload for version {step}")
    blocks = unpack(ckpt.plan, ckpt.host, rows)
    state = jax.block_until_ready(
        assemble(blocks, ckpt.abstract_state, ckpt.state_shardings, ckpt.mesh))
    tiers = ["local" if sources[h] == h else "peer" for h in range(ckpt.hosts)]
    mine = {"seconds": time.perf_counter() - start, "bytes": moved}
    everyone = _allgather_json(mine, ckpt.hosts)
    return Recovered(state, decode_trailer(ckpt.plan, rows[0]), step, tiers[ckpt.host], tiers,
                     max(x["seconds"] for x in everyone), sum(x["bytes"] for x in everyone))
