"""Kill-and-recover with real processes: the job resumes from host RAM and
continues bitwise identically to a run that never failed (float32, CPU)."""

import functools
import json
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from capricorn_jax._src.memory.store.store import HostStore
from tests.helpers import assert_no_orphans, run_train
from tests.tree_utils import assert_trees_equal

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # every test here starts processes

COMMON = ("--model=tiny", "--eval_sequences=0", "--log_every=5")
STEPS = 14


def _train(workdir, store, *flags, hosts=2, devices=2, steps=STEPS, audit=False, ckpt="inmem"):
    env = {"CAPRICORN_AUDIT_STORE": "1"} if audit else {}
    proc = run_train(f"--hosts={hosts}", f"--devices_per_host={devices}", f"--steps={steps}",
                     f"--workdir={workdir}", f"--store_root={store}", f"--ckpt={ckpt}",
                     *COMMON, *flags,
                     timeout=400, env=env)
    if proc.returncode != 0:
        per_host = {h: [x for x in proc.stdout.splitlines() if x.startswith(f"[host {h}]")
                        and "Gloo" not in x] for h in range(hosts)}
        tails = "\n".join("\n".join(lines[-25:]) for lines in per_host.values())
        raise AssertionError(f"launch.train failed ({proc.returncode}):\n{tails}\n"
                             f"{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    assert "STORE ISOLATION VIOLATION" not in proc.stdout + proc.stderr
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert_no_orphans(str(workdir))
    return proc, records


def _losses(records):
    """Loss per step; a step run twice (before and after a failure) must agree."""
    out = {}
    for r in records:
        if "event" in r:
            continue
        if r["step"] in out:
            assert r["loss"] == out[r["step"]], f"step {r['step']} differs after recovery"
        out[r["step"]] = r["loss"]
    return out


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run: its losses, and every step's full state as an
    Orbax step in WORKDIR/checkpoints (the PEC tests assemble from them)."""
    root = tmp_path_factory.mktemp("ref")
    _, records = _train(root / "w", root / "s", "--persist_every=1", f"--max_to_keep={STEPS}",
                        hosts=2, devices=2)
    losses = _losses(records)
    assert sorted(losses) == list(range(STEPS))
    return losses, root / "w" / "checkpoints"


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run[0]


def _events(records, name):
    return [r for r in records if r.get("event") == name]


@pytest.mark.parametrize("mode,tier", [pytest.param("process", "local", marks=pytest.mark.soak),
                                       ("host", "peer")])
def test_kill_resumes_from_memory_bitwise(tmp_path, reference, mode, tier):
    proc, records = _train(tmp_path / "w", tmp_path / "s", "--kill_host=1", "--kill_at_step=6",
                           f"--kill_mode={mode}", audit=True)
    (recovery,) = _events(records, "recovery")
    assert recovery["tiers"][0] == "local"
    if mode == "host":
        assert recovery["tiers"] == ["local", "peer"] and recovery["bytes_moved"] > 0
    else:
        # A crashed process keeps its store, but it may have died while writing
        # the newest version, which then only its peer holds.
        assert recovery["tiers"][1] in ("local", "peer")
        assert (recovery["bytes_moved"] > 0) == (recovery["tiers"][1] == "peer")
    tier = recovery["tier"]
    assert 6 <= recovery["step"] <= STEPS
    assert _losses(records) == reference
    # The console: one line for the fault, the lost host, the survivor stopped
    # because of it (its traceback hidden) and the recovery.
    lines = proc.stdout.splitlines()
    assert [x for x in lines if "recovery: resumed" in x] == [
        f"[host 0] recovery: resumed from step {recovery['step']} via tier {tier} "
        f"(hosts: {', '.join(recovery['tiers'])}) in {recovery['seconds']:.2f}s, "
        f"{recovery['bytes_moved']} bytes from peers"]
    assert len([x for x in lines if x.startswith("fault: SIGKILLed host 1 at step 6")]) == 1
    assert "[host 0] stopped after host 1 was killed (its error output: --verbose)" in lines
    assert "Traceback" not in proc.stdout and "Gloo" not in proc.stdout
    checkpoints = _events(records, "checkpoint")
    assert {c["step"] for c in checkpoints} == set(range(1, STEPS + 1))
    assert all(c["bytes"] > 0 for c in checkpoints)
    # RAM held by host 0's store (measured when a save starts): own + replica versions.
    assert max(c["store_bytes"] for c in checkpoints) >= 2 * checkpoints[0]["bytes"]
    # Every host's store size reaches host 0 through the all-gathered statuses.
    per_host = checkpoints[-1]["store_kib_per_host"]
    assert len(per_host) == 2 and all(k * 1024 >= checkpoints[0]["bytes"] for k in per_host)


@pytest.mark.soak
@pytest.mark.parametrize("ckpt,flags", [("gemini", ("--profile_first_n=3",)),
                                        # The drift trigger re-profiles mid-run on tiny's
                                        # fixed dispatch (the capacity trigger would not).
                                        ("capricorn", ("--timeline", "--profile_trigger=drift"))])
def test_scheduled_strategy_commits_every_version_and_recovers(tmp_path, reference, ckpt,
                                                                flags):
    """The scheduled strategies move versions inside the step, re-partition
    (capricorn: mid-run), commit every version, and recover from a host loss
    bitwise like inmem."""
    proc, records = _train(tmp_path / "w", tmp_path / "s", "--kill_host=1", "--kill_at_step=7",
                           "--kill_mode=host", *flags, audit=True, ckpt=ckpt)
    (recovery,) = _events(records, "recovery")
    assert recovery["tiers"] == ["local", "peer"] and recovery["bytes_moved"] > 0
    assert 7 <= recovery["step"] <= STEPS
    assert _losses(records) == reference
    checkpoints = _events(records, "checkpoint")
    assert {c["step"] for c in checkpoints} == set(range(1, STEPS + 1))
    # A version moved inside a step carries every byte of the unscheduled one.
    moved = [c for c in checkpoints if "moved_in_step" in c]
    assert moved and all(c["moved_in_step"] == c["step"] for c in moved)
    assert {c["bytes"] for c in checkpoints} == {checkpoints[0]["bytes"]}
    repartitions = _events(records, "repartition")
    assert repartitions and all(r["strategy"] == ckpt for r in repartitions)
    for r in repartitions:
        assert sum(r["window_bytes"]) + r["tail_bytes"] == checkpoints[0]["bytes"] // 2
    if ckpt == "capricorn":
        # Re-partitioned in the middle of the run, between versions moved in steps.
        assert any(min(c["step"] for c in moved) < r["step"] < max(c["step"] for c in moved)
                   for r in repartitions)
    else:  # gemini schedules once per process, after its first n steps
        assert len(repartitions) == 2
    assert f"via tier {recovery['tier']}" in proc.stdout
    if "--timeline" in flags:
        doc = json.loads((tmp_path / "w" / "timeline.json").read_text())
        assert doc["metadata"]["scheduled"] and (tmp_path / "w" / "timeline.png").exists()


@pytest.mark.soak
def test_capricorn_moves_partial_expert_versions_inside_the_step(tmp_path):
    """capricorn with PEC (K = 2 of 8): the versions moved inside steps carry
    K experts per layer (fewer bytes, own schedule), every version commits,
    and a host loss restores each expert from its newest copy."""
    _, records = _train(tmp_path / "w", tmp_path / "s", "--kill_host=1", "--kill_at_step=7",
                        "--kill_mode=host", "--pec_k=2", "--nopec_dynamic", audit=True,
                        ckpt="capricorn")
    checkpoints = _events(records, "checkpoint")
    assert {c["step"] for c in checkpoints} == set(range(1, STEPS + 1))
    full = checkpoints[0]["bytes"]
    assert checkpoints[0]["pec_k"] == 8
    moved = [c for c in checkpoints if "moved_in_step" in c]
    assert moved and all(c["pec_k"] == 2 and c["bytes"] < full for c in moved)
    (recovery,) = _events(records, "recovery")
    assert recovery["tiers"] == ["local", "peer"] and 7 <= recovery["step"] <= STEPS
    sources = {s for layer in recovery["expert_source_steps"] for s in layer}
    assert max(sources) == recovery["step"] and sorted(sources) == recovery["versions"]
    assert [r["step"] for r in records if "event" not in r][-1] == STEPS - 1


@pytest.mark.soak
def test_pec_full_k_recovers_bitwise(tmp_path, reference):
    """PEC with K = N is the full checkpoint: same bytes, bitwise the same run."""
    _, records = _train(tmp_path / "w", tmp_path / "s", "--kill_host=1", "--kill_at_step=6",
                        "--kill_mode=host", "--pec_k=8", "--nopec_dynamic")
    (recovery,) = _events(records, "recovery")
    assert recovery["plt"] == 0.0 and recovery["versions"] == [recovery["step"]]
    assert _losses(records) == reference


@pytest.mark.soak
def test_pec_repeated_host_loss_assembles_experts_from_several_versions(tmp_path):
    """K = 2 of 8 experts per version, host 1 lost every 5 steps: each restore
    takes every expert (params and moments) from its newest copy."""
    _, records = _train(tmp_path / "w", tmp_path / "s", "--kill_host=1", "--kill_at_step=5",
                        "--kill_every=5", "--kill_mode=host", "--pec_k=2", "--nopec_dynamic",
                        steps=16)
    recoveries = _events(records, "recovery")
    # Lost after steps 5, 10, 15: each resume is from the version that step made,
    # or the one before if the lost host was still writing it.
    assert len(recoveries) >= 2
    kills = (5, 10, 15)[: len(recoveries)]
    assert all(r["step"] in (k, k + 1) for r, k in zip(recoveries, kills, strict=True))
    checkpoints = _events(records, "checkpoint")
    full = checkpoints[0]["bytes"]
    assert checkpoints[0]["pec_k"] == 8  # the first version has no older copies to lean on
    assert all(c["pec_k"] == 2 and c["bytes"] < full for c in checkpoints[1:])
    for r in recoveries:
        sources = {s for layer in r["expert_source_steps"] for s in layer}
        assert len(sources) == 4 and max(sources) == r["step"]  # ceil(8 / 2) versions
        assert sorted(sources) == r["versions"] and r["tiers"] == ["local", "peer"]
        assert 0.0 < r["plt"] <= r["accumulated_plt"]
    assert [r["step"] for r in records if "event" not in r][-1] == 15


def test_persistent_tier_takes_over_when_every_ram_store_is_lost(tmp_path, reference):
    """Two levels: the memory tier every step, Orbax steps every 4 from host RAM;
    with every host's RAM store gone, --resume restores the newest Orbax step."""
    _, first = _train(tmp_path / "w", tmp_path / "s", "--persist_every=4", "--max_to_keep=2",
                      "--kill_host=1", "--kill_at_step=6", "--kill_mode=host", steps=10)
    (recovery,) = _events(first, "recovery")
    assert recovery["tiers"] == ["local", "peer"]
    assert [e["step"] for e in _events(first, "persist")] == [1, 4, 8]
    steps = sorted(int(p.name) for p in (tmp_path / "w" / "checkpoints").iterdir()
                   if p.name.isdigit())
    assert steps == [4, 8]  # max_to_keep; no temporary step left behind
    assert not list((tmp_path / "w" / "checkpoints").glob("*tmp*"))
    import shutil

    shutil.rmtree(tmp_path / "s")  # every host's RAM is lost
    _, records = _train(tmp_path / "w", tmp_path / "s", "--persist_every=4", "--max_to_keep=2",
                        "--resume", steps=STEPS)
    (restore,) = [r for r in _events(records, "recovery") if r not in first]
    assert restore["tier"] == "persistent" and restore["step"] == 8
    assert _losses(records) == reference  # the same run, bitwise, from the Orbax step


# ----------------------------------------------------------------- PEC + persistent tier


@functools.cache
def _tiny():
    """The 2x2 runs' train state layout in this process (4 devices, expert axis 4)."""
    from launch.trainer import OptimizerOptions, Trainer, make_mesh
    from models import get_config

    return Trainer(get_config("tiny"), make_mesh(4), OptimizerOptions())


def _reference_state(directory, step: int) -> dict:
    """Persistent step ``step`` of a 2x2 run, as numpy (plain Orbax, onto this
    process's 4 devices)."""
    trainer = _tiny()
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          trainer.abstract_state, trainer.state_shardings)
    with ocp.CheckpointManager(directory) as manager:
        state = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target))).state
    return jax.tree.map(np.asarray, state)


