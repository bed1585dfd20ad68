"""Every checkpoint strategy by name, and the one factory that builds them.

launch.train (``--ckpt``) and launch.bench (``--strategies``) accept the same
names, those of the library's registry (``capricorn_jax.experimental.specs``:
``inmem``, ``pec``, ``gemini``, ``capricorn``, ``capricorn_pec``) plus the
baselines registered here (``launch.baselines``): ``none``, ``blocking``,
``orbax_async``, ``orbax_emergency``; and the control registered here
(``launch.control``): ``control``, no checkpoint, a version's bytes sent to
the peer host every step (the emulator's own floor; 2 hosts or more).

Every strategy is driven the same way (``capricorn_jax.Strategy``): the
caller runs each step through ``capricorn_jax.ProfilingDriver`` and calls
``save``/``finish``/``close``/``restore``. The name tuples below are read
from the registry at import, by the launcher's flag checks before JAX
starts; every list of strategy names in launch/ reads them (or ``spec``).

A strategy of one's own: a module that calls
``capricorn_jax.experimental.register`` with its spec, named in the
environment variable ``CAPRICORN_STRATEGY_MODULES`` (comma-separated module
names, imported here first, so every launcher and every process it starts
knows it).
"""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path

from capricorn_jax import Strategy
from capricorn_jax.experimental import BuildArgs, StrategySpec, register, spec, specs
from capricorn_jax.experimental.strategies import build

PLUGINS_ENV = "CAPRICORN_STRATEGY_MODULES"


def _baseline(args: BuildArgs, name: str) -> Strategy:
    from launch import baselines

    if name == "none":
        return baselines.NoCheckpoint()
    directory = args.extra.get("directory")
    if directory is None:
        raise ValueError(f"strategy {name!r} needs a directory")
    if name == "blocking":
        return baselines.BlockingCheckpoint(directory, args.train)  # type: ignore[arg-type]
    if name == "orbax_async":
        return baselines.OrbaxAsync(directory, args.train,  # type: ignore[arg-type]
                                    args.extra.get("tier", "persistent"))
    local = args.extra.get("local_directory")
    if local is None:
        raise ValueError("strategy 'orbax_emergency' needs a local directory (its RAM tier)")
    return baselines.OrbaxEmergency(local, directory, args.train,  # type: ignore[arg-type]
                                    args.extra.get("persist_every", 10))


BASELINES = {"none": "none", "blocking": "blocking (RAM disk)", "orbax_async": "Orbax async",
             "orbax_emergency": "Orbax emergency"}
"""The baselines and their names in tables."""
for _name, _label in BASELINES.items():
    register(StrategySpec(_name, functools.partial(_baseline, name=_name), label=_label))


def _control(args: BuildArgs) -> Strategy:
    from launch import control

    return control.build(args)


CONTROLS = {"control": "control (bulk bytes, no ckpt)"}
"""The controls and their names in tables: no checkpoint, nothing to
restore (not in-memory), a peer host needed."""
for _name, _label in CONTROLS.items():
    register(StrategySpec(_name, _control, label=_label))
for _module in filter(None, os.environ.get(PLUGINS_ENV, "").split(",")):
    importlib.import_module(_module.strip())

_ALL = specs()
STRATEGIES = (*BASELINES, *(s.name for s in _ALL if s.name not in BASELINES))
# Built on the in-memory tier (its checkpointer, recovery and persistent tier).
IN_MEMORY = tuple(s.name for s in _ALL if s.in_memory)
# Move a version inside the step on a schedule (one peer replica).
SCHEDULED = tuple(s.name for s in _ALL if s.scheduled)
# Partial expert checkpoints: need the checkpointer's PEC options (K).
PEC = tuple(s.name for s in _ALL if s.pec)
# The profiling policy a strategy plans on (the others: the caller's choice, off by default).
STRATEGY_PROFILE = {s.name: s.profile for s in _ALL if s.profile}
# Send to a peer host every step, so refuse a job of one host: the scheduled
# ones and the controls (the registry has no trait for it).
PEER_ONLY = (*SCHEDULED, *CONTROLS)
LABELS = {s.name: s.label for s in _ALL}
"""Each strategy's name in tables."""


def uses_channel(name: str, chunk_path: str, backend: str) -> bool:
    """Whether ``name``'s versions move on the chunk channel (the registry's answer)."""
    return spec(name).uses_channel(chunk_path, backend)


def make_strategy(name: str, train, *, checkpointer=None, directory: Path | None = None,
                  first_n: int | None = None, chunk_cap: int = 1 << 20,
                  chunk_path: str = "auto", span_windows: bool = True,
                  tier: str = "persistent", local_directory: Path | None = None,
                  persist_every: int = 10, traffic_class: str | None = None,
                  replicas: int | None = None, time_scale: float = 1.0) -> Strategy:
    """The strategy ``name`` of this host.

    Args:
      name: one of ``STRATEGIES``.
      train: the trainer (``launch.trainer.Trainer``).
      checkpointer: the host's InMemoryCheckpointer, for the ``IN_MEMORY``
        strategies (with PEC options for ``PEC``); None for the others.
      directory: where ``blocking`` (this host's own folder),
        ``orbax_async`` (the Orbax root, shared) or ``orbax_emergency`` (its
        persistent root, shared) writes.
      first_n: gemini's profiled steps (default: ``ProfilingOptions``').
      chunk_cap: the scheduled strategies' largest chunk in a window, bytes.
      chunk_path: how they move chunks: "auto", "in_graph" or "threaded";
        ``inmem``/``pec`` replicate over the threaded chunk channel
        (``capricorn_jax.experimental.ChannelReplication``) with "threaded", in the
        in-graph exchange otherwise.
      span_windows: the scheduled strategies plan on the idle spans between
        a layer's all-to-alls on the threaded path (False: one window per
        layer segment, the bench's ``*_layers`` rows).
      tier: ``orbax_async``'s restore tier ("persistent" disk or "local" RAM disk).
      local_directory: ``orbax_emergency``'s local tier (a RAM disk; each host
        writes its own folder in it).
      persist_every: ``orbax_emergency``'s persistent interval, steps.
      traffic_class, replicas, time_scale: ``control``'s traffic class
        ("fifo" or "priority"), the in-memory tier's m its peers follow and
        the bench's ``--time_scale`` (its bounds scale with it); None: fifo, 2.
    """
    return build(name, BuildArgs(
        train, checkpointer, first_n=first_n, chunk_cap=chunk_cap, chunk_path=chunk_path,
        spans=None if span_windows else False,
        extra={"directory": directory, "tier": tier, "local_directory": local_directory,
               "persist_every": persist_every, "traffic_class": traffic_class,
               "replicas": replicas, "time_scale": time_scale}))
