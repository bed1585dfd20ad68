"""Partial expert checkpointing in the in-memory tier: payloads, store, recovery.

Single-process tests use the four CPU devices as one host (mesh data 2 x
expert 2, so C = K experts per device with two MoE layers) unless they say
otherwise. ``test_two_processes_restore_pec_versions_from_a_peer`` starts this
file as two real processes (``python tests/test_pec_packing.py --worker``),
joined by jax.distributed with gloo, and wipes one host's store.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import cast

if __name__ == "__main__":  # a worker of the two-process test: set up JAX first
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import capricorn_jax
from capricorn_jax._src.memory.store.head_seal import seal
from capricorn_jax._src.memory.store.store import HostStore
from capricorn_jax._src.memory.tier import retention
from capricorn_jax._src.memory.wire.packing import (
    TRAILER_BYTES,
    make_pec_plan,
    make_plan,
    unpack,
    unpack_pec,
)
from capricorn_jax._src.memory.wire.transport import Transport, local_rows
from capricorn_jax._src.partial.leaves import MoEShape, expert_leaf_axes, leaf_steps, pec_bytes
from capricorn_jax._src.partial.plans import version_needs
from capricorn_jax._src.partial.selection import PecOptions, padded_gather_indices, sequential_mask
from capricorn_jax._src.partial.tracker import PltTracker, restore_plan
from launch.trainer import OptimizerOptions, Trainer, make_mesh
from models import get_config
from tests.helpers import child_env
from tests.tree_utils import assert_trees_equal

ROOT = Path(__file__).resolve().parent.parent
TOKENS_PER_STEP = 16 * 64  # tiny: global batch x sequence length
TPE = np.full((2, 8), TOKENS_PER_STEP * 2 // 8)  # top-2, spread evenly


@pytest.fixture(scope="module")
def trainer():
    return Trainer(get_config("tiny"), make_mesh(2), OptimizerOptions())


def _bump(trainer):
    """A jitted state -> state + v (every leaf), so each version's values differ."""
    return jax.jit(lambda s, v: jax.tree.map(lambda x: x + v.astype(x.dtype), s),
                   out_shardings=trainer.state_shardings)


def _checkpointer(trainer, root, pec_options=None, **kw):
    opts = capricorn_jax.InMemoryOptions(store_root=str(root), job="j", replicas=1,
                                         pec=pec_options, **kw)
    extra = {} if pec_options is None else {"model": trainer.cfg,
                                            "tokens_per_step": TOKENS_PER_STEP}
    return capricorn_jax.InMemoryCheckpointer(opts, trainer.mesh, trainer.abstract_state,
                                              trainer.state_shardings, 0, 1, **extra)


def _expected(base_leaves, leaves, steps):
    """base + the step each leaf (or each expert of an expert leaf) comes from."""
    out = {}
    for (path, info), base in zip(leaves.items(), base_leaves, strict=True):
        step = np.asarray(steps[path])
        if info is not None:
            step = step.reshape((-1,) + (1,) * (base.ndim - 1))
        out[path] = base + step.astype(base.dtype)
    return out


def _replay(masks: dict[int, np.ndarray]) -> PltTracker:
    """The tracker the checkpointer must hold after saving ``masks`` (step -> mask)."""
    tracker = PltTracker(2, 8, top_k=2)
    for step in sorted(masks):
        tracker.observe(TPE)
        tracker.on_saved(step, masks[step])
    return tracker


# ------------------------------------------------------------------ payload bytes


def test_bytes_per_version_follow_pec_bytes(trainer, tmp_path):
    """K = 1, 2, N: the payload's state bytes are pec_bytes(K), the trailers aside."""
    cfg = trainer.cfg
    ckpt = _checkpointer(trainer, tmp_path, PecOptions(k=1, dynamic=False))
    state = trainer.init_state(0)
    devices = len(ckpt.plan.host_positions(0))
    slack = 4 * len(ckpt.plan.leaves)  # per-leaf rounding of the split over 4 devices
    masks = {1: None, 2: sequential_mask(1, 2, 2, 8, 2), 3: sequential_mask(2, 3, 2, 8, 2)}
    sent = {}
    for step, k in zip(masks, (8, 1, 2), strict=True):
        report = ckpt.save(step, state, {"s": step}, tokens_per_expert=TPE,
                           expert_mask=masks[step])
        assert report.pec_k == k
        sent[step] = report.bytes
        state_bytes = report.bytes - devices * TRAILER_BYTES
        assert 0 <= state_bytes - pec_bytes(trainer.abstract_state, cfg, k) <= slack, k
    ckpt.wait_until_finished(60)
    for v in ckpt.store.versions(0):  # the store holds exactly the payloads
        chunks = ckpt.store.manifest(0, v)["chunks"].values()
        assert sum(c["nbytes"] for c in chunks) == sent[v]
    assert sent[2] < sent[3] < sent[1]
    ckpt.close()


