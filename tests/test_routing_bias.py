"""The routing bias (models.routing_bias, --routing_bias): its table, its flag,
and the tiny model's real routing under it."""

import re

import jax
import numpy as np
import pytest
from absl import flags

from launch.bench import command as bench
from launch.bench import config as bench_config
from launch.chaos import command as chaos
from launch.chaos import config as chaos_config
from launch.data import Corpus, DataIterator, DataOptions
from launch.errors import FlagError
from launch.experiments.routing_bias import loads
from launch.train import command as train
from launch.train import config
from launch.trainer import OptimizerOptions, Trainer, make_mesh
from models import routing_bias as rb
from models.config import get_config

SCHEDULE = rb.SCHEDULES[rb.CONG24]


def _build(seed=0, n_domains=4, shift_every=5, experts=8, n_moe=2):
    return rb.build(rb.CONG24, num_experts=experts, top_k=2, n_moe=n_moe, n_domains=n_domains,
                    shift_every=shift_every, seed=seed)


def test_the_table_is_a_pure_function_of_its_arguments_and_seed():
    a, b, c = _build(seed=3), _build(seed=3), _build(seed=4)
    for name in ("hot", "ratio", "table"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.ratio, c.ratio) or not np.array_equal(a.hot, c.hot)


@pytest.mark.parametrize("seed", range(5))
def test_the_hot_expert_changes_at_every_shift_and_holds_within_a_period(seed):
    bias = _build(seed=seed, shift_every=5)
    hot = [tuple(np.argmax(bias.table[bias.row(step)], axis=-1)) for step in range(80)]
    for step in range(1, 80):
        if step % 5:
            assert hot[step] == hot[step - 1]
        else:  # a shift: every layer's hot expert moves
            assert all(x != y for x, y in zip(hot[step], hot[step - 1], strict=True))


@pytest.mark.parametrize("seed", range(5))
def test_the_strength_fluctuates_early_and_is_stable_later(seed):
    bias = _build(seed=seed)
    lo, hi = SCHEDULE.transient_ratio
    transient = bias.ratio[:SCHEDULE.transient_periods]
    assert ((transient >= lo) & (transient <= hi)).all()
    jumps = np.abs(np.diff(transient, axis=0))
    assert (jumps >= SCHEDULE.min_jump * (hi - lo) - 1e-9).all()
    stable = bias.ratio[SCHEDULE.transient_periods:]
    assert (stable == stable[0]).all()
    assert ((stable >= SCHEDULE.stable_ratio[0]) & (stable <= SCHEDULE.stable_ratio[1])).all()
    # Each row: the hot expert at its ratio, the others sharing the rest; mean load 1.
    np.testing.assert_allclose(bias.table.max(axis=-1), bias.ratio, rtol=1e-6)
    np.testing.assert_allclose(bias.table.sum(axis=-1), 8.0, rtol=1e-5)


def test_the_rows_follow_the_datas_rotation():
    corpus = Corpus({name: np.full(70_000, i, np.uint8)
                     for i, name in enumerate(("a", "b", "c"))})
    data = DataIterator(DataOptions(seq_len=8, batch_per_host=2, workload="dynamic",
                                    shift_every=3), 0, 1, corpus)
    bias = _build(n_domains=3, shift_every=3)
    for step in range(60):
        row = bias.row(step)
        domain = row % 3 if row < bias.transient_periods else row - bias.transient_periods
        assert corpus.names[domain] == data.domain
        assert int(jax.jit(bias.row_index)(np.int32(step))) == row
        data.next_batch()


def test_resolve_auto_none_named_and_bad_values():
    assert rb.resolve("auto", accelerator="emulated", workload="dynamic") == rb.CONG24
    for accelerator, workload in (("emulated", "steady"), ("none", "dynamic"),
                                  ("emulated", "synthetic")):
        assert rb.resolve("auto", accelerator=accelerator, workload=workload) == rb.NONE
    assert rb.resolve("none", accelerator="emulated", workload="dynamic") == rb.NONE
    assert rb.resolve(rb.CONG24, accelerator="none", workload="dynamic") == rb.CONG24
    with pytest.raises(ValueError, match=re.escape("--routing_bias='cong25': one of auto, none")):
        rb.resolve("cong25", accelerator="none", workload="dynamic")
    with pytest.raises(ValueError, match="not with --workload=steady"):
        rb.resolve(rb.CONG24, accelerator="emulated", workload="steady")


