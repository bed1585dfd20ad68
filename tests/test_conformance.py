"""Every strategy of launch's factory through one lifecycle, in one process.

save -> finish -> close, then a fresh strategy on the same stores restores:
the newest version, bitwise (``none`` restores nothing). One host of 4 forced
CPU devices (the multi-host paths run in the multiprocess tests); the
alternative not taken, several simulated hosts in this process, would need
the checkpointer's internals rather than the factory's public surface.

Two kinds cannot run in one process: the scheduled strategies (gemini,
capricorn, capricorn_pec) send one peer replica per step and refuse a single
host; orbax_emergency needs jax.distributed. Their kill-and-recover runs are
in test_strategies.py.
"""

import jax
import numpy as np
import pytest

import capricorn_jax
from launch.strategies import IN_MEMORY, PEC, SCHEDULED, STRATEGIES, make_strategy
from launch.trainer import OptimizerOptions, Trainer, make_mesh
from models import get_config
from tests.tree_utils import assert_trees_equal


@pytest.fixture(scope="module")
def trainer():
    return Trainer(get_config("tiny"), make_mesh(4), OptimizerOptions())


def _build(name, trainer, root):
    ckpt = None
    if name in IN_MEMORY:
        cfg = trainer.cfg
        pec = (capricorn_jax.PecOptions(k=cfg.num_experts, dynamic=False)
               if name in PEC else None)
        opts = capricorn_jax.InMemoryOptions(store_root=str(root / "store"), job="j",
                                             replicas=1, pec=pec)
        ckpt = capricorn_jax.InMemoryCheckpointer(
            opts, trainer.mesh, trainer.abstract_state, trainer.state_shardings, 0, 1,
            model=cfg, tokens_per_step=cfg.global_batch * cfg.seq_len)
    return make_strategy(name, trainer, checkpointer=ckpt, directory=root / "disk",
                         local_directory=root / "local", persist_every=1)


MULTI_HOST_ONLY = (*SCHEDULED, "orbax_emergency")
SINGLE_PROCESS = [s for s in STRATEGIES if s not in MULTI_HOST_ONLY]


def test_every_strategy_is_either_here_or_named_multi_host_only():
    assert sorted(SINGLE_PROCESS) == ["blocking", "inmem", "none", "orbax_async", "pec"]
    assert set(SINGLE_PROCESS) | set(MULTI_HOST_ONLY) == set(STRATEGIES)


@pytest.mark.parametrize("name", SINGLE_PROCESS)
def test_strategy_saves_finishes_closes_and_restores_bitwise(trainer, tmp_path, name):
    tokens = np.ones((len(trainer.moe_layers), trainer.cfg.num_experts), np.int64)
    states = {v: trainer.init_state(v) for v in (1, 2, 3)}
    want = jax.tree.map(np.array, states[3])
    strategy = _build(name, trainer, tmp_path)
    assert strategy.restore() is None  # nothing saved yet
    for v in (1, 2, 3):
        strategy.save(v, states[v], {"data": {"step": v}}, tokens_per_expert=tokens)
    strategy.finish(3, states[3], {"data": {"step": 3}})
    strategy.close()
    got = _build(name, trainer, tmp_path).restore()
    if name == "none":
        assert got is None
        return
    assert got.step == 3 and got.host_state == {"data": {"step": 3}}
    assert_trees_equal(got.state, want)