def test_pec_plan_roundtrip_on_two_simulated_hosts():
    """ep4 over hosts (0,0,1,1): every carried expert unpacks to its own bytes;
    K*L/R not a whole number pads the emptier ranks with empty slots."""
    trainer = Trainer(get_config("tiny"), make_mesh(4), OptimizerOptions())
    state = trainer.init_state(0)
    base = make_plan(trainer.abstract_state, trainer.state_shardings, trainer.mesh, 1 << 16,
                     device_host=[0, 0, 1, 1])
    layers = [None if i is None else i.moe_layer
              for i in expert_leaf_axes(trainer.abstract_state, trainer.cfg).values()]
    mask = sequential_mask(1, 5, 2, 8, 4)  # 2 experts on 4 ranks: counts 1, 1, 0, 0
    gather, counts = padded_gather_indices(mask, 4)
    assert sorted(counts.tolist()) == [0, 0, 1, 1] and (gather[counts == 0] == -1).all()
    plan = make_pec_plan(base, layers, gather.shape[1])
    assert plan.fingerprint() != base.fingerprint()
    transport = Transport(plan, trainer.mesh, trainer.state_shardings, [{0: 1, 1: 0}], 2)
    own, received, _, _ = transport.replicate(state, np.zeros(TRAILER_BYTES, np.uint8),
                                              np.zeros(2), gather)
    rows, peer = local_rows(own), local_rows(received[0])
    np.testing.assert_array_equal(np.stack(peer[:2]), np.stack(rows[2:]))
    leaves = jax.tree.leaves(state)
    seen = set()
    for owner in (0, 1):
        positions = plan.host_positions(owner)
        blocks, slices = unpack_pec(plan, owner, [rows[p] for p in positions], gather)
        for p in positions:
            device = trainer.mesh.devices.flat[p]
            shard = {i: next(np.asarray(s.data) for s in x.addressable_shards
                             if s.device == device) for i, x in enumerate(leaves)}
            for i, block in enumerate(blocks[p]):
                if block is None:
                    assert layers[i] is not None
                else:
                    np.testing.assert_array_equal(block, shard[i])
            for (i, j), piece in slices[p].items():
                np.testing.assert_array_equal(piece, shard[i][j])
                seen.add((layers[i], plan.experts.expert_rank[p] * 2 + j))
    assert seen == {tuple(x) for x in np.argwhere(mask)}
    with pytest.raises(ValueError, match="unpack_pec"):
        unpack(plan, 0, rows[:2])


# ------------------------------------------------------------------ K = N


def test_k_equal_n_is_bitwise_the_full_checkpoint(trainer, tmp_path):
    state = _bump(trainer)(trainer.init_state(0), jnp.int32(3))
    full = _checkpointer(trainer, tmp_path / "full")
    part = _checkpointer(trainer, tmp_path / "pec", PecOptions(k=2))
    full.save(1, state, {"data": 1})
    report = part.save(1, state, {"data": 1}, tokens_per_expert=TPE)
    assert report.pec_k == 8  # no expert has a copy yet: the first version is full
    for ckpt in (full, part):
        ckpt.wait_until_finished(60)
    meta_full, meta_part = full.store.manifest(0, 1), part.store.manifest(0, 1)
    assert set(meta_full["chunks"]) == set(meta_part["chunks"])
    for name in meta_full["chunks"]:
        assert full.store.read_chunk(0, 1, name) == part.store.read_chunk(0, 1, name), name
    for meta in (meta_full, meta_part):  # the store's own record of where it put them
        del meta["generation"], meta["slot"]
    assert "pec" not in meta_full and meta_part.pop("pec")["needed"] == [1]
    assert meta_full == meta_part
    for ckpt in (full, part):
        ckpt.close()
    restored = [capricorn_jax.recover(_checkpointer(trainer, tmp_path / name, opts))
                for name, opts in (("full", None), ("pec", PecOptions(k=2)))]
    assert_trees_equal(restored[0][0], state, check_sharding=True)
    assert_trees_equal(restored[1][0], state, check_sharding=True)
    assert restored[1][1].pec.versions == [1] and restored[1][1].pec.plt == 0.0


