"""Which leaves of a train state are expert leaves, and what a PEC version weighs.

* ``MoEShape``: what PEC needs of a model config;
* ``expert_leaf_axes`` / ``ExpertLeafRule``: the expert leaves (the experts'
  parameters and the optax moments that mirror them) and their MoE layer;
* ``leaf_steps``: the step each leaf is restored from under a ``RestorePlan``;
* ``state_bytes`` / ``pec_bytes`` / ``PecBytes``: the bytes a version moves
  for a given K.

Design choice: expert leaves are found by a naming rule on the *end* of each
leaf's path (block, MoE module, parameter name), so the optimizer's moments,
which mirror the parameters below their own prefix, are matched like the
parameters without knowing the optimizer. Alternative not taken: a list of
expert leaves declared by the model, which every optimizer's state tree
would have to be mapped onto again.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import numpy as np

from capricorn_jax._src.partial.selection import check_k
from capricorn_jax._src.partial.tracker import RestorePlan


class MoEShape(Protocol):
    """What PEC needs of a model config (``models.config.ModelConfig`` fits)."""

    num_experts: int
    top_k: int

    @property
    def moe_layers(self) -> tuple[int, ...]: ...


# --------------------------------------------------------------------------- state leaves


@dataclasses.dataclass(frozen=True)
class ExpertLeaf:
    """An expert leaf of the train state.

    Attributes:
      moe_layer: index of its MoE layer (0 .. len(cfg.moe_layers) - 1).
      axis: its experts axis (always the leading one).
    """

    moe_layer: int
    axis: int = 0


@dataclasses.dataclass(frozen=True)
class ExpertLeafRule:
    """How expert leaves are named (defaults: ``models.gpt``).

    A leaf is an expert leaf iff its path *ends* with
    ``(f"{block_prefix}{i}", moe_name, p)``, p in ``expert_params``; whatever
    comes before (``['params']``, or ``['opt_state'][1][0].mu``) does not
    matter, so the optax moments, which mirror the params tree below their own
    prefix, are matched like the parameters. Block i must be a MoE layer, and
    the leaf's leading axis must have num_experts entries (its experts axis).
    Everything else (router, scalar counts, rng, ...) is non-expert state.
    """

    block_prefix: str = "block"
    moe_name: str = "moe"
    expert_params: tuple[str, ...] = ("w_in", "w_out")


_KEY = re.compile(r"\['((?:[^'\\]|\\.)*)'\]|\[(-?\d+)\]|\.([A-Za-z_]\w*)")


def _path_names(path: str) -> tuple[str, ...]:
    """keystr path -> names: "['a'][1].mu" -> ("a", "1", "mu")."""
    names = tuple(next(g for g in m.groups() if g is not None) for m in _KEY.finditer(path))
    if "".join(m.group(0) for m in _KEY.finditer(path)) != path:
        raise ValueError(f"cannot parse leaf path {path!r} (expected jax.tree_util.keystr form)")
    return names


def _classify(path: str, shape: tuple[int, ...] | None, cfg: MoEShape,
              rule: ExpertLeafRule) -> ExpertLeaf | None:
    names = _path_names(path)
    if len(names) < 3 or names[-2] != rule.moe_name or names[-1] not in rule.expert_params:
        return None
    block = names[-3]
    index = block[len(rule.block_prefix):]
    if not block.startswith(rule.block_prefix) or not index.isdigit():
        return None
    if int(index) not in cfg.moe_layers:
        raise ValueError(f"leaf {path}: layer {index} is not a MoE layer {cfg.moe_layers}")
    if shape is not None and (len(shape) == 0 or shape[0] != cfg.num_experts):
        raise ValueError(f"leaf {path}: shape {shape} has no leading experts axis of "
                         f"{cfg.num_experts}")
    return ExpertLeaf(cfg.moe_layers.index(int(index)))


def _leaf_shapes(tree_or_paths: Any) -> list[tuple[str, tuple[int, ...] | None]]:
    if isinstance(tree_or_paths, list | tuple) and tree_or_paths and all(
            isinstance(p, str) for p in tree_or_paths):
        return [(p, None) for p in tree_or_paths]
    flat = jax.tree_util.tree_flatten_with_path(tree_or_paths)[0]
    return [(jax.tree_util.keystr(p), tuple(getattr(leaf, "shape", np.shape(leaf))))
            for p, leaf in flat]


def expert_leaf_axes(tree_or_paths: Any, cfg: MoEShape,
                     rule: ExpertLeafRule = ExpertLeafRule()) -> dict[str, ExpertLeaf | None]:
    """Which leaves of a state are expert leaves, and of which MoE layer.

    Args:
      tree_or_paths: a pytree of arrays or ShapeDtypeStructs (e.g. the
        trainer's abstract train state), or a list of leaf paths in
        ``jax.tree_util.keystr`` form (then shapes are not checked).
      cfg: the model config (num_experts, moe_layers).
      rule: the naming rule (see ExpertLeafRule).

    Returns:
      {path: ExpertLeaf, or None for a non-expert leaf}, in tree-flatten order
      (the paths are those of ``packing.LeafSlot.path``).
    """
    return {path: _classify(path, shape, cfg, rule)
            for path, shape in _leaf_shapes(tree_or_paths)}


def leaf_steps(plan: RestorePlan,
               leaves: Mapping[str, ExpertLeaf | None]) -> dict[str, int | np.ndarray]:
    """The step each leaf is restored from: an int for non-expert leaves, an
    int64 [N] vector along the experts axis for expert leaves (the plan's row
    of its MoE layer, shared by an expert's parameters and moments)."""
    return {path: plan.non_expert_step if info is None else plan.source[info.moe_layer].copy()
            for path, info in leaves.items()}


@dataclasses.dataclass(frozen=True)
class PecBytes:
    """Bytes of a train state split into expert and non-expert state.

    Attributes:
      non_expert: bytes of every non-expert leaf.
      expert: bytes of every expert leaf (parameters and moments, all layers).
      num_experts: experts per MoE layer.
    """

    non_expert: int
    expert: int
    num_experts: int

    @property
    def expert_fraction(self) -> float:
        return self.expert / (self.expert + self.non_expert)

    def per_version(self, k: int) -> int:
        """Bytes of one PEC version: non-expert + k/N of the expert bytes."""
        check_k(k, self.num_experts, 1)
        return self.non_expert + k * self.expert // self.num_experts


def state_bytes(tree: Any, cfg: MoEShape, rule: ExpertLeafRule = ExpertLeafRule()) -> PecBytes:
    """Splits the bytes of a state pytree (arrays or ShapeDtypeStructs)."""
    leaves = expert_leaf_axes(tree, cfg, rule)
    sizes = [math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
             for leaf in jax.tree_util.tree_leaves(tree)]
    expert = sum(s for s, info in zip(sizes, leaves.values(), strict=True) if info is not None)
    return PecBytes(sum(sizes) - expert, expert, cfg.num_experts)


def pec_bytes(tree: Any, cfg: MoEShape, k: int,
              rule: ExpertLeafRule = ExpertLeafRule()) -> int:
    """Bytes per PEC version with k experts per layer (see PecBytes.per_version)."""
    return state_bytes(tree, cfg, rule).per_version(k)
