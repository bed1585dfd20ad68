"""The names of ``capricorn_jax.experimental.multihost``, read by type
checkers and, on first use of a name, by ``capricorn_jax._faces`` (the docstring:
the module's ``.py``)."""

from __future__ import annotations

from capricorn_jax._src.multihost.agree import allgather_floats, allgather_json
from capricorn_jax._src.multihost.client import distributed_client
from capricorn_jax._src.multihost.secret import SECRET_NAME, start_job_secret
from capricorn_jax._src.scheduling.threaded.chunk_channel import job_address

__all__ = [
    "SECRET_NAME",
    "allgather_floats",
    "allgather_json",
    "distributed_client",
    "job_address",
    "start_job_secret",
]
