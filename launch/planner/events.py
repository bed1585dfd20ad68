"""The discrete-event core: a clock, a heap of timed callbacks, and links
shared by fluid flows.

A ``Link`` is one host's send direction. Its ``discipline`` says how flows
on it (an all-to-all, a checkpoint chunk) share it: ``"fair"``, they share
its rate equally while they are active (processor sharing, what competing
TCP/RDMA flows on one NIC approach); ``"fifo"``, the oldest flow gets the
whole rate and the others wait behind it (what XLA:CPU over gloo does: it
runs an in-graph collective to its end before the next, so a step's
all-to-all queues behind a checkpoint exchange already on the link). Either
way the link never carries more than its rate; a flow completes when its
bytes are through. ``Sim.run`` advances the clock to the earlier of the next timed
callback and the next flow completion, moves every active flow's bytes by
its share, and fires what is due. Every interval of the link's use is kept
(``Link.log``), so the tests check the invariants on the record: bytes in =
bytes delivered, never above the rate.

Design choice: our own heap (``heapq``), a few dozen lines. Alternative not
taken: simpy (not installed here, and its processes are generators; the
planner's chains of callbacks are as short), and a packet-level model such
as ASTRA-sim's (MoC-System's), which resolves congestion the planner does
not need: a host's link is the only shared resource modelled.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable

_EPS = 1e-12


@dataclasses.dataclass
class Flow:
    tag: str
    nbytes: float
    remaining: float
    on_done: Callable[[], None] | None
    started_s: float


DISCIPLINES = ("fair", "fifo")


class Link:
    """A link of ``rate`` bytes/s: its active flows share it equally
    (``"fair"``) or go one at a time in arrival order (``"fifo"``)."""

    def __init__(self, sim: Sim, rate: float, name: str = "link",
                 discipline: str = "fair") -> None:
        if not rate > 0:
            raise ValueError(f"link {name}: rate must be > 0, got {rate}")
        if discipline not in DISCIPLINES:
            raise ValueError(f"link {name}: discipline {discipline!r}, one of {DISCIPLINES}")
        self.sim, self.rate, self.name = sim, float(rate), name
        self.discipline = discipline
        self.active: list[Flow] = []
        self.log: list[tuple[float, float, float]] = []  # (t0, t1, bytes/s carried)
        self.bytes_in: dict[str, float] = {}
        self.bytes_out: dict[str, float] = {}
        sim.links.append(self)

    def send(self, tag: str, nbytes: float, on_done: Callable[[], None] | None = None) -> None:
        """Starts a flow of ``nbytes`` now; ``on_done`` fires when it is through."""
        if nbytes < 0:
            raise ValueError(f"link {self.name}: negative flow {nbytes}")
        self.bytes_in[tag] = self.bytes_in.get(tag, 0.0) + nbytes
        if nbytes == 0:
            self.bytes_out[tag] = self.bytes_out.get(tag, 0.0)
            if on_done is not None:
                self.sim.at(self.sim.now, on_done)
            return
        self.active.append(Flow(tag, nbytes, float(nbytes), on_done, self.sim.now))

    def _moving(self) -> list[Flow]:
        """The flows the link carries now (fifo: the oldest only)."""
        return self.active[:1] if self.discipline == "fifo" else self.active

    def next_completion(self) -> float:
        moving = self._moving()
        if not moving:
            return float("inf")
        share = self.rate / len(moving)
        return self.sim.now + min(f.remaining for f in moving) / share

    def advance(self, dt: float, completes: bool) -> list[Flow]:
        """Moves the active flows' bytes over ``dt`` seconds; returns the finished.

        ``completes``: ``dt`` ends at this link's next completion, so the
        flows with the least bytes left finish now whatever the rounding left
        of them (else a remainder below the clock's resolution never would).
        """
        moving = self._moving()
        if not moving:
            return []
        share = self.rate / len(moving)
        least = min(f.remaining for f in moving)
        if dt > 0:
            self.log.append((self.sim.now, self.sim.now + dt, share * len(moving)))
        done = []
        for f in moving:
            moved = min(f.remaining, share * max(dt, 0.0))
            f.remaining -= moved
            self.bytes_out[f.tag] = self.bytes_out.get(f.tag, 0.0) + moved
            last = completes and f.remaining + moved <= least * (1 + 1e-9)
            if last or f.remaining <= _EPS * max(1.0, f.nbytes):
                self.bytes_out[f.tag] += f.remaining
                f.remaining = 0.0
                done.append(f)
        self.active = [f for f in self.active if f.remaining > 0]
        return done

    def busy_s(self, t0: float, t1: float) -> float:
        """Seconds within [t0, t1] in which the link carried anything."""
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b, _ in self.log)


class Sim:
    """The clock and the heap of timed callbacks."""

    def __init__(self) -> None:
        self.now = 0.0
        self.links: list[Link] = []
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Fires ``fn`` at time ``t`` (>= now)."""
        if t < self.now - 1e-9:
            raise ValueError(f"event at {t} before now {self.now}")
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn))

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        self.at(self.now + dt, fn)

    def run(self) -> None:
        """Runs until nothing is scheduled and no flow is active."""
        while True:
            t_event = self._heap[0][0] if self._heap else float("inf")
            t_flow = min((link.next_completion() for link in self.links), default=float("inf"))
            t = min(t_event, t_flow)
            if t == float("inf"):
                return
            finished = []
            for link in self.links:
                finished += link.advance(t - self.now, link.next_completion() <= t)
            self.now = t
            for f in finished:
                if f.on_done is not None:
                    f.on_done()
            while self._heap and self._heap[0][0] <= self.now + 1e-15:
                heapq.heappop(self._heap)[2]()
