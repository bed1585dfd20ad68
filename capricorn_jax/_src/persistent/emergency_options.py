"""The two tiers' options, in the shape of Orbax's emergency ``CheckpointManagerOptions``.

Why. A JAX user who keeps checkpoints in host RAM today builds Orbax's
emergency manager (``orbax.checkpoint.experimental.emergency``) with
``CheckpointManagerOptions(local=LocalCheckpointOptions(...),
persistent=PersistentCheckpointOptions(...), ...)``, almost always through
MaxText. ``TwoTierOptions`` takes those field names, so switching is one import
and one options line: every field of Orbax's options that means something
here is taken with Orbax's meaning, every other one is refused by name at
construction (``OptionRefused``), never accepted and ignored.

What differs, on purpose (``docs/guide.md`` has the table):

* ``local.save_interval_steps`` defaults to 1 (the point of the memory tier:
  every step); Orbax's default is 10. ``local.max_to_keep`` is refused: the
  memory tier keeps what its retention rule needs for one version of every
  host to survive on all its holders (``memory.tier.retention``), not a count.
* ``persistent`` defaults to every 10 steps, 2 kept (Orbax: every 1000, all
  kept); ``save_interval_steps``, ``max_to_keep``, ``keep_period``,
  ``should_save_fn``, ``save_decision_policy`` and ``preservation_policy`` go to
  Orbax's persistent manager as they are.
* ``replica_axis_index`` is refused unless 0: the peer copies here are placed
  over hosts by the memory tier (``replicas``), not read from a replica axis
  of the mesh, which an expert-parallel mesh does not have.
* Ours beside Orbax's: ``replicas`` (capped at the host count, said once),
  ``job``, ``chunk_bytes``, ``pec``, ``barrier_timeout_s``, ``fsync``, and
  ``schedule`` (``"gemini"`` | ``"capricorn"``: each version moves inside the
  next step, through ``TwoTierCheckpointManager.train_step``; None: after
  the step, as before) with its ``profiling`` and ``channel_secret_file``.

The top-level ``save_interval_steps`` / ``max_to_keep`` of 0.18 are kept for
one release: given, they set ``persistent``'s (with a deprecation warning).

Alternative not taken: accepting Orbax's own options object. It would tie the
package to one Orbax version's experimental classes, and its defaults (a
persistent step every 1000 steps, none deleted) are not this tier's.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from capricorn_jax._src.partial.selection import PecOptions
from capricorn_jax._src.persistent.barriers import DEFAULT_S as DEFAULT_BARRIER_S
from capricorn_jax._src.profiling.policy import ProfilingOptions

SCHEDULES = ("gemini", "capricorn")
"""The scheduled strategies ``TwoTierOptions.schedule`` names."""


class OptionRefused(ValueError):
    """An option of Orbax's emergency manager that has no meaning here."""


@dataclasses.dataclass(frozen=True)
class LocalCheckpointOptions:
    """The memory tier (Orbax: local checkpoints).

    Attributes:
      save_interval_steps: a version in host RAM every this many steps (and at
        every persistent step); 1: every step.
      max_to_keep: refused (the retention rule decides); None.
      read_only: refused unless False.
    """

    save_interval_steps: int = 1
    max_to_keep: int | None = None
    read_only: bool = False

    def __post_init__(self) -> None:
        if type(self.save_interval_steps) is not int or self.save_interval_steps < 1:
            raise ValueError(f"local.save_interval_steps must be an integer >= 1, got "
                             f"{self.save_interval_steps!r}")
        if self.max_to_keep is not None:
            raise OptionRefused(
                f"local.max_to_keep={self.max_to_keep}: the memory tier keeps what its retention "
                f"rule needs (one version of every host on all its holders), not a count; "
                f"leave it None")
        if self.read_only:
            raise OptionRefused("local.read_only=True: a read-only memory tier has nothing to "
                                "restore from; restore the persistent tier with "
                                "orbax.checkpoint.CheckpointManager instead")


