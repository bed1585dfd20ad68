"""The retention rule: which versions a host keeps and which one is safe.

The protocol test drives every host's saves and both of its writers through
interleavings hypothesis chooses (writers lagging, replicas dropped while the
replica writer is busy, own versions skipped), with the real placement,
retention and recovery decisions, and checks after every event that losing
any m-1 hosts leaves a version recoverable that is at least the newest safe
version any host adopted.
"""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capricorn_jax._src.memory.tier import retention
from capricorn_jax._src.memory.tier.options import InMemoryOptions
from capricorn_jax._src.memory.tier.recovery import choose_pec_version, choose_version
from capricorn_jax._src.memory.wire import placement


@given(st.sets(st.integers(0, 200), max_size=40))
def test_held_versions_travel_exactly_within_the_mask(held):
    newest, mask = retention.encode_held(held)
    assert 0 <= mask < 2 ** 31  # an int32 status entry
    assert newest == max(held, default=-1)
    expected = {v for v in held if v >= newest - retention.MASK_BITS}
    assert retention.decode_held(newest, mask) == expected


def test_safe_version_needs_one_version_on_every_holder_of_every_owner():
    holders = placement.holders(2, 2)  # owner 0: hosts 0, 1; owner 1: hosts 1, 0
    # Host 1 dropped owner 0's replica of 5; host 0 still has 4 of owner 1.
    held = [{0: {4, 5, 6}, 1: {4, 6}}, {0: {4, 6}, 1: {4, 5, 6}}]
    assert retention.safe_version(held, holders, -1) == 6
    held = [{0: {4, 5, 6}, 1: {4, 5}}, {0: {4, 6}, 1: {4, 5, 6}}]
    assert retention.safe_version(held, holders, -1) == 4
    assert retention.safe_version(held, holders, 5) == 5  # never goes back
    held = [{0: {5, 6}, 1: {5}}, {0: {6}, 1: {5, 6}}]
    assert retention.safe_version(held, holders, 3) == 3  # nothing common: keep the old one


def test_safe_version_under_pec_reads_only_versions_held_everywhere():
    holders = placement.holders(2, 2)
    held = [{0: {4, 5, 6}, 1: {4, 5, 6}}, {0: {5, 6}, 1: {4, 5, 6}}]
    needs = {4: ((4,), True), 5: ((4, 5), True), 6: ((5, 6), False)}
    # 6 is incomplete; 5 reads 4, which host 1 lacks for owner 0.
    assert retention.safe_version(held, holders, -1, needs) == -1
    needs[6] = ((5, 6), True)
    assert retention.safe_version(held, holders, -1, needs) == 6


@given(st.sets(st.integers(0, 60), max_size=20), st.integers(-1, 60), st.integers(1, 4))
def test_versions_to_keep(stored, safe, window):
    keep = retention.versions_to_keep(retention.whole_versions(stored), safe, window)
    assert keep <= stored
    at_or_before = [v for v in stored if v <= safe]
    if at_or_before:
        assert max(at_or_before) in keep
    after = sorted(v for v in stored if v > safe)
    assert set(after[-(window + 1):]) <= keep
    assert len(keep) <= window + 2
    assert not any(v < max(at_or_before, default=-1) for v in keep)


def test_window_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        InMemoryOptions(store_root=str(tmp_path), job="j", window=0)


