"""The one restore result type: what a restore took from where.

Every restore of the library answers ``(state, RestoreInfo)``: the memory
tier's recovery (``recovery.recover``, tier "memory"), the strategies'
``restore`` and the two-tier manager's (``CheckpointManager.last_restore``,
tier "memory" or "persistent"). It lives in the memory tier, the lowest
floor that restores, so that the persistent tier and the strategies above it
import it without an upward arrow.

Design choice: one frozen dataclass beside the state, not a result object
that carries the state as well; the state is what the caller trains on, the
info what it logs. Alternative not taken: a type per tier (the memory tier's
result type beside ``RestoreInfo``), which gave callers two shapes to tell
apart for the same question.
"""

from __future__ import annotations

import dataclasses
from typing import Any


class NoCheckpoint(FileNotFoundError):
    """A restore found no version in any tier: a fresh start (every restore
    of the library raises it: the strategies', the managers'). A
    ``FileNotFoundError``, as Orbax's ``restore`` raises when it finds no
    step. Any other ``FileNotFoundError`` from a restore is a version that
    vanished or lost a file while it was read, which a caller must not take
    for a fresh start."""


@dataclasses.dataclass(frozen=True)
class PecRestore:
    """What a PEC restore took from where (``RestoreInfo.pec``).

    Attributes:
      plt: the portion of lost tokens of this restore (``pec.RestorePlan``).
      accumulated_plt: the same with the earlier restores included.
      source: [L][N] the step each expert (its parameters and its optimizer
        state alike) was restored from.
      versions: the versions read: the restore point and every expert source.
      k: experts per layer of the restore point's version.
      data_steps: [L][N] the training step of each restored expert's values
        when it differs from ``source`` (a persisted step holds the memory
        tier's newest copies, which may be older than the step); None: ``source``.
    """

    plt: float
    accumulated_plt: float
    source: list[list[int]]
    versions: list[int]
    k: int
    data_steps: list[list[int]] | None = None


@dataclasses.dataclass(frozen=True)
class RestoreInfo:
    """Where a restore got the state.

    Attributes:
      step: the step restored.
      tier: "memory" or "persistent".
      seconds: wall time of the restore (``recover``: on the slowest host;
        ``CheckpointManager.restore``: on this host).
      host_state: this host's JSON state saved with that step ({} if none).
      memory_tiers: for the memory tier, how each host got its shards
        ("local" or "peer", see ``recover``); None otherwise.
      bytes_moved: for the memory tier, bytes that came from peers (all hosts).
      pec: under partial expert checkpointing, where the experts came from
        and the restore's PLT (memory tier: ``recover``'s; persistent tier:
        ``source`` holds the persisted step of each expert and ``data_steps``
        the training step of its values); None otherwise.
    """

    step: int
    tier: str
    seconds: float
    host_state: dict[str, Any]
    memory_tiers: list[str] | None = None
    bytes_moved: int | None = None
    pec: PecRestore | None = None
