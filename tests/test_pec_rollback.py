"""PEC versions lost on some host leave every tracker (``PecTier.roll_back``).

A version the PEC tier recorded when it was planned may never be held on
every host (a corrupt frame, a chunk channel lost while it was in flight, a
busy writer). The status round names it, and every host replays its tracker
without that version's save, so the versions after it name older copies and
stay restorable.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import capricorn_jax
from capricorn_jax._src.memory.tier.pec_tier import JOURNAL_STEPS
from capricorn_jax._src.partial.leaves import expert_leaf_axes, leaf_steps
from capricorn_jax._src.partial.selection import PecOptions, sequential_mask
from capricorn_jax._src.partial.tracker import PltTracker, restore_plan
from launch.trainer import OptimizerOptions, Trainer, make_mesh
from models import get_config

TOKENS_PER_STEP = 16 * 64  # tiny: global batch x sequence length
TPE = np.full((2, 8), TOKENS_PER_STEP * 2 // 8)  # top-2, spread evenly


@pytest.fixture(scope="module")
def trainer():
    return Trainer(get_config("tiny"), make_mesh(2), OptimizerOptions())


def _checkpointer(trainer, root, k=2):
    opts = capricorn_jax.InMemoryOptions(store_root=str(root), job="j", replicas=1,
                                         pec=PecOptions(k=k, dynamic=False))
    return capricorn_jax.InMemoryCheckpointer(opts, trainer.mesh, trainer.abstract_state,
                                              trainer.state_shardings, 0, 1, model=trainer.cfg,
                                              tokens_per_step=TOKENS_PER_STEP)


@pytest.fixture(scope="module")
def pec(trainer, tmp_path_factory):
    ckpt = _checkpointer(trainer, tmp_path_factory.mktemp("pec"))
    yield ckpt.pec
    ckpt.close()


def _replay(steps, masks, tokens) -> PltTracker:
    """The tracker of ``steps`` (1..n) observed with ``tokens`` and saved with
    ``masks`` (step -> mask; a step without one saved nothing)."""
    tracker = PltTracker(2, 8, top_k=2)
    for step in steps:
        tracker.observe(tokens[step])
        if step in masks:
            tracker.on_saved(step, masks[step])
    return tracker


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_roll_back_is_the_replay_without_the_lost_saves(pec, data):
    """Any run of saves and skips, any lost set (in two calls, overlapping):
    the tracker equals the one that never saved the lost versions, except
    versions older than the journal, which stay."""
    n = data.draw(st.integers(1, JOURNAL_STEPS + 12), label="steps")
    pec.resume(PltTracker(2, 8, top_k=2), 2)
    masks, tokens = {}, {}
    for step in range(1, n + 1):
        tokens[step] = np.array(data.draw(st.lists(st.integers(0, 300), min_size=16,
                                                   max_size=16)), np.int64).reshape(2, 8)
        if data.draw(st.booleans()):
            mask = np.array(data.draw(st.lists(st.booleans(), min_size=16, max_size=16)),
                            bool).reshape(2, 8)
            mask[:, step % 8] = True  # every layer saves an expert
            masks[step] = mask
            pec.version(step, tokens[step], expert_mask=mask)
        else:
            pec.skip(step, tokens[step])
    lost = data.draw(st.sets(st.integers(1, n)), label="lost")
    first = data.draw(st.sets(st.sampled_from(sorted(lost)))) if lost else set()
    oldest = n - JOURNAL_STEPS + 1  # the journal holds steps oldest..n
    rolled = pec.roll_back(first) + pec.roll_back(lost)
    gone = {v for v in lost if v in masks and v >= oldest}
    assert sorted(rolled) == sorted(gone)
    kept = {s: m for s, m in masks.items() if s not in gone}
    assert pec.tracker == _replay(range(1, n + 1), kept, tokens)
    assert pec.roll_back(lost) == []  # once only


def test_a_pec_version_dropped_here_is_rolled_back_and_the_next_ones_restore(
        trainer, tmp_path, caplog):
    """Version 3 (K = 2 of 8) is planned, then dropped on this host (its
    peer's payload never came). Its drop travels in the next status round;
    reading it, the tracker replays without version 3's save. Version 4,
    planned before that round was read, still names version 3 and is not
    restorable; versions 5 and 6 name the older copies, and version 6
    restores bit for bit from versions that are held."""
    bump = jax.jit(lambda s, v: jax.tree.map(lambda x: x + v.astype(x.dtype), s),
                   out_shardings=trainer.state_shardings)
    base = trainer.init_state(0)
    ckpt = _checkpointer(trainer, tmp_path)
    masks = {}
    with caplog.at_level(logging.WARNING, logger="capricorn_jax"):
        for step in range(1, 7):
            if step == 3:
                planned = ckpt.plan_pec_version(3, TPE)
                report = ckpt.drop(3, corrupt=False)
                assert report.skipped and not report.corrupt
            else:
                ckpt.save(step, bump(base, jnp.int32(step)), {"data": step},
                          tokens_per_expert=TPE)
                masks[step] = (np.ones((2, 8), bool) if step == 1
                               else sequential_mask(2, step, 2, 8, 2))
            ckpt.wait_until_finished(60)
    assert not planned.mask.all() and ckpt.pec.rolled_back == {3}
    assert "PEC versions [3] are not held on every host" in caplog.text
    tracker = _replay(range(1, 7), masks, {s: TPE for s in range(1, 7)})
    assert ckpt.pec.tracker == tracker
    assert 3 in ckpt._needs[4][0]
    assert all(3 not in ckpt._needs[v][0] for v in (5, 6))
    ckpt.close()

    fresh = _checkpointer(trainer, tmp_path)
    restored, recovered = capricorn_jax.recover(fresh)
    assert recovered.step == 6 and recovered.host_state == {"data": 6}
    saved = {key: [s for s in masks if masks[s][key]] for key in np.ndindex(2, 8)}
    plan = restore_plan(saved, 6, tracker, 6 * TOKENS_PER_STEP)
    assert recovered.pec.source == plan.source.tolist()
    assert 3 not in recovered.pec.versions and 1 in recovered.pec.versions
    leaves = expert_leaf_axes(trainer.abstract_state, trainer.cfg)
    steps = leaf_steps(plan, leaves)
    for (path, info), b, got in zip(leaves.items(), jax.tree.leaves(base),
                                    jax.tree.leaves(restored), strict=True):
        step = np.asarray(steps[path])
        if info is not None:
            step = step.reshape((-1,) + (1,) * (np.ndim(b) - 1))
        want = np.asarray(b) + step.astype(np.asarray(b).dtype)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=path)
    fresh.close()
