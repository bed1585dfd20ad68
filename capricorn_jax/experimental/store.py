"""The RAM store and its administration (reclaiming, sizing: ``python -m
capricorn_jax.stores`` and the launchers) and the pinned-host copy path.

Unstable: see ``capricorn_jax.experimental``."""

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
