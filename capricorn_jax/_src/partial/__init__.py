"""Partial Expert Checkpointing (PEC, MoC-System): the decision logic, pure.

A PEC version carries all non-expert state and, of every MoE layer, only K
of the N experts, each expert with its optimizer state (its Adam moments).
A restore takes the non-expert state from the restore point and every expert
from its newest saved copy at or before it, so the updates an expert received
after that copy are lost (the portion of lost tokens, PLT).

* ``selection``: which experts a version carries and how many (K);
* ``tracker``: the PLT account and the restore plans;
* ``leaves``: which train-state leaves are expert leaves, and the bytes;
* ``plans``: what each tier's versions read and carry (in-memory needs,
  persisted steps).

The tiers that move and store the bytes are ``memory`` (``memory.pec_tier``)
and ``persistent`` (``persistent.pec_steps``).
"""
