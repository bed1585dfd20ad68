"""A deliberate roll-back (fault plan point ``rollback``), the launcher's side.

launch.chaos checks a PEC trial against a reference job that takes the same
roll-backs as the faulted one, without its faults (``launch.chaos.pec_reference``).
A ``rollback`` entry of the plan stops every host after its step (each one
announces the point and waits, as at ``after_step``); the supervisor's
injector (``launch.train.faults``) waits until ``ready`` says the stores hold
the version, kills every host, calls ``apply`` between the attempts, and
restarts them: the hosts then recover as after any kill, through the
ordinary recovery (``launch.train.persistence.resume``), from that version.

``apply`` removes each store's versions newer than the target (as a
recovery to it does), the persistent steps newer than it, and the RAM stores
the roll-back loses (``lose``: a peer serves those hosts, as in a recovery
after a lost machine; ``wipe_all``: every store, the persistent tier serves).

Design choice: the roll-back ends the attempt and lets the restart recover,
so the reference restores through the very code a faulted job recovers
with (and the same tier), the only deliberate step being which versions are
left. Alternative not taken: a restore to a named version inside the
running job, a second restore path that a faulted job never takes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from capricorn_jax.experimental import HostStore, committed_steps
from launch.train.config import CheckpointConfig
from launch.train.fault_plan import Fault

WAIT_S = 60.0
"""How long the injector waits, once every host stopped, for the stores to
hold the roll-back's version (its writes run on while the hosts wait); past
it the roll-back goes ahead, and the recovery reports the version it found."""


def persistent_steps(workdir: str | Path) -> set[int]:
    """The persistent steps Orbax finalized under WORKDIR/checkpoints."""
    root = Path(workdir) / "checkpoints"
    if not root.is_dir():
        return set()
    return {int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit()}


def ready(fault: Fault, checkpoint: CheckpointConfig, workdir: str | Path, hosts: int) -> bool:
    """Whether the roll-back's version can be restored from the tier it names:
    with ``wipe_all`` a finalized persistent step; else every owner's shards
    of it in a store that the roll-back keeps (its own, or for a host in
    ``lose`` a peer's). Version 0 (a fresh start) needs nothing."""
    if fault.version == 0:
        return True
    if fault.wipe_all:
        return fault.version in persistent_steps(workdir)
    kept = [h for h in range(hosts) if h not in fault.lose]
    held = {h: committed_steps(checkpoint.store_dir(h)) for h in kept}
    for owner in range(hosts):
        holders = [owner] if owner in kept else [h for h in kept if h != owner]
        if not any(fault.version in held[h].get(owner, ()) for h in holders):
            return False
    return True


def apply(fault: Fault, checkpoint: CheckpointConfig, workdir: str | Path,
          hosts: int) -> list[str]:
    """Between the stopped attempt and the restart: the stores as the
    roll-back leaves them (module docstring); one line per thing done."""
    lines = []
    lost = range(hosts) if fault.wipe_all else fault.lose
    for host in range(hosts):
        root = checkpoint.store_dir(host)
        if host in lost:
            shutil.rmtree(root, ignore_errors=True)
            continue
        if not root.is_dir():
            continue
        store = HostStore(root)
        try:
            for owner in store.owners():
                store.prune(owner, [s for s in store.versions(owner) if s <= fault.version])
        finally:
            store.close()
    if lost:
        lines.append(f"rollback: the RAM stores of host{'s' if len(lost) > 1 else ''} "
                     f"{', '.join(map(str, lost))} lost")
    newer = sorted(s for s in persistent_steps(workdir) if s > fault.version)
    for step in newer:
        shutil.rmtree(Path(workdir) / "checkpoints" / str(step), ignore_errors=True)
    lines.append(f"rollback: every host back to version {fault.version}; stored versions "
                 f"after it dropped" + (f", persistent steps {newer} deleted" if newer else ""))
    return lines
