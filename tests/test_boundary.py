"""The layer-boundary hook: a no-op by default, applied at trace time when attached."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import capricorn_jax
from capricorn_jax import boundary_hooks, layer_boundary
from capricorn_jax._src.profiling.boundary import active_hooks
from models import GPTMoE, get_config


def test_public_api_is_small_and_explicit():
    assert set(capricorn_jax.__all__) >= {"layer_boundary", "boundary_hooks"}
    for name in capricorn_jax.__all__:
        assert hasattr(capricorn_jax, name)


def test_noop_without_hooks():
    x = jnp.arange(4.0)
    assert layer_boundary(x, "a") is x


def test_hooks_apply_in_order_and_detach():
    seen = []

    def first(x, name):
        seen.append(("first", name))
        return x + 1

    def second(x, name):
        seen.append(("second", name))
        return x * 2

    with boundary_hooks(first, second):
        assert float(layer_boundary(jnp.float32(1), "l0")) == 4.0
        assert active_hooks() == (first, second)
    assert seen == [("first", "l0"), ("second", "l0")]
    assert active_hooks() == ()
    assert float(layer_boundary(jnp.float32(1), "l0")) == 1.0


@pytest.mark.slow  # long: compiles or many examples
def test_model_calls_the_boundary_between_layers():
    cfg = get_config("tiny", n_layers=3)
    names = []

    def record(x, name):
        names.append((name, x.shape))
        return x

    tokens = np.zeros((2, cfg.seq_len), np.int32)
    model = GPTMoE(cfg)
    params = model.init(jax.random.key(0), tokens)["params"]
    plain = jax.jit(lambda p, t: model.apply({"params": p}, t)[0])(params, tokens)
    with boundary_hooks(record):
        hooked = jax.jit(lambda p, t: model.apply({"params": p}, t)[0] + 0.0)(params, tokens)
    assert names == [(f"block{i}", (2, cfg.seq_len, cfg.d_model)) for i in range(3)]
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(hooked))
