"""Every strategy of launch's factory through one lifecycle, in one process.

save -> finish -> close on the 4 forced CPU devices, then the saved bytes are
read back and checked bit for bit against the state saved:

* ``none``, ``blocking``, ``orbax_async``, ``orbax_emergency``, ``inmem``,
  ``pec``: one host; a fresh strategy on the same directories restores the
  newest version through the factory's ``restore`` (``none`` restores
  nothing). ``orbax_emergency`` runs without jax.distributed: the launcher
  builds Orbax's process maps as the identity in a single process
  (``launch.baselines._orbax_id_maps``), once per process.
* ``gemini``, ``capricorn``, ``capricorn_pec``: they send one peer replica per
  step and refuse a single host, so this process is host 0 of two hosts
  simulated by device placement (devices 0,1 and 2,3, as the executor tests
  do), on the in_graph path (collective-permutes among this process's
  devices). Host 0's store then holds both hosts' payloads and the replicas
  each received: read back with the recovery's own reader, the replicas must
  equal the peers' payloads and the payloads, assembled over the 4 devices,
  the saved state, bit for bit.

Why the scheduled strategies' ``restore`` itself is not called here:
``recover`` agrees on the version from every host's inventory (an
``allgather_json`` over ``ckpt.hosts`` = 2, through the jax.distributed
key-value store), and this process holds host 0's store only; answering for
host 1 with host 0's inventory would be a fake agreement, and the decision
then loads only host 0's device positions. Their restore runs in the
multi-process kill-and-recover tests (test_strategies.py).
"""

import jax
import numpy as np
import pytest

import capricorn_jax
from capricorn_jax._src.memory.tier.recovery import read_rows
from capricorn_jax._src.memory.wire.host_arrays import global_arrays
from capricorn_jax._src.memory.wire.packing import decode_trailer, unpack
from launch.strategies import IN_MEMORY, PEC, PEER_ONLY, SCHEDULED, STRATEGIES, make_strategy
from launch.trainer import OptimizerOptions, Trainer, make_mesh
from models import get_config
from tests.tree_utils import assert_trees_equal

SIMULATED_HOSTS = [0, 0, 1, 1]  # host of each mesh device: this process is host 0 of 2


@pytest.fixture(scope="module")
def trainer():
    return Trainer(get_config("tiny"), make_mesh(4), OptimizerOptions())


def _checkpointer(name, trainer, root):
    cfg = trainer.cfg
    pec = (capricorn_jax.PecOptions(k=cfg.num_experts, dynamic=False)
           if name in PEC else None)
    hosts, device_host = (2, SIMULATED_HOSTS) if name in SCHEDULED else (1, None)
    opts = capricorn_jax.InMemoryOptions(store_root=str(root / "store"), job="j",
                                         replicas=hosts, pec=pec)
    return capricorn_jax.InMemoryCheckpointer(
        opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, hosts,
        device_host, model=cfg, tokens_per_step=cfg.global_batch * cfg.seq_len)


def _build(name, trainer, root):
    ckpt = _checkpointer(name, trainer, root) if name in IN_MEMORY else None
    return make_strategy(name, trainer, checkpointer=ckpt, directory=root / "disk",
                         local_directory=root / "local", persist_every=1,
                         chunk_path="in_graph")


RESTORED = [s for s in STRATEGIES if s not in PEER_ONLY]
"""Every strategy of the registry is in one of the two tests below (read from
the registry: a new strategy is checked here without an edit), but the
controls (``CONTROLS``: they refuse one host and save nothing; their own
2-process test is tests/test_control.py); each test asserts the built
strategy is what its spec says (scheduled or not)."""


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_factory_refuses_what_a_strategy_does_not_take(trainer, tmp_path, name):
    """The registry's traits are enforced at the one factory: an in-memory
    strategy without a checkpointer, a baseline with one, a PEC strategy over
    a checkpointer without PEC options: each refused, naming the strategy."""
    if name in IN_MEMORY:
        with pytest.raises(ValueError, match=f"strategy '{name}' needs in-memory checkpointer"):
            make_strategy(name, trainer)
    else:
        with pytest.raises(ValueError, match=f"strategy '{name}' takes no in-memory"):
            make_strategy(name, trainer, checkpointer=object())
    if name in PEC:
        plain = _checkpointer("inmem", trainer, tmp_path)
        try:
            with pytest.raises(ValueError, match=f"'{name}' needs a checkpointer with PEC"):
                make_strategy(name, trainer, checkpointer=plain)
        finally:
            plain.close()


