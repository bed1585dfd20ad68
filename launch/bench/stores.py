"""launch.bench's RAM stores: a folder of its own per run, so no run deletes another's.

A bench run's stores (every strategy's host stores, the baselines' RAM
directories) live in ``<--store_root>/run<pid>``, ``pid`` the supervisor's
(``run_root``); the workers receive that folder as their ``--store_root``
(``worker_argv``). At its start a run removes only what no live run owns
(``clear_stale``: the folders of runs whose supervisor is gone, and anything
else under the root, each through ``store_lifecycle.remove_unused``, which
deletes nothing while a process has one of its stores open); at its end it
removes its own folder, then the root if that left it empty (``release``).

Why: the bench used to delete the whole ``--store_root`` before and after
every run. Its default root is one fixed folder, so a second bench started
(or ended) while a first one ran deleted the first one's stores: a run that
had committed every version, whose in-memory strategies had finished their
last block while the other strategies ran theirs, then found no stored
version in its recovery measurement (``recovery from the local store found
no version every host holds``), and ``recover`` dropped what was left. The
same command alone passed. ``removable`` is the pure decision of what a run
may delete.

Design choice: isolation, so two benches may share a root (and a RAM disk)
at once, as two training jobs do with theirs. Alternative not taken: an
exclusive lock on the root that refuses a second run; it would have turned
the loss into an error but still forbid what the default root invites, and a
lock file left by a killed supervisor would need the same liveness test.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from capricorn_jax.experimental import remove_unused
from launch.cluster.netns import pid_alive

RUN = re.compile(r"^run(\d+)$")
"""A run's folder under the store root: ``run<supervisor pid>``."""


def run_root(store_root: str | os.PathLike, pid: int | None = None) -> Path:
    """The folder of the run whose supervisor is ``pid`` (default: this process)."""
    return Path(store_root) / f"run{os.getpid() if pid is None else pid}"


def removable(names: Iterable[str], own: int, alive: Callable[[int], bool]) -> list[str]:
    """The entries of a store root a starting run (supervisor ``own``) may try to
    remove: all but the folders of live runs (``alive(pid)``) other than its
    own, sorted. Pure; each is then removed only if none of its stores is
    open (``clear_stale``)."""
    out = []
    for name in names:
        m = RUN.match(name)
        if m is not None and int(m.group(1)) != own and alive(int(m.group(1))):
            continue
        out.append(name)
    return sorted(out)


def clear_stale(store_root: str | os.PathLike, own: int | None = None,
                alive: Callable[[int], bool] = pid_alive) -> list[str]:
    """At a run's start: removes what crashed or earlier runs left under
    ``store_root`` and no live run owns (``removable``), each entry only while
    no process has a store in it open; returns the entries removed."""
    root = Path(store_root)
    if not root.is_dir():
        return []
    own = os.getpid() if own is None else own
    removed = []
    for name in removable((p.name for p in root.iterdir()), own, alive):
        path = root / name
        if path.is_dir() and not path.is_symlink():
            if remove_unused(path):
                removed.append(name)
    return removed


def release(store_root: str | os.PathLike, run: Path) -> None:
    """At a run's end (its workers gone): removes its folder ``run``, then the
    root if nothing else is left in it."""
    shutil.rmtree(run, ignore_errors=True)
    try:
        Path(store_root).rmdir()  # only when empty: another run's folder stays
    except OSError:
        pass


def worker_argv(argv: Sequence[str], run: Path) -> list[str]:
    """The launcher's flags for its workers: ``--store_root`` names the run's
    folder (the launcher's own ``--store_root`` left out, in either form)."""
    kept: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--store_root":
            skip = True  # its value is the next argument
        elif not a.startswith("--store_root="):
            kept.append(a)
    return [*kept, f"--store_root={run}"]