def test_the_flag_in_train_bench_and_chaos(tmp_path):
    fv = train.define_flags(flags.FlagValues())
    fv(["train", f"--workdir={tmp_path}", "--accelerator=emulated", "--workload=dynamic"])
    t = config.from_flags(fv).train
    assert t.routing_bias == rb.CONG24 and t.model_config.routing_bias == rb.CONG24
    fv = train.define_flags(flags.FlagValues())
    fv(["train", f"--workdir={tmp_path}", "--accelerator=emulated"])  # steady: unbiased
    assert config.from_flags(fv).train.model_config.routing_bias == rb.NONE
    fv = train.define_flags(flags.FlagValues())
    fv(["train", f"--workdir={tmp_path}", "--routing_bias=cong24"])
    with pytest.raises(FlagError, match="--routing_bias=cong24: its hot experts follow"):
        config.from_flags(fv)
    with pytest.raises(flags.IllegalFlagValueError, match="cong25"):
        train.define_flags(flags.FlagValues())(["train", "--routing_bias=cong25"])

    fv = bench.define_flags(flags.FlagValues())
    fv(["bench", f"--workdir={tmp_path}", "--accelerator=emulated", "--workload=dynamic"])
    cfg = bench_config.BenchConfig.from_flags(fv)
    assert cfg.record()["routing_bias"] == rb.CONG24
    assert cfg.setup.overrides()["routing_bias"] == rb.CONG24
    fv = bench.define_flags(flags.FlagValues())
    fv(["bench", f"--workdir={tmp_path}", "--accelerator=emulated", "--workload=dynamic",
        "--routing_bias=none"])
    cfg = bench_config.BenchConfig.from_flags(fv)
    assert cfg.record()["routing_bias"] == rb.NONE and "routing_bias" not in cfg.setup.overrides()

    fv = chaos.define_flags(flags.FlagValues())
    fv(["chaos", "--routing_bias=cong24"])
    with pytest.raises(FlagError, match="not with --workload=steady"):
        chaos_config.ChaosConfig.from_flags(fv)


FACTORS = (4.0, 4.0)  # the largest bucket: no assignment dropped, one program
BOUND = 2.5


def _train(bias, steps):
    """The tiny model on the 4 CPU devices, dynamic workload (2 steps per domain):
    per step (max/mean per MoE layer, tokens_per_expert), and the compiles
    after the first step."""
    cfg = get_config("tiny", dispatch="bucketed")
    options = DataOptions(seq_len=cfg.seq_len, batch_per_host=cfg.global_batch,
                          workload="dynamic", shift_every=2)
    data = DataIterator(options, 0, 1, Corpus.load(256 << 10))
    trainer = Trainer(cfg, make_mesh(4), OptimizerOptions(total_steps=steps), routing_bias=bias)
    state, out, compiles = trainer.init_state(0), [], []

    def on_event(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        for step in range(steps):
            if step == 1:
                compiles.clear()
            state, metrics = trainer.step_fn(FACTORS)(state, trainer.global_batch(
                data.next_batch()))
            tpe = np.asarray(metrics["tokens_per_expert"])
            out.append((loads(tpe, cfg.global_batch * cfg.seq_len, cfg.top_k)[0], tpe))
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    return out, len(compiles)


def test_the_bias_drives_the_real_routing_without_recompiling():
    bias = _build(shift_every=2)
    biased, compiles = _train(bias, 4)
    assert compiles == 0  # steps 1-3 cross a shift and a table row: the same program
    unbiased, _ = _train(None, 4)
    for step in range(4):
        assert max(unbiased[step][0]) < BOUND
    for step in (2, 3):  # period 1: the transient row with targets over BOUND
        ratios, tpe = biased[step]
        targets = bias.ratio[1]
        assert (targets > BOUND + 0.2).all()
        assert min(ratios) > BOUND
        np.testing.assert_allclose(ratios, targets, rtol=0.1)
        np.testing.assert_array_equal(np.argmax(tpe, axis=-1), bias.hot[1])