class _Cluster:
    """The in-memory tier's bookkeeping on every host (no data): what each
    host holds, its writers' queues, and the statuses of the last save."""

    def __init__(self, hosts, replicas, window, needs):
        self.hosts, self.window, self.needs = hosts, window, needs
        self.holders = placement.holders(hosts, replicas)
        self.sources = [placement.replica_sources(hosts, replicas, x) for x in range(hosts)]
        self.losses = list(itertools.combinations(range(hosts), replicas - 1))
        self.held = [{} for _ in range(hosts)]
        self.own_q = [[] for _ in range(hosts)]  # versions; head is being written
        self.rep_q = [[] for _ in range(hosts)]  # [version, owners left to write]
        self.safe = [-1] * hosts
        self.previous = None  # statuses of the last completed save
        self.current = {}

    def commit(self, x, own):
        if own:
            self.held[x].setdefault(x, set()).add(self.own_q[x].pop(0))
            return
        version, owners = self.rep_q[x][0]
        self.held[x].setdefault(owners.pop(0), set()).add(version)
        if not owners:
            self.rep_q[x].pop(0)

    def save(self, x, step, skip_own):
        if self.previous is not None:
            self.safe[x] = retention.safe_version(self.previous, self.holders, self.safe[x],
                                                  self.needs)
        for held in self.held[x].values():
            if not held:
                continue
            if self.needs is None:
                needs = retention.whole_versions(held)
            else:
                needs = {v: self.needs[v] for v in held}
            keep = retention.versions_to_keep(needs, self.safe[x], self.window)
            assert len(keep) <= self.window + 2 or self.needs is not None
            held &= keep
        self.current[x] = {o: retention.decode_held(*retention.encode_held(h))
                           for o, h in self.held[x].items()}
        if len(self.own_q[x]) < 2:
            self.own_q[x].append(step)
        elif not skip_own:  # the save waits for the writer, or skips its own version
            self.commit(x, own=True)
            self.own_q[x].append(step)
        if len(self.rep_q[x]) < 2:  # otherwise the replicas are dropped
            self.rep_q[x].append([step, list(self.sources[x])])

    def end_save(self):
        self.previous = [self.current[x] for x in range(self.hosts)]
        self.current = {}

    def pending(self):
        return [(x, own) for x in range(self.hosts) for own in (True, False)
                if (self.own_q if own else self.rep_q)[x]]

    def check(self):
        safe = max(self.safe)
        if safe < 0:
            return
        for lost in self.losses:
            inventories = [{} if x in lost else {o: sorted(v) for o, v in self.held[x].items()}
                           for x in range(self.hosts)]
            if self.needs is None:
                decision = choose_version(inventories, self.hosts)
            else:
                stored = {v for inv in inventories for vs in inv.values() for v in vs}
                decision = choose_pec_version(
                    inventories, {v: self.needs[v] for v in stored}, self.hosts)
            assert decision is not None and decision[0] >= safe, (
                f"hosts {lost} lost: recovery finds {decision}, safe version {safe}; "
                f"held {self.held}")


@st.composite
def _pec_needs(draw, steps):
    """Each version reads itself and up to 3 earlier ones; some are incomplete."""
    needs = {}
    for v in range(1, steps + 4):
        back = draw(st.sets(st.integers(1, 3), max_size=3))
        needs[v] = (tuple(sorted({v, *(v - b for b in back if v - b >= 1)})),
                    draw(st.booleans()))
    return needs


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_safe_version_survives_any_m_minus_1_host_losses_at_every_moment(data):
    hosts = data.draw(st.integers(2, 5), label="hosts")
    replicas = data.draw(st.integers(2, min(3, hosts)), label="replicas")
    window = data.draw(st.integers(1, 3), label="window")
    steps = data.draw(st.integers(1, 14), label="steps")
    needs = data.draw(st.none() | _pec_needs(steps), label="pec needs")
    sim = _Cluster(hosts, replicas, window, needs)
    for step in range(1, steps + 1):
        for x in data.draw(st.permutations(range(hosts)), label="save order"):
            for _ in range(data.draw(st.integers(0, 3), label="writer events")):
                pending = sim.pending()
                if pending:
                    sim.commit(*data.draw(st.sampled_from(pending), label="writer"))
                    sim.check()
            sim.save(x, step, data.draw(st.booleans(), label="skip own when busy"))
            sim.check()
        sim.end_save()
    # Quiescent saves (every write lands before the next save): the safe
    # version catches up with the versions written.
    for step in range(steps + 1, steps + 4):
        while sim.pending():
            sim.commit(*sim.pending()[0])
        for x in range(hosts):
            sim.save(x, step, skip_own=False)
            sim.check()
        sim.end_save()
    if needs is None:
        assert sim.safe == [steps + 1] * hosts


def test_held_everywhere_is_what_every_holder_of_every_owner_holds():
    from capricorn_jax._src.memory.tier.retention import held_everywhere

    held = [{0: {1, 2, 3}, 1: {2}}, {0: {2, 3}, 1: {1, 2, 3}}, {2: {3}}]
    # Owner 0 on hosts 0, 1; owner 1 on hosts 1, 0; owner 2 on host 2 alone.
    assert held_everywhere(held, [[0, 1], [1, 0], [2]]) == set()  # owner 2 lacks 2
    held[2][2] = {2, 3}
    assert held_everywhere(held, [[0, 1], [1, 0], [2]]) == {2}  # owner 1 on host 0 lacks 3
    assert held_everywhere(held, [[0], [1], [2]]) == {2, 3}
    assert held_everywhere([{}, {}], [[0, 1], [1, 0]]) == set()