def _assembled(reference_dir, point: int, data_steps: np.ndarray):
    """The reference's state at ``point`` with each expert (all of its leaves:
    parameters and Adam moments) replaced by its values at ``data_steps``."""
    from capricorn_jax._src.partial.leaves import expert_leaf_axes

    trainer = _tiny()
    leaves = expert_leaf_axes(trainer.abstract_state, trainer.cfg)
    states = {s: jax.tree.leaves(_reference_state(reference_dir, s))
              for s in {point, *np.unique(data_steps).tolist()}}
    out = []
    for n, info in enumerate(leaves.values()):
        leaf = np.array(states[point][n])
        if info is not None:
            for e, s in enumerate(data_steps[info.moe_layer]):
                leaf[e] = states[int(s)][n][e]
        out.append(leaf)
    return jax.tree.unflatten(jax.tree.structure(trainer.abstract_state), out)


def _memory_copies(k: int, point: int) -> np.ndarray:
    """[L, N] each expert's newest in-memory copy at or before ``point`` for
    sequential PEC with K=k on 4 expert ranks (version 1 carries every expert)."""
    from capricorn_jax._src.partial.plans import newest_copies
    from capricorn_jax._src.partial.selection import sequential_mask

    masks = {1: np.ones((2, 8), bool)}
    masks.update({v: sequential_mask(k, v, 2, 8, 4) for v in range(2, point + 1)})
    return newest_copies(masks, (2, 8), point)


