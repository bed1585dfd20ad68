"""Orbax's synchronous barriers, bounded for every user of the managers.

Why. In orbax-checkpoint 0.12.8 the barriers a ``CheckpointManager`` passes
through (creating the root, a save's start, the steps to remove, a deleted
step, ...) are ``jax.experimental.multihost_utils.sync_global_devices``: a
collective with no timeout, so one host that is alive but never arrives (a
stuck data loader, a wedged filesystem) holds every other host for ever;
a dead host is ended by the ``jax.distributed`` heartbeat, a silent one is
not. Orbax runs them through the distributed client with a timeout
(``multihost.coordination_timeout()``, 300 s) only when its absl flag
``experimental_orbax_use_distributed_barrier`` is on; the launchers set it,
a library program (no ``app.run``, flags never parsed) never did.

What. ``bound(timeout_s)``, called by ``manager.CheckpointManager`` (and so
``TwoTierCheckpointManager``) before Orbax's constructor when several
processes run: turns that flag on unless the user gave it (parsed and
present on the command line, in which case their value stands), and sets
Orbax's barrier bound to ``timeout_s``. The bound is process-wide (Orbax reads
a module constant); the newest manager's value holds, said once on the log.
A barrier that times out raises in Orbax; the manager records it as a failed
persistent step (a save) or raises it (the constructor).

Alternative not taken: Orbax's ``MultiprocessingOptions.active_processes``
set to every process, which also routes barriers through the client with a
timeout but switches Orbax to its subset-of-processes mode (no root
creation, other directory rules).
"""

from __future__ import annotations

import logging

from absl import flags

log = logging.getLogger("capricorn_jax")

FLAG = "experimental_orbax_use_distributed_barrier"
DEFAULT_S = 300.0
"""The default bound: Orbax's own (``coordination_timeout()`` in 0.12.8)."""
_said: list[float] = []


def bound(timeout_s: float) -> None:
    """Orbax's synchronous barriers through the distributed client, bounded by
    ``timeout_s`` seconds (rounded up to a whole second)."""
    from orbax.checkpoint._src.multihost import multihost

    if timeout_s <= 0:
        raise ValueError(f"barrier_timeout_s must be positive, got {timeout_s}")
    seconds = max(1, int(-(-timeout_s // 1)))
    flag = flags.FLAGS[FLAG]
    if not flag.present:  # the user did not choose
        flag.value = True
        flag.present = 1  # readable before (or without) absl's parse
    elif not flag.value:
        log.warning("--%s=false was given: Orbax's barriers stay unbounded collectives", FLAG)
    multihost._DEFAULT_BARRIER_TIMEOUT = seconds  # Orbax reads it at each barrier
    if _said != [seconds]:
        _said[:] = [seconds]
        log.info("Orbax's barriers run on the jax.distributed client, bounded at %d s", seconds)


def current() -> int:
    """Orbax's barrier bound now (seconds)."""
    from orbax.checkpoint._src.multihost import multihost

    return int(multihost.coordination_timeout())