def test_scheduled_path_commits_full_and_planned_pec_versions(trainer, tmp_path):
    """save_transferred: version 1 as the in-step executor moves it today (full
    plan), version 2 packed by the program of a planned PEC version."""
    bump, base = _bump(trainer), trainer.init_state(0)
    ckpt = _checkpointer(trainer, tmp_path, PecOptions(k=2, dynamic=False))
    own, received, _, _ = ckpt.transport.replicate(
        bump(base, jnp.int32(1)), np.zeros(TRAILER_BYTES, np.uint8), np.zeros(2))
    assert ckpt.save_transferred(1, own, received, tokens_per_expert=TPE).pec_k == 8
    version = ckpt.plan_pec_version(2, TPE)
    assert version.k == 2 and version.gather.shape == (2, 2)
    own, received, _, _ = version.transport.replicate(
        bump(base, jnp.int32(2)), np.zeros(TRAILER_BYTES, np.uint8), np.zeros(2), version.gather)
    with pytest.raises(ValueError, match="version 2"):
        ckpt.save_transferred(3, own, received, version=version)
    assert ckpt.save_transferred(2, own, received, version=version).pec_k == 2
    ckpt.close()
    restored, recovered = capricorn_jax.recover(_checkpointer(trainer, tmp_path,
                                                               PecOptions(k=2)))
    masks = {1: np.ones((2, 8), bool), 2: version.mask}
    saved = {key: [s for s in masks if masks[s][key]] for key in np.ndindex(2, 8)}
    plan = restore_plan(saved, 2, _replay(masks), 2 * TOKENS_PER_STEP)
    assert recovered.pec.versions == [1, 2] and recovered.pec.source == plan.source.tolist()
    leaves = expert_leaf_axes(trainer.abstract_state, trainer.cfg)
    want = _expected([np.asarray(x) for x in jax.tree.leaves(base)], leaves,
                     leaf_steps(plan, leaves))
    for (path, _), got in zip(leaves.items(), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want[path], err_msg=path)


# ------------------------------------------------------------------ restore + prune


@pytest.mark.parametrize("damage", ["json", "pec_record"])
def test_a_version_with_an_unreadable_manifest_is_ignored_on_open(trainer, tmp_path, caplog,
                                                                  damage):
    """A PEC store reopened with a corrupt manifest (a head that does not
    parse, or one whose PEC record lost its fields): the checkpointer opens,
    says which version it ignores, and recovery takes the newest good one."""
    base = trainer.init_state(0)
    ckpt = _checkpointer(trainer, tmp_path, PecOptions(k=8, dynamic=False))
    for step in (1, 2, 3):
        ckpt.save(step, base, {"data": step}, tokens_per_expert=TPE)
        ckpt.wait_until_finished(60)
    ckpt.close()
    slot = HostStore(tmp_path / "j" / "host0").manifest(0, 3)["slot"]
    head = tmp_path / "j" / "host0" / "owner0" / f"slot{slot}.head"
    if damage == "json":
        head.write_text("{")
        said = f"owner0/slot{slot}.head: unreadable commit record; its version is ignored"
    else:
        record = json.loads(head.read_text())
        (record["meta"] if "pec" in record.get("meta", {}) else record)["pec"] = {}
        head.write_text(json.dumps(seal(record)))  # as a writer that wrote it so
        said = "version 3 of owner 0 has an unreadable manifest; ignored"
    with caplog.at_level("WARNING", logger="capricorn_jax"):
        fresh = _checkpointer(trainer, tmp_path, PecOptions(k=8, dynamic=False))
    assert said in caplog.text
    _, recovered = capricorn_jax.recover(fresh)
    assert recovered.step == 2 and recovered.host_state == {"data": 2}
    fresh.close()