def _disk_steps(workdir) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.soak
def test_pec_full_persistent_step_is_the_memory_restore(tmp_path, reference_run):
    """PEC K=2 of 8 with --persist_every: a persisted step holds every expert,
    each from its newest in-memory copy (what a memory-tier restore gives), as
    a plain Orbax step. (--resume from such a step is the standard restore
    that test_persistent_tier_takes_over_when_every_ram_store_is_lost runs;
    the PEC bookkeeping after it is checked by the next test and, for K_persist
    = N, by test_orbax_handler's one-process test against ``recover``.)"""
    _, ref = reference_run
    flags = ("--pec_k=2", "--nopec_dynamic", "--persist_every=4", "--max_to_keep=2")
    _, first = _train(tmp_path / "w", tmp_path / "s", *flags, steps=8)
    persists = _events(first, "persist")
    assert [p["step"] for p in persists] == [1, 4, 8]
    assert all(p["pec_k_persist"] == 8 and p["experts"] == [list(range(8))] * 2
               for p in persists)
    assert persists[0]["plt"] == 0.0 and persists[-1]["plt"] > 0
    assert _disk_steps(tmp_path / "w") == [4, 8]
    data = _memory_copies(2, 8)
    assert sorted(np.unique(data).tolist()) == [5, 6, 7, 8]  # ceil(8 / 2) versions
    # Plain Orbax (no capricorn_jax) reads the step: the reference's step 8 with
    # each expert as of its newest copy in memory, bitwise.
    assert_trees_equal(_reference_state(tmp_path / "w" / "checkpoints", 8),
                       _assembled(ref, 8, data))
    record = ocp.CheckpointManager(tmp_path / "w" / "checkpoints").metadata(
        8).custom_metadata["capricorn_pec"]
    assert record["plt"] == persists[-1]["plt"] and record["data_step"] == data.tolist()
    assert _losses(first) == {s: loss for s, loss in reference_run[0].items() if s < 8}


