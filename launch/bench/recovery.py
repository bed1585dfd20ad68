"""launch.bench's recovery measurements, after the timed steps.

In-memory strategies recover from the local RAM store and then from a peer
(host 1's store wiped); the baselines restore through their own ``restore``,
disk reads from a dropped page cache where the process may drop it. Every
function is collective over the bench's hosts. Split from ``launch.bench``
so that the command module holds the command; alternative not taken: timing
recovery inside the runner, which would mix restores into the step timings.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from launch.tiers import host_tiers

if TYPE_CHECKING:
    from capricorn_jax import RestoreInfo


FINISH_S = 120.0
"""The wait for the tier's writers before the recovery (seconds at
``--time_scale=1``; multiplied by it)."""


def recovery_times(ckpt, job, replicas: int, time_scale: float = 1.0) -> dict:
    """An in-memory strategy's recovery: from the local store, then from a
    peer after host 1's store is wiped (with peers and replicas > 1)."""
    import capricorn_jax
    from capricorn_jax.experimental import allgather_floats

    ckpt.wait_until_finished(FINISH_S * time_scale)
    out = {}
    local = capricorn_jax.recover(ckpt)
    if local is None:
        raise RuntimeError("recovery from the local store found no version every host holds")
    out["local"] = _times(local[1])
    if job.hosts > 1 and replicas > 1:
        if job.host == 1:
            ckpt.store.wipe()
        allgather_floats([0.0], job.hosts)  # barrier: the wipe is done before anyone scans
        peer = capricorn_jax.recover(ckpt)
        if peer is None:
            raise RuntimeError("recovery from a peer found no version every host holds")
        out["peer"] = _times(peer[1])
    return out


def _times(info: RestoreInfo) -> dict:
    """A memory-tier recovery's record: the slowest host's seconds, the bytes
    moved between hosts and each host's tier."""
    return {"seconds": info.seconds, "bytes_moved": info.bytes_moved, "tiers": info.memory_tiers}


def _drop_page_cache(job) -> bool:
    """Drops this machine's page cache (host 0; root only), so that a restore
    from disk reads the disk; whether it could (collective)."""
    from capricorn_jax.experimental import allgather_floats

    done = 0.0
    if job.host == 0:
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            done = 1.0
        except OSError:
            pass
    return bool(allgather_floats([done], job.hosts)[0][0])


def _timed_restore(strategy, job, cold: bool) -> dict:
    """Restores ``strategy``'s newest version (collective): the slowest host's
    seconds, the tier, and whether the page cache was dropped first."""
    from capricorn_jax.experimental import allgather_floats

    dropped = _drop_page_cache(job) if cold else False
    allgather_floats([0.0], job.hosts)  # everyone starts together
    t0 = time.perf_counter()
    import capricorn_jax

    try:
        _, info = strategy.restore()
    except capricorn_jax.NoCheckpoint as e:
        raise RuntimeError(f"{strategy.name}: nothing to restore after the benchmark") from e
    seconds = time.perf_counter() - t0
    slowest = max(x[0] for x in allgather_floats([seconds], job.hosts))
    return {"seconds": slowest, "bytes_moved": info.bytes_moved or 0,
            "tiers": host_tiers(info), "step": info.step, "cold_cache": dropped}


def baseline_recovery(name: str, strategy, job) -> dict:
    """Recovery per tier of a baseline (its own restore), on the same state as
    the in-memory strategies'. Disk reads start from a dropped page cache
    when the process may drop it (``cold_cache``)."""
    import shutil

    if name == "orbax_emergency":
        out = {}
        if strategy.local_tier:
            out["local"] = _timed_restore(strategy, job, cold=False)
            shutil.rmtree(strategy.local, ignore_errors=True)  # every host's RAM tier lost
            strategy.local.mkdir(parents=True)
            strategy.manager.reload()
        out["persistent"] = _timed_restore(strategy, job, cold=True)
        return out
    disk = name == "blocking_disk"
    return {"disk" if disk else "local": _timed_restore(strategy, job, cold=disk)}
