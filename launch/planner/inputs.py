"""The planner's inputs, one frozen dataclass per concern.

* ``Cluster``: hosts x accelerators, the link rate per host, host RAM, the
  chunk cost ``alpha``.
* the accelerator profile: ``models.emulation.profile.AcceleratorProfile``,
  the emulated accelerator's own class and JSON schema (per layer: dense
  forward and backward milliseconds, expert milliseconds at balanced load,
  all-to-all bytes per routed token; ``simulate.segments`` scales an MoE
  layer's expert time by the busiest expert's tokens over the balanced share).
* ``ModelSpec``: what a checkpoint must move (state bytes per host, the
  experts' share of them) and the routing shape (MoE layers, experts, top-k,
  tokens per step).
* ``StrategyOptions`` / ``FailureModel``: the strategy's knobs, the failure
  rate and the recovery costs.

Design choice: the profile is the emulated accelerator's class, one schema
for both, so a profile is written once and the validation simulates exactly
what an emulated run waits; alternative not taken: a planner schema of its
own (seconds, expert seconds per token) bridged by a converter, as until 0.12.
"""

from __future__ import annotations

import dataclasses
import math

from capricorn_jax import experimental as ex

GBIT = 1e9 / 8  # bytes per second in one Gbit/s


def _positive(owner: str, name: str, value: float, *, zero_ok: bool = False) -> None:
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"{owner}.{name} must be finite and {bound}, got {value}")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The simulated cluster.

    Attributes:
      hosts: machines.
      devices_per_host: accelerators per machine.
      link_gbps: each host's inter-host link, Gbit/s per direction.
      host_ram_gb: RAM per host (reported against the strategy's need).
      alpha_s: fixed cost of one checkpoint chunk (the partitioner's alpha).
      host_step_s: the host's time per step outside device compute and the
        link (dispatch, the runtime, the optimizer's host work), spent at the
        step's start with the link free; the validator measures it from a
        bench's ``none`` row.
      link_discipline: how flows share a host's link (``events.Link``):
        ``"fair"`` (processor sharing, a NIC under concurrent flows) or
        ``"fifo"`` (one collective at a time, as XLA:CPU over gloo runs
        in-graph collectives, so an all-to-all queues behind checkpoint bytes).
      ckpt_blocks_step: the host's checkpoint send does not overlap its step's
        compute (the step resumes when the bytes are through). Measured so on
        the emulated CPU cluster (validation: the overhead there is the
        version's link time, not what is left of it after the compute
        windows); False on an accelerator, whose compute leaves the host free.
    """

    hosts: int
    devices_per_host: int
    link_gbps: float
    host_ram_gb: float = 1024.0
    alpha_s: float = 50e-6
    host_step_s: float = 0.0
    link_discipline: str = "fair"
    ckpt_blocks_step: bool = False

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.devices_per_host < 1:
            raise ValueError(f"Cluster: hosts and devices_per_host must be >= 1, got "
                             f"{self.hosts}, {self.devices_per_host}")
        _positive("Cluster", "link_gbps", self.link_gbps)
        _positive("Cluster", "host_ram_gb", self.host_ram_gb)
        _positive("Cluster", "alpha_s", self.alpha_s, zero_ok=True)
        _positive("Cluster", "host_step_s", self.host_step_s, zero_ok=True)
        if self.link_discipline not in ("fair", "fifo"):
            raise ValueError(f"Cluster.link_discipline must be 'fair' or 'fifo', got "
                             f"{self.link_discipline!r}")

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * GBIT


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the checkpoint moves and how tokens are routed.

    Attributes:
      name: shown in reports.
      state_bytes_per_host: one version of the train state held by one host
        (its shards: parameters and optimizer state).
      expert_fraction: the experts' share of those bytes (PEC saves K/N of it).
      num_experts: experts per MoE layer.
      top_k: experts per token.
      tokens_per_step: tokens of one global batch (sequences x length).
    """

    name: str
    state_bytes_per_host: float
    expert_fraction: float
    num_experts: int
    top_k: int
    tokens_per_step: int

    def __post_init__(self) -> None:
        _positive("ModelSpec", "state_bytes_per_host", self.state_bytes_per_host)
        if not 0 <= self.expert_fraction <= 1:
            raise ValueError(f"ModelSpec.expert_fraction must be in [0, 1], got "
                             f"{self.expert_fraction}")
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"ModelSpec: num_experts={self.num_experts}, top_k={self.top_k}")
        if self.tokens_per_step < 1:
            raise ValueError(f"ModelSpec.tokens_per_step must be >= 1, got "
                             f"{self.tokens_per_step}")

    @property
    def routed_per_step(self) -> int:
        """Token-expert assignments of one MoE layer in one step."""
        return self.tokens_per_step * self.top_k


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
    """The strategies' knobs (the library's defaults unless said: its constants
    read, not copied, so the planner replays what the strategies do).

    Attributes:
      replicas: m, copies of each host's version (own + m-1 peers).
      pec_k: PEC's base K (experts per MoE layer in a version).
      budget_s: the cost budget (``InMemoryOptions.max_wait_s``): None waits
        for the previous version; set, a version is skipped when the previous
        one is still on the link at its save.
      margin: windows are scaled by this before partitioning (the library's
        ``SCHEDULE_MARGIN``, ``ScheduledTransfers``' default).
      chunk_cap_bytes: the partitioner's largest chunk (not the library's 1 MiB
        default: a paper-scale version of ~87 GB would pay its alpha per MiB).
      first_n: gemini's profiled iterations (the library's ``DEFAULT_FIRST_N``).
      drift_threshold: the detector's drift threshold (jsd).
      window: versions kept after the safe one (``InMemoryOptions.window``).
      pec_dynamic: PEC's K adapts to the lost tokens (``PecOptions.dynamic``).
    """

    replicas: int = 2
    pec_k: int = 1
    budget_s: float | None = None
    margin: float = ex.SCHEDULE_MARGIN
    chunk_cap_bytes: int = 64 << 20
    first_n: int = ex.DEFAULT_FIRST_N
    drift_threshold: float = 0.05
    window: int = 1
    pec_dynamic: bool = True

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.pec_k < 1 or self.first_n < 1 or self.window < 1:
            raise ValueError(f"StrategyOptions: replicas, pec_k, first_n, window must be >= 1: "
                             f"{self}")
        if not 0 < self.margin <= 1:
            raise ValueError(f"StrategyOptions.margin must be in (0, 1], got {self.margin}")
        if self.budget_s is not None:
            _positive("StrategyOptions", "budget_s", self.budget_s, zero_ok=True)


@dataclasses.dataclass(frozen=True)
class FailureModel:
    """What a failure costs.

    Attributes:
      mtbf_h: mean time between failures of the whole job, hours.
      restart_s: detecting the failure and restarting every process.
      memory_restore_gbps: reading a version back from host RAM (or a peer).
      persist_every: steps between persistent checkpoints (``none`` restores
        from there).
      storage_gbps: the persistent tier's read bandwidth per host.
    """

    mtbf_h: float = 24.0
    restart_s: float = 60.0
    memory_restore_gbps: float = 100.0
    persist_every: int = 500
    storage_gbps: float = 8.0

    def __post_init__(self) -> None:
        for name in ("mtbf_h", "memory_restore_gbps", "storage_gbps"):
            _positive("FailureModel", name, getattr(self, name))
        _positive("FailureModel", "restart_s", self.restart_s, zero_ok=True)
        if self.persist_every < 1:
            raise ValueError(f"FailureModel.persist_every must be >= 1, got {self.persist_every}")