@pytest.mark.soak
def test_pec_persistent_tier_assembles_experts_from_several_steps(tmp_path, reference_run):
    """K=4 and K_persist=4 of 8 (one expert per rank and layer): every persisted
    step carries the least recently persisted experts; retention keeps the steps
    with an expert's newest copy; with every RAM store lost, --resume assembles
    each expert from its newest persisted copy (parameters and moments alike)."""
    import capricorn_jax
    from capricorn_jax._src.partial.plans import newest_copies

    _, ref = reference_run
    flags = ("--pec_k=4", "--pec_k_persist=4", "--nopec_dynamic", "--persist_every=2",
             "--max_to_keep=1")
    _, first = _train(tmp_path / "w", tmp_path / "s", *flags, steps=6)
    persists = _events(first, "persist")
    assert [p["step"] for p in persists] == [1, 2, 4, 6]
    assert _losses(first) == {s: loss for s, loss in reference_run[0].items() if s < 6}
    assert [p["pec_k_persist"] for p in persists] == [8, 4, 4, 4]
    carried = {p["step"]: np.array([[e in row for e in range(8)] for row in p["experts"]])
               for p in persists}
    for s in (2, 4, 6):  # one expert of each rank (2 local experts) and layer
        assert (carried[s].reshape(2, 4, 2).sum(axis=2) == 1).all()
    assert (carried[2] | carried[4]).all() and (carried[4] | carried[6]).all()
    newest = newest_copies(carried, (2, 8))
    assert sorted(np.unique(newest).tolist()) == [4, 6]
    assert _disk_steps(tmp_path / "w") == [4, 6]  # max_to_keep=1, plus step 4's experts
    # Each persisted expert holds its newest in-memory copy when its step was written.
    data = np.array([[_memory_copies(4, newest[layer, e])[layer, e] for e in range(8)]
                     for layer in range(2)])
    assert (data < newest).any()

    # What --resume will do, in this process (a CheckpointManager without a memory tier).
    trainer = _tiny()
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          trainer.abstract_state, trainer.state_shardings)
    handler = capricorn_jax.CapricornHandler()
    with capricorn_jax.CheckpointManager(tmp_path / "w" / "checkpoints",
                                         handler_registry=handler.registry("state")) as manager:
        restored = manager.restore(args=ocp.args.Composite(
            state=capricorn_jax.CapricornRestore(target))).state
        info = manager.last_restore
    assert (info.step, info.tier) == (6, "persistent") and info.pec.versions == [4, 6]
    assert info.pec.source == newest.tolist() and info.pec.data_steps == data.tolist()
    assert_trees_equal(jax.tree.map(np.asarray, restored), _assembled(ref, 6, data))

    shutil.rmtree(tmp_path / "s")  # every host's RAM is lost
    _, records = _train(tmp_path / "w", tmp_path / "s", *flags, "--resume", steps=9)
    (restore,) = [r for r in _events(records, "recovery") if r not in first]
    assert restore["tier"] == "persistent" and restore["step"] == 6
    assert restore["expert_source_steps"] == newest.tolist()
    assert restore["expert_data_steps"] == data.tolist() and restore["versions"] == [4, 6]
    assert restore["plt"] == persists[-1]["plt"] > 0
    resumed = [c for c in _events(records, "checkpoint") if c not in _events(first, "checkpoint")]
    assert [c["step"] for c in resumed] == [7, 8, 9] and resumed[0]["pec_k"] == 8
    (later,) = [p for p in _events(records, "persist") if p not in persists]
    assert later["step"] == 8 and later["pec_k_persist"] == 4
    assert later["accumulated_plt"] > later["plt"]  # the restore's losses count
    assert (np.array([[e in row for e in range(8)] for row in later["experts"]])
            == carried[4]).all()  # the least recently persisted ones
    assert _disk_steps(tmp_path / "w") == [6, 8]