def _lifecycle(strategy, trainer, versions, seed=0):
    """Saves ``versions`` (the states ``init_state(seed + v)``), finishes at
    the last, closes; returns the last state."""
    tokens = np.ones((len(trainer.moe_layers), trainer.cfg.num_experts), np.int64)
    states = {v: trainer.init_state(seed + v) for v in versions}
    last = versions[-1]
    want = jax.tree.map(np.array, states[last])
    for v in versions:
        strategy.save(v, states[v], {"data": {"step": v}}, tokens_per_expert=tokens)
    strategy.finish(last, states[last], {"data": {"step": last}})
    strategy.close()
    return want


@pytest.mark.parametrize("name", RESTORED)
def test_strategy_saves_finishes_closes_and_restores_bitwise(trainer, tmp_path, name):
    strategy = _build(name, trainer, tmp_path)
    assert not isinstance(strategy, capricorn_jax.ScheduledStrategy)
    with pytest.raises(capricorn_jax.NoCheckpoint):  # nothing saved yet: one convention
        strategy.restore()
    assert strategy.restore_or_none() is None  # 0.18's, kept for one release
    want = _lifecycle(strategy, trainer, (1, 2, 3))
    restarted = _build(name, trainer, tmp_path)
    if name == "none":
        with pytest.raises(capricorn_jax.NoCheckpoint):
            restarted.restore()
        restarted.close()
        return
    state, info = restarted.restore()
    restarted.close()
    assert info.step == 3 and info.host_state == {"data": {"step": 3}}
    assert info.tier in ("memory", "persistent")
    assert_trees_equal(state, want)


STARTS_OVER = [s for s in RESTORED if s not in ("none", "orbax_async", "orbax_emergency")]
"""The strategies whose own stores a restarted job can save over: Orbax's
manager never saves a step at or below its newest (``should_save``), and
a job restarts there only at that newest step (Orbax's restore reads it)."""


@pytest.mark.parametrize("name", STARTS_OVER)
def test_a_job_that_starts_over_saves_the_steps_it_saved_before_and_restores_the_new_bytes(
        trainer, tmp_path, name):
    """A job that found no version every host holds (a peer machine's store
    lost, and no replica of it) starts over at step 0 beside the versions this
    host kept of the attempt it abandoned, and saves those steps again: each
    save goes through, and a restore returns the new attempt's bytes.
    (``blocking`` renamed a step's new folder onto the old one's and failed
    the job, after pruning the version it had just saved as older than the
    old attempt's two.)"""
    _lifecycle(_build(name, trainer, tmp_path), trainer, (1, 2, 3, 4))
    want = _lifecycle(_build(name, trainer, tmp_path), trainer, (1, 2, 3, 4), seed=100)
    restarted = _build(name, trainer, tmp_path)
    state, info = restarted.restore()
    restarted.close()
    assert info.step == 4 and info.host_state == {"data": {"step": 4}}
    assert_trees_equal(state, want)


@pytest.mark.parametrize("name", SCHEDULED)
def test_scheduled_strategy_stores_both_simulated_hosts_payloads_bitwise(
        trainer, tmp_path, name):
    """Two versions (the replica writer holds one and queues one: none is
    dropped however slow the box); the newest is read back from host 0's store
    with the recovery's reader. In one process host 0's writers write every
    local device's row: its own version holds both hosts' payloads (devices
    0,1 then 2,3), its replica version what each device received from its
    peer (host 1's payload on devices 0,1, host 0's on 2,3)."""
    strategy = _build(name, trainer, tmp_path)
    assert isinstance(strategy, capricorn_jax.ScheduledStrategy)
    assert strategy.chunk_path == "in_graph" and strategy.ckpt.hosts == 2
    want = _lifecycle(strategy, trainer, (1, 2))
    reader = _checkpointer(name, trainer, tmp_path)  # a fresh one on the same store
    assert reader.store.versions(0) == [1, 2] and reader.store.versions(1) == [1, 2]
    own, replica = read_rows(reader, 0, 2), read_rows(reader, 1, 2)
    assert len(own) == len(replica) == 4
    for got, peer in zip(replica, own[2:] + own[:2], strict=True):
        np.testing.assert_array_equal(got, peer)
    assert decode_trailer(reader.plan, own[0]) == {"data": {"step": 2}}
    blocks = {**unpack(reader.plan, 0, own[:2]), **unpack(reader.plan, 1, own[2:])}
    got = global_arrays(blocks, trainer.abstract_state, trainer.state_shardings, trainer.mesh)
    assert_trees_equal(got, want)
    reader.close()
