"""launch.bench's configuration: its parsed flags, read once into frozen dataclasses.

``BenchConfig.from_flags`` reads the flags (defined by ``launch.cli_flags``
and ``launch.bench.define_flags``) once, in ``launch.bench``'s ``main``; the
workers, the strategies' factory calls and the report receive these objects,
never the flag namespace (as launch.train with ``launch.train.config``):

* ``BenchSetup``: the job every strategy runs in (the cluster, its links, the
  model, the data, the accelerator), the same for every row;
* ``BenchConfig``: the setup, the strategies and how they are checkpointed
  and profiled, and the bench's own run (repetitions, warm-up, probes,
  outputs).

The checks raise ``FlagError`` naming the bad flag, in the order the command
printed them before (``--strategies``, ``--pec_k``, the accelerator and the
links, links on a GPU); ``main`` prints ``bench: error: <message>`` and
exits 2. Design choice: the bench's own pair rather than ``launch.train.config``'s
``Config``: train's parts check flags the bench does not take (faults,
``--ckpt``), and the bench's rows carry several strategies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import flags

from launch.accelerator import AcceleratorConfig, resolve_routing_bias
from launch.bench.report import VARIANTS
from launch.cluster.netns import LinkOptions, link_from_flags
from launch.errors import FlagError
from launch.strategies import IN_MEMORY, PEC, STRATEGIES


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchSetup:
    """The job every strategy of a bench runs in."""

    hosts: int
    devices_per_host: int
    platform: str
    timeout_s: float
    process_id: int
    coordinator: str
    link: LinkOptions
    model: str
    expert_parallel: int
    dispatch: str
    global_batch: int
    steps: int
    workdir: str | None
    seed: int
    workload: str
    shift_every: int
    accelerator: AcceleratorConfig
    routing_bias: str = "none"  # --routing_bias, resolved (launch.accelerator.resolve_routing_bias)

    @property
    def time_scale(self) -> float:
        """``--time_scale``: the step and the links this many times slower
        (``link`` is already the dilated one, ``dilated_link``)."""
        return self.accelerator.time_scale

    def overrides(self) -> dict[str, Any]:
        """The model config's overrides (``--dispatch``, ``--global_batch``, the routing bias)."""
        out: dict[str, Any] = {"dispatch": self.dispatch} if self.dispatch else {}
        if self.global_batch:
            out["global_batch"] = self.global_batch
        if self.routing_bias != "none":
            out["routing_bias"] = self.routing_bias
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Everything launch.bench reads from its flags."""

    setup: BenchSetup
    strategies: tuple[str, ...]
    reps: int
    a2a_steps: int
    collectives: bool
    warmup: int
    json: str | None
    png: str | None
    bandwidth_mib: int
    link_probe_mib: float
    # checkpoint group
    replicas: int
    chunk_bytes: int
    chunk_path: str
    store_root: str
    ckpt_budget: float
    persist_every: int
    pec_k: int
    # profiling group
    profile_first_n: int
    profile_trigger: str
    drift_threshold: float

    def __post_init__(self) -> None:
        _check_strategies(self.strategies, self.pec_k)

    @staticmethod
    def from_flags(fv: flags.FlagValues) -> BenchConfig:
        """The parsed flags ``fv`` as a ``BenchConfig``; raises FlagError (a ValueError)."""
        strategies = tuple(fv.strategies)
        _check_strategies(strategies, fv.pec_k)  # first, as the command always did
        try:
            accelerator = AcceleratorConfig(accelerator=fv.accelerator,
                                            profile=fv.accelerator_profile,
                                            time_scale=fv.time_scale)
            link = dilated_link(link_from_flags(fv), accelerator.time_scale)
        except ValueError as e:
            raise FlagError(str(e)) from None
        if link.shaped and fv.platform == "gpu":
            raise FlagError("--link_gbps shapes the simulated CPU hosts' links; not with "
                            "--platform=gpu")
        setup = BenchSetup(
            hosts=fv.hosts, devices_per_host=fv.devices_per_host, platform=fv.platform,
            timeout_s=fv.timeout_s, process_id=fv.process_id, coordinator=fv.coordinator,
            link=link, model=fv.model, expert_parallel=fv.expert_parallel,
            dispatch=fv.dispatch, global_batch=fv.global_batch, steps=fv.steps,
            workdir=fv.workdir, seed=fv.seed, workload=fv.workload,
            shift_every=fv.shift_every, accelerator=accelerator,
            routing_bias=resolve_routing_bias(fv.routing_bias, fv.accelerator, fv.workload))
        return BenchConfig(
            setup=setup, reps=fv.reps, a2a_steps=fv.a2a_steps, collectives=fv.collectives,
            warmup=fv.warmup,
            json=fv.json, png=fv.png, bandwidth_mib=fv.bandwidth_mib,
            link_probe_mib=fv.link_probe_mib, replicas=fv.replicas,
            chunk_bytes=fv.chunk_bytes, chunk_path=fv.chunk_path, store_root=fv.store_root,
            ckpt_budget=fv.ckpt_budget, persist_every=fv.persist_every,
            profile_first_n=fv.profile_first_n, profile_trigger=fv.profile_trigger,
            drift_threshold=fv.drift_threshold, strategies=strategies, pec_k=fv.pec_k)

    def total_steps(self) -> int:
        """Steps a host runs: every strategy's warm-up, timed and probed steps."""
        return ((self.warmup + self.setup.steps * self.reps
                 + max(self.a2a_steps, 0) * (self.reps + 1) + (self.a2a_steps == 0))
                * len(self.strategies))

    def chunk_path_of(self, name: str) -> str:
        """The chunk path of a row: its variant's, else --chunk_path, where auto
        is threaded for every in-memory row on CPU with --replicas=2 (inmem and
        pec too: one transport per comparison)."""
        if name.endswith("_in_graph"):
            return "in_graph"
        if self.chunk_path == "auto" and self.setup.platform != "gpu" and self.replicas == 2:
            return "threaded"
        return self.chunk_path

    def transport_of(self, name: str) -> str | None:
        """How an in-memory row's versions travel (None: not an in-memory row)."""
        if VARIANTS.get(name, name) not in IN_MEMORY:
            return None
        path = self.chunk_path_of(name)
        return "in_graph" if path == "auto" and self.setup.platform == "gpu" else path

    def record(self) -> dict[str, Any]:
        """The JSON's "config" (DESIGN.md contract): these flags' values."""
        s = self.setup
        return {"model": s.model, "workload": s.workload, "shift_every": s.shift_every,
                "steps": s.steps, "reps": self.reps,
                "hosts": s.hosts, "devices_per_host": s.devices_per_host,
                "dispatch": s.dispatch, "replicas": self.replicas,
                "global_batch": s.global_batch, "platform": s.platform,
                "a2a_steps": self.a2a_steps, "collectives": self.collectives,
                "ckpt_budget": self.ckpt_budget,
                "accelerator": s.accelerator.accelerator,
                "accelerator_profile": s.accelerator.profile, "routing_bias": s.routing_bias}


def dilated_link(link: LinkOptions, time_scale: float) -> LinkOptions:
    """The shaped link under ``--time_scale=k``: its rate divided by k and its
    latency k times longer, while its token bucket holds the same bytes (the
    default, one frame, does whatever the rate; an explicit ``burst_kb`` is
    kept) and its frames stay: the same bytes take k times as long, as the
    emulated compute does. An unshaped link, or k = 1, is returned as it is."""
    if time_scale == 1 or not link.shaped:
        return link
    return dataclasses.replace(link, gbps=link.gbps / time_scale,
                               latency_ms=link.latency_ms * time_scale)


def _check_strategies(strategies: tuple[str, ...], pec_k: int) -> None:
    unknown = [s for s in strategies if s not in STRATEGIES and s not in VARIANTS]
    if unknown:
        raise FlagError(f"--strategies: unknown {unknown}; known: {', '.join(STRATEGIES)}, "
                        f"{', '.join(VARIANTS)}")
    if pec_k < 1 and any(VARIANTS.get(s, s) in PEC for s in strategies):
        raise FlagError(f"--pec_k={pec_k}: the pec rows checkpoint K experts per MoE "
                        f"layer: they need --pec_k > 0")
