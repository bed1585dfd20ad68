"""Gemini's placement of m checkpoint replicas over H hosts (pure).

Group placement when m divides H: hosts form H/m groups of m, and each host's
checkpoint lives on every host of its group. Otherwise mixed placement: the
first floor(H/m) - 1 groups use group placement and the last m + H % m hosts
form a ring in which each host's checkpoint lives on itself and the next m-1
hosts. Either way every host's data sits on m distinct hosts, and a single
host loss is always recoverable from CPU memory when m >= 2.

Replication is expressed as m-1 *rounds*; in round r every host sends its
shards to one peer, and the (host -> peer) map of a round is a permutation,
so a round is one collective-permute in which every host sends and receives
the same volume.
"""

from __future__ import annotations


def groups(hosts: int, replicas: int) -> list[list[int]]:
    """The placement groups: lists of consecutive host indices.

    Raises:
      ValueError: when replicas < 1 or replicas > hosts.
    """
    if hosts < 1:
        raise ValueError(f"hosts must be >= 1, got {hosts}")
    if not 1 <= replicas <= hosts:
        raise ValueError(f"replicas must be in [1, hosts={hosts}], got {replicas}")
    count = hosts // replicas
    sizes = [replicas] * count
    sizes[-1] += hosts % replicas  # mixed: the last group is a ring of m + H % m hosts
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out


def send_rounds(hosts: int, replicas: int) -> list[dict[int, int]]:
    """The m-1 replication rounds: round r maps each host to the peer it sends to."""
    rounds = []
    for r in range(1, replicas):
        perm = {}
        for group in groups(hosts, replicas):
            size = len(group)
            for i, host in enumerate(group):
                perm[host] = group[(i + r) % size]
        rounds.append(perm)
    return rounds


def holders(hosts: int, replicas: int) -> list[list[int]]:
    """holders[h]: the hosts holding h's checkpoint, h itself first."""
    out = [[h] for h in range(hosts)]
    for perm in send_rounds(hosts, replicas):
        for src, dst in perm.items():
            out[src].append(dst)
    return out


def replica_sources(hosts: int, replicas: int, host: int) -> list[int]:
    """The owners whose replicas ``host`` receives, one per round, in round order."""
    return [next(s for s, d in perm.items() if d == host) for perm in send_rounds(hosts, replicas)]
