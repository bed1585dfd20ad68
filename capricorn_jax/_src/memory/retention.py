"""Which versions a host keeps, and which version is safe (pure).

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


def versions_to_keep(stored: Iterable[int], safe: int, window: int) -> set[int]:
    """The versions of one owner a host keeps (without PEC).

    The newest stored version at or before ``safe`` (the safe version itself
    once adopted), and the newest ``window`` + 1 versions after it: the
    candidates to become safe while the holders' writers lag by up to
    ``window`` versions. With ``window`` = 0 a one-version lag between two
    holders would never let the safe version advance.
    """
    stored = sorted(set(stored))
    at_or_before = [v for v in stored if v <= safe]
    after = [v for v in stored if v > safe]
    return set(at_or_before[-1:]) | set(after[-(window + 1):])
