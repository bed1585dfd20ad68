"""launch.chaos's configuration: its parsed flags, read once into frozen dataclasses.

``ChaosConfig.from_flags`` reads the flags (defined by ``launch.cli_flags`` and
``launch.chaos.define_flags``) once, in ``launch.chaos``'s ``main``; the
trials receive the object, never the flag namespace (as launch.train with
``launch.train.config`` and launch.bench with ``launch.bench.config``).
``Topology`` (``HxD`` / ``HxDrM``) is the shape a trial draws.

The checks raise, in the order the command always ran them: a topology that
does not parse raises ``ValueError`` (``parse_topology``); the others
``FlagError`` naming the flag (``--trials`` / ``--steps``, ``--strategies``,
a topology no chosen strategy runs on, the accelerator, the links and
whether this process can shape them), which ``main`` turns into absl's
``UsageError``.
"""

from __future__ import annotations

import dataclasses

from absl import flags

from launch.accelerator import AcceleratorConfig, resolve_routing_bias
from launch.cluster.netns import LinkError, LinkOptions, check_available, link_from_flags
from launch.errors import FlagError
from launch.strategies import IN_MEMORY, spec
from launch.train.fault_plan import (
    CORRUPT_FRAME,
    DISK_FULL_FINALIZE,
    PARTITION,
    PAUSE,
    SLOW_LINK,
    STALL_CHANNEL,
)

IN_MEMORY_STRATEGIES = tuple(n for n in IN_MEMORY if n != "capricorn_pec")
"""The default draw: every in-memory strategy of the registry but capricorn_pec
(capricorn's channel with pec's checks, named with ``--strategies``; left out
of the default so that a seed draws what it drew before)."""


def moves_on_channel_from_start(strategy: str) -> bool:
    """Whether ``strategy``'s versions can move on the chunk channel from a
    trial's first step (so the channel's faults can strike them): a scheduled
    strategy on the channel that plans from the start (capricorn; gemini
    profiles its first steps past a trial's faults), or an unscheduled one
    that takes the channel with ``--chunk_path=threaded`` (inmem, pec)."""
    s = spec(strategy)
    if s.scheduled:
        return s.planner == "replan" and s.uses_channel("auto", "cpu")
    return s.uses_channel("threaded", "cpu")

FAULT_CLASSES = ("after_step", "mid_step", "mid_replication", "mid_persist", "recovery",
                 "kill_mid_serve", "double_kill", "persist_error", "persist_hang",
                 DISK_FULL_FINALIZE, PAUSE, CORRUPT_FRAME, PARTITION, SLOW_LINK, STALL_CHANNEL)
"""The classes of ``--faults`` and of each fault of a trial's JSON (``fault_classes``):
the fault points, a kill in a recovery's serve round (``kill_mid_serve``, point
``mid_serve``) and a second recovery struck in a row (``double_kill``)."""
NETWORK_CLASSES = frozenset({PARTITION, SLOW_LINK})
CHANNEL_CLASSES = frozenset({CORRUPT_FRAME, STALL_CHANNEL})
"""Classes drawn for strategies on the chunk channel from their first step: capricorn
(from its first schedule on), inmem and pec over it (the threaded variant)."""


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    hosts: int
    devices_per_host: int
    replicas: int