def test_restored_experts_come_from_one_step_and_prune_keeps_what_restore_needs(
        trainer, tmp_path):
    """Versions 1 (full), 2..9 (K=2, sequential), 10..11 (K=1, given masks), each
    with its own values: every leaf restores from the step leaf_steps names; an
    expert's parameters and moments from one step; the store stays within
    ceil(N/K) + 2 versions while K=2."""
    bump, base = _bump(trainer), trainer.init_state(0)
    ckpt = _checkpointer(trainer, tmp_path, PecOptions(k=2, dynamic=False))
    masks = {}
    for step in range(1, 12):
        given = sequential_mask(1, step, 2, 8, 2) if step >= 10 else None
        ckpt.save(step, bump(base, jnp.int32(step)), {"data": step}, tokens_per_expert=TPE,
                  expert_mask=given)
        masks[step] = (given if given is not None else np.ones((2, 8), bool) if step == 1
                       else sequential_mask(2, step, 2, 8, 2))
        ckpt.wait_until_finished(60)
        if 2 <= step <= 9:
            assert len(ckpt.store.versions(0)) <= math.ceil(8 / 2) + 2, ckpt.store.versions(0)
    tracker = _replay(masks)
    assert ckpt.pec.tracker == tracker
    newest = tracker.saved_step
    assert set(np.unique(newest)) <= set(ckpt.store.versions(0))  # every newest copy kept
    ckpt.close()

    fresh = _checkpointer(trainer, tmp_path, PecOptions(k=2, dynamic=False))
    restored, recovered = capricorn_jax.recover(fresh)
    saved = {key: [s for s in masks if masks[s][key]] for key in np.ndindex(2, 8)}
    plan = restore_plan(saved, 11, tracker, 11 * TOKENS_PER_STEP)
    assert recovered.step == 11 and recovered.host_state == {"data": 11}
    assert recovered.pec.source == plan.source.tolist()
    assert recovered.pec.plt == pytest.approx(plan.plt) and recovered.pec.plt > 0
    assert recovered.pec.versions == sorted({*np.unique(plan.source).tolist(), 11})
    assert len(set(recovered.pec.versions)) > 2  # experts really came from several versions
    leaves = expert_leaf_axes(trainer.abstract_state, trainer.cfg)
    want = _expected([np.asarray(x) for x in jax.tree.leaves(base)], leaves,
                     leaf_steps(plan, leaves))
    for (path, _), got in zip(leaves.items(), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want[path], err_msg=path)
    tracker.on_restored(plan)
    assert fresh.pec.tracker == tracker and fresh.pec.k == 1
    fresh.save(12, restored, {"data": 12}, tokens_per_expert=TPE)  # goes on from 11
    fresh.close()


def test_versions_to_keep_is_bounded_and_always_restorable():
    """Sequential selection at constant K, replication lagging 0..2 versions."""
    rng = np.random.default_rng(0)
    for k in (1, 2, 3, 8):
        tracker, needs, replicated = PltTracker(2, 8, top_k=2), {}, -1
        for step in range(1, 40):
            tracker.observe(TPE)
            mask = (np.ones((2, 8), bool) if step == 1
                    else sequential_mask(k, step, 2, 8, 2))
            tracker.on_saved(step, mask)
            needs[step] = version_needs(tracker.saved_step)
            replicated = max(replicated, step - int(rng.integers(0, 3)))  # never goes back
            keep = retention.versions_to_keep(needs, replicated, window=2)
            needs = {v: n for v, n in needs.items() if v in keep}
            assert len(keep) <= math.ceil(8 / k) + 2, (k, step, sorted(keep))
            assert set(np.unique(tracker.saved_step)) <= keep  # the newest restore works
            safe = [v for v in keep if v <= replicated and set(needs[v][0]) <= keep]
            assert safe or replicated < 1, (k, step, sorted(keep))


def test_pec_argument_errors(trainer, tmp_path):
    full = _checkpointer(trainer, tmp_path / "a")
    with pytest.raises(ValueError, match="tokens_per_expert"):
        full.save(1, trainer.init_state(0), {}, tokens_per_expert=TPE)
    full.close()
    with pytest.raises(ValueError, match="tokens_per_step"):
        capricorn_jax.InMemoryCheckpointer(
            capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="b", replicas=1,
                                          pec=PecOptions()),
            trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1)
    part = _checkpointer(trainer, tmp_path / "c", PecOptions())
    with pytest.raises(ValueError, match="tokens_per_expert"):
        part.save(1, trainer.init_state(0), {})
    with pytest.raises(ValueError, match="does not follow step 0"):
        part.save(3, trainer.init_state(0), {}, tokens_per_expert=TPE)
    with pytest.raises(ValueError, match="expert_mask"):
        part.save(1, trainer.init_state(0), {}, tokens_per_expert=TPE,
                  expert_mask=np.ones((2, 4), bool))
    part.close()