def test_corrupted_chunk_is_fetched_from_a_peer(tmp_path, reference):
    proc, records = _train(tmp_path / "w", tmp_path / "s", "--kill_host=1", "--kill_at_step=6",
                           "--kill_mode=process", "--corrupt_store", audit=True)
    assert "fault: flipped a byte in owner1/" in proc.stdout
    assert "fails its checksums" in proc.stdout
    (recovery,) = _events(records, "recovery")
    assert recovery["tiers"] == ["local", "peer"] and recovery["bytes_moved"] > 0
    assert _losses(records) == reference


def test_kill_mid_replication(tmp_path, reference):
    proc, records = _train(tmp_path / "w", tmp_path / "s", "--kill_host=0", "--kill_at_step=5",
                           "--kill_point=mid_replication", "--kill_mode=process")
    (recovery,) = _events(records, "recovery")
    assert recovery["step"] >= 5
    assert _losses(records) == reference
    assert "paused halfway through writing replicas" in proc.stdout


@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_peer_that_stops_answering_leaves_versions_under_replicated(tmp_path):
    # Host 1 holds host 0's replicas; its replica writer stalls for 4 s at step 3.
    proc, records = _train(tmp_path / "w", tmp_path / "s", "--stall_host=1",
                           "--stall_at_step=3", "--stall_seconds=4",
                           "--replication_timeout_s=1", steps=60)
    under = [u for c in _events(records, "checkpoint") for u in c["under_replicated"]]
    assert under, "no version was reported under-replicated"
    assert all(u["owner"] == 0 and u["missing"] == [1] for u in under)
    assert "under-replicated" in proc.stdout
    last = _events(records, "checkpoint")[-1]
    assert last["replicated"] > max(u["step"] for u in under)  # replication came back
    host1 = next((tmp_path / "s").glob("*/host1"))
    assert HostStore(host1).versions(0)[-1] == 60


