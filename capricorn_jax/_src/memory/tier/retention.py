"""Which versions a store keeps, and which version is safe (pure).

``versions_to_keep`` is the one keep rule of every store: the memory tier's
with and without PEC, and the persistent tier's under PEC (which steps hold
the experts a restore of the newest step reads). The stores differ only in
its inputs: what each version's restore reads (a version saved whole reads
itself), the safe version and the lag window. Alternative not taken: a rule
per store (there were three, whose ``window`` counted stored versions in one
and steps in another); the safety proof below would then have to hold for
each of them separately. The rest of this module is the memory tier's safe
version.

Every save all-gathers each host's *held* versions of every owner (committed
to its store and not marked for removal). The *safe* version is the newest
one that every holder of every owner reports holding (and, under PEC, that is
complete and whose restore reads only versions every holder holds). A host
removes a version only by a decision taken on the training thread right
after it adopted the safe version from the statuses of the previous save,
and before it reports its own held versions for this save; a version never
leaves ``held`` otherwise. So the safe version adopted at save n+1 was held
by every holder when the statuses of save n were taken, and no holder has
removed it since: every decision keeps the safe version. Hence at every
moment one version of every owner sits on all its holders, and losing any
m-1 hosts leaves it reachable.

Alternative not taken (the earlier rule): safe = the minimum over holders of
the *newest* version each committed, each writer pruning to {newest, safe}
as it committed. A holder could then hold something newer than the safe
version but not the safe version itself (a dropped replica, or a writer that
committed and pruned before the safe version caught up), while the others
removed the older copy it still relied on; after a host loss no version
covered every owner and the job started fresh.

A held set travels as (newest, mask): bit i of mask says that version
newest - 1 - i is held, for i < ``MASK_BITS`` (the statuses are int32).
Older held versions are not reported, so a safe version further than that
behind the newest cannot be adopted; the previous safe one stays.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

MASK_BITS = 30  # fits a non-negative int32


def encode_held(held: Iterable[int]) -> tuple[int, int]:
    """(newest, mask) of a set of held versions; (-1, 0) when empty."""
    held = set(held)
    if not held:
        return -1, 0
    newest = max(held)
    mask = 0
    for v in held:
        i = newest - 1 - v
        if 0 <= i < MASK_BITS:
            mask |= 1 << i
    return newest, mask


def decode_held(newest: int, mask: int) -> set[int]:
    """The versions an (newest, mask) pair reports held."""
    if newest < 0:
        return set()
    return {newest} | {newest - 1 - i for i in range(MASK_BITS)
                       if mask >> i & 1 and newest - 1 - i >= 0}


def held_everywhere(held: Sequence[Mapping[int, Iterable[int]]],
                    holders: Sequence[Sequence[int]]) -> set[int]:
    """The versions that every holder of every owner reports holding (a version
    committed on its owner and on every replica). ``held``, ``holders`` as in
    ``safe_version``."""
    out: set[int] | None = None
    for owner, owner_holders in enumerate(holders):
        for x in owner_holders:
            versions = set(held[x].get(owner, ()))
            out = versions if out is None else out & versions
    return out or set()


def safe_version(held: Sequence[Mapping[int, Iterable[int]]], holders: Sequence[Sequence[int]],
                 previous: int,
                 needs: Mapping[int, tuple[Sequence[int], bool]] | None = None) -> int:
    """The newest version safe to recover at, never older than ``previous``.

    Args:
      held: held[x][o]: versions of owner o that host x reports holding.
      holders: holders[o]: the hosts holding owner o (placement.holders).
      previous: the safe version adopted so far (-1: none).
      needs: PEC: {version: (versions its restore reads, complete)}; a
        version qualifies only when complete and every version it reads is
        held everywhere too. None: every version qualifies.
    """
    everywhere = None
    for owner, hosts in enumerate(holders):
        for x in hosts:
            have = set(held[x].get(owner, ()))
            everywhere = have if everywhere is None else everywhere & have
    everywhere = everywhere or set()

    def qualifies(v: int) -> bool:
        if needs is None:
            return True
        if v not in needs:
            return False
        reads, complete = needs[v]
        return complete and set(reads) <= everywhere

    return max([previous, *(v for v in everywhere if qualifies(v))])


Needs = Mapping[int, tuple[Sequence[int], bool]]
"""{version: (the versions a restore to it reads, complete)}."""


def whole_versions(stored: Iterable[int]) -> dict[int, tuple[tuple[int, ...], bool]]:
    """The needs of versions saved whole (without PEC): each reads itself alone."""
    return {int(v): ((int(v),), True) for v in stored}


def versions_to_keep(needs: Needs, safe: int, window: int) -> set[int]:
    """The versions of one store a tier keeps: the one keep rule of every tier.

    A stored version (a key of ``needs``) is *restorable* when it is complete
    and every version its restore reads is stored. The *roots* are:

    * the newest stored version (the one just written, which the next
      versions build on);
    * the newest restorable version at or before ``safe`` (the safe version
      itself once adopted);
    * the newest ``window`` restorable versions after ``safe``, before the
      newest: the candidates to become safe while the writers of the holders
      lag by up to ``window`` versions.

    The store keeps the roots and every stored version a root reads.

    The tiers' callers:

    * memory tier without PEC: ``needs = whole_versions(held)``, ``safe``
      the adopted safe version, ``window`` = ``InMemoryOptions.window``: the
      safe version and the newest ``window`` + 1 versions after it (with
      ``window`` = 0 a one-version lag between two holders would never let
      the safe version advance);
    * memory tier with PEC: ``needs`` from the versions' manifests
      (``plans.version_needs``), the same ``safe`` and ``window``. With the
      sequential policy at a constant K and replication lagging by at most
      ``window``, that is at most ceil(N/K) + window versions (ceil(N/K)
      consecutive versions hold every expert); a longer lag adds the safe
      version's own needs (at most 2 * ceil(N/K) + window), until
      replication catches up;
    * persistent tier under PEC: ``needs = plans.persisted_needs(masks)``,
      ``safe`` the newest committed step, ``window`` = 0: every step holding
      some expert's newest persisted copy, so the newest step always restores
      (Orbax's own policy, ``max_to_keep``..., keeps others besides).

    Alternative not taken: keeping every version after the safe one, which
    also survives any lag but grows without bound while a peer stalls.

    Args:
      needs: {stored version: (versions its restore reads, complete)}.
      safe: the safe version (-1: none yet).
      window: how many versions before the newest stay candidates (>= 0).

    Returns:
      The versions to keep (a subset of ``needs``' keys).
    """
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    stored = set(needs)
    if not stored:
        return set()

    def restorable(v: int) -> bool:
        reads, complete = needs[v]
        return complete and set(reads) <= stored

    newest = max(stored)
    ready = sorted(v for v in stored if restorable(v))
    roots = {newest, *[v for v in ready if v <= safe][-1:]}
    roots |= set([v for v in ready if safe < v < newest][-window:] if window else [])
    keep = set(roots)
    for root in roots:
        keep |= set(needs[root][0]) & stored
    return keep