# ------------------------------------------------------------------ two processes


@pytest.mark.slow
def test_two_processes_restore_pec_versions_from_a_peer(tmp_path):
    """Two real hosts (2 devices each, ep4), replicas=2, K=2: host 1's store is
    wiped, so its expert copies (four versions) come from host 0's replicas."""
    from launch.cluster.processes import free_port

    env = child_env(2)
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", str(h), str(port), str(tmp_path)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for h in range(2)]
    try:
        deadline = time.monotonic() + 240
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one host failed: the other waits in a collective forever
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        outputs = [p.communicate()[0] for p in procs]
    for h, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"host {h} failed ({p.returncode}):\n{out[-4000:]}"
    results = [json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:])
               for out in outputs]
    for r in results:
        assert r["tiers"] == ["local", "peer"] and r["step"] == 6
        # Sequential K=2 of 8: versions 3..6 hold the newest copy of every expert.
        assert r["bytes_moved"] > 0 and r["versions"] == [3, 4, 5, 6] and r["plt"] > 0
    assert results[0]["source"] == results[1]["source"]


def _worker(host: int, port: int, root: str) -> None:
    from jax.experimental import multihost_utils

    from launch.runtime import init_distributed

    init_distributed(2, f"127.0.0.1:{port}", host)
    cfg = get_config("tiny")
    trainer = Trainer(cfg, make_mesh(4), OptimizerOptions())
    bump, base = _bump(trainer), trainer.init_state(0)
    opts = capricorn_jax.InMemoryOptions(store_root=root, job="two", replicas=2,
                                         chunk_bytes=1 << 18, pec=PecOptions(k=2, dynamic=False))

    def checkpointer():
        return capricorn_jax.InMemoryCheckpointer(
            opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, host, 2,
            model=cfg, tokens_per_step=TOKENS_PER_STEP)

    ckpt, masks = checkpointer(), {}
    for step in range(1, 7):
        ckpt.save(step, bump(base, jnp.int32(step)), {"data": [host, step]},
                  tokens_per_expert=TPE)
        masks[step] = np.ones((2, 8), bool) if step == 1 else sequential_mask(2, step, 2, 8, 4)
        ckpt.wait_until_finished(60)
    ckpt.close()
    multihost_utils.sync_global_devices("saved")
    if host == 1:
        ckpt.store.wipe()  # the machine is lost: its RAM store is gone
    multihost_utils.sync_global_devices("wiped")
    result = capricorn_jax.recover(checkpointer())
    assert result is not None
    restored, recovered = result
    assert recovered.pec is not None
    assert recovered.host_state == {"data": [host, 6]}, recovered.host_state
    tracker = _replay(masks)
    saved = {key: [s for s in masks if masks[s][key]] for key in np.ndindex(2, 8)}
    plan = restore_plan(saved, 6, tracker, 6 * TOKENS_PER_STEP)
    assert recovered.pec.source == plan.source.tolist() and recovered.pec.plt == plan.plt
    _check_shards(base, restored, leaf_steps(plan, expert_leaf_axes(
        trainer.abstract_state, cast(MoEShape, cfg))))
    print("RESULT " + json.dumps({
        "tiers": recovered.memory_tiers, "step": recovered.step,
        "bytes_moved": recovered.bytes_moved, "versions": recovered.pec.versions,
        "plt": recovered.pec.plt, "source": recovered.pec.source}), flush=True)


def _check_shards(base, restored, steps) -> None:
    """Each addressable shard of ``restored`` equals base + its step(s), bitwise."""
    flat = jax.tree_util.tree_flatten_with_path(restored)[0]
    for (path, got), want_leaf in zip(flat, jax.tree.leaves(base), strict=True):
        name = jax.tree_util.keystr(path)
        step = np.asarray(steps[name])
        by_device = {s.device: s for s in want_leaf.addressable_shards}
        for shard in got.addressable_shards:
            b = np.asarray(by_device[shard.device].data)
            s = step if step.ndim == 0 else step[shard.index[0]].reshape(
                (-1,) + (1,) * (b.ndim - 1))
            np.testing.assert_array_equal(np.asarray(shard.data), b + s.astype(b.dtype),
                                          err_msg=name)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"]:
        sys.exit("usage: test_pec_packing.py --worker HOST PORT ROOT")
    try:
        _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    except BaseException:  # noqa: BLE001 - reported through the exit code
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # skip jax.distributed's shutdown barrier: both hosts are done