def parse_topology(name: str) -> Topology:
    """``HxD`` or ``HxDrM`` (default M = 2)."""
    try:
        shape, _, replicas = name.partition("r")
        hosts, devices = (int(x) for x in shape.split("x"))
        topo = Topology(name, hosts, devices, int(replicas or 2))
    except ValueError:
        raise ValueError(f"--topologies: {name!r} is not HxD or HxDrM") from None
    if hosts < 2 or devices < 1 or not 2 <= topo.replicas <= hosts:
        raise ValueError(f"--topologies: {name!r} needs >= 2 hosts and 2 <= replicas <= hosts")
    return topo


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    """Everything launch.chaos reads from its flags."""

    trials: int
    only_trial: int
    seed: int  # of the trial draws, not of the jobs
    json: str | None
    topologies: tuple[Topology, ...]
    strategies: tuple[str, ...]
    trial_timeout_s: float
    keep_going: bool
    fast_compile: bool
    faults: tuple[str, ...] = ()  # --faults: the classes drawn (empty: all)
    # shared groups: each trial's job
    model: str
    steps: int
    workdir: str | None
    link: LinkOptions = LinkOptions()
    accelerator: AcceleratorConfig = AcceleratorConfig()

    def __post_init__(self) -> None:
        if self.trials < 1 or self.steps < 6:
            raise FlagError(f"--trials must be >= 1 and --steps >= 6, got {self.trials}, "
                            f"{self.steps}")
        unknown = set(self.strategies) - set(IN_MEMORY)
        if unknown:
            raise FlagError(f"--strategies: {sorted(unknown)} are not in-memory strategies "
                            f"({', '.join(IN_MEMORY)})")
        for topo in self.topologies:  # the draw would stop at the first trial on such a topology
            if topo.replicas != 2 and all(spec(s).scheduled for s in self.strategies):
                raise FlagError(f"--topologies={topo.name}: none of --strategies="
                                f"{','.join(self.strategies)} runs there (gemini and "
                                f"capricorn need 2 replicas); add inmem or pec, or drop it")

    @staticmethod
    def from_flags(fv: flags.FlagValues) -> ChaosConfig:
        """The parsed flags ``fv`` as a ``ChaosConfig`` (module docstring: what it raises)."""
        topologies = tuple(parse_topology(t) for t in fv.topologies)
        config = ChaosConfig(
            trials=fv.trials, only_trial=fv.only_trial, seed=fv.seed, json=fv.json,
            topologies=topologies, strategies=tuple(fv.strategies),
            trial_timeout_s=fv.trial_timeout_s, keep_going=fv.keep_going,
            fast_compile=fv.fast_compile, model=fv.model, steps=fv.steps, workdir=fv.workdir,
            faults=tuple(fv.faults))
        try:
            accelerator = AcceleratorConfig(accelerator=fv.accelerator,
                                            profile=fv.accelerator_profile)
            # The trials' jobs run the steady workload: auto is none there, a schedule an error.
            resolve_routing_bias(fv.routing_bias, fv.accelerator, "steady")
            link = link_from_flags(fv)
            if link.shaped:
                check_available(link)
        except (ValueError, LinkError) as e:
            raise FlagError(str(e)) from None
        config.check_classes(link.shaped)
        return dataclasses.replace(config, link=link, accelerator=accelerator)

    def check_classes(self, shaped: bool) -> None:
        """``--faults``: known classes, each drawable with these flags."""
        unknown = sorted(set(self.faults) - set(FAULT_CLASSES))
        if unknown:
            raise FlagError(f"--faults: {unknown} are not fault classes "
                            f"({', '.join(FAULT_CLASSES)})")
        if set(self.faults) & NETWORK_CLASSES and not shaped:
            raise FlagError(f"--faults: {sorted(set(self.faults) & NETWORK_CLASSES)} act on "
                            f"shaped links: they need --link_gbps > 0")
        if set(self.faults) & CHANNEL_CLASSES and not any(
                moves_on_channel_from_start(s) for s in self.strategies):
            raise FlagError(f"--faults: {sorted(set(self.faults) & CHANNEL_CLASSES)} are "
                            f"drawn for capricorn, and inmem and pec over the chunk channel: "
                            f"add one of them to --strategies")

    def job_flags(self) -> list[str]:
        """Flags every job of every trial gets (the reference runs' too): the
        links, the accelerator."""
        out = ([f"--link_gbps={self.link.gbps:g}", f"--link_latency_ms={self.link.latency_ms:g}",
                f"--link_burst_kb={self.link.burst_kb:g}",
                f"--traffic_class={self.link.traffic_class}"] if self.link.shaped else [])
        if self.link.mtu:
            out.append(f"--link_mtu={self.link.mtu}")
        if self.link.filler:
            out.append("--link_filler")
        if self.accelerator.accelerator != "none":
            out.append(f"--accelerator={self.accelerator.accelerator}")
        if self.accelerator.profile:
            out.append(f"--accelerator_profile={self.accelerator.profile}")
        return out
