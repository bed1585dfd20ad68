"""Which RAM store is this machine's when process ids change across a restart.

Why. A cluster scheduler may restart a job with its processes numbered
differently: the machine that was process 0 comes back as process 1. Each
machine keeps its RAM disk, and the stores are named by process index
(``STORE_ROOT/JOB/host{i}``), so a process that opens ``host{its index}``
finds an empty store while its machine holds another index's, and the job
falls back to the persistent tier for nothing. What a store holds is keyed
by owner (the host whose mesh positions the shards are), so any process can
recover from any store; only the directory's name has to be found.

What. Every host lists the stores with versions under its own
``STORE_ROOT/JOB`` and all hosts agree (``choose_store_hosts``, pure) on the
store each opens: when every host found at most one and no two found the
same one, the RAM disks are the machines' own and each host opens the one it
found (its own name when it found none); otherwise (a RAM disk several hosts
share, as the simulated cluster's may be, or two hosts finding one store)
each opens its own index's, as before. The collective agrees, so no two
hosts of one directory ever open one store.

Alternative not taken: a machine identity file in each store (hostname,
``/etc/machine-id``): the simulated hosts of one machine share it, and a
renamed or re-imaged machine would lose its store for no reason.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

from capricorn_jax._src.memory.store.store_lifecycle import committed_steps
from capricorn_jax._src.multihost.agree import allgather_json

log = logging.getLogger("capricorn_jax")

_HOST = re.compile(r"^host(\d+)$")


def stores_with_versions(job_root: str | os.PathLike) -> list[int]:
    """The indices of the stores under ``job_root`` that hold a committed version."""
    root = Path(job_root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _HOST.match(entry.name)
        if m and entry.is_dir() and any(committed_steps(entry).values()):
            found.append(int(m.group(1)))
    return sorted(found)


def choose_store_hosts(found: Sequence[Sequence[int]]) -> list[int]:
    """Each host's store index from what every host found under its own
    ``STORE_ROOT/JOB`` (module docstring): ``found[h]`` is host h's list."""
    hosts = len(found)
    singles = [list(f)[0] for f in found if len(f) == 1]
    own_disks = all(len(f) <= 1 for f in found) and len(singles) == len(set(singles))
    if not own_disks:
        return list(range(hosts))
    return [list(f)[0] if f else h for h, f in enumerate(found)]


def agree_store_host(job_root: str | os.PathLike, host: int, hosts: int) -> int:
    """This host's store index (collective: every host calls it)."""
    found = [list(map(int, f)) for f in allgather_json(
        stores_with_versions(job_root), hosts, what="the RAM stores each host holds")]
    chosen = choose_store_hosts(found)[host]
    if chosen != host:
        log.warning("host %d: this machine's RAM store was written as host %d's (the process "
                    "ids changed across the restart); recovering from it", host, chosen)
    return chosen
