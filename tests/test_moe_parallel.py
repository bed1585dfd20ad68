"""The expert-parallel model on 4 CPU devices equals the single-device model."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from launch.trainer import make_mesh
from models import GPTMoE, get_config, param_count, param_partition_specs
from models.gpt import BATCH_AXES


@pytest.mark.parametrize("expert_parallel", [4, 2])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("factors", [(2.0, 2.0), (0.5, 1.0)])  # no drops / drops
def test_expert_parallel_forward_matches_single_device(expert_parallel, top_k, factors):
    assert jax.device_count() == 4
    cfg = get_config("tiny", top_k=top_k)
    mesh = make_mesh(expert_parallel)
    tokens = jax.random.randint(jax.random.key(1), (8, cfg.seq_len), 0, 256)
    local = GPTMoE(cfg, None, num_groups=4)
    params = local.init(jax.random.key(0), tokens)["params"]
    want_logits, want = jax.jit(lambda p, t: local.apply({"params": p}, t, factors))(params, tokens)

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_partition_specs(params))
    sharded = jax.device_put(params, shardings)
    sharded_tokens = jax.device_put(tokens, NamedSharding(mesh, P(BATCH_AXES)))
    ep = GPTMoE(cfg, mesh)
    logits, got = jax.jit(lambda p, t: ep.apply({"params": p}, t, factors))(sharded, sharded_tokens)

    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)
    for name in ("tokens_per_expert", "dropped", "max_routed"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                      np.asarray(getattr(want, name)))
    np.testing.assert_allclose(float(got.aux_loss), float(want.aux_loss), rtol=1e-5)
    n_moe = len(cfg.moe_layers)
    assert got.tokens_per_expert.shape == (n_moe, cfg.num_experts)
    assert got.tokens_per_expert.dtype == np.int32
    # Tokens per expert sums to tokens * k minus the dropped ones, per layer.
    total = tokens.size * top_k
    np.testing.assert_array_equal(
        np.asarray(got.tokens_per_expert).sum(axis=1), total - np.asarray(got.dropped)
    )
    if factors == (0.5, 1.0):
        assert int(np.asarray(got.dropped)[0]) > 0


def test_expert_params_are_sharded_over_the_expert_axis():
    cfg = get_config("tiny")
    mesh = make_mesh(4)
    params = jax.eval_shape(
        lambda: GPTMoE(cfg, None, 4).init(jax.random.key(0), np.zeros((4, 8), np.int32))["params"]
    )
    specs = param_partition_specs(params)
    moe = specs["block0"]["moe"]
    assert moe["w_in"] == P("expert") and moe["w_out"] == P("expert")
    assert moe["router"] == P() and specs["embed"]["embedding"] == P()
    assert mesh.shape == {"data": 1, "expert": 4}


def test_all_to_all_is_in_the_compiled_step():
    cfg = get_config("tiny")
    mesh = make_mesh(4)
    tokens = jax.device_put(np.zeros((8, cfg.seq_len), np.int32),
                            NamedSharding(mesh, P(BATCH_AXES)))
    model = GPTMoE(cfg, mesh)
    params = jax.jit(lambda t: model.init(jax.random.key(0), t)["params"])(tokens)
    lowered = jax.jit(lambda p, t: model.apply({"params": p}, t)).lower(params, tokens)
    hlo = lowered.compile().as_text()
    # Dispatch and combine of each MoE layer.
    assert hlo.count("all-to-all-start") + hlo.count(" all-to-all(") >= 2 * len(cfg.moe_layers)
    assert sum(x.size for x in jax.tree.leaves(params)) == param_count(cfg)["total"]
