"""The names of ``capricorn_jax.experimental.store``, read by type
checkers and, on first use of a name, by ``capricorn_jax._faces`` (the docstring:
the module's ``.py``)."""

from __future__ import annotations

from capricorn_jax._src.memory.store import pinned
from capricorn_jax._src.memory.store.store import HostStore
from capricorn_jax._src.memory.store.store_lifecycle import (
    committed_steps,
    mount_point,
    remove_unused,
    store_in_use,
    tree_bytes,
)

__all__ = [
    "committed_steps",
    "HostStore",
    "mount_point",
    "pinned",
    "remove_unused",
    "store_in_use",
    "tree_bytes",
]
