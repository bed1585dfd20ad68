"""Tree assertions shared by the tests."""

import jax
import numpy as np


def assert_trees_equal(got, want, check_sharding: bool = False) -> None:
    """Same structure, and every leaf bitwise equal (and same sharding if asked)."""
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
    # jaxlib's native PyTreeDef ships no stub, so mypy cannot see its __eq__.
    assert got_def == want_def, (  # type: ignore[operator]
        f"tree structures differ: {got_def} vs {want_def}")
    for (path, a), (_, b) in zip(got_leaves, want_leaves, strict=True):
        name = jax.tree_util.keystr(path)
        if check_sharding:
            assert a.sharding == b.sharding, f"{name}: sharding {a.sharding} != {b.sharding}"
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{name}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        np.testing.assert_array_equal(a, b, err_msg=name)
