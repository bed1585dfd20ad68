"""What the in-memory tier reports: a save's ``SaveReport`` and a store's release.

``release_store`` carries out ``InMemoryCheckpointer.release`` once the
checkpointer has adopted its final statuses: it deletes the store, or keeps
per owner only what a restore to the safe version reads and drops the slots
that hold nothing.

Design choice: the reports and the release's file work apart from the
checkpointer, which keeps the decisions (lifecycle, writers, status round);
these read nothing of it but the store and the versions wanted. Alternative
not taken: the release's store walk inside the checkpointer's method, which
grew the class past the size a reader can hold.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from capricorn_jax._src.memory.store.store import HostStore


@dataclasses.dataclass(frozen=True)
class StoreRelease:
    """What ``InMemoryCheckpointer.release`` did to this host's store.

    ``keep``: "none" (the store was deleted) or "final"; ``versions``: the
    versions left per owner ({} after "none"); ``bytes_held``: the store's
    bytes after; ``bytes_freed``: the bytes given back to the RAM disk.
    """

    keep: str
    versions: dict[int, list[int]]
    bytes_held: int
    bytes_freed: int


@dataclasses.dataclass
class DropCounts:
    """Versions a host's checkpointer did not take or hold, by cause, since it
    opened (cumulative; the lag alarm reads their growth).

    ``corrupt``: dropped, a peer's payload failed its end-to-end check
    (``drop``); ``lost``: dropped, a peer's payload never came (a lost chunk
    channel); ``skipped``: not taken on purpose at the caller's word
    (``skip``: a lost channel, a version still on the link); ``budget``:
    skipped by the cost budget (some host's writers busy at the previous
    save); ``own_busy``: this host's own writer busy past the wait;
    ``replicas_busy``: versions whose replicas this host dropped, its replica
    writer busy.
    """

    corrupt: int = 0
    lost: int = 0
    skipped: int = 0
    budget: int = 0
    own_busy: int = 0
    replicas_busy: int = 0


@dataclasses.dataclass
class SaveReport:
    """What one save() knows when it returns (for the ``checkpoint`` event).

    ``committed`` (this host's newest own version committed) and
    ``safe_version`` (the newest version every holder of every owner holds,
    ``retention.safe_version``; -1: none) lag the save by the writers'
    latency: they describe the newest versions confirmed so far, not
    necessarily ``step``. ``store_bytes`` is this host's store now;
    ``store_kib_per_host`` every host's, as of the previous save (it travels
    in the all-gathered statuses). ``skipped``: this version was not taken
    (the budget skipped it everywhere, or this host's writer was busy past
    the wait); ``interval``: steps since the previous version this host took
    (None: skipped, or the first); ``dropped_replicas``: replica copies this
    save received but did not write (the replica writer was busy);
    ``newly_committed``: versions the gathered statuses show, for the first
    time, on every holder of every owner (committed on owners and replicas).
    """

    step: int
    bytes: int
    store_bytes: int
    committed: int
    safe_version: int
    under_replicated: list[dict[str, Any]]
    skipped: bool
    store_kib_per_host: list[int] = dataclasses.field(default_factory=list)
    interval: int | None = None
    dropped_replicas: int = 0
    newly_committed: list[int] = dataclasses.field(default_factory=list)
    pec_k: int | None = None
    pec_plt: float | None = None
    corrupt: bool = False  # this host dropped the version: a peer's payload failed its check

    @property
    def replicated(self) -> int:
        """``safe_version`` under the name of the ``checkpoint`` event's key."""
        return self.safe_version


def release_store(store: HostStore, keep: str, safe: int, wanted: set[int]) -> StoreRelease:
    """Releases ``store`` (``InMemoryCheckpointer.release``): "none" deletes it
    (and the job's directory once no host's store is left in it); "final"
    keeps, per owner holding the safe version ``safe``, the versions in
    ``wanted`` (a restore to ``safe`` reads them; ``safe`` < 0: none yet,
    every committed version stays), drops the slots that hold none, and
    closes the store."""
    before = store.bytes_held()
    if keep == "none":
        root = store.root
        store.destroy()
        try:
            root.parent.rmdir()  # the job's directory, once the last host's store is gone
        except OSError:
            pass
        return StoreRelease(keep, {}, 0, before)
    if safe >= 0:
        for owner in store.owners():
            versions = set(store.versions(owner))
            if safe in versions:
                store.prune(owner, wanted & versions)
    store.drop_free_slots()
    left = {o: store.versions(o) for o in store.owners()}
    held = store.bytes_held()
    store.close()
    return StoreRelease(keep, {o: v for o, v in left.items() if v}, held,
                        max(before - held, 0))
