"""Small cross-host agreements, the distributed client, the address a host
advertises and the job's secret the launchers use.

Unstable: see ``capricorn_jax.experimental``."""

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
