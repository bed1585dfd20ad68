"""One strategy over N steps of a simulated cluster.

The model of a step (one host stands for all: every host runs the same
layers, and Gemini's placement sends each host's version to m-1 peers while
it receives as many, so every host's send link carries the same load):

* forward layers 0..L-1, then backward L-1..0; each (layer, direction) is a
  *segment*: compute (from the accelerator profile: dense time + the expert
  time at balanced load x the most tokens on one expert at this step's load
  over the balanced share, as the emulation waits), then the layer's
  all-to-all (bytes per routed token x the host's routed tokens) on the
  host's link. The link is idle during compute: these are
  the partitioner's windows (``windows_from_profile`` of a profile built
  from the segments).
* checkpoint traffic shares the link with the all-to-alls (``events.Link``,
  processor sharing or fifo, ``Cluster.link_discipline``): a chunk still on
  the link when the all-to-all starts slows it, and so the step. With
  ``Cluster.ckpt_blocks_step`` the host's step does not run while its
  checkpoint bytes are on the link (the next step, or the next segment after
  a window's chunks, starts when they are through).

The strategies' decisions are the library's own, called here:

* ``inmem`` / ``pec``: version t+1 leaves after step t (async); the next save
  waits for it (or, under a cost budget, skips its version). ``pec``'s K and
  experts: ``DynamicK`` / ``version_mask`` over a ``PltTracker`` fed the trace.
* ``gemini``: profiles its first ``first_n`` steps (``should_profile``),
  then partitions once (``average_windows`` -> ``scale_windows`` by the
  margin -> ``even_partition``) and keeps the schedule.
* ``capricorn`` (and ``capricorn_pec``): the dynamicity detector observes
  every step; a drift asks for a profile, gated by ``schedule_at_risk``;
  each profile re-partitions (``shortest_windows`` of the last
  ``PLAN_PROFILES``). A profiled step moves no chunks (its version leaves
  after it, as ``inmem``), as in ``strategies.scheduled``.
* the partition is the strategies' own (``ScheduledTransfers``): the
  windows scaled by ``StrategyOptions.margin`` (the library's
  ``SCHEDULE_MARGIN``), then ``even_partition`` (every window filled to the
  same least share that holds the version; the tail where none does), one
  schedule per payload size.
* RAM per host: the versions ``retention.versions_to_keep`` keeps (PEC: with
  ``plans.version_needs`` of each version's tracker) x the owners whose
  versions host 0 holds under Gemini's placement (``placement.holders``).

Not modelled (assumed free): the device-to-host copy, profiling's own cost,
compiles, the spill-triggered re-profile of the threaded path, and the
library's ``ProfilingDriver`` object itself, which runs real JAX steps: the
planner calls the decisions it calls, in its order. The schedule is the
in-graph path's (one window per layer segment, a tail after the step): the
threaded path's span windows and, under a budget, its spreading of a version
over the windows of several steps (``partition_search.spread``) are not
replayed.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import numpy as np

import capricorn_jax as cj
from capricorn_jax import experimental as ex
from launch.planner.events import Link, Sim
from launch.planner.inputs import Cluster, FailureModel, ModelSpec, StrategyOptions
from launch.planner.traces import tokens as to_tokens
from launch.strategies import IN_MEMORY, spec
from models.emulation.profile import AcceleratorProfile

STRATEGIES = ("none", *IN_MEMORY)
"""What the planner simulates: every in-memory strategy of the registry, by
its spec (planner "fixed" as gemini, "replan" as capricorn, none as inmem;
PEC from ``pec``), and none."""

PARTITION = ex.even_partition
"""How a payload is cut into the windows: the strategies' own call
(``ScheduledTransfers``' default ``even=True``; its margin is
``StrategyOptions.margin``, the library's ``SCHEDULE_MARGIN``)."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Everything a simulation needs but the load trace."""

    cluster: Cluster
    profile: AcceleratorProfile
    model: ModelSpec
    options: StrategyOptions = StrategyOptions()
    failure: FailureModel = FailureModel()

    def __post_init__(self) -> None:
        if self.options.replicas > self.cluster.hosts:
            raise ValueError(f"replicas={self.options.replicas} exceeds hosts="
                             f"{self.cluster.hosts}")


def segments(sc: Scenario, load: np.ndarray) -> list[tuple[str, str, float, float]]:
    """(name, direction, compute_s, all-to-all bytes) of one step, in order.

    Args:
      sc: the scenario.
      load: [moe_layers, experts] tokens per expert of the step.
    """
    moe = {layer: i for i, layer in enumerate(sc.profile.moe_layers)}
    routed_per_host = sc.model.routed_per_step / sc.cluster.hosts
    balanced = sc.model.routed_per_step / sc.model.num_experts
    out = []
    for direction in ("fwd", "bwd"):
        order = range(len(sc.profile.layers))
        for idx in order if direction == "fwd" else reversed(order):
            layer = sc.profile.layers[idx]
            peak = float(load[moe[idx]].max()) if idx in moe else 0.0
            if direction == "fwd":
                dense_ms, expert_ms = layer.dense_fwd_ms, layer.expert_fwd_ms
            else:
                dense_ms, expert_ms = layer.dense_bwd_ms, layer.expert_bwd_ms
            compute = dense_ms / 1e3 + expert_ms / 1e3 / balanced * peak
            nbytes = layer.a2a_bytes_per_routed_token * routed_per_host
            out.append((f"block{idx}", direction, compute, nbytes))
    return out


def plain_step_s(sc: Scenario, load: np.ndarray) -> float:
    """The step with no checkpoint traffic: compute plus all-to-alls at the link rate."""
    rate = sc.cluster.link_bytes_per_s
    return sc.cluster.host_step_s + sum(c + b / rate for _, _, c, b in segments(sc, load))


def layer_profile(sc: Scenario, step: int, load: np.ndarray) -> ex.LayerProfile:
    """The library's LayerProfile of a step at ``load`` with a free link (what
    the profiler measures on a step that moves no chunks)."""
    rate, t, segs = sc.cluster.link_bytes_per_s, sc.cluster.host_step_s, []
    for name, direction, compute, nbytes in segments(sc, load):
        a2a = nbytes / rate
        segs.append(ex.Segment(name, direction, t, compute + a2a, a2a))
        t += compute + a2a
    return ex.LayerProfile(step, t, tuple(segs))


class _Sender:
    """The host's checkpoint sender: jobs (chunks, bytes) in FIFO order, each
    paying chunks x alpha before its bytes flow (the partitioner's cost)."""

    def __init__(self, sim: Sim, link: Link, alpha_s: float) -> None:
        self.sim, self.link, self.alpha_s = sim, link, alpha_s
        self.queue: collections.deque[tuple[int, float]] = collections.deque()
        self.busy = False
        self.waiters: list[Any] = []

    def push(self, chunks: int, nbytes: float) -> None:
        if nbytes <= 0:
            return
        self.queue.append((chunks, nbytes))
        if not self.busy:
            self._next()

    def _next(self) -> None:
        if not self.queue:
            self.busy = False
            waiters, self.waiters = self.waiters, []
            for fn in waiters:
                fn()
            return
        self.busy = True
        chunks, nbytes = self.queue.popleft()
        self.sim.after(chunks * self.alpha_s,
                       lambda: self.link.send("ckpt", nbytes, self._next))

    def when_idle(self, fn: Any) -> None:
        if self.busy:
            self.waiters.append(fn)
        else:
            fn()


class _Run:
    """One strategy's simulation (see the module docstring)."""

    def __init__(self, sc: Scenario, strategy: str, load: np.ndarray) -> None:
        self.sc, self.strategy, self.load = sc, strategy, load
        s = spec(strategy)
        self.planner = s.planner
        self.policy = cj.ProfilePolicy(s.profile) if s.profile else None
        self.pec = s.pec and load.shape[1] > 0
        opts = sc.options
        self.sim = Sim()
        self.link = Link(self.sim, sc.cluster.link_bytes_per_s, "host0/send",
                         sc.cluster.link_discipline)
        self.sender = _Sender(self.sim, self.link, sc.cluster.alpha_s)
        self.linkmodel = ex.LinkModel(sc.cluster.alpha_s, sc.cluster.link_bytes_per_s)
        self.moe_layers = sc.profile.moe_layers
        layers, experts = load.shape[1], load.shape[2]
        self.detector = ex.DynamicityDetector(cj.DetectorOptions(threshold=opts.drift_threshold))
        self.decision: Any = None  # the detector's Decision about the previous step
        if self.pec:
            self.tracker = ex.PltTracker(layers, experts, sc.model.top_k)
            self.dyn = ex.DynamicK(cj.PecOptions(k=opts.pec_k, dynamic=opts.pec_dynamic),
                                   experts)
            self.k = experts
        self.schedule: Any = None
        self._schedules: dict[int, Any] = {}
        self._windows: list[Any] = []
        self.planned_on: ex.LayerProfile | None = None
        self.profiles: list[ex.LayerProfile] = []
        self.recent: collections.deque = collections.deque(maxlen=ex.PLAN_PROFILES)
        self.partitions: list[int] = []
        self.profiled: list[int] = []
        self.step_s: list[float] = []
        self.taken: list[int] = []
        self.skipped: list[int] = []
        self.version_bytes: dict[int, float] = {}
        self.needs: dict[int, tuple[tuple[int, ...], bool]] = {}
        self.last_taken = -1
        self.intervals: list[int] = []

    # ---------------------------------------------------------------- decisions
    def _profile_this(self, step: int) -> bool:
        if self.policy is None:
            return False
        if self.planner == "fixed":
            return self.schedule is None and ex.should_profile(
                self.policy, step, None, self.sc.options.first_n)
        return ex.should_profile(self.policy, step, self.decision)

    def _replan(self, windows: list) -> None:
        self._windows = ex.scale_windows(windows, self.sc.options.margin)
        self._schedules = {}
        self.schedule = self._schedule_for(self.sc.model.state_bytes_per_host)

    def _schedule_for(self, payload: float) -> Any:
        """The schedule of a payload over the windows in force, as the
        strategies' ``ScheduledTransfers`` partitions it (``even=True``, its
        default): ``even_partition``, every window filled to the same least
        share that holds the payload (one per payload size: a PEC version's is
        smaller)."""
        size = int(payload)
        if size not in self._schedules:
            self._schedules[size], _ = PARTITION(size, self._windows, self.linkmodel,
                                                 self.sc.options.chunk_cap_bytes)
        return self._schedules[size]

    def _on_profile(self, step: int, profile: ex.LayerProfile) -> None:
        self.profiled.append(step)
        if self.planner == "fixed":
            self.profiles.append(profile)
            if len(self.profiles) >= self.sc.options.first_n:
                self._replan(ex.average_windows(self.profiles, ex.windows_from_profile))
                self.planned_on, self.profiles = profile, []
                self.partitions.append(step)
        else:
            self.recent.append(profile)
            self._replan(ex.shortest_windows(list(self.recent), ex.windows_from_profile))
            self.planned_on = profile
            self.partitions.append(step)

    def _after_step(self, step: int, tpe: np.ndarray, profile: ex.LayerProfile | None) -> None:
        """The driver's order: profile -> strategy, then the detector and the gate."""
        if profile is not None:
            self._on_profile(step, profile)
        if self.planner != "replan":
            return
        if profile is not None:
            durations = ex.moe_durations(profile, self.moe_layers)
            self.detector.record_profile(step, tpe, durations)
        decision = self.detector.observe(step, tpe)
        if decision.profile_next and not ex.schedule_at_risk(
                self.schedule, self.detector, tpe, self.planned_on, self.moe_layers):
            decision = dataclasses.replace(decision, profile_next=False)
        self.decision = decision

    def _version_bytes(self, version: int, tpe: np.ndarray) -> float:
        """Bytes of version ``version`` per host (PEC: decides its K and experts)."""
        model = self.sc.model
        if not self.pec:
            return model.state_bytes_per_host
        self.k, mask = ex.version_mask(self.tracker, self.dyn, self.k, tpe,
                                       model.tokens_per_step, version)
        self.tracker.on_saved(self.tracker.step, mask)
        self.needs[version] = ex.version_needs(self.tracker.saved_step)
        experts = self.load.shape[2]
        return model.state_bytes_per_host * (1 - model.expert_fraction
                                             + model.expert_fraction * self.k / experts)

    def _take(self, version: int, nbytes: float) -> None:
        self.taken.append(version)
        self.version_bytes[version] = nbytes
        if self.last_taken >= 0:
            self.intervals.append(version - self.last_taken)
        self.last_taken = version

    # ---------------------------------------------------------------- the event chain
    def run(self) -> None:
        self._tpe = to_tokens(self.load, self.sc.model.routed_per_step)
        self.sim.at(0.0, lambda: self._start(0, None))
        self.sim.run()

    def _start(self, step: int, moving: tuple[int, float] | None) -> None:
        if step >= self.load.shape[0]:
            return
        tpe = self._tpe[step]
        if self.pec:
            self.tracker.observe(tpe)
        profiled = self._profile_this(step)
        schedule = None
        if moving is not None:
            schedule = self._schedule_for(moving[1])
        segs = segments(self.sc, tpe)
        t0 = self.sim.now

        def segment(i: int) -> None:
            if i == len(segs):
                return end()
            _, _, compute, nbytes = segs[i]

            def run_segment() -> None:
                self.sim.after(compute,
                               lambda: self.link.send("a2a", nbytes, lambda: segment(i + 1)))

            if schedule is not None and schedule.chunks[i]:
                self.sender.push(len(schedule.chunks[i]), schedule.bytes_in_window(i) * self.copies)
                if self.sc.cluster.ckpt_blocks_step:
                    return self.sender.when_idle(run_segment)
            run_segment()

        def end() -> None:
            profile = layer_profile(self.sc, step, tpe) if profiled else None
            if schedule is not None:
                self.sender.push(len(schedule.tail), schedule.tail_bytes * self.copies)
            self._after_step(step, tpe, profile)
            self._save(step, t0, tpe, schedule is not None)

        self.sim.after(self.sc.cluster.host_step_s, lambda: segment(0))

    @property
    def copies(self) -> int:
        return self.sc.options.replicas - 1

    def _save(self, step: int, t0: float, tpe: np.ndarray, moved: bool) -> None:
        """After step ``step``: version ``step + 1`` is taken, deferred or skipped."""
        version = step + 1

        def next_step(moving: tuple[int, float] | None) -> None:
            self.step_s.append(self.sim.now - t0)
            self._start(step + 1, moving)

        if self.strategy == "none":
            return next_step(None)
        scheduled = self.planner is not None
        budget = self.sc.options.budget_s

        def save() -> None:
            nbytes = self._version_bytes(version, tpe)
            self._take(version, nbytes)
            if (scheduled and self.schedule is not None and version < self.load.shape[0]
                    and not self._profile_this(step + 1)):
                return next_step((version, nbytes))  # moved inside the next step
            self.sender.push(max(1, math.ceil(nbytes / self.sc.options.chunk_cap_bytes)),
                             nbytes * self.copies)
            if self.sc.cluster.ckpt_blocks_step:
                return self.sender.when_idle(lambda: next_step(None))
            next_step(None)

        if moved:  # the version moved in this step commits when its last chunk is in
            return self.sender.when_idle(save)
        if self.sender.busy and budget is not None:
            self.skipped.append(version)
            if self.pec:
                pass  # a skipped PEC version records nothing (``PecTier.skip``)
            return next_step(None)
        self.sender.when_idle(save)


def _ram_per_host(run: _Run) -> float:
    """Bytes a host holds at the end: its own and m-1 peers' kept versions."""
    if not run.taken:
        return 0.0
    newest = run.taken[-1]
    held = run.taken[-(run.sc.options.window + 8):]
    safe = run.taken[-2] if len(run.taken) > 1 else newest
    if run.pec:
        needs = {v: run.needs[v] for v in run.needs if v in set(run.taken)}
        held_needs = {v: needs[v] for v in run.taken if v in needs}
        kept = ex.versions_to_keep(held_needs, safe, run.sc.options.window)
    else:
        kept = ex.versions_to_keep(ex.whole_versions(held), safe, run.sc.options.window)
    del newest
    hosts, m = run.sc.cluster.hosts, run.sc.options.replicas
    owners_held = sum(1 for holders in ex.placement_holders(hosts, m) if 0 in holders)
    return sum(run.version_bytes[v] for v in kept) * owners_held


def simulate(sc: Scenario, strategy: str, shares: np.ndarray) -> dict[str, Any]:
    """Runs ``strategy`` over the trace ``shares`` [steps, moe_layers, experts].

    Returns:
      Per-strategy results: step times and overheads (against the plain step
      at each step's load), versions taken and skipped, RAM per host, the
      training time lost per failure and the effective training-time ratio.
    """
    if shares.shape[1] != len(sc.profile.moe_layers):
        raise ValueError(f"trace has {shares.shape[1]} MoE layers, the profile "
                         f"{len(sc.profile.moe_layers)}")
    run = _Run(sc, strategy, shares)
    run.run()
    tpe = run._tpe
    plain = np.array([plain_step_s(sc, tpe[t]) for t in range(len(run.step_s))])
    steps = np.asarray(run.step_s)
    overhead = steps / plain - 1.0
    f = sc.failure
    mean_step = float(steps.mean())
    if strategy == "none":
        lost = (f.restart_s + f.persist_every / 2 * mean_step
                + sc.model.state_bytes_per_host / (f.storage_gbps * 1e9 / 8))
    else:
        interval = float(np.mean(run.intervals)) if run.intervals else 1.0
        lost = (f.restart_s + (interval / 2 + 1) * mean_step
                + sc.model.state_bytes_per_host / (f.memory_restore_gbps * 1e9 / 8))
    plain_mean = float(plain.mean())
    mtbf_s = f.mtbf_h * 3600
    ettr = plain_mean / mean_step * max(0.0, 1 - lost / mtbf_s)
    ram = _ram_per_host(run)
    out = {
        "strategy": strategy,
        "steps": len(steps),
        "plain_step_s": plain_mean,
        "mean_step_s": mean_step,
        "median_step_s": float(np.median(steps)),
        "p95_step_s": float(np.percentile(steps, 95)),
        "overhead_median": float(np.median(overhead)),
        "overhead_mean": float(overhead.mean()),
        "overhead_p95": float(np.percentile(overhead, 95)),
        "slowdown": mean_step / plain_mean,
        "versions_taken": len(run.taken),
        "versions_skipped": len(run.skipped),
        "mean_interval": float(np.mean(run.intervals)) if run.intervals else None,
        "ram_per_host_gb": ram / 1e9,
        "ram_fits": ram / 1e9 <= sc.cluster.host_ram_gb,
        "lost_per_failure_s": lost,
        "ettr": ettr,
        "profiled_steps": len(run.profiled),
        "partitions": run.partitions,
        "tail_bytes": None if run.schedule is None else run.schedule.tail_bytes,
        "link_bytes": dict(run.link.bytes_out),
    }
    out["_run"] = run
    return out