@dataclasses.dataclass(frozen=True)
class PersistentCheckpointOptions:
    """The persistent tier, passed to Orbax's ``CheckpointManagerOptions``.

    Attributes: as Orbax's ``PersistentCheckpointOptions`` (``max_to_keep`` None
    keeps every step), with this tier's defaults.
    """

    save_interval_steps: int = 10
    max_to_keep: int | None = 2
    keep_period: int | None = None
    should_save_fn: Callable[[int, int | None], bool] | None = None
    save_decision_policy: Any = None
    preservation_policy: Any = None

    def __post_init__(self) -> None:
        if type(self.save_interval_steps) is not int or self.save_interval_steps < 1:
            raise ValueError(f"persistent.save_interval_steps must be an integer >= 1, got "
                             f"{self.save_interval_steps!r}")
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(f"persistent.max_to_keep must be None or >= 1, got "
                             f"{self.max_to_keep}")
        if self.preservation_policy is not None and (self.max_to_keep is not None
                                                     or self.keep_period is not None):
            raise ValueError("persistent.preservation_policy replaces max_to_keep and "
                             "keep_period: leave those None")

    def orbax(self, **extra: Any) -> Any:
        """Orbax's ``CheckpointManagerOptions`` for the persistent tier."""
        import orbax.checkpoint as ocp

        fields = {"save_interval_steps": self.save_interval_steps,
                  "max_to_keep": self.max_to_keep, "keep_period": self.keep_period,
                  "should_save_fn": self.should_save_fn,
                  "save_decision_policy": self.save_decision_policy,
                  "preservation_policy": self.preservation_policy}
        return ocp.CheckpointManagerOptions(**{k: v for k, v in fields.items()
                                               if v is not None or k == "max_to_keep"}, **extra)


@dataclasses.dataclass(frozen=True)
class MultiprocessingOptions:
    """Orbax's ``coordination_timeout_secs``: the bound of every barrier of
    the persistent tier (``barrier_timeout_s``, which it overrides)."""

    coordination_timeout_secs: int = 120