@pytest.mark.soak  # a long variant of the machine loss CI runs on 2 hosts (test_kill_resumes_...)
def test_four_hosts_host_loss(tmp_path):
    _, records = _train(tmp_path / "w", tmp_path / "s", "--kill_host=2", "--kill_at_step=4",
                        "--kill_mode=host", hosts=4, devices=1, steps=8, audit=True)
    (recovery,) = _events(records, "recovery")
    assert recovery["tiers"] == ["local", "local", "peer", "local"]
    _losses(records)


def test_store_audit_catches_a_read_of_another_hosts_store(tmp_path):
    """The audit used by the kill tests really fires on a cross-host access."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    code = (
        "import os, sys\n"
        "from absl import flags\n"
        "from launch.train import command as train, config\n"
        "from launch.train import faults\n"
        "train.define_flags()\n"
        f"flags.FLAGS(['x', '--workdir={tmp_path}/w', '--store_root={tmp_path}/s'])\n"
        "ckpt = config.from_flags(flags.FLAGS).checkpoint\n"
        "os.environ['CAPRICORN_AUDIT_STORE'] = '1'\n"
        "faults.audit_store_if_asked(ckpt, 0)\n"
        "own = ckpt.store_dir(0); other = ckpt.store_dir(1)\n"
        "os.makedirs(own, exist_ok=True); open(own / 'ok', 'w').close()\n"
        "os.listdir(other.parent)\n"  # the job root itself is not another host's store
        "open(other / 'x', 'w')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "STORE ISOLATION VIOLATION: host 0 open" in proc.stderr
