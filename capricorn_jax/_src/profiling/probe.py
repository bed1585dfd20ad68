"""Collective timing: the all-to-all probe in a step, and an all-to-all alone.

Two ways to see what an MoE layer's all-to-alls cost, for two questions:

* ``CollectiveProbe``, a boundary hook for the bench's interference column:
  ordered per-device callbacks at the edges of every collective phase a model
  marks with ``collective_boundary`` (dispatch, combine; forward and
  backward), inside the real step, under whatever else the step does (the
  checkpoint chunks of a scheduled step). It includes the wait for the
  slowest peer and the callbacks' own cost: compare it across strategies.
* ``time_all_to_all``: one all-to-all of a buffer shape timed in isolation on
  the mesh, the estimate the layer profiler subtracts from a layer's
  duration (``Segment.collective_s``); the step's segments cannot see their
  collectives, which run inside the layer's ``shard_map``.

Design choice: each stamp takes one element of the buffer as operand and
returns a dummy the buffer is tied to (``tie``: a select on a flag that is
always False), so XLA cannot move it off its edge (as the profiler's marks;
see ``profiling.profiler``). Alternative not taken: timing the collectives from
the profiled step's segments, which hold the layer's compute too.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from capricorn_jax._src.profiling.layer_profile import BWD, FWD, Recorder


def probe_scalar(leaves: Sequence[jax.Array]) -> jax.Array:
    """A float32 scalar that depends on every (non-empty) leaf."""
    parts = [leaf.ravel()[0].astype(jnp.float32) for leaf in leaves if leaf.size]
    return functools.reduce(jnp.add, parts, jnp.zeros((), jnp.float32))


@dataclasses.dataclass(frozen=True)
class MarkKey:
    """A mark's recorder and key: called with the tag, it records in Python;
    an unordered mark of a recorder with native slots (``native_slot``, e.g.
    the threaded sender's ``WindowMarks``) is stamped by the native handler
    instead (``native.marks``): no host callback, no GIL."""

    recorder: Any
    name: str
    direction: str

    def __call__(self, tag: Any) -> np.ndarray:
        return self.recorder.record(self.name, self.direction, tag)


def emit_mark(callback: Callable, tag: jax.Array, ordered: bool) -> jax.Array:
    """The mark of ``callback`` on this device (inside a shard_map): a native
    stamp where ``callback`` is a ``MarkKey`` whose recorder gives it a slot
    (unordered marks only), else a host callback; a float32 scalar to tie the
    data to."""
    if isinstance(callback, MarkKey) and not ordered:
        slot = getattr(callback.recorder, "native_slot", None)
        where = slot(callback.name, callback.direction) if slot is not None else None
        if where is not None:
            from capricorn_jax._src.native import marks as native_marks

            return native_marks.emit(tag, *where)
    return io_callback(callback, jax.ShapeDtypeStruct((), jnp.float32), tag, ordered=ordered)


def tie(leaves: Sequence[jax.Array], result: jax.Array) -> list[jax.Array]:
    """``leaves`` unchanged bit for bit (-0.0 and NaN payloads included), but
    computed from ``result`` (a mark's float32 scalar): whatever consumes
    them runs after the mark. A select on a flag that is always False
    (``result > +inf``) whose other branch differs from the leaf, so XLA can
    neither fold it nor schedule the consumer first.

    Why not ``lax.optimization_barrier`` alone (this module's tie until
    2026-12-05): XLA:CPU removes the barrier before it schedules, so a mark
    on a collective's input ran *after* the collective (measured in the
    compiled step: both edges of every all-to-all stamped within 1 ms of each
    other, the collective inside the idle span before them), as it had
    hoisted the in-graph chunks' permutes (``scheduling.in_graph.executor``)."""
    never = result > jnp.inf
    return [jnp.where(never, ~leaf if leaf.dtype == jnp.bool_ else -leaf, leaf)
            for leaf in leaves]


def _stamp(tree: Any, callback: Callable, axes: tuple[str, ...], ordered: bool) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    device = jax.lax.axis_index(axes).astype(jnp.float32)
    tag = jnp.stack([device, probe_scalar(leaves)])
    result = emit_mark(callback, tag, ordered)
    return jax.tree.unflatten(treedef, tie(leaves, result))


def both_passes(x: Any, forward: Callable[[Any], Any], backward: Callable[[Any], Any]) -> Any:
    """``forward(x)`` in the forward pass; in the backward pass the cotangent
    goes through ``backward`` (both value-preserving: marks)."""
    @jax.custom_vjp
    def ident(y):
        return forward(y)

    def fwd(y):
        return forward(y), None

    def bwd(_, g):
        return (backward(g),)

    ident.defvjp(fwd, bwd)
    return ident(x)


def edge_marked(x: Any, axes: tuple[str, ...], forward: Callable | None,
                backward: Callable | None, ordered: bool = True) -> Any:
    """``x`` (a per-device buffer inside a ``shard_map`` over ``axes``) tied to
    a host callback ``forward(tag)`` in the forward pass and, on its
    cotangent, ``backward(tag)`` in the backward pass (tag: float32[2],
    device index and a probe of the data); None: that pass is not marked.
    ``ordered``: see ``profiler.mark``."""
    def marker(callback: Callable | None) -> Callable[[Any], Any]:
        if callback is None:
            return lambda y: y
        return lambda y: _stamp(y, callback, axes, ordered)

    return both_passes(x, marker(forward), marker(backward))


class CollectiveProbe:
    """A hook that times the collective phases a model marks with
    ``collective_boundary`` (the MoE all-to-alls), in the forward and the
    backward pass, on every device: the interference probe.

    It adds no layer-boundary marks (``__call__`` is the identity). At each
    phase edge an ordered per-device callback stamps the time, tied to the
    buffer by data dependency (as the profiler's marks are); in the backward
    pass the same edges are stamped on the cotangents, where the transposed
    collective runs from the ``end`` edge to the ``begin`` edge.
    ``phase_seconds`` turns one step's stamps into the time of each phase.
    """

    def __init__(self, recorder: Recorder | None = None) -> None:
        self.recorder = recorder or Recorder()

    def __call__(self, x: Any, name: str) -> Any:
        del name
        return x

    def collective(self, x: Any, name: str, phase: str, axes: tuple[str, ...]) -> Any:
        return edge_marked(x, axes, functools.partial(self.recorder.record, name, f"{FWD}:{phase}"),
                           functools.partial(self.recorder.record, name, f"{BWD}:{phase}"))

    def step_record(self) -> StepCollectives:
        """What the one step stamped since the last call (forgets its stamps):
        each phase's time (as ``phase_seconds``), each MoE layer's expert
        span per direction (from the dispatch's end to the combine's start in
        the forward pass; in the backward pass from the transposed combine's
        end to the transposed dispatch's start: the layer's idle link, the
        slowest device's) and when the step's last collective ended (the
        latest stamp, ``time.perf_counter``), from which the bench measures
        the step's closing gradient all-reduce."""
        times = self.recorder.drain()
        return StepCollectives(_phases(times), _expert_spans(times),
                               max(times.values(), default=None))

    def phase_seconds(self) -> dict[tuple[str, str, str], float]:
        """{(layer, direction, collective): seconds} of the one step stamped
        since the last call (forgets its stamps): per device the time from the
        phase's first edge to its second in that direction, the slowest
        device's. A phase missing an edge on some device is left out."""
        return _phases(self.recorder.drain())


@dataclasses.dataclass(frozen=True)
class StepCollectives:
    """One step's collective times (``CollectiveProbe.step_record``).

    Attributes:
      phases: {(layer, direction, collective): seconds}.
      expert_spans: {(layer, direction): seconds} between a layer's two
        all-to-alls (its experts' compute).
      last_edge: ``time.perf_counter`` of the step's last stamp (None: none).
    """

    phases: dict[tuple[str, str, str], float]
    expert_spans: dict[tuple[str, str], float]
    last_edge: float | None


def _phases(times: dict[tuple[str, str, int], float]) -> dict[tuple[str, str, str], float]:
    """Per (layer, direction, collective) its time: per device from its first
    edge to its second, the slowest device's (a phase missing an edge on some
    device left out)."""
    out: dict[tuple[str, str, str], float] = {}
    for (name, key, device), t in times.items():
        direction, phase = key.split(":", 1)
        collective, edge = phase.rsplit(".", 1)
        other = times.get((name, f"{direction}:{collective}."
                           f"{'end' if edge == 'begin' else 'begin'}", device))
        if edge != "begin" or other is None:
            continue
        seconds = abs(other - t)
        k = (name, direction, collective)
        out[k] = max(out.get(k, 0.0), seconds)
    return out


def _expert_spans(times: dict[tuple[str, str, int], float]) -> dict[tuple[str, str], float]:
    """Per (layer, direction) the span between its dispatch and its combine
    (``CollectiveProbe.step_record``), the slowest device's; a layer missing
    an edge on some device left out."""
    # (opening edge, closing edge) per direction: the backward pass runs the
    # transposed combine first, from its end edge to its begin edge.
    edges = {FWD: ("dispatch.end", "combine.begin"), BWD: ("combine.begin", "dispatch.end")}
    out: dict[tuple[str, str], float] = {}
    for (name, key, device), t in times.items():
        direction, phase = key.split(":", 1)
        opening, closing = edges.get(direction, ("", ""))
        if phase != opening:
            continue
        close = times.get((name, f"{direction}:{closing}", device))
        if close is None:
            continue
        out[(name, direction)] = max(out.get((name, direction), 0.0), close - t)
    return out


def time_all_to_all(
    mesh: Mesh, axis: str, buffer: jax.ShapeDtypeStruct, repeats: int = 5, chain: int = 10
) -> float:
    """Median seconds of one tiled all-to-all of ``buffer`` per device over ``axis``.

    The buffer is split on its leading dimension into ``mesh.shape[axis]``
    pieces, as GPTMoE's dispatch and combine do; every device of the mesh takes
    part (the other axes run independent all-to-alls), as in the step. The
    dispatch overhead is removed by timing programs of 1 and 1 + ``chain``
    dependent all-to-alls and dividing the difference by ``chain``.
    """
    axes = tuple(mesh.axis_names)
    spec = P(axes)
    shape = (buffer.shape[0] * mesh.size, *buffer.shape[1:])
    x = jax.device_put(jnp.zeros(shape, buffer.dtype), jax.sharding.NamedSharding(mesh, spec))

    def program(n: int) -> Callable:
        def body(b: jax.Array) -> jax.Array:
            return jax.lax.fori_loop(
                0, n, lambda _, v: jax.lax.all_to_all(v, axis, 0, 0, tiled=True), b
            )

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))

    return _per_op_s(program, (x,), repeats, chain)