@dataclasses.dataclass(frozen=True)
class TwoTierOptions:
    """Both tiers' options (module docstring: Orbax's fields and ours).

    Attributes (Orbax's emergency options):
      local: ``LocalCheckpointOptions``; persistent: ``PersistentCheckpointOptions``.
      replica_axis_index: 0 only (refused otherwise).
      enable_async_checkpointing: False waits for each persistent step in
        ``save`` (Orbax's synchronous mode).
      async_options: Orbax's ``AsyncOptions`` for the persistent tier.
      cleanup_tmp_directories: remove uncommitted step directories at start.
      multiprocessing_options: its timeout bounds the barriers.
      step_name_format: refused (steps are named by their number).
      single_host_load_and_broadcast: True only (each host reads its own
        shards here; refused otherwise).

    Attributes (ours):
      replicas: copies of each host's shards in host RAM (its own and
        ``replicas - 1`` peers'), capped at the host count; 2 survives a
        machine's loss.
      job: the memory tier's job name (default: from the persistent
        directory's real path, so a restart finds its versions).
      chunk_bytes: the memory tier's chunk (``InMemoryOptions.chunk_bytes``).
      pec: partial expert checkpointing (``PecOptions``), or None.
      barrier_timeout_s: the bound of Orbax's synchronous barriers when
        several processes run: a host that never arrives fails the save
        after that long instead of holding the others.
      fsync: each persistent step made durable before it is committed.
      schedule: None (each version moves to the peers after the step), or
        ``"gemini"`` / ``"capricorn"``: the steps run through
        ``TwoTierCheckpointManager.train_step`` and each version's chunks
        move inside the next step, in the idle windows of a schedule planned
        on layer profiles (gemini: once; capricorn: re-planned as the
        experts' load drifts). Needs 2 hosts or more, ``replicas=2`` and
        ``local.save_interval_steps=1``.
      profiling: with ``schedule``, the profiling driver's options (their
        policy the schedule's: capricorn ``speculative``, gemini
        ``first_n``); None: that policy's defaults.
      channel_secret_file: with ``schedule`` on the threaded path (CPU), the
        job's secret the chunk channel's ends prove (``docs/guide.md``,
        section 9); None: the environment's, else
        ``persistent_directory/.capricorn.secret`` (created 0600 by the
        first host).
      save_interval_steps, max_to_keep: deprecated (0.18's form of
        ``persistent``'s; one release).
    """

    local: LocalCheckpointOptions = LocalCheckpointOptions()
    persistent: PersistentCheckpointOptions = PersistentCheckpointOptions()
    replica_axis_index: int = 0
    enable_async_checkpointing: bool = True
    async_options: Any = None
    cleanup_tmp_directories: bool = False
    multiprocessing_options: MultiprocessingOptions | None = None
    step_name_format: Any = None
    single_host_load_and_broadcast: bool = True
    replicas: int = 2
    job: str | None = None
    chunk_bytes: int = 4 << 20
    pec: PecOptions | None = None
    barrier_timeout_s: float = DEFAULT_BARRIER_S
    fsync: bool = True
    schedule: str | None = None
    profiling: ProfilingOptions | None = None
    channel_secret_file: str | None = None
    save_interval_steps: int | None = None
    max_to_keep: int | None = None

    def __post_init__(self) -> None:
        if self.replica_axis_index != 0:
            raise OptionRefused(
                f"replica_axis_index={self.replica_axis_index}: the peer copies are placed over "
                f"hosts by the memory tier (replicas={self.replicas}), not read from a replica "
                f"axis of the mesh; leave it 0")
        if self.step_name_format is not None:
            raise OptionRefused("step_name_format: persistent steps are named by their number "
                                "(the PEC records and the restore read them so); leave it None")
        if not self.single_host_load_and_broadcast:
            raise OptionRefused("single_host_load_and_broadcast=False: each host reads its own "
                                "shards here; leave it True")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        self._check_schedule()
        if self.save_interval_steps is not None or self.max_to_keep is not None:
            warnings.warn("TwoTierOptions(save_interval_steps=, max_to_keep=) is deprecated: use "
                          "persistent=PersistentCheckpointOptions(save_interval_steps=, "
                          "max_to_keep=)", DeprecationWarning, stacklevel=3)
            if self.persistent != PersistentCheckpointOptions():
                raise ValueError("give persistent= or the deprecated save_interval_steps= / "
                                 "max_to_keep=, not both")
            old = PersistentCheckpointOptions()
            object.__setattr__(self, "persistent", dataclasses.replace(
                old, save_interval_steps=self.save_interval_steps or old.save_interval_steps,
                max_to_keep=self.max_to_keep or old.max_to_keep))

    def _check_schedule(self) -> None:
        if self.schedule is None:
            if self.profiling is not None:
                raise ValueError("TwoTierOptions(profiling=) drives the scheduled strategies' "
                                 "profiled steps: give schedule='gemini' or 'capricorn' too")
            return
        if self.schedule not in SCHEDULES:
            raise ValueError(f"TwoTierOptions(schedule={self.schedule!r}): one of "
                             f"{', '.join(map(repr, SCHEDULES))}, or None")
        if self.replicas != 2:
            raise ValueError(f"TwoTierOptions(schedule={self.schedule!r}) moves one peer copy "
                             f"inside each step: it needs replicas=2, got {self.replicas}")
        if self.local.save_interval_steps != 1:
            raise ValueError(f"TwoTierOptions(schedule={self.schedule!r}) moves a version "
                             f"inside every step: local.save_interval_steps must be 1, got "
                             f"{self.local.save_interval_steps}")

    @property
    def barrier_bound_s(self) -> float:
        """The barriers' bound: ``multiprocessing_options``' when given."""
        if self.multiprocessing_options is not None:
            return float(self.multiprocessing_options.coordination_timeout_secs)
        return self.barrier_timeout_s
