"""What the hosts of a job must share, agreed once at a strategy's start.

Two builds, or two configurations, with the same format tags and a
different pack plan or schedule would run mismatched collectives (a hang
until a timeout) or fail later with a frame that does not fit. So every
strategy over the memory tier states, at its start, the parts every host
must share: the pack plan's fingerprint (leaves, chunk size, hosts, ranks),
the replication rounds, the replica count, the PEC options, the cost
budget and the strategy's name; ``multihost.agree.agree_shared`` compares
them on every host (a mismatch stops the job naming each part that differs
with both hosts' values) and every later agreement carries their digest.
The chunk channel's hello states the same digest (``peer_channel``).

Design choice: one agreement at the start, through the key-value store,
before the first collective. Alternative not taken: a check at the first
save's status round (an all-gather: two builds whose programs differ would
already hang inside it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from capricorn_jax._src.memory.tier.writer_door import TierWriter
from capricorn_jax._src.multihost.agree import agree_shared


def tier_parts(ckpt: TierWriter, name: str | None = None) -> dict[str, Any]:
    """The parts of ``ckpt``'s tier every host must share (and the
    strategy's ``name``, when given)."""
    options = ckpt.options
    parts: dict[str, Any] = {
        "plan": ckpt.plan.fingerprint(),
        "replicas": options.replicas,
        "rounds": [sorted(r.items()) for r in ckpt.rounds],
        "pec": None if options.pec is None else dataclasses.asdict(options.pec),
        "max_wait_s": options.max_wait_s,
    }
    if name is not None:
        parts["strategy"] = name
    return parts


def agree_on_start(ckpt: TierWriter, name: str) -> str:
    """Every host checks the others share its tier's parts (``tier_parts``);
    the digest. One process exchanges nothing."""
    return agree_shared(tier_parts(ckpt, name), what=f"the shared identity of {name}")
