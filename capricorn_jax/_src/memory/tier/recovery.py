"""Recovery: the hosts agree on a version, then each loads its shards.

1. Every host scans its own store and verifies each committed version's chunk
   checksums; versions with a bad chunk do not count.
2. The inventories ({owner: [steps]}) are all-gathered (a collective over the
   processes, ``agree.allgather_json``), so every host takes the
   same decision (``choose_version``, pure): the newest step at which every
   owner's shards are held by some host, preferring the owner's own store.
3. Every host removes its stored versions newer than the one chosen (the
   steps after it are trained again; a later recovery must not mix them with
   the new ones), or all of them when there is none.
4. A host whose own store has the version reads it (tier ``local``); the
   others receive their payloads from a peer's replica through
   ``Transport.serve`` collective-permutes (tier ``peer``), in rounds in which
   each server sends one owner's payload.

Under partial expert checkpointing (the checkpointer's ``pec``), a version
holds K experts per MoE layer, so a restore reads several versions: the
restore point s for the non-expert state, and for each expert its newest copy
at or before s, parameters and Adam moments alike (``tracker.restore_plan``).
Each version's manifest records the versions a restore to it reads (from the
tracker saved with it), so the decision (``choose_pec_version``, pure) is:
the newest complete s such that s and every version it reads are held, for
every owner, by some host. Every needed version then moves like a single
one (local read or serve rounds, one version after the other, with the
transport of that version's layout), and the state is assembled expert by
expert. The tracker saved with s gives the PLT of the restore and becomes the
checkpointer's tracker. With K = N everywhere the restore reads s alone, as
without PEC.

Design choice: agreement through a collective rather than the jax.distributed
key-value store; the key-value client is a private JAX API, and every host
must run the serve collectives anyway.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from capricorn_jax._src.memory.store.store import ChecksumError
from capricorn_jax._src.memory.tier.reader import TierReader
from capricorn_jax._src.memory.tier.restore_info import PecRestore, RestoreInfo
from capricorn_jax._src.memory.wire.host_arrays import global_arrays
from capricorn_jax._src.memory.wire.packing import (
    PackPlan,
    check_compatible,
    decode_trailer,
    unpack,
    unpack_pec,
)
from capricorn_jax._src.memory.wire.transport import Transport, local_rows
from capricorn_jax._src.multihost.agree import allgather_json
from capricorn_jax._src.native.integrity import crc32c
from capricorn_jax._src.partial.plans import mask_from_hex, mask_to_hex
from capricorn_jax._src.partial.selection import padded_gather_indices
from capricorn_jax._src.partial.tracker import (
    PltTracker,
    restore_plan,
    saved_from_masks,
    whole_version_tracker,
)

log = logging.getLogger("capricorn_jax")


def _servers_at(inventories: list[dict[int, list[int]]], step: int, hosts: int
                ) -> dict[int, int] | None:
    """{owner: serving host} for ``step``, preferring the owner; None if some owner lacks it."""
    sources = {}
    for owner in range(hosts):
        have = [x for x in range(hosts) if step in inventories[x].get(owner, [])]
        if not have:
            return None
        sources[owner] = owner if owner in have else have[0]
    return sources


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
        sources = _servers_at(inventories, step, hosts)
        if sources is not None:
            return step, sources
    return None


def choose_pec_version(inventories: list[dict[int, list[int]]],
                       needs: dict[int, tuple[list[int], bool]], hosts: int
                       ) -> tuple[int, dict[int, dict[int, int]]] | None:
    """The newest PEC restore point every owner can be assembled at.

    Args:
      inventories: inventories[x][o]: verified steps of owner o in host x's store.
      needs: {step: (versions a restore to it reads, complete)} from the manifests.
      hosts: number of hosts.

    Returns:
      (step, {version read: {owner: serving host}}) or None.
    """
    for step in sorted(needs, reverse=True):
        needed, complete = needs[step]
        if not complete:
            continue
        servers = {}
        for version in sorted({*needed, step}):
            got = _servers_at(inventories, version, hosts)
            if got is None:
                break
            servers[version] = got
        else:
            return step, servers
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


def _inventory(ckpt: TierReader, verify: bool = True) -> dict[int, list[int]]:
    """Per owner, this host's stored versions (``verify``: only those whose
    chunks pass their checksums, a read of every byte)."""
    out = {}
    for owner in ckpt.store.owners():
        good = []
        for step in ckpt.store.versions(owner):
            if not verify or ckpt.store.verify(owner, step):
                good.append(step)
            else:
                log.warning("host %d: version %d of owner %d fails its checksums; ignored",
                            ckpt.host, step, owner)
        out[owner] = good
    return out


def row_chunk_names(plan: PackPlan, j: int) -> list[str]:
    """The store's names of device row ``j``'s chunks, in payload order."""
    return [f"d{j}.c{k}" for k in range(plan.num_chunks)]


def read_rows(ckpt: TierReader, owner: int, step: int, plan: PackPlan | None = None
              ) -> list[np.ndarray]:
    """The payload rows of ``owner``'s version ``step`` in this host's store, one
    copy per row (each chunk checksummed) in ``plan``'s layout (default: the
    full one)."""
    plan = ckpt.plan if plan is None else plan
    manifest = ckpt.store.manifest(owner, step)
    check_compatible(plan, manifest["leaves"])
    if manifest["fingerprint"] != plan.fingerprint():
        raise ValueError(f"version {step} of host {owner} was saved with another layout "
                         f"(mesh, sharding, chunk size or expert count) than the current one")
    rows = [np.empty(plan.payload_bytes, np.uint8) for _ in range(manifest["devices"])]

    def read(j: int) -> None:
        ckpt.store.read_span_into(owner, step, row_chunk_names(plan, j), rows[j], manifest)

    # One copy per row out of the store's slot, then its chunks' CRC32C, rows in
    # parallel (the copy and the checksum release the GIL).
    with concurrent.futures.ThreadPoolExecutor(ckpt.options.write_threads) as pool:
        list(pool.map(read, range(len(rows))))  # raises the first failed read
    return rows


SERVE_ATTEMPTS = 3
"""Tries of a serve round whose bytes failed their check on a receiver (a
byte corrupted in transit) before the recovery fails."""


def _fetch_rows(ckpt: TierReader, step: int, sources: dict[int, int],
                transport: Transport) -> tuple[list[np.ndarray], int]:
    """This host's own payloads of version ``step``: read locally or served by a
    peer (every host runs the same serve rounds). Returns (rows, bytes received).

    A served row follows ``native.integrity``'s rule: its server takes each
    row's CRC32C (``integrity.crc32c``) from the rows it read (each chunk
    checked against the store's CRC), before they leave; every host learns
    them (an all-gather of the small lists); the receiver checks every row
    it expects, as placed in its host copy (a row without its server's CRC
    fails too), and every host learns the verdict (another); a round that
    failed anywhere is served again, up to ``SERVE_ATTEMPTS`` tries, then
    every host raises ``ChecksumError`` naming the rows. Alternative not
    taken: the check inside the serve program (``integrity.crc32c_chunks``,
    as the replication exchange): recovery runs once, where two small
    all-gathers cost nothing."""
    plan = transport.plan
    rows = read_rows(ckpt, ckpt.host, step, plan) if sources[ckpt.host] == ckpt.host else None
    moved = 0
    hooks = ckpt.hooks
    for perm in serve_rounds(sources):
        send: dict[int, np.ndarray] = {}
        if ckpt.host in perm:
            if hooks.on_serve is not None:
                hooks.on_serve(step)  # fault injection: a server lost mid-recovery
            send = dict(enumerate(read_rows(ckpt, perm[ckpt.host], step, plan)))
        sums = {str(j): crc32c(row) for j, row in send.items()}
        for attempt in range(SERVE_ATTEMPTS):
            payloads = send
            if send and attempt < hooks.flip_serve:  # fault injection: bytes hit in transit
                payloads = {**send, 0: send[0].copy()}
                payloads[0][0] ^= 0xFF
                log.warning("host %d: flipped a byte of the row it serves for version %d "
                            "(serve try %d; its fault point)", ckpt.host, step, attempt + 1)
            received = transport.serve(payloads, perm)
            everyone = allgather_json(sums, ckpt.hosts, what="serve_sums")
            bad: list[int] = []
            got = None
            if ckpt.host in perm.values():
                server = next(h for h, owner in perm.items() if owner == ckpt.host)
                got = local_rows(received)
                bad = [j for j, row in enumerate(got)
                       if crc32c(row) != everyone[server].get(str(j))]
            verdicts = allgather_json(bad, ckpt.hosts, what="serve_verdict")
            failed = {owner: rows_bad for owner, rows_bad in enumerate(verdicts) if rows_bad}
            if not failed:
                if got is not None:
                    rows = got
                    moved = sum(r.nbytes for r in got)
                break
            text = "; ".join(f"host {o} rows {r} from host "
                             f"{next(h for h, w in perm.items() if w == o)}"
                             for o, r in sorted(failed.items()))
            log.warning("host %d: version %d served with bytes that fail their check (%s); "
                        "try %d of %d", ckpt.host, step, text, attempt + 1, SERVE_ATTEMPTS)
        else:
            raise ChecksumError(f"version {step}: the rows served in recovery failed their "
                                f"check {SERVE_ATTEMPTS} times ({text})")
    if rows is None:
        raise ChecksumError(f"host {ckpt.host}: no payload for version {step}")
    return rows, moved


def restorable_version(ckpt: TierReader, verify: bool = False) -> int | None:
    """The version ``recover`` restores now, or None (a collective; with
    ``verify`` False it reads no chunk, only the stores' lists and, under PEC,
    the versions' records): the one answer to "which version do I restore"
    that the persistent handler and recovery share (PEC's rule under PEC).
    Without ``verify`` a version whose chunks fail their checksums still
    counts; ``recover`` itself verifies."""
    return _decide(ckpt, verify)[0]


def _decide(ckpt: TierReader, verify: bool = True
            ) -> tuple[int | None, Any, list[dict[int, list[int]]], dict[int, dict[str, Any]]]:
    """(version, its sources: ``choose_version``'s or ``choose_pec_version``'s,
    every host's inventory, the PEC records) of the restore decision."""
    if ckpt.pec is not None:
        inventories, metas = _pec_inventories(ckpt, verify)
        needs = {s: (m["needed"], m["complete"]) for s, m in metas.items()}
        decision: Any = choose_pec_version(inventories, needs, ckpt.hosts)
    else:
        gathered = allgather_json({str(o): v for o, v in _inventory(ckpt, verify).items()},
                                  ckpt.hosts)
        inventories, metas = [{int(o): v for o, v in inv.items()} for inv in gathered], {}
        decision = choose_version(inventories, ckpt.hosts)
    if decision is None:
        return None, None, inventories, metas
    return decision[0], decision[1], inventories, metas


def recover(ckpt: TierReader) -> tuple[Any, RestoreInfo] | None:
    """Restores the newest version every host can reach: (the state in the
    checkpointer's shardings, its RestoreInfo: tier "memory", each host's
    "local"/"peer" in ``memory_tiers``, the slowest host's seconds, the bytes
    moved between hosts), or None if there is none."""
    if ckpt.pec is not None:
        return _recover_pec(ckpt)
    start = time.perf_counter()
    step_or_none, sources_or_none, inventories, _ = _decide(ckpt)
    decision = None if step_or_none is None else (step_or_none, sources_or_none)
    if decision is None:
        if any(any(inv.values()) for inv in inventories):
            log.warning("host %d: stored versions do not cover every host; starting fresh",
                        ckpt.host)
        ckpt.drop_newer_than(-1)
        return None
    step, sources = decision
    ckpt.drop_newer_than(step)
    rows, moved = _fetch_rows(ckpt, step, sources, ckpt.transport)
    blocks = unpack(ckpt.plan, ckpt.host, rows)
    state = jax.block_until_ready(
        global_arrays(blocks, ckpt.abstract_state, ckpt.state_shardings, ckpt.mesh))
    tiers = ["local" if sources[h] == h else "peer" for h in range(ckpt.hosts)]
    mine = {"seconds": time.perf_counter() - start, "bytes": moved}
    everyone = allgather_json(mine, ckpt.hosts)
    return state, _info(step, decode_trailer(ckpt.plan, rows[0]), tiers, everyone)


def _info(step: int, host_state: dict[str, Any], tiers: list[str],
          everyone: list[dict[str, Any]], pec: PecRestore | None = None) -> RestoreInfo:
    """A memory-tier RestoreInfo from every host's {"seconds", "bytes"}."""
    return RestoreInfo(step, "memory", max(x["seconds"] for x in everyone), host_state, tiers,
                       sum(x["bytes"] for x in everyone), pec)


# --------------------------------------------------------------------------- PEC


def _pec_meta(ckpt: TierReader, owner: int, step: int) -> dict[str, Any]:
    """A version's PEC record (without its tracker); a full one if saved without PEC."""
    assert ckpt.pec is not None  # PEC only
    meta = ckpt.store.manifest(owner, step).get("pec")
    if meta is None:
        shape = ckpt.pec.shape
        return {"needed": [step], "complete": True, "count": None, "k": shape[1],
                "mask": mask_to_hex(np.ones(shape, bool)),
                "tokens": step * ckpt.pec.tokens_per_step}
    return {key: meta[key] for key in ("needed", "complete", "count", "k", "mask", "tokens")}


def _pec_inventories(ckpt: TierReader, verify: bool = True
                     ) -> tuple[list[dict[int, list[int]]], dict[int, dict[str, Any]]]:
    """Every host's (verified) steps per owner, and every version's PEC record."""
    inventory = _inventory(ckpt, verify)
    metas: dict[int, dict[str, Any]] = {}
    for owner, steps in inventory.items():
        for step in list(steps):
            try:
                meta = _pec_meta(ckpt, owner, step)
            except (KeyError, TypeError, ValueError):  # a head that parses, a record that does not
                log.warning("host %d: version %d of owner %d has an unreadable PEC record; "
                            "ignored", ckpt.host, step, owner)
                steps.remove(step)
                continue
            metas.setdefault(step, meta)
    doc = {"inv": {str(o): v for o, v in inventory.items()},
           "meta": {str(s): m for s, m in metas.items()}}
    gathered = allgather_json(doc, ckpt.hosts)
    merged: dict[int, dict[str, Any]] = {}
    for d in gathered:  # every host records a version alike
        for s, m in d["meta"].items():
            merged.setdefault(int(s), m)
    return [{int(o): v for o, v in d["inv"].items()} for d in gathered], merged


def _tracker_at(ckpt: TierReader, inventories: list[dict[int, list[int]]], step: int
                ) -> tuple[PltTracker, list[list[int]] | None]:
    """The tracker and the cumulative assignments saved with version ``step``
    (any host's copy; all are alike); None for counts it does not record."""
    assert ckpt.pec is not None  # PEC only
    mine = None
    owner = next((o for o, steps in inventories[ckpt.host].items() if step in steps), None)
    if owner is not None:
        meta = ckpt.store.manifest(owner, step).get("pec") or {}
        if "tracker" in meta:
            mine = {"tracker": meta["tracker"], "cumulative": meta.get("cumulative")}
    docs = [d for d in allgather_json(mine, ckpt.hosts) if d is not None]
    if docs:
        return PltTracker.from_dict(docs[0]["tracker"]), docs[0]["cumulative"]
    # A version saved without PEC.
    return whole_version_tracker(ckpt.pec.shape, ckpt.pec.tracker.top_k, step), None


def _recover_pec(ckpt: TierReader) -> tuple[Any, RestoreInfo] | None:
    assert ckpt.pec is not None  # PEC only
    start = time.perf_counter()
    step_or_none, servers_or_none, inventories, metas = _decide(ckpt)
    decision = None if step_or_none is None else (step_or_none, servers_or_none)
    if decision is None:
        if metas:
            log.warning("host %d: no PEC version can be assembled for every host (some expert "
                        "copy is missing); starting fresh", ckpt.host)
        ckpt.drop_newer_than(-1)
        return None
    step, servers = decision
    ckpt.drop_newer_than(step)
    tracker, cumulative = _tracker_at(ckpt, inventories, step)
    shape = ckpt.pec.shape
    masks = {v: mask_from_hex(metas[v]["mask"], shape) for v in servers}
    plan = restore_plan(saved_from_masks(masks, shape), step, tracker,
                                metas[step]["tokens"])
    blocks = PecBlocks(ckpt, plan.source)
    moved, host_state = 0, {}
    for version in sorted(servers):
        transport = ckpt.pec.transport(metas[version]["count"])
        rows, got = _fetch_rows(ckpt, version, servers[version], transport)
        moved += got
        blocks.fold(version, rows, transport.plan, masks[version], version == step)
        if version == step:
            host_state = decode_trailer(transport.plan, rows[0])
    state = jax.block_until_ready(
        global_arrays(blocks.result(), ckpt.abstract_state, ckpt.state_shardings, ckpt.mesh))
    tracker.on_restored(plan)
    tiers = ["local" if all(s[h] == h for s in servers.values()) else "peer"
             for h in range(ckpt.hosts)]
    if "peer" in tiers:
        # Some host's own store lacks versions of its chain (a lost machine,
        # a corrupt copy): the next version carries every expert, so that no
        # later version (nor a persistent write, which reads the own store
        # only) needs a copy the own store does not hold. Same on every host.
        tracker.forget_copies()
    ckpt.resume_pec(tracker, int(metas[step]["k"]), cumulative)
    everyone = allgather_json({"seconds": time.perf_counter() - start, "bytes": moved},
                               ckpt.hosts)
    info = PecRestore(plan.plt, plan.accumulated_plt, plan.source.tolist(), sorted(servers),
                      int(metas[step]["k"]))
    return state, _info(step, host_state, tiers, everyone, info)


class PecBlocks:
    """This host's shard blocks, assembled from several versions (PEC restore).

    Non-expert leaves come from the restore point; expert leaf i's block on
    device p gets local expert j from the version ``source[layer, e]``, e the
    expert's global index. Devices of this host holding the same block share
    one buffer.
    """

    def __init__(self, ckpt: TierReader, source: np.ndarray):
        assert ckpt.pec is not None  # PEC only
        self.ckpt, self.source = ckpt, source
        self.experts = ckpt.pec.experts
        self.layer_of = dict(zip(self.experts.leaves, self.experts.layers, strict=True))
        self.positions = ckpt.plan.host_positions(ckpt.host)
        self.blocks: dict[int, list[np.ndarray | None]] = {
            p: [None] * len(ckpt.plan.leaves) for p in self.positions}
        self.filled: dict[tuple[int, int], set[int]] = {}

    def fold(self, version: int, rows: list[np.ndarray], plan: PackPlan, mask: np.ndarray,
             restore_point: bool) -> None:
        """Takes what ``source`` wants of version ``version`` (its payload ``rows``)."""
        host = self.ckpt.host
        non_expert: Mapping[int, Sequence[np.ndarray | None]]
        if plan.experts is None:
            full = unpack(plan, host, rows)
            local = range(self.experts.local_experts)
            slices = {p: {(i, j): full[p][i][j] for i in self.layer_of for j in local}
                      for p in self.positions}
            non_expert = full
        else:
            gather = padded_gather_indices(mask, self.experts.ranks)[0]
            non_expert, slices = unpack_pec(plan, host, rows, gather)
        for p in self.positions:
            if restore_point:
                for i, block in enumerate(non_expert[p]):
                    if i not in self.layer_of:
                        self.blocks[p][i] = block
            self._take_experts(p, version, slices[p])

    def _take_experts(self, p: int, version: int,
                      slices: dict[tuple[int, int], np.ndarray]) -> None:
        ep, plan = self.experts, self.ckpt.plan
        for (i, j), piece in slices.items():
            expert = ep.expert_rank[p] * ep.local_experts + j
            if self.source[self.layer_of[i], expert] != version:
                continue
            block = self.blocks[p][i]
            if block is None:
                slot = plan.leaves[i]
                twin = next((shared for q in self.positions
                             if (shared := self.blocks[q][i]) is not None
                             and plan.block_keys[i][q] == plan.block_keys[i][p]), None)
                block = (twin if twin is not None
                         else np.empty(slot.block_shape, np.dtype(slot.dtype)))
                self.blocks[p][i] = block
            block[j] = piece
            self.filled.setdefault((p, i), set()).add(j)

    def result(self) -> dict[int, list[np.ndarray]]:
        """The blocks; raises naming a leaf whose block is incomplete."""
        plan = self.ckpt.plan
        out: dict[int, list[np.ndarray]] = {}
        for p in self.positions:
            out[p] = []
            for i, block in enumerate(self.blocks[p]):
                if block is None or (i in self.layer_of and len(
                        self.filled.get((p, i), ())) != self.experts.local_experts):
                    raise RuntimeError(f"host {self.ckpt.host}: the restore assembled no "
                                        f"complete block of {plan.leaves[i].path} on device {p}")
                out[p].append(block)
        return out
