"""launch.bench's runner: steps a job under one strategy at a time, timed.

``Runner`` keeps the trajectory (state, data position, routing maxima) that
every strategy replays from, times each step and records what a step did
(profiled, compiled, CPU per launch.cluster.cpu_account group, versions committed,
the seconds the training thread was blocked in the step and in the save, the
emulated accelerator's layer windows against its waits).
Split from ``launch.bench`` (the command: flags, workers, the report) so
that the measurement loop reads on its own; alternative not taken: one
module for the command and its loop, past the size a reader holds.
"""

from __future__ import annotations

import time
from typing import Any

from launch.bench import step_stats
from launch.cluster import cpu_account


class Runner:
    """Steps the job under a given strategy, timing each step."""

    def __init__(self, job, seed: int, every_step: bool = False):
        import jax

        from capricorn_jax.experimental import CollectiveProbe
        from models.capacity import choose_capacity_factors

        self.job, self.choose = job, choose_capacity_factors
        self.state = job.trainer.init_state(seed)
        self.max_routed: list[int] | None = None  # None until a step reported its maxima
        self.step = 0
        self.probe = CollectiveProbe()
        # Every XLA compile in this process (a step variant, or a program a
        # strategy's save compiles, e.g. PEC's packing for a new K): a step
        # during which one ran is not timed.
        self.compiles = 0
        self.saves: dict[str, list[int]] = {}  # strategy -> [versions saved, skipped]
        # Commit accounting (in-memory strategies): the versions of timed steps
        # with the strategy's save index, and the save index at which each
        # version was first reported on every holder of every owner.
        self.timed_versions: dict[str, list[tuple[int, int]]] = {}
        self.save_index: dict[str, int] = {}  # saves and status rounds, per strategy
        # Identical work: step -> {strategy: loss} and {strategy: capacity factors}
        # of the timed repetitions, where every strategy replays the same steps.
        self.losses: dict[int, dict[str, float]] = {}
        self.buckets: dict[int, dict[str, list[float]]] = {}
        self.record = False
        self.committed_at: dict[str, dict[int, int]] = {}
        # strategy -> CPU seconds of this process in its timed steps, per
        # launch.cluster.cpu_account group (sampled outside the timed span); and in
        # its steady-state steps only (neither profiled nor compiled).
        self.cpu: dict[str, list[float]] = {}
        self.steady_cpu: dict[str, list[float]] = {}
        # strategy -> per timed step, seconds the training thread spent in the
        # step call and in the strategy's save (launch.bench.step_stats.blocked);
        # and the emulated windows' check records (step_stats.emulation_errors).
        self.blocked: dict[str, list[dict[str, Any]]] = {}
        self.emulation: dict[str, list[dict]] = {}
        # ``every_step``: the probe rides on every step (but the profiled ones
        # of a strategy that profiles with an instrumented variant; one whose
        # own program's marks are the profile carries it there too);
        # strategy -> per timed step, what
        # its windows and collectives did (``step_record``).
        self.every_step = every_step
        self.records: dict[str, list[dict]] = {}
        # The emulated backward compute after the step's last all-to-all
        # edge (the first MoE layer's attention and every layer below it):
        # taken off the closing span to leave the gradient all-reduce.
        self.after_last_edge_s = 0.0
        if job.trainer.emulation is not None and job.trainer.moe_layers:
            first = min(job.trainer.moe_layers)
            self.after_last_edge_s = sum(
                t.dense_bwd_ms for t in job.trainer.emulation.layers[:first + 1]) / 1e3

        def on_event(event: str, duration_secs: float, **_: str | int) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                self.compiles += 1

        jax.monitoring.register_event_duration_secs_listener(on_event)

    def snapshot(self) -> tuple:
        """The trajectory's position: a copy of the state, the data position,
        the last step's routing maxima and the step."""
        import jax

        return (jax.tree.map(lambda x: x.copy(), self.state), self.job.data.state(),
                self.max_routed, self.step)

    def rewind(self, snapshot: tuple) -> None:
        """Back to ``snapshot`` (its state copied again: a block donates it)."""
        import jax

        state, data, max_routed, step = snapshot
        self.state = jax.tree.map(lambda x: x.copy(), state)
        self.job.data.restore(data)
        self.max_routed, self.step = max_routed, step

    def block(self, strategy, driver, n: int, probed: int = 0
              ) -> tuple[list[tuple[float, bool, bool]], list[float]]:
        """Runs ``n`` steps under ``strategy`` through its ``driver``; the last
        ``probed`` of them run the variant with the all-to-all probe
        (CollectiveProbe) attached.

        Returns:
          ((seconds, profiled, compiled) of each timed step: unprobed, not the
           block's first; all-to-all seconds of each warm probed step: the sum
           of its phases).
        """
        import jax
        import numpy as np

        trainer, times, a2a = self.job.trainer, [], []
        for i in range(n):
            hooks = (self.probe,) if self.every_step or i >= n - probed else ()
            factors = self.choose(self.job.cfg, self.max_routed, trainer.tokens_per_group)
            compiles = self.compiles
            cpu_before = cpu_account.sample()
            t0 = time.perf_counter()
            batch = trainer.global_batch(self.job.data.next_batch())
            run = driver.step(self.step, factors, self.state, batch, hooks)
            self.state, out = run.state, run.metrics
            loss = float(out["loss"])
            t_stepped = time.perf_counter()
            if self.record:
                self.losses.setdefault(self.step, {})[strategy.name] = loss
                self.buckets.setdefault(self.step, {})[strategy.name] = list(factors)
            collectives = None
            if hooks:
                jax.block_until_ready(self.state)  # the backward pass's stamps are in
                t_ready = time.perf_counter()
                collectives = self.probe.step_record()
            self.max_routed = [int(v) for v in np.asarray(out["max_routed"])]
            strategy.resume_at(self.step)  # the other strategies ran the steps in between
            events = strategy.save(self.step + 1, self.state,
                                   {"data": self.job.data.state(), "max_routed": self.max_routed},
                                   tokens_per_expert=np.asarray(out["tokens_per_expert"]),
                                   next_step_profiled=driver.profile_next)
            t_saved = time.perf_counter()
            phases = strategy.blocked_phases()  # its run_step's and save's, by phase
            if run.profile is not None and trainer.emulation is not None and self.record:
                self.emulation.setdefault(strategy.name, []).extend(step_stats.emulation_errors(
                    trainer.emulation, run.profile.segments,
                    np.asarray(out["tokens_per_expert"]), trainer.moe_layers))
            count = self.saves.setdefault(strategy.name, [0, 0])
            count[0] += 1
            count[1] += any(e.get("skipped") for e in events)
            index = self.save_index[strategy.name] = self.save_index.get(strategy.name, 0) + 1
            self.committed(strategy.name, events)
            timed = i > 0 and i < n - probed
            # The all-to-all column: every timed step that compiled nothing
            # (the probe on every step), else the block's probed tail.
            sampled = timed if self.every_step else i >= n - probed
            if (sampled and collectives is not None and collectives.phases
                    and run.profile is None and not run.compiled and self.compiles == compiles):
                a2a.append(sum(collectives.phases.values()))
            if timed and self.record:  # the timed repetitions' versions
                self.timed_versions.setdefault(strategy.name, []).append((self.step + 1, index))
            # Checked after the save: it may compile too (e.g. PEC packing).
            if timed:
                compiled = run.compiled or self.compiles != compiles
                times.append((time.perf_counter() - t0, run.profile is not None, compiled))
                if self.record:
                    self.records.setdefault(strategy.name, []).append(step_record(
                        self.step, events, collectives,
                        None if collectives is None or collectives.last_edge is None
                        else max(0.0, t_ready - collectives.last_edge - self.after_last_edge_s)))
                if self.record:
                    self.blocked.setdefault(strategy.name, []).append(
                        {"step": t_stepped - t0, "save": t_saved - t_stepped,
                         "phases": {**phases, "plan": driver.plan_s},
                         "steady": run.profile is None and not compiled})
                if self.record:  # the timed repetitions, as the step times
                    used = cpu_account.delta(cpu_before, cpu_account.sample())
                    _add(self.cpu, strategy.name, used)
                    if run.profile is None and not compiled:
                        _add(self.steady_cpu, strategy.name, used)
            self.step += 1
        return times, a2a

    def committed(self, name: str, events: list[dict]) -> None:
        """Notes the versions these events report committed everywhere for the first time."""
        index = self.save_index.get(name, 0)
        for event in events:
            for version in event.get("newly_committed", ()):
                self.committed_at.setdefault(name, {}).setdefault(version, index)


