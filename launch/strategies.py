"""Every checkpoint strategy by name, and the one factory that builds them.

launch.train (``--ckpt``) and launch.bench (``--strategies``) accept the same
names and build them here:

* ``none``, ``blocking``, ``orbax_async``, ``orbax_emergency``: the baselines
  (``launch.baselines``);
* ``inmem``: capricorn_jax's in-memory tier, every step to host RAM and m-1
  peers, moved after the step; ``pec``: the same with partial expert
  checkpointing (the checkpointer's PEC options: K of N experts per version);
* ``gemini``, ``capricorn``: versions moved inside the step on a schedule
  from layer profiles (gemini: its first N profiled steps, kept; capricorn:
  re-planned when the expert load drifts); ``capricorn_pec``: capricorn with
  partial expert checkpoints.

Every strategy is driven the same way (``capricorn_jax.Strategy``): the
caller runs each step through ``capricorn_jax.ProfilingDriver`` and calls
``save``/``finish``/``close``/``restore``. The tables are plain data, read
by the launcher's flag checks before JAX starts.
"""

from __future__ import annotations

from pathlib import Path

from capricorn_jax import (
    InMemoryCheckpointer,
    InMemoryStrategy,
    ScheduledStrategy,
    Strategy,
)
from capricorn_jax.experimental import ChannelReplication

STRATEGIES = ("none", "blocking", "orbax_async", "orbax_emergency", "inmem", "gemini",
              "capricorn", "pec", "capricorn_pec")
# Built on the in-memory tier (its checkpointer, recovery and persistent tier).
IN_MEMORY = ("inmem", "gemini", "capricorn", "pec", "capricorn_pec")
# Move a version inside the step on a schedule (one peer replica).
SCHEDULED = ("gemini", "capricorn", "capricorn_pec")
# Partial expert checkpoints: need the checkpointer's PEC options (K).
PEC = ("pec", "capricorn_pec")
# The profiling policy a strategy plans on (the others: the caller's choice, off by default).
STRATEGY_PROFILE = {"gemini": "first_n", "capricorn": "speculative",
                    "capricorn_pec": "speculative"}


def make_strategy(name: str, train, *, checkpointer: InMemoryCheckpointer | None = None,
                  directory: Path | None = None, first_n: int | None = None,
                  chunk_cap: int = 1 << 20, chunk_path: str = "auto",
                  span_windows: bool = True, tier: str = "persistent",
                  local_directory: Path | None = None, persist_every: int = 10) -> Strategy:
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
    """
    from capricorn_jax import ProfilingOptions
    from launch import baselines

    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
    if (checkpointer is not None) != (name in IN_MEMORY):
        raise ValueError(f"strategy {name!r} {'needs' if name in IN_MEMORY else 'takes no'} "
                         f"in-memory checkpointer")
    if checkpointer is None:  # the baselines
        if name == "none":
            return baselines.NoCheckpoint()
        if directory is None:
            raise ValueError(f"strategy {name!r} needs a directory")
        if name == "blocking":
            return baselines.BlockingCheckpoint(directory, train)
        if name == "orbax_async":
            return baselines.OrbaxAsync(directory, train, tier)
        # orbax_emergency
        if local_directory is None:
            raise ValueError("strategy 'orbax_emergency' needs a local directory (its RAM tier)")
        return baselines.OrbaxEmergency(local_directory, directory, train, persist_every)
    if name in PEC and checkpointer.pec is None:
        raise ValueError(f"strategy {name!r} needs a checkpointer with PEC options")
    if name in SCHEDULED:
        return ScheduledStrategy(name, checkpointer, train,
                                 first_n=first_n or ProfilingOptions().first_n,
                                 chunk_cap=chunk_cap, chunk_path=chunk_path,
                                 spans=None if span_windows else False)
    if chunk_path == "threaded":
        return ChannelReplication(checkpointer, train, name, chunk_cap)
    return InMemoryStrategy(checkpointer, name)
