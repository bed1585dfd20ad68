"""Gemini placement: every host's data on m distinct hosts, rounds are permutations."""

import pytest

from capricorn_jax._src.memory.wire.placement import groups, holders, replica_sources, send_rounds

CASES = [(h, m) for h in range(1, 17) for m in range(1, 4) if m <= h]


@pytest.mark.parametrize("hosts,replicas", CASES)
def test_every_host_on_m_distinct_hosts(hosts, replicas):
    held = holders(hosts, replicas)
    for h in range(hosts):
        assert held[h][0] == h
        assert len(held[h]) == replicas
        assert len(set(held[h])) == replicas
        assert all(0 <= x < hosts for x in held[h])
    # Every host also stores exactly m-1 peers' data: the load is balanced.
    stored = [sum(x in held[h][1:] for h in range(hosts)) for x in range(hosts)]
    assert stored == [replicas - 1] * hosts


@pytest.mark.parametrize("hosts,replicas", CASES)
def test_rounds_are_permutations_and_sources_invert_them(hosts, replicas):
    rounds = send_rounds(hosts, replicas)
    assert len(rounds) == replicas - 1
    for perm in rounds:
        assert sorted(perm) == list(range(hosts))
        assert sorted(perm.values()) == list(range(hosts))
        assert all(src != dst for src, dst in perm.items())
    for h in range(hosts):
        sources = replica_sources(hosts, replicas, h)
        assert [rounds[r][s] for r, s in enumerate(sources)] == [h] * len(rounds)


@pytest.mark.parametrize("hosts,replicas", CASES)
def test_group_when_m_divides_h_else_mixed_ring(hosts, replicas):
    gs = groups(hosts, replicas)
    assert sorted(x for g in gs for x in g) == list(range(hosts))
    if hosts % replicas == 0:
        assert all(len(g) == replicas for g in gs)
        held = holders(hosts, replicas)
        for g in gs:  # group placement: the group holds each other's data
            for h in g:
                assert sorted(held[h]) == g
    else:
        assert [len(g) for g in gs[:-1]] == [replicas] * (len(gs) - 1)
        assert len(gs[-1]) == replicas + hosts % replicas


def test_examples():
    assert holders(4, 2) == [[0, 1], [1, 0], [2, 3], [3, 2]]
    assert holders(5, 2) == [[0, 1], [1, 0], [2, 3], [3, 4], [4, 2]]
    with pytest.raises(ValueError, match="replicas"):
        groups(2, 3)
