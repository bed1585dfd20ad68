"""launch.train's configuration: its flags, parsed once into frozen dataclasses.

``from_flags`` reads the flags (defined by ``launch.cli_flags``) once into
a ``Config`` of five parts: the cluster (``ClusterConfig``), the training job
(``TrainConfig``), layer profiling (``ProfileConfig``), the checkpoint tiers
(``CheckpointConfig``), fault injection (``FaultConfig``, in
``launch.train.fault_plan``) and the accelerator (``AcceleratorConfig``). Everything past
``main`` receives these objects, never the flag namespace.

Each part checks its own values at construction (``__post_init__``) and
raises ``FlagError`` naming the first bad flag, in the order the parts are
built: cluster, job, profiling, checkpoints, faults. A check that spans two
parts (``--replicas`` against ``--hosts``, ``--pec_k`` against the model's
experts) takes the other part's value as an init-only argument, so the
dataclass that owns a flag owns all of its checks. Checks that a flag is not
set where nothing reads it need to know which flags the user gave: ``given``.

Design choice: typed, frozen values handed down explicitly. Alternative not
taken: one validation pass over absl's global ``FLAGS`` and helpers reading
``FLAGS`` wherever they need a value; that hid what each helper depends on
and let a check and the code that reads the value drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import tempfile
from dataclasses import InitVar
from pathlib import Path

from absl import flags

from capricorn_jax import DetectorOptions, ProfilePolicy, ProfilingOptions
from capricorn_jax.experimental import CAPACITY_CACHE, TRIGGERS, CacheOptions
from launch import runtime
from launch.accelerator import AcceleratorConfig, resolve_routing_bias
from launch.cluster.netns import LinkOptions
from launch.errors import FlagError
from launch.strategies import IN_MEMORY, PEC, SCHEDULED, STRATEGY_PROFILE
from launch.train.fault_plan import FaultConfig
from models.config import CONFIGS, ModelConfig, get_config

ON_LAG = ("warn", "fail")
"""What a lag past --max_version_lag does (``launch.train.lag``)."""

AGREEMENT_TIMEOUT_S = 1800.0
"""capricorn_jax's cross-host agreement bound (its multihost default; a test
checks they agree)."""


def job_name(workdir: str) -> str:
    """The store's job name: stable for a workdir across restarts, and the
    same whatever path reaches it (symlinks resolved: a symlinked --workdir
    once named another store and resumed from an older disk step)."""
    return "job-" + hashlib.sha1(os.path.realpath(workdir).encode()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The hosts and how this process joins them (``--process_id`` >= 0: a worker)."""

    hosts: int
    devices_per_host: int
    pin_hosts: bool
    platform: str
    timeout_s: float
    process_id: int
    coordinator: str
    link_gbps: float = 0.0
    link_latency_ms: float = 0.0
    link_burst_kb: float = 0.0
    traffic_class: str = "fifo"
    link_mtu: int = 0
    link_filler: bool = False
    peer_timeout_s: float = 100.0

    def __post_init__(self) -> None:
        try:
            link = self.link
        except ValueError as e:
            raise FlagError(str(e)) from None
        if link.shaped and self.platform == "gpu":
            raise FlagError("--link_gbps shapes the simulated CPU hosts' links; not with "
                            "--platform=gpu")
        if self.hosts < 1:
            raise FlagError(f"--hosts must be >= 1, got {self.hosts}")
        # A silent host must end the job before a cross-host agreement gives
        # up on it with a vaguer error; below 5 s a loaded host's heartbeat
        # thread can miss its beat.
        if not 5 <= self.peer_timeout_s < AGREEMENT_TIMEOUT_S:
            raise FlagError(f"--peer_timeout_s={self.peer_timeout_s:g} must be >= 5 and below "
                            f"the cross-host agreement bound ({AGREEMENT_TIMEOUT_S:g} s)")
        if self.devices_per_host < 1:
            raise FlagError(f"--devices_per_host must be >= 1, got {self.devices_per_host}")
        if self.platform == "gpu" and self.hosts > 1 and self.process_id < 0:
            raise FlagError("--platform=gpu with --hosts>1: start one worker per host with "
                            "--process_id and --coordinator")

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def link(self) -> LinkOptions:
        return LinkOptions(gbps=self.link_gbps, latency_ms=self.link_latency_ms,
                           burst_kb=self.link_burst_kb, traffic_class=self.traffic_class,
                           mtu=self.link_mtu, filler=self.link_filler)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The training job: model, data, optimizer, steps and where its outputs go."""

    model: str
    steps: int
    workdir: str
    seed: int
    workload: str
    shift_every: int
    dispatch: str
    global_batch: int
    expert_parallel: int
    learning_rate: float
    warmup_steps: int
    log_every: int
    eval_sequences: int
    resume: bool
    fresh: bool = False
    verbose: bool = False
    routing_bias: str = "none"
    cluster: InitVar[ClusterConfig]

    def __post_init__(self, cluster: ClusterConfig) -> None:
        if self.steps < 1:
            raise FlagError(f"--steps must be >= 1, got {self.steps}")
        if self.model not in CONFIGS:
            raise FlagError(f"--model: unknown model {self.model!r}; known: {', '.join(CONFIGS)}")
        if self.shift_every < 1:
            raise FlagError(f"--shift_every must be >= 1, got {self.shift_every}")
        if self.resume and self.fresh:
            raise FlagError("--resume and --fresh contradict each other: resuming is the "
                            "default; --fresh deletes the checkpoints and starts over")
        cfg, devices = self.model_config, cluster.devices
        ep = self.expert_axis(cluster)
        if ep is not None:
            if ep < 1 or devices % ep:
                raise FlagError(f"--expert_parallel={ep} does not divide the {devices} devices")
            if cfg.num_experts % ep:
                raise FlagError(
                    f"--expert_parallel={ep}: the model's {cfg.num_experts} experts are not "
                    f"divisible by the expert axis"
                )
            if cfg.global_batch % devices:
                raise FlagError(
                    f"--global_batch={cfg.global_batch} not divisible by {devices} devices")
        if not self.workdir:
            raise FlagError("--workdir is required")
        try:
            Path(self.workdir).mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.workdir, prefix=".write_probe"):
                pass
        except OSError as e:
            raise FlagError(f"--workdir: cannot write to {self.workdir!r}: {e.strerror}") from None

    @property
    def overrides(self) -> dict:
        """The model config's fields that flags override (``--dispatch``, ``--global_batch``,
        ``--routing_bias`` resolved)."""
        overrides: dict = {}
        if self.dispatch:
            overrides["dispatch"] = self.dispatch
        if self.global_batch:
            overrides["global_batch"] = self.global_batch
        if self.routing_bias != "none":
            overrides["routing_bias"] = self.routing_bias
        return overrides

    @functools.cached_property
    def model_config(self) -> ModelConfig:
        return get_config(self.model, **self.overrides)

    def expert_axis(self, cluster: ClusterConfig) -> int | None:
        """The expert axis size on the simulated cluster (None on GPU, where it
        follows the devices a worker finds)."""
        if cluster.platform != "cpu":
            return None
        return runtime.expert_parallel(self.expert_parallel, self.model_config.num_experts,
                                       cluster.devices)

    @property
    def metrics_path(self) -> Path:
        return Path(self.workdir) / "metrics.jsonl"


# Profiling flags that only one policy reads: set explicitly for another, they mislead.
_POLICY_FLAGS = (("profile_first_n", ProfilePolicy.FIRST_N),
                 ("drift_threshold", ProfilePolicy.SPECULATIVE),
                 ("drift_metric", ProfilePolicy.SPECULATIVE),
                 ("profile_cache_max_age", ProfilePolicy.SPECULATIVE),
                 ("profile_cache_samples", ProfilePolicy.SPECULATIVE),
                 ("profile_cache_granularity", ProfilePolicy.SPECULATIVE),
                 ("profile_trigger", ProfilePolicy.SPECULATIVE))
# Speculative flags that only the drift trigger reads.
_DRIFT_FLAGS = ("drift_threshold", "drift_metric")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """Layer profiling: the policy (``--profile`` or the strategy's) and its knobs.

    ``policy`` is resolved at construction from ``profile`` and the strategy.
    """

    profile: str
    first_n: int
    drift_threshold: float
    drift_metric: str
    cache_max_age: int
    cache_samples: int
    cache_granularity: str
    timeline: bool
    trigger: str = ProfilingOptions().trigger
    given: frozenset[str] = frozenset()
    strategy: InitVar[str]
    policy: ProfilePolicy = dataclasses.field(init=False)

    def __post_init__(self, strategy: str) -> None:
        names = [p.value for p in ProfilePolicy]
        if self.profile and self.profile not in names:
            raise FlagError(f"--profile must be one of {', '.join(names)}, got {self.profile!r}")
        policy = ProfilePolicy(self.profile or STRATEGY_PROFILE.get(strategy, "off"))
        object.__setattr__(self, "policy", policy)
        if strategy in SCHEDULED and policy.value != STRATEGY_PROFILE[strategy]:
            raise FlagError(f"--profile={self.profile}: --ckpt={strategy} schedules from its own "
                            f"profiling policy, {STRATEGY_PROFILE[strategy]}")
        if self.timeline and policy is ProfilePolicy.OFF:
            raise FlagError("--timeline draws a profiled iteration: it needs --profile (or "
                            "--ckpt=gemini|capricorn)")
        if self.first_n < 1:
            raise FlagError(f"--profile_first_n must be >= 1, got {self.first_n}")
        if not 0.0 <= self.drift_threshold <= 1.0:
            raise FlagError(f"--drift_threshold must be in [0, 1], got {self.drift_threshold}")
        if self.cache_max_age < 0:
            raise FlagError(f"--profile_cache_max_age must be >= 0, got {self.cache_max_age}")
        if self.cache_samples < 0:
            raise FlagError(f"--profile_cache_samples must be >= 1 (0: the trigger's "
                            f"default), got {self.cache_samples}")
        if self.trigger not in TRIGGERS:
            raise FlagError(f"--profile_trigger must be one of {', '.join(TRIGGERS)}, "
                            f"got {self.trigger!r}")
        for flag in _DRIFT_FLAGS:
            if (flag in self.given and policy is ProfilePolicy.SPECULATIVE
                    and self.trigger != "drift"):
                raise FlagError(f"--{flag} is only used with --profile_trigger=drift "
                                f"(trigger here: {self.trigger})")
        for flag in ("profile_cache_samples", "profile_cache_granularity"):
            if flag in self.given and not self.cache_max_age and self.trigger == "drift":
                raise FlagError(f"--{flag} is only used with --profile_cache_max_age > 0")
        for flag, user in _POLICY_FLAGS:
            if flag in self.given and policy is not user:
                raise FlagError(f"--{flag} is only used with --profile={user.value} "
                                f"(profiling policy here: {policy.value})")

    def detector_options(self) -> DetectorOptions:
        return DetectorOptions(threshold=self.drift_threshold, metric=self.drift_metric)

    def cache_options(self, dispatch: str) -> CacheOptions | None:
        """The profile cache's options. The capacity trigger always has one
        (max age 0 = the default's); the drift trigger none without a max age
        or with fixed dispatch."""
        if self.trigger == "capacity":
            return CacheOptions(self.cache_max_age or CAPACITY_CACHE.max_age,
                                self.cache_samples or CAPACITY_CACHE.samples,
                                self.cache_granularity)
        if not self.cache_max_age or dispatch != "bucketed":
            return None
        return CacheOptions(self.cache_max_age, self.cache_samples or CacheOptions().samples,
                            self.cache_granularity)

    def options(self, dispatch: str) -> ProfilingOptions:
        """The library's ``ProfilingDriver`` options, for the model's ``dispatch``."""
        return ProfilingOptions(self.policy, self.first_n, self.detector_options(),
                                self.cache_options(dispatch), self.trigger)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The --ckpt strategy, its in-memory tier (host RAM stores), PEC and the
    persistent tier.

    ``chunk_bytes`` is the in-memory tier's transfer chunk (the store's and
    the collective-permutes'); ``chunk_cap`` the scheduled strategies'
    partitioner cap on a chunk placed in a window (``--chunk_cap_bytes``,
    default: ``chunk_bytes``). ``max_version_lag`` and ``on_lag`` are the
    in-memory tier's lag alarm (``launch.train.lag``): the bound in steps on
    the newest safe version's age (0: none) and what passing it does.
    """

    strategy: str
    replicas: int
    chunk_bytes: int
    chunk_cap_bytes: int
    store_root: str
    chunk_path: str = "auto"
    job: str
    replication_timeout_s: float
    persist_timeout_s: float = 300.0
    budget_s: float = -1.0
    persist_every: int
    max_to_keep: int
    pec_k: int
    pec_policy: str
    pec_plt_threshold: float
    pec_dynamic: bool
    pec_k_persist: int
    max_version_lag: int = 50
    on_lag: str = "warn"
    given: frozenset[str] = frozenset()
    hosts: InitVar[int]
    model: InitVar[ModelConfig]
    expert_axis: InitVar[int | None]

    def __post_init__(self, hosts: int, model: ModelConfig, expert_axis: int | None) -> None:
        if self.in_memory and not 1 <= self.replicas <= hosts:
            raise FlagError(f"--replicas={self.replicas} must be in [1, --hosts={hosts}]")
        if self.scheduled and self.replicas != 2:
            raise FlagError(f"--replicas={self.replicas}: --ckpt={self.strategy} moves one peer "
                            f"replica inside the step; it needs --replicas=2")
        if self.in_memory and self.chunk_path == "threaded" and self.replicas != 2:
            raise FlagError(f"--replicas={self.replicas}: --chunk_path=threaded sends one peer "
                            f"replica over the chunk channel; it needs --replicas=2")
        if self.strategy == "pec" and self.chunk_path == "threaded" and self.persist_every:
            # Found by the chaos soak (seed 46, trial 0): every persistent step failed.
            raise FlagError(f"--ckpt=pec --chunk_path=threaded with --persist_every="
                            f"{self.persist_every}: over the chunk channel a version is "
                            f"committed one save later, after the next PEC version was "
                            f"decided, and a persistent PEC step is written from the newest "
                            f"one; use the in-graph exchange (--chunk_path=auto) with "
                            f"--persist_every")
        if self.budget_s != -1.0 and not self.in_memory:
            raise FlagError(f"--ckpt_budget bounds the in-memory tier: it needs --ckpt in "
                            f"{', '.join(IN_MEMORY)}, got --ckpt={self.strategy}")
        if self.budget_s != -1.0 and not 0.0 <= self.budget_s <= 60.0:
            raise FlagError(f"--ckpt_budget must be -1 (none) or in [0, 60] seconds, got "
                            f"{self.budget_s}")
        if self.chunk_cap_bytes < 0:
            raise FlagError(f"--chunk_cap_bytes must be >= 0 (0: --chunk_bytes), got "
                            f"{self.chunk_cap_bytes}")
        self._check_pec(model)
        if self.persist_every < 0 or self.max_to_keep < 1:
            raise FlagError(f"--persist_every must be >= 0 and --max_to_keep >= 1, got "
                            f"{self.persist_every}, {self.max_to_keep}")
        if self.persist_every and not self.in_memory and self.strategy != "orbax_emergency":
            raise FlagError(f"--persist_every writes the in-memory versions to disk: it needs "
                            f"--ckpt in {', '.join(IN_MEMORY)} (or orbax_emergency, its "
                            f"persistent interval), got --ckpt={self.strategy}")
        self._check_pec_persist(model, expert_axis)
        self._check_lag()
        # The persistent tier's barriers wait up to 4x --persist_timeout_s (a
        # write, then the others' outcomes, each bounded twice); a host that
        # failed its write alone waits at the next cross-host agreement, which
        # must outlast them (capricorn_jax's agreement bound).
        if not 0 < 4 * self.persist_timeout_s < AGREEMENT_TIMEOUT_S:
            raise FlagError(f"--persist_timeout_s={self.persist_timeout_s:g}: the persistent "
                            f"tier's barriers wait up to 4x it ({4 * self.persist_timeout_s:g} "
                            f"s), which must be positive and below the cross-host agreement "
                            f"bound ({AGREEMENT_TIMEOUT_S:g} s)")

    def _check_lag(self) -> None:
        if self.max_version_lag < 0:
            raise FlagError(f"--max_version_lag must be >= 0 steps (0: no bound), got "
                            f"{self.max_version_lag}")
        if self.on_lag not in ON_LAG:
            raise FlagError(f"--on_lag must be one of {', '.join(ON_LAG)}, got {self.on_lag!r}")
        if self.on_lag == "fail" and not self.max_version_lag:
            raise FlagError("--on_lag=fail ends the job past --max_version_lag steps: it needs "
                            "--max_version_lag > 0, got 0")
        for flag in ("max_version_lag", "on_lag"):
            if flag in self.given and not self.in_memory:
                raise FlagError(f"--{flag} watches the in-memory tier's safe version: it needs "
                                f"--ckpt in {', '.join(IN_MEMORY)}, got --ckpt={self.strategy}")

    def _check_pec(self, model: ModelConfig) -> None:
        if self.strategy in PEC and self.pec_k == 0:
            raise FlagError(f"--ckpt={self.strategy} checkpoints K experts per MoE layer: it "
                            f"needs --pec_k > 0")
        if self.pec_k == 0:
            for flag in ("pec_policy", "pec_plt_threshold", "pec_dynamic"):
                if flag in self.given:
                    raise FlagError(f"--{flag} is only used with --pec_k > 0")
            return
        if not self.in_memory:
            raise FlagError(f"--pec_k needs an in-memory strategy ({', '.join(IN_MEMORY)}), "
                            f"got --ckpt={self.strategy}")
        if not 1 <= self.pec_k <= model.num_experts:
            raise FlagError(f"--pec_k={self.pec_k} must be in [1, {model.num_experts}] "
                            f"(experts of {model.name})")
        if not 0.0 < self.pec_plt_threshold < 1.0:
            raise FlagError(f"--pec_plt_threshold must be in (0, 1), got "
                            f"{self.pec_plt_threshold}")

    def _check_pec_persist(self, model: ModelConfig, expert_axis: int | None) -> None:
        kp = self.pec_k_persist
        if "pec_k_persist" not in self.given:
            return
        if kp < 0:
            raise FlagError(f"--pec_k_persist={kp} must be >= 0 (0: all experts)")
        if not self.pec_k:
            raise FlagError(f"--pec_k_persist={kp} is only used with --pec_k > 0")
        if not self.persist_every:
            raise FlagError(f"--pec_k_persist={kp} is only used with --persist_every > 0")
        if kp > self.pec_k:
            raise FlagError(f"--pec_k_persist={kp} exceeds --pec_k={self.pec_k} (K_persist <= K)")
        if 0 < kp < model.num_experts and expert_axis is not None and kp % expert_axis:
            raise FlagError(f"--pec_k_persist={kp} is not a multiple of the expert-parallel "
                            f"size {expert_axis}: every rank persists the same number of experts "
                            f"of each MoE layer (use --expert_parallel or another value)")

    @property
    def in_memory(self) -> bool:
        """Whether the strategy is built on the in-memory tier (recoverable)."""
        return self.strategy in IN_MEMORY

    @property
    def scheduled(self) -> bool:
        """Whether the strategy moves chunks inside the step on a schedule."""
        return self.strategy in SCHEDULED

    @property
    def chunk_cap(self) -> int:
        """The scheduled strategies' partitioner chunk cap, in bytes."""
        return self.chunk_cap_bytes or self.chunk_bytes

    @property
    def job_root(self) -> Path:
        """This job's host stores (one folder per host)."""
        return Path(self.store_root) / self.job

    def store_dir(self, host: int) -> Path:
        """Host ``host``'s RAM store."""
        return self.job_root / f"host{host}"


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything launch.train reads from its flags."""

    cluster: ClusterConfig
    train: TrainConfig
    profile: ProfileConfig
    checkpoint: CheckpointConfig
    faults: FaultConfig
    accelerator: AcceleratorConfig = AcceleratorConfig()


def from_flags(fv: flags.FlagValues) -> Config:
    """The parsed flags ``fv`` (``launch.cli_flags``) as a ``Config``; raises FlagError."""
    given = frozenset(name for name in fv if fv[name].present)
    cluster = ClusterConfig(
        hosts=fv.hosts, devices_per_host=fv.devices_per_host, pin_hosts=fv.pin_hosts,
        platform=fv.platform, timeout_s=fv.timeout_s, process_id=fv.process_id,
        coordinator=fv.coordinator, link_gbps=fv.link_gbps, link_latency_ms=fv.link_latency_ms,
        link_burst_kb=fv.link_burst_kb, traffic_class=fv.traffic_class, link_mtu=fv.link_mtu,
        link_filler=fv.link_filler, peer_timeout_s=fv.peer_timeout_s)
    train = TrainConfig(
        model=fv.model, steps=fv.steps, workdir=fv.workdir, seed=fv.seed, workload=fv.workload,
        shift_every=fv.shift_every, dispatch=fv.dispatch, global_batch=fv.global_batch,
        expert_parallel=fv.expert_parallel, learning_rate=fv.learning_rate,
        warmup_steps=fv.warmup_steps, log_every=fv.log_every, eval_sequences=fv.eval_sequences,
        resume=fv.resume, fresh=fv.fresh, verbose=fv.verbose, cluster=cluster,
        routing_bias=resolve_routing_bias(fv.routing_bias, fv.accelerator, fv.workload))
    profile = ProfileConfig(
        profile=fv.profile, first_n=fv.profile_first_n, drift_threshold=fv.drift_threshold,
        drift_metric=fv.drift_metric, cache_max_age=fv.profile_cache_max_age,
        cache_samples=fv.profile_cache_samples, cache_granularity=fv.profile_cache_granularity,
        timeline=fv.timeline, trigger=fv.profile_trigger, given=given, strategy=fv.ckpt)
    checkpoint = CheckpointConfig(
        strategy=fv.ckpt, replicas=fv.replicas, chunk_bytes=fv.chunk_bytes,
        chunk_cap_bytes=fv.chunk_cap_bytes, store_root=fv.store_root,
        chunk_path=fv.chunk_path,
        job=job_name(train.workdir), replication_timeout_s=fv.replication_timeout_s,
        persist_timeout_s=fv.persist_timeout_s, budget_s=fv.ckpt_budget,
        persist_every=fv.persist_every, max_to_keep=fv.max_to_keep, pec_k=fv.pec_k,
        pec_policy=fv.pec_policy, pec_plt_threshold=fv.pec_plt_threshold,
        pec_dynamic=fv.pec_dynamic, pec_k_persist=fv.pec_k_persist,
        max_version_lag=fv.max_version_lag, on_lag=fv.on_lag, given=given,
        hosts=cluster.hosts, model=train.model_config, expert_axis=train.expert_axis(cluster))
    faults = FaultConfig(
        kill_host=fv.kill_host, kill_at_step=fv.kill_at_step, kill_every=fv.kill_every,
        kill_mode=fv.kill_mode, kill_point=fv.kill_point, corrupt_store=fv.corrupt_store,
        stall_host=fv.stall_host, stall_at_step=fv.stall_at_step,
        stall_seconds=fv.stall_seconds, fault_at=fv.fault_at, fault_plan=fv.fault_plan,
        hosts=cluster.hosts, steps=train.steps, strategy=checkpoint.strategy,
        replicas=checkpoint.replicas, persist_every=checkpoint.persist_every,
        shaped=cluster.link.shaped, chunk_path=checkpoint.chunk_path, platform=cluster.platform)
    accelerator = AcceleratorConfig(accelerator=fv.accelerator,
                                    profile=fv.accelerator_profile)
    return Config(cluster, train, profile, checkpoint, faults, accelerator)