def _per_op_s(program: Callable[[int], Callable], args: tuple, repeats: int,
              chain: int) -> float:
    """Seconds of one op: the median time of ``program(1 + chain)`` (a chain
    of that many dependent ops) less ``program(1)``'s, over ``chain``; each
    program run once untimed first (its compile)."""
    def median_s(fn: Callable) -> float:
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    one, many = median_s(program(1)), median_s(program(1 + chain))
    return max(0.0, (many - one) / chain)


def time_all_reduce(mesh: Mesh, buffers: Sequence[jax.ShapeDtypeStruct], repeats: int = 5,
                    chain: int = 10) -> float:
    """Median seconds of one all-reduce (a sum over every device of ``mesh``)
    of ``buffers``, each one device's (e.g. the gradients of the parameters
    every device holds), reduced together as XLA combines a step's gradient
    all-reduces. As ``time_all_to_all``: programs of 1 and 1 + ``chain``
    dependent reductions, the difference over ``chain``. 0 for no buffers.
    """
    if not buffers:
        return 0.0
    axes = tuple(mesh.axis_names)
    spec = P(axes)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    xs = tuple(jax.device_put(jnp.zeros((b.shape[0] * mesh.size, *b.shape[1:]) if b.shape
                                        else (mesh.size,), b.dtype), sharding)
               for b in buffers)

    def program(n: int) -> Callable:
        def body(*bs: jax.Array) -> tuple[jax.Array, ...]:
            return jax.lax.fori_loop(0, n, lambda _, v: jax.lax.psum(v, axes), bs)

        # check_vma=False: a psum's result is the same on every device, and
        # the loop carries it back in as each device's own buffer.
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(xs),
                                     out_specs=(spec,) * len(xs), check_vma=False))

    return _per_op_s(program, xs, repeats, chain)
