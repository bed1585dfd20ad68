"""Partial expert checkpointing in the persistent tier (MoC-System's two-level
PEC, K_persist <= K): the records of persisted steps, and restores from them.

* **what a persisted step holds.** The background reader assembles, from this
  host's own store, the state a memory-tier restore to version ``step`` gives
  (``memory_read.read_pec_blocks``). With ``PecOptions.k_persist`` None (= N)
  the step is that whole state, a standard step plain Orbax restores. With
  K_persist < N it keeps, of every MoE layer, the K_persist experts of
  ``plans.persist_mask``: per expert-parallel rank the K_persist/R whose
  newest *persisted* copy is oldest (a round robin with no counter:
  ceil(N/K_persist) consecutive persisted steps carry every expert, so the
  experts of a failed step are carried within the next ceil(N/K_persist)),
  ties to the freshest values in memory. An expert leaf [N, ...] is written
  as [K_persist, ...], the carried experts in ascending order, sharded like
  the full leaf (so K_persist must be a multiple of R); non-expert leaves are
  written whole. The first persisted step (no expert has a copy yet) carries
  every expert.
* **the record.** ``PecSteps.decide`` decides the step in the training thread
  (collective: every host takes the primary host's experts) and the manager
  stores it in the step's custom metadata under ``capricorn_pec``: the
  experts carried, the training step of each one's values (``data_step``,
  possibly older than the step), the cumulative assignments of the memory
  tier's ``PecTier`` (the PLT of a restore is a difference of those counts),
  the memory tracker, and the PLT a restore of this step would have when
  written (also in the manager's ``last_persist`` and the ``persist`` event).
* **restore.** A PEC step is restored (``restore_step``) by
  ``plans.persisted_plan``: non-expert state from the step, each expert from
  its newest persisted copy at or before it (parameters and moments from that
  one step): every needed step is read with Orbax placeholders for the leaves
  it does not give, and the expert leaves are gathered in one jitted program
  into the target's sharding (``assemble``). ``RestoreInfo.pec`` reports the
  sources, the data steps and the PLT; a PEC memory tier goes on from the
  restored step with no expert in memory yet (its next version is full) and
  the restore's losses (``resume_memory_tier``).
* **retention.** Orbax's policy (``max_to_keep``, ``keep_period``...) is
  extended: a step that holds some expert's newest persisted copy is never
  deleted (``KeepNewestCopies``, an ``AnyPreservationPolicy`` member, which
  applies ``retention.versions_to_keep``, the keep rule of every store), so
  the newest step always restores. With a constant K_persist that is at most
  ceil(N/K_persist) steps beyond ``max_to_keep``.

Alternative not taken: persisting K_persist of the experts the version itself
carries (a subset of its K), as in MoC-System's buffer rotation. The memory
tier already holds a copy of every expert, and the experts a version carries
follow the memory tier's own round robin, so with ``persist_every`` a multiple
of N/K the same experts would be persisted every time and others never.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from capricorn_jax._src.memory.tier import retention
from capricorn_jax._src.memory.tier.reader import TierReader
from capricorn_jax._src.memory.tier.restore_info import PecRestore
from capricorn_jax._src.multihost.agree import allgather_json
from capricorn_jax._src.partial.plans import (
    PersistedPlan,
    mask_from_hex,
    mask_to_hex,
    newest_copies,
    persist_mask,
    persisted_needs,
    persisted_plan,
)
from capricorn_jax._src.partial.tracker import PltTracker

log = logging.getLogger("capricorn_jax")

PEC_METADATA = "capricorn_pec"  # key of a PEC step's record in the step's custom metadata
_PEC_FORMAT = 1

Copies = dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]
"""{persisted step: (experts carried, assignments at their values, the training
step of their values)} (``plans.persisted_plan``'s copies)."""

ReadStep = Callable[[int, Any], tuple[Any, dict[str, Any]]]
"""Reads one persistent step into a target tree (``ocp.PLACEHOLDER`` leaves are
not read): (state, this host's host state)."""


class PecSteps:
    """The PEC records of a manager's persistent steps (read once, then cached).

    Args:
      custom_metadata: the custom metadata of a persistent step (the
        manager's ``metadata(step).custom_metadata``); may raise for a step
        being deleted or damaged.
    """

    def __init__(self, custom_metadata: Callable[[int], Mapping[str, Any] | None]):
        self._custom_metadata = custom_metadata
        self._records: dict[int, dict[str, Any] | None] = {}

    def remember(self, step: int, record: dict[str, Any]) -> None:
        """Caches the record of a step being written (its metadata is not yet)."""
        self._records[step] = record

    def forget(self, step: int | None) -> None:
        """Drops the record of a step whose save failed or did not start."""
        if step is not None:
            self._records.pop(step, None)

    def record_of(self, step: int) -> dict[str, Any] | None:
        """The PEC record of persistent step ``step`` (its custom metadata), None
        for a step without one (written without PEC) or unreadable."""
        if step in self._records:
            return self._records[step]
        try:
            custom = self._custom_metadata(step) or {}
        except Exception as e:  # noqa: BLE001 - a step being deleted, or damaged
            log.warning("persistent step %d: no readable metadata (%s: %s); taken as a step "
                        "without PEC", step, type(e).__name__, e)
            return None
        record = custom.get(PEC_METADATA)
        if record is not None and record.get("format") != _PEC_FORMAT:
            raise ValueError(f"persistent step {step}: unknown PEC record format "
                             f"{record.get('format')!r}")
        self._records[step] = record
        return record

    def copies(self, steps: list[int]) -> Copies:
        """The ``Copies`` of those of ``steps`` that have a PEC record."""
        out = {}
        for step in steps:
            record = self.record_of(step)
            if record is not None:
                shape = tuple(record["shape"])
                out[step] = (mask_from_hex(record["mask"], shape),
                             np.asarray(record["at_copy"], np.int64),
                             np.asarray(record["data_step"], np.int64))
        return out

    def decide(self, step: int, ckpt: TierReader, earlier: list[int]
               ) -> dict[str, Any]:
        """Decides the PEC record of persistent step ``step`` (collective).

        The experts it carries (``plans.persist_mask`` over the newest copies
        of the ``earlier`` committed steps, as the primary host sees them:
        every host takes its decision), the training step and the cumulative assignments of each
        carried expert's values (the memory tier's tracker at ``step``), and
        the PLT a restore from the persistent tier would have once it is written.

        Raises:
          ValueError: version ``step`` is not the memory tier's newest on some host.
        """
        tier = ckpt.pec
        assert tier is not None, "a PEC record is decided only for a memory tier under PEC"
        tracker, shape = tier.tracker, tier.shape
        k = tier.dyn.options.k_persist or shape[1]
        copies = self.copies(earlier)
        newest = newest_copies({s: c[0] for s, c in copies.items()}, shape)
        mask = persist_mask(k, newest, tier.ranks, fresh=tracker.saved_step)
        problem = ""
        if tracker.step != step:
            problem = (f"host {ckpt.host}: persistent step {step} under PEC is written from the "
                       f"memory tier's newest version, which is {tracker.step}")
        everyone = allgather_json({"problem": problem, "mask": mask_to_hex(mask)})
        problems = [e["problem"] for e in everyone if e["problem"]]
        if problems:
            raise ValueError("; ".join(problems))
        mask = mask_from_hex(everyone[0]["mask"], shape)
        cumulative = tier.cumulative
        data_step = np.where(mask, tracker.saved_step, -1)
        at_copy = np.where(mask, cumulative - tracker.since_save, -1)
        tokens = step * tier.tokens_per_step
        plan = persisted_plan({**copies, step: (mask, at_copy, data_step)}, step,
                              cumulative, tracker.restored_lost, tokens, tracker.top_k)
        paths = jax.tree_util.tree_flatten_with_path(ckpt.abstract_state)[0]
        return {
            "format": _PEC_FORMAT, "step": step, "k_persist": int(mask.sum(axis=1).max()),
            "experts": [np.flatnonzero(row).tolist() for row in mask],
            "shape": list(shape), "mask": mask_to_hex(mask), "ranks": tier.ranks,
            "data_step": data_step.tolist(), "at_copy": at_copy.tolist(),
            "cumulative": cumulative.tolist(), "tracker": tracker.to_dict(),
            "memory_k": tier.k, "tokens": tokens, "plt": plan.plt,
            "accumulated_plt": plan.accumulated_plt, "source": plan.source.tolist(),
            "expert_leaves": {jax.tree_util.keystr(path): layer
                              for (path, _), layer in zip(paths, tier.layers, strict=True)
                              if layer is not None},
        }

    def keep_policy(self, shape: tuple[int, int]) -> KeepNewestCopies:
        """The preservation policy that keeps what a restore of the newest step reads."""
        return KeepNewestCopies(self, shape)


class KeepNewestCopies:
    """An Orbax preservation policy: keeps every persistent step that holds some
    expert's newest persisted copy (a restore of the newest step reads them):
    ``retention.versions_to_keep`` of the steps' needs, the newest step safe
    (it is committed), no lag window."""

    def __init__(self, steps: PecSteps, shape: tuple[int, int]):
        self.steps, self.shape = steps, shape

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        del context
        steps = [info.step for info in checkpoints]
        masks = {s: c[0] for s, c in self.steps.copies(steps).items()}
        needs = persisted_needs(masks, self.shape)
        keep = retention.versions_to_keep(needs, max(needs, default=-1), window=0)
        return [s in keep for s in steps]


def restore_step(step: int, record: dict[str, Any], copies: Copies, abstract: Any,
                 read: ReadStep) -> tuple[Any, dict[str, Any], PecRestore, PersistedPlan]:
    """Restores PEC persistent step ``step``: (state, host state, what came from
    where, the plan).

    A step that carries every expert is read as a standard full step; one that
    carries some is assembled (``assemble``) from the steps holding each
    expert's newest copy at or before it (``copies`` must hold them).
    """
    tracker = PltTracker.from_dict(record["tracker"])
    plan = persisted_plan(copies, step, record["cumulative"], tracker.restored_lost,
                          record["tokens"], tracker.top_k)
    needed = sorted({*(int(s) for s in np.unique(plan.source)), step})
    if needed == [step]:  # the step carries every expert: a standard full step
        state, host_state = read(step, abstract)
    else:
        if abstract is None:
            raise ValueError(f"persistent step {step} carries some experts only; restoring "
                             f"it needs CapricornRestore(abstract_state) (or a handler with "
                             f"an InMemoryCheckpointer)")
        state, host_state = assemble(step, needed, plan, record, copies, abstract, read)
    info = PecRestore(plan.plt, plan.accumulated_plt, plan.source.tolist(), needed,
                      int(record["k_persist"]), plan.data_step.tolist())
    return state, host_state, info, plan


def assemble(point: int, needed: list[int], plan: PersistedPlan, record: dict[str, Any],
             copies: Copies, abstract: Any, read: ReadStep) -> tuple[Any, dict[str, Any]]:
    """The state of a restore to ``point`` from several persisted steps.

    Step ``point`` gives every non-expert leaf; each needed step gives the
    carried experts that are the newest copies (its other leaves are not
    read: Orbax placeholders). Each expert leaf is then gathered, in one
    jitted program, from the rows of those steps into the target's sharding:
    an expert's parameters and moments come from one step, its source.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    paths = [jax.tree_util.keystr(path) for path, _ in flat]
    targets = [leaf for _, leaf in flat]
    layer_of = {path: int(layer) for path, layer in record["expert_leaves"].items()}
    unknown = sorted(set(layer_of) - set(paths))
    if unknown:
        raise ValueError(f"restore target has no leaf {unknown[0]}, an expert leaf of "
                         f"persistent step {point}")
    base: list[Any] = []
    host_state: dict[str, Any] = {}
    pieces: dict[str, list[tuple[Any, np.ndarray, int]]] = {path: [] for path in layer_of}
    for v in [point, *(s for s in needed if s != point)]:
        mask = copies[v][0]

        def target(path: str, leaf: Any, v: int = v, mask: np.ndarray = mask) -> Any:
            if path not in layer_of:
                return leaf if v == point else ocp.PLACEHOLDER
            layer = layer_of[path]
            if not np.any(plan.source[layer] == v):
                return ocp.PLACEHOLDER
            shape = (int(mask[layer].sum()), *leaf.shape[1:])
            return jax.ShapeDtypeStruct(shape, leaf.dtype,
                                        sharding=_fitting(getattr(leaf, "sharding", None),
                                                          shape))

        tree = jax.tree.unflatten(treedef, [target(p, leaf)
                                            for p, leaf in zip(paths, targets, strict=True)])
        restored, restored_host_state = read(v, tree)
        # jaxlib's PyTreeDef comes from a compiled module without stubs.
        leaves = treedef.flatten_up_to(restored)  # type: ignore[attr-defined]
        if v == point:
            base, host_state = leaves, restored_host_state
        for n, path in enumerate(paths):
            if path in layer_of and leaves[n] is not ocp.PLACEHOLDER:
                pieces[path].append((leaves[n], np.flatnonzero(mask[layer_of[path]]), v))
    index: dict[str, np.ndarray] = {}
    for path, parts in pieces.items():
        row = plan.source[layer_of[path]]
        index[path], offset = np.full(row.shape, -1, np.int64), 0
        for _, carried, v in parts:
            take = row[carried] == v
            index[path][carried[take]] = offset + np.flatnonzero(take)
            offset += carried.size
        assert np.all(index[path] >= 0), path
    shardings = {p: getattr(t, "sharding", None) for p, t in zip(paths, targets, strict=True)
                 if p in layer_of}
    if all(sh is not None for sh in shardings.values()):
        gather = jax.jit(lambda arrays: {p: jnp.concatenate(arrays[p])[index[p]]
                                         for p in arrays}, out_shardings=shardings)
        experts = gather({p: [a for a, _, _ in parts] for p, parts in pieces.items()})
    else:  # a target without shardings restores numpy arrays
        experts = {p: np.concatenate([np.asarray(a) for a, _, _ in parts])[index[p]]
                   for p, parts in pieces.items()}
    leaves = [experts[p] if p in layer_of else base[n] for n, p in enumerate(paths)]
    return jax.tree.unflatten(treedef, leaves), host_state


def resume_memory_tier(ckpt: TierReader | None, step: int,
                       record: dict[str, Any] | None, plan: PersistedPlan | None) -> None:
    """A PEC memory tier goes on from persistent step ``step``: no copy of any
    expert in memory yet (its next version carries all), the losses of the
    restores so far, and the cumulative assignments at ``step``."""
    if ckpt is None or ckpt.pec is None:
        return
    tier = ckpt.pec
    tracker = PltTracker(*tier.shape, tier.tracker.top_k, step)
    k = cumulative = None
    if record is not None:
        assert plan is not None, "a PEC record is resumed with the plan restored from it"
        before = PltTracker.from_dict(record["tracker"])
        tracker.restored_lost[:] = before.restored_lost + plan.lost
        k, cumulative = int(record["memory_k"]), record["cumulative"]
    ckpt.resume_pec(tracker, k, cumulative)


def _fitting(sharding: Any, shape: tuple[int, ...]) -> Any:
    """``sharding`` if it can hold an array of ``shape``, else the same devices, replicated."""
    if sharding is None:
        return None
    try:
        sharding.shard_shape(shape)
        return sharding
    except ValueError:
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
        devices = np.array(sorted(sharding.device_set, key=lambda d: d.id))
        return NamedSharding(Mesh(devices, ("devices",)), PartitionSpec())
