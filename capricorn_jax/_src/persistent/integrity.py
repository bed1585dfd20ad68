"""Each persistent leaf's CRC32C: taken at save from the host copy, checked at restore.

Why. Orbax writes what it is handed and reads back what the filesystem gives:
a bit flipped on disk, a truncated chunk file that still parses, or a step
directory patched by hand restores as model weights with no error. The
memory tier checks a CRC32C per chunk; the persistent tier had none.

What. At save each host takes the CRC32C (``crc32c``, hardware-accelerated)
of every block it writes, over the host-RAM bytes the step is written from,
one entry per distinct shard of each leaf (its index, as ``[start, stop]`` per
dimension, and its checksum), and writes them beside the step's files
(``capricorn_crc32c.<host>.json`` in the item directory; plain Orbax ignores
it). At restore each host checks every recorded shard that lies inside a
shard it restored (the same sharding, or fewer devices: a bigger shard holds
the recorded ones) and raises ``PersistentChecksumError`` naming the step, the
leaf, the shard and the tier; recorded shards no restored shard of this host
holds (a restore into smaller shards) are counted as unchecked. A step
written by a build that recorded nothing restores with a log line saying so.

Alternative not taken: one checksum per leaf over its global bytes: no host
holds a whole sharded leaf, and a per-host order of shards would tie the
check to one topology.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from capricorn_jax._src.memory.store.arena import checksum
from capricorn_jax._src.memory.store.store import ChecksumError

log = logging.getLogger("capricorn_jax")

CRC_FILE = "capricorn_crc32c.{host}.json"
_GLOB = "capricorn_crc32c.*.json"

Index = tuple[tuple[int, int], ...]


class PersistentChecksumError(ChecksumError):
    """A restored persistent leaf does not match the CRC32C recorded at save.

    Attributes:
      step: the persistent step; leaf: the leaf's key path.
      state: what was restored (for a caller that must finish a collective
        before acting on the error); None when not kept.
    """

    def __init__(self, message: str, step: int | None, leaf: str, state: Any = None):
        super().__init__(message)
        self.step, self.leaf, self.state = step, leaf, state


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a restore's check covered: shards checked, and recorded shards no
    restored shard of this host held."""

    checked: int
    unchecked: int


def _index(slices: Sequence[slice], shape: Sequence[int]) -> Index:
    return tuple((s.start or 0, dim if s.stop is None else s.stop)
                 for s, dim in zip(slices, shape, strict=True))


def _crc(a: np.ndarray) -> int:
    return checksum(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def leaf_names(tree: Any) -> list[str]:
    """The key path of each leaf of ``tree``, in ``jax.tree.leaves`` order."""
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def record(blocks: dict[int, list[np.ndarray]], abstract: Any, shardings: Any,
           devices: Sequence[Any], shapes: list[tuple[int, ...]] | None = None
           ) -> dict[str, list[list[Any]]]:
    """{leaf name: [[index, crc32c], ...]} of the blocks this host writes.

    Args:
      blocks: {mesh position: [block of each leaf]} (``host_arrays.global_arrays``'s input).
      abstract, shardings: the state's pytree and shardings.
      devices: the mesh's devices, flat (positions index it).
      shapes: each leaf's global shape when not ``abstract``'s (PEC).
    """
    out: dict[str, list[list[Any]]] = {}
    leaves = jax.tree.leaves(abstract)
    for i, (name, leaf, sharding) in enumerate(zip(
            leaf_names(abstract), leaves, jax.tree.leaves(shardings), strict=True)):
        shape = tuple(leaf.shape if shapes is None else shapes[i])
        where = sharding.devices_indices_map(shape)
        seen: dict[Index, int] = {}
        for p in sorted(blocks):
            index = _index(where[devices[p]], shape)
            if index not in seen:
                seen[index] = _crc(blocks[p][i])
        out[name] = [[[list(d) for d in index], crc] for index, crc in seen.items()]
    return out


def write(directory: epath.Path, host: int, records: dict[str, list[list[Any]]]) -> None:
    (directory / CRC_FILE.format(host=host)).write_text(json.dumps(records))


def read(directory: epath.Path) -> dict[str, dict[Index, int]]:
    """Every host's records in ``directory``: {leaf name: {index: crc32c}}."""
    merged: dict[str, dict[Index, int]] = {}
    for path in sorted(directory.glob(_GLOB)):
        for name, entries in json.loads(path.read_text()).items():
            mine = merged.setdefault(name, {})
            for index, crc in entries:
                mine[tuple((int(a), int(b)) for a, b in index)] = int(crc)
    return merged


def verify(directory: epath.Path, state: Any, step: int | None) -> Verdict:
    """Checks ``state`` (restored from ``directory``) against the recorded
    CRC32Cs; raises ``PersistentChecksumError`` (carrying ``state``) at the
    first mismatch."""
    records = read(directory)
    if not records:
        log.info("persistent step %s records no CRC32C (written before 0.19): not checked", step)
        return Verdict(0, 0)
    checked = unchecked = 0
    for name, leaf in zip(leaf_names(state), jax.tree.leaves(state), strict=True):
        wanted = records.get(name)
        if not wanted or not isinstance(leaf, jax.Array):
            continue
        shards = {_index(s.index, leaf.shape): s for s in leaf.addressable_shards}
        for index, crc in wanted.items():
            holder = next((h for h in shards if _inside(index, h)), None)
            if holder is None:
                unchecked += 1
                continue
            local = tuple(slice(a - h[0], b - h[0]) for (a, b), h in zip(index, holder,
                                                                        strict=True))
            got = _crc(np.asarray(shards[holder].data)[local])
            checked += 1
            if got != crc:
                raise PersistentChecksumError(
                    f"persistent step {step}: leaf {name} shard {list(map(list, index))} has "
                    f"CRC32C {got:#010x}, {crc:#010x} recorded at save (persistent tier, "
                    f"{directory})", step, name, state)
    return Verdict(checked, unchecked)


def _inside(index: Index, holder: Index) -> bool:
    return len(index) == len(holder) and all(
        h0 <= a and b <= h1 for (a, b), (h0, h1) in zip(index, holder, strict=True))


@contextlib.contextmanager
def corruption_named(step: int | None, target: Any) -> Iterator[None]:
    """Turns a read that the storage layer found corrupt (TensorStore's
    ``DATA_LOSS``: a chunk or B-tree node that fails its own checksum or does
    not decode) into ``PersistentChecksumError`` for step ``step``, carrying a
    stand-in state of ``target``'s layout (zeros; None without a target) so a
    caller can finish its collectives before taking the verdict."""
    try:
        yield
    except (ValueError, OSError) as e:
        if "DATA_LOSS" not in str(e):
            raise
        raise PersistentChecksumError(
            f"persistent step {step}: its files are corrupt (the storage layer: "
            f"{str(e).splitlines()[0][:300]}) (persistent tier)", step, "",
            None if target is None else stand_in(target)) from e


def stand_in(target: Any) -> Any:
    """Zeros in ``target``'s layout (``jax.ShapeDtypeStruct`` leaves; other leaves kept)."""

    def zeros(leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        out = jnp.zeros(leaf.shape, leaf.dtype)
        sharding = getattr(leaf, "sharding", None)
        return out if sharding is None else jax.device_put(out, sharding)

    return jax.tree.map(zeros, target)
