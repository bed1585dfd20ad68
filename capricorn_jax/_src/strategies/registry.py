"""Every checkpoint strategy by name: one spec each, one place to add one.

A ``StrategySpec`` says what a strategy is (its name, whether it checkpoints
partial experts, which planner schedules its transfers, the profiling policy
it plans on, whether it runs on the in-memory tier, whether its versions move
on the chunk channel for a given chunk path and backend) and how it is built
(``build``, from one ``BuildArgs``). The library registers its own
(``inmem``, ``pec``, ``gemini``, ``capricorn``, ``capricorn_pec``); a tool
registers more (the project's launchers add the baselines) with
``register``. Every name list of the launchers, the planner, the tables and
the tests reads ``specs()``, so adding a strategy is its entry here (or one
``register`` call) plus its code.

Design choice: plain frozen data plus a builder function, looked up by name
(the form of optax's named transformations and orbax's handler registry).
Alternative not taken: a class attribute per Strategy subclass read by
introspection: the baselines' classes live outside the library, and a
question such as "does this strategy use the chunk channel on GPU?" would
still need its answer written next to the class, without one table to read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the registry's readers (a launcher's flag check) import no JAX
    from capricorn_jax._src.memory.tier.writer_door import TierWriter
    from capricorn_jax._src.profiling.train_step import TrainStep
    from capricorn_jax._src.strategies.base import Strategy

PLANNERS = ("fixed", "replan")
"""``fixed``: a schedule built once from the first profiled steps and kept
(gemini); ``replan``: re-planned when the expert load drifts (capricorn)."""
CHUNK_PATHS = ("auto", "in_graph", "threaded")


@dataclasses.dataclass(frozen=True)
class BuildArgs:
    """What a strategy is built from (each builder reads what it needs).

    Attributes:
      train: the caller's TrainStep.
      checkpointer: the host's memory tier, for specs with ``in_memory``
        (with PEC options for specs with ``pec``); None for the others.
      first_n: the ``fixed`` planner's profiled steps (None: the default).
      chunk_cap: the largest chunk a scheduled transfer moves, bytes.
      chunk_path: "auto", "in_graph" or "threaded".
      spans: plan on span windows (``ScheduledStrategy``'s ``spans``).
      extra: a tool's own inputs for the strategies it registers (the
        launchers' baselines: their directories and intervals).
    """

    train: TrainStep
    checkpointer: TierWriter | None = None
    first_n: int | None = None
    chunk_cap: int = 1 << 20
    chunk_path: str = "auto"
    spans: bool | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StrategySpec:
    """One strategy (see the module docstring).

    Attributes:
      name: its name in flags, events and tables.
      build: the strategy of this host from ``BuildArgs``.
      in_memory: built on the in-memory tier (a checkpointer, its recovery
        and its persistent tier).
      pec: partial expert checkpoints (the checkpointer's PEC options).
      planner: which planner schedules its transfers inside the step
        (``PLANNERS``); None: moved after the step.
      profile: the profiling policy it plans on (None: the caller's choice).
      label: its name in tables (default: ``name``).
      channel_paths: the chunk paths ("in_graph"/"threaded") on which a
        strategy moves its versions over the chunk channel.
    """

    name: str
    build: Callable[[BuildArgs], Strategy]
    in_memory: bool = False
    pec: bool = False
    planner: str | None = None
    profile: str | None = None
    label: str = ""
    channel_paths: frozenset[str] = frozenset({"threaded"})

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"a strategy's name must be an identifier, got {self.name!r}")
        if self.planner is not None and self.planner not in PLANNERS:
            raise ValueError(f"{self.name}: planner must be one of {PLANNERS} or None, "
                             f"got {self.planner!r}")
        if (self.pec or self.planner) and not self.in_memory:
            raise ValueError(f"{self.name}: PEC and a planner need the in-memory tier")
        if not self.label:
            object.__setattr__(self, "label", self.name)

    @property
    def scheduled(self) -> bool:
        """Its versions move inside the step on a planned schedule (one peer replica)."""
        return self.planner is not None

    def resolved_path(self, chunk_path: str, backend: str) -> str:
        """The path its versions take: ``chunk_path`` with "auto" resolved:
        the scheduled strategies in the step's program on GPU (collectives
        run asynchronously there) and on the threaded channel elsewhere; the
        unscheduled ones in the in-graph exchange after the step."""
        if chunk_path not in CHUNK_PATHS:
            raise ValueError(f"chunk_path must be one of {CHUNK_PATHS}, got {chunk_path!r}")
        if chunk_path != "auto":
            return chunk_path
        return "threaded" if self.scheduled and backend != "gpu" else "in_graph"

    def uses_channel(self, chunk_path: str, backend: str) -> bool:
        """Whether its versions move on the chunk channel (so the channel's
        faults can strike them) with ``chunk_path`` on ``backend``
        ("cpu", "gpu", ...)."""
        return self.in_memory and self.resolved_path(chunk_path, backend) in self.channel_paths


_REGISTRY: dict[str, StrategySpec] = {}


def register(spec: StrategySpec) -> StrategySpec:
    """Adds ``spec``; a second spec of the same name is an error (unless it
    is the same spec, so re-importing a module is harmless)."""
    old = _REGISTRY.get(spec.name)
    if old is not None and old != spec:
        raise ValueError(f"strategy {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Removes a strategy (a test's toy strategy); unknown names are an error."""
    if _REGISTRY.pop(name, None) is None:
        raise KeyError(f"no strategy {name!r} registered")


def spec(name: str) -> StrategySpec:
    """The spec of ``name``; an unknown name is an error listing the known."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(_REGISTRY)}") from None


def specs() -> tuple[StrategySpec, ...]:
    """Every registered strategy, in registration order."""
    return tuple(_REGISTRY.values())


def build(name: str, args: BuildArgs) -> Strategy:
    """The strategy ``name`` of this host, checked against its spec's needs."""
    s = spec(name)
    if (args.checkpointer is not None) != s.in_memory:
        raise ValueError(f"strategy {name!r} {'needs' if s.in_memory else 'takes no'} "
                         f"in-memory checkpointer")
    if s.pec and getattr(args.checkpointer, "pec", None) is None:
        raise ValueError(f"strategy {name!r} needs a checkpointer with PEC options")
    return s.build(args)


def _unscheduled(args: BuildArgs, name: str) -> Strategy:
    from capricorn_jax._src.strategies.channel_replication import ChannelReplication
    from capricorn_jax._src.strategies.inmemory import InMemoryStrategy

    assert args.checkpointer is not None
    if args.chunk_path == "threaded":
        return ChannelReplication(args.checkpointer, args.train, name, args.chunk_cap)
    return InMemoryStrategy(args.checkpointer, name)


def _scheduled(args: BuildArgs, name: str) -> Strategy:
    from capricorn_jax._src.profiling.policy import ProfilingOptions
    from capricorn_jax._src.strategies.scheduled import ScheduledStrategy

    assert args.checkpointer is not None
    return ScheduledStrategy(name, args.checkpointer, args.train,
                             first_n=args.first_n or ProfilingOptions().first_n,
                             chunk_cap=args.chunk_cap, chunk_path=args.chunk_path,
                             spans=args.spans, planner=spec(name).planner)


register(StrategySpec("inmem", lambda a: _unscheduled(a, "inmem"), in_memory=True))
register(StrategySpec("gemini", lambda a: _scheduled(a, "gemini"), in_memory=True,
                      planner="fixed", profile="first_n"))
register(StrategySpec("capricorn", lambda a: _scheduled(a, "capricorn"), in_memory=True,
                      planner="replan", profile="speculative"))
register(StrategySpec("pec", lambda a: _unscheduled(a, "pec"), in_memory=True, pec=True))
register(StrategySpec("capricorn_pec", lambda a: _scheduled(a, "capricorn_pec"),
                      in_memory=True, pec=True, planner="replan", profile="speculative",
                      label="capricorn + pec"))
