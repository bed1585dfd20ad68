"""Routing invariants: capacity, drops, combine weights, token counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.routing import combine, dispatch, route

# capacity only enters route() as a comparison, so it can be traced.
_route = jax.jit(route, static_argnums=1)


_dispatch_combine = jax.jit(
    lambda x, logits, k, cap: _identity_experts(x, route(logits, k, cap), logits.shape[1], cap),
    static_argnums=(2, 3),
)


def _identity_experts(x, r, experts, cap):
    buf = dispatch(x, r, experts, cap)
    return buf, combine(buf, r), r


@st.composite
def routing_case(draw):
    # Few distinct shapes, so the jitted functions compile a handful of times.
    tokens = draw(st.sampled_from([1, 7, 16, 33]))
    experts = draw(st.sampled_from([2, 4, 8]))
    k = draw(st.sampled_from([1, 2]))
    cap = draw(st.sampled_from([1, 2, 3, 8, 64]))
    seed = draw(st.integers(0, 2**31 - 1))
    logits = jax.random.normal(jax.random.key(seed), (tokens, experts)) * draw(
        st.sampled_from([0.1, 1.0, 5.0])
    )
    return np.asarray(logits), k, cap


@pytest.mark.slow  # long: compiles or many examples
@settings(max_examples=30, deadline=None)
@given(routing_case())
def test_route_invariants(case):
    logits, k, cap = case
    r = _route(jnp.asarray(logits), k, cap)
    tokens, experts = logits.shape
    idx, kept = np.asarray(r.expert_index), np.asarray(r.kept)
    tpe = np.asarray(r.tokens_per_expert)
    # No expert receives more than its capacity, and counts match the kept set.
    assert tpe.max() <= cap
    counted = np.bincount(idx[kept], minlength=experts)
    np.testing.assert_array_equal(tpe, counted)
    # Dropped assignments are counted; kept + dropped = tokens * k.
    assert int(r.dropped) == int((~kept).sum())
    assert tpe.sum() == tokens * k - int(r.dropped)
    np.testing.assert_array_equal(np.asarray(r.routed_per_expert),
                                  np.bincount(idx.ravel(), minlength=experts))
    # Slots of kept assignments are unique per expert and below capacity.
    slots = np.asarray(r.slot)
    pairs = list(zip(idx[kept].tolist(), slots[kept].tolist(), strict=True))
    assert len(pairs) == len(set(pairs))
    assert all(0 <= s < cap for _, s in pairs)
    # Combine weights of kept assignments are the gate values, dropped are 0.
    w, g = np.asarray(r.combine_weights), np.asarray(r.gates)
    np.testing.assert_array_equal(w[kept], g[kept])
    assert np.all(w[~kept] == 0)
    # The gates: top-1 softmax probability, or the top-2 renormalized to 1.
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))
    top = np.take_along_axis(probs, idx, axis=1)
    expect = top if k == 1 else top / top.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(g, expect, rtol=1e-6)
    # Distinct experts per token, and first choices beat second choices to a slot.
    if k == 2:
        assert np.all(idx[:, 0] != idx[:, 1])
        for e in range(experts):
            first_dropped = (~kept[:, 0]) & (idx[:, 0] == e)
            second_kept = kept[:, 1] & (idx[:, 1] == e)
            assert not (first_dropped.any() and second_kept.any())


def test_priority_is_token_order_within_a_choice():
    # Every token prefers expert 0; capacity 2 keeps the first two tokens only.
    logits = jnp.array([[5.0, 0.0]] * 4)
    r = route(logits, 1, 2)
    np.testing.assert_array_equal(np.asarray(r.kept[:, 0]), [True, True, False, False])
    np.testing.assert_array_equal(np.asarray(r.slot[:2, 0]), [0, 1])
    assert int(r.dropped) == 2


@pytest.mark.slow  # long: compiles or many examples
@settings(max_examples=15, deadline=None)
@given(routing_case())
def test_dispatch_combine_identity_experts(case):
    """With identity experts, combine(dispatch(x)) = x * sum of kept gates."""
    logits, k, cap = case
    tokens, experts = logits.shape
    x = jax.random.normal(jax.random.key(tokens), (tokens, 16))
    buf, y, r = _dispatch_combine(x, jnp.asarray(logits), k, cap)
    assert buf.shape == (experts, cap, 16)
    expect = x * jnp.sum(r.combine_weights, axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(y), np.asarray(expect), rtol=1e-6, atol=1e-6)
    # Exactly the kept assignments occupy slots; the rest of the buffer is zero.
    occupied = np.asarray(jnp.any(buf != 0, axis=-1)).sum()
    assert occupied == int(np.asarray(r.tokens_per_expert).sum())


def test_aux_and_z_loss_values():
    logits = jnp.zeros((8, 4))
    r = route(logits, 1, 8)
    # Uniform router: E * sum(f_e * 1/E) = 1 whatever f is.
    np.testing.assert_allclose(float(r.aux_loss), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(r.z_loss), np.log(4.0) ** 2, rtol=1e-6)
