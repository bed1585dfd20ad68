"""The strategies' write door (``memory.writer_door.TierWriter``).

mypy checks the door: ``as_writer`` below assigns an ``InMemoryCheckpointer``
to a ``TierWriter``, which type-checks only while the checkpointer satisfies
the protocol structurally (same member types and signatures); and the
strategies, typed against ``TierWriter``, cannot reach a member outside it.
The tests here hold the list itself and check the members by name on a real
checkpointer at run time.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from capricorn_jax import InMemoryCheckpointer, InMemoryOptions
from capricorn_jax._src.memory.tier.reader import TierReader
from capricorn_jax._src.memory.tier.writer_door import TierWriter

WRITE_MEMBERS = {"clock", "rounds", "sources", "agreed_note", "note_status", "note_channel",
                 "channel_lost_anywhere", "save",
                 "save_transferred", "skip", "drop", "note_lost", "begin_round", "plan_pec_version",
                 "trailer_rows", "close"}
"""What the strategies use of the checkpointer beyond what recovery reads."""


def as_writer(ckpt: InMemoryCheckpointer) -> TierWriter:
    """Type-checked by mypy: an InMemoryCheckpointer is a TierWriter."""
    return ckpt


def members(protocol: type) -> set[str]:
    """The members a protocol class declares itself (annotations, methods, properties)."""
    own = {n for n in vars(protocol) if not n.startswith("_")}
    return own | set(vars(protocol).get("__annotations__", {}))


def test_the_door_adds_the_strategies_members_to_the_readers():
    assert TierReader in TierWriter.__mro__
    assert members(TierWriter) == WRITE_MEMBERS


def test_an_in_memory_checkpointer_has_every_member_of_the_door(tmp_path):
    mesh = Mesh(np.array(jax.devices()).reshape(-1), ("data",))
    ckpt = InMemoryCheckpointer(
        InMemoryOptions(store_root=str(tmp_path / "shm"), job="door", replicas=1),
        mesh, {"b": jax.ShapeDtypeStruct((4,), np.int32)},
        {"b": NamedSharding(mesh, P())}, 0, 1)
    try:
        writer = as_writer(ckpt)
        missing = sorted(n for n in members(TierWriter) | members(TierReader)
                         if not hasattr(writer, n))
        assert missing == []
        writer.note_status(7)
        assert ckpt.status_note == 7  # the note the next status round carries
        writer.note_channel(True)
        lost_flag = 2 * ckpt.hosts + 3  # then the versions never held here: (newest, mask)
        assert ckpt.status_vector()[lost_flag] == 1 and not writer.channel_lost_anywhere()
        writer.note_lost([5, 3])
        assert list(ckpt.status_vector()[lost_flag + 1:]) == [5, 0b10]
    finally:
        ckpt.close()
