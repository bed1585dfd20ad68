"""The jax.distributed key-value client of this process.

JAX keeps it private (``jax._src.distributed``); the library's threaded chunk
path and the project's measurement tools use it to coordinate processes
outside any collective. Design choice: one function that names the private
attribute, in the floor every user can import, rather than each caller
reaching into ``jax._src`` (or a library module importing the public face
``capricorn_jax.experimental``, which re-exports this).
"""

from __future__ import annotations

from typing import Any


def distributed_client() -> Any:
    """The jax.distributed key-value client of this process (None before
    ``jax.distributed.initialize``)."""
    from jax._src import distributed

    return distributed.global_state.client