def _add(totals: dict[str, list[float]], name: str, values: list[float]) -> None:
    total = totals.get(name, [0.0] * len(values))
    totals[name] = [a + b for a, b in zip(total, values, strict=True)]


def step_record(step: int, events: list[dict], collectives, grad_all_reduce_s: float | None
                ) -> dict:
    """One timed step's record (DESIGN.md contracts, "Long-run accounting"):
    its windows (from the checkpoint events' window records: the threaded
    path's, ``scheduling.plan.spills.window_spills``), its collectives (each
    all-to-all phase from the probe, and the gradient all-reduce) and each
    MoE layer's expert span (the idle link between its all-to-alls)."""
    windows = [{"name": w["window"], "planned_idle_s": w["planned_s"],
                "observed_idle_s": w["observed_s"], "bytes_planned": w.get("bytes_planned"),
                "bytes_sent": w.get("bytes_sent"), "bytes_late": w.get("bytes_late"),
                "bytes_carried": w.get("bytes_carried"),
                "bytes_carried_in": w.get("bytes_carried_in"),
                "late_s": w.get("late_s"), "spill_s": w["spill_s"]}
               for e in events for w in e.get("windows") or ()]
    out: dict = {"step": step, "windows": windows, "collectives": [], "expert_spans": []}
    if collectives is not None:
        out["collectives"] = [{"name": f"{layer}/{direction}/{phase}", "seconds": round(t, 6)}
                              for (layer, direction, phase), t
                              in sorted(collectives.phases.items())]
        if grad_all_reduce_s is not None:
            out["collectives"].append({"name": "grad_all_reduce",
                                       "seconds": round(grad_all_reduce_s, 6)})
        spans = sorted(collectives.expert_spans.items())
        out["expert_spans"] = [{"name": f"{layer}/{direction}", "seconds": round(t, 6)}
                               for (layer, direction), t in spans]
    return out
