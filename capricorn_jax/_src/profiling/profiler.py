"""Layer-level online profiler: an instrumented variant of the train step.

Every layer boundary, in the forward and in the backward pass, emits an
ordered host callback (``io_callback(..., ordered=True)``) that records
``time.perf_counter()`` on the host; the step's start and end are marked the
same way. From the timestamps a ``LayerProfile`` gives, per layer and
direction, the wall time between consecutive boundaries.

How a mark stays where it belongs. A callback whose operand does not depend on
the layer output is moved by XLA (measured: all of them ran at the end of the
step). Each mark therefore (1) takes as operand one element of the boundary's
activation, a true data dependency, so it cannot run before the layer is done,
and (2) returns a dummy scalar the activation is tied to (``probe.tie``: a
select on an always-False flag; ``lax.optimization_barrier`` alone did not
hold on XLA:CPU), so whatever consumes the activation waits for the mark,
which pins it before the next layer. The backward marks come from a
``custom_vjp`` identity at the boundary whose bwd marks the incoming cotangent
the same way. The values are untouched: the profiled step computes bitwise
what the plain step computes (tested on CPU).

Per device, not per program. In a jit over a multi-device mesh with automatic
sharding, an ordered callback gets a MAXIMAL sharding: XLA gathers the operand
onto the first device of the assignment and runs the callback once, there
(with a full activation as operand it printed "Involuntary full
rematerialization"); on several processes only the process owning that device
would see it. Each mark here runs instead inside a ``shard_map`` over all mesh
axes (callbacks are allowed there when every axis is manual), so it fires once
per device, in the process owning the device, on that device's shard, with no
collective added. The recorder keeps the first timestamp per (boundary,
direction, device) (robust to a transform that replays a mark); the step
starts on this host when its first local device starts, and a boundary is
passed when its *last* local device passed it. Alternative not taken: marks on
a replicated reduction of the activation (``jnp.sum``), which would add an
all-reduce, i.e. a barrier across all devices, at every boundary. Measured
(jax 0.10.2, CPU): ``jax.debug.callback(ordered=True)`` is refused in a jit
over more than one device ("ordered effects are not supported for more than 1
device"), io_callback's ordered effect is allowed; with 2 processes x 2
devices each process recorded the marks of exactly its 2 devices. The device
of a mark is its position in the mesh (``axis_index`` over all axes).

Cost. Each callback goes through JAX's io_callback path (its operand is
device_put to a CPU device): ~0.5 ms per mark over 4 CPU devices, so the
callback carries one float32[2] operand (device, probe) that the recorder
reads only after the step. The barriers and shard_maps alone cost nothing
measurable; the plain variant has no callback in its HLO (tested).

Segments. With boundaries b0..b{L-1} (one per ``layer_boundary`` call, in trace
order) the step is cut into ``(b_i, "fwd")`` = layer i's forward (b0's also
holds the embedding), ``("head", "fwd")`` = the output head and loss, forward
*and* backward, ``(b_i, "bwd")`` for i >= 1 = layer i's backward, and
``("tail", "bwd")`` = layer 0's backward, the embedding's backward and the
optimizer update (no boundary separates them). Work that XLA schedules past a
mark (e.g. a weight gradient not needed by the next cotangent) is counted in
the later segment.

Collective time. The all-to-alls of an MoE layer run inside its ``shard_map``,
where the model has no boundary, so their time cannot be read off the marks.
When the caller names each layer's all-to-all buffers (``collectives``: the
model knows them, the library does not), each one is timed *in isolation*
(``probe.time_all_to_all``) on the same mesh axis and the layer's
``collective_s`` is that estimate (the forward runs the all-to-alls, the
backward their transposes, the same shapes); ``compute_s`` is the measured
duration minus it, so waiting for a slower peer counts as compute. Without
``collectives`` both are None. The gradient all-reduce of the parameters
every device holds runs after the last boundary's backward mark (XLA:CPU's
schedule of the tiny 2x2 step: one combined all-reduce after layer 0's
backward); given its buffers (``reductions``) it is timed the same way and
added to the TAIL segment's estimate.

Idle spans. The profiled step also marks every edge of the collectives a
model marks with ``collective_boundary`` (the MoE all-to-alls: dispatch and
combine, forward and backward), inside the model's ``shard_map``, ordered
with the boundary marks. Each segment then has its idle spans
(``Segment.spans``): the times between one collective's end and the next
one's begin, each with the collective that closes it, measured in the step.
A window opened at a layer boundary is not idle from its start: a layer's
backward begins with the combine's transposed all-to-all, so bytes sent at
the boundary meet it on the link (measured in the emulated 2x2 runs: the
backward combines took 15 -> 31 ms and 23 -> 41 ms under capricorn's
boundary windows). The threaded sender opens span windows at those edges.
An MoE layer costs 4 marks more per direction (2 per all-to-all).

The marks' own cost. A mark (a host callback per device) costs ~0.5 ms on
4 CPU devices, inside the segments it bounds: the time between two marks
holds the rest of one callback and the start of the next. ``time_marks``
measures it once per trainer (a chain of marks against the same chain
without them, on the trainer's mesh) and every segment is its marks' gap
less that cost (``LayerProfile.mark_cost_s``), so a plan sizes its windows
on the step without its marks. Alternative not taken: a second mark right
after each mark (their gap is one mark's cost in the step itself), which
doubles the profiled step's callbacks.

Caching. ``make_profiled_step`` keeps the variants and the all-to-all timings
of a trainer in a weak mapping keyed by the trainer, so they live and die
with it and nothing is written on the caller's object. Alternative not
taken: attributes set on the trainer (``vars(trainer)``), which made the
library's cache part of a class it does not own.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from capricorn_jax._src.profiling.layer_profile import (
    BWD,
    END,
    FWD,
    START,
    STEP,
    LayerProfile,
    Recorder,
    build_profile,
    opens_span,
)
from capricorn_jax._src.profiling.probe import (
    MarkKey,
    both_passes,
    edge_marked,
    emit_mark,
    probe_scalar,
    tie,
    time_all_reduce,
    time_all_to_all,
)

if TYPE_CHECKING:
    from capricorn_jax._src.profiling.train_step import TrainStep


class MarkSink(Protocol):
    """The host side of a mark: ``Recorder`` (timestamps), or another sink of
    the marks (the threaded scheduler's window marks count them)."""

    def record(self, name: str, direction: str, tag: Any) -> np.ndarray: ...


def mark(tree: Any, specs: Any, mesh: Mesh, recorder: MarkSink, name: str, direction: str,
         ordered: bool = True) -> Any:
    """Emits a per-device ordered callback that depends on ``tree``; returns it.

    Args:
      tree: a pytree of arrays sharded over ``mesh``.
      specs: a PartitionSpec per leaf of ``tree`` (a matching pytree), the
        leaves' current shardings, so the shard_map moves no data.
      mesh: the mesh; the callback runs once per device of it.
      recorder: where the callback stamps (name, direction, device, time).
      name, direction: the mark's key.
      ordered: an ordered callback (the profiler's: the marks of a step in
        program order); unordered, only the data dependency places it.

    Returns:
      ``tree``, unchanged in value, tied to the callback's result so its
      consumers run after the callback.
    """
    leaves, treedef = jax.tree.flatten(tree)
    # jaxlib's PyTreeDef comes from a compiled module without stubs.
    flat_specs = treedef.flatten_up_to(specs)  # type: ignore[attr-defined]
    axes = tuple(mesh.axis_names)
    callback = MarkKey(recorder, name, direction)

    def body(*local: jax.Array) -> tuple[jax.Array, ...]:
        device = jax.lax.axis_index(axes).astype(jnp.float32)  # exact below 2**24
        tag = jnp.stack([device, probe_scalar(local)])  # one operand: one transfer
        result = emit_mark(callback, tag, ordered)
        return tuple(tie(local, result))

    # check_vma=False: a replicated leaf (spec P()) passes through unchanged,
    # so it is still replicated on the way out.
    out = jax.shard_map(
        body, mesh=mesh, in_specs=tuple(flat_specs), out_specs=tuple(flat_specs),
        check_vma=False,
    )(*leaves)
    return jax.tree.unflatten(treedef, out)


def time_marks(mesh: Mesh, marks: int = 8, repeats: int = 5) -> float:
    """Seconds one ordered mark adds to a program on ``mesh`` (at least 0).

    Times, alternating, a jitted chain of ``marks`` marks (``mark``, as the
    profiled step places them: per device, ordered, tied to the data) on a
    small array sharded over every device, and the same chain without them;
    the median difference over ``repeats`` rounds (after one untimed round
    that compiles both), per mark. A collective in the mesh's sense: every
    process calls it at the same point (each times its own devices).
    """
    if marks < 1 or repeats < 1:
        raise ValueError(f"time_marks needs marks >= 1 and repeats >= 1, got {marks}, {repeats}")
    axes = tuple(mesh.axis_names)
    spec = P(axes)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    x = jax.make_array_from_callback((mesh.size, 8), sharding,
                                     lambda index: np.zeros((mesh.size, 8), np.float32)[index])
    sink = Recorder()

    def chain(marked: bool) -> Callable[[jax.Array], jax.Array]:
        def body(y: jax.Array) -> jax.Array:
            for i in range(marks):
                if marked:
                    y = mark(y, spec, mesh, sink, f"calibration{i}", FWD)
                y = y + 1.0
            return y
        return jax.jit(body, in_shardings=sharding, out_shardings=sharding)

    programs = {"plain": chain(False), "marked": chain(True)}
    times: dict[str, list[float]] = {"plain": [], "marked": []}
    for round_ in range(repeats + 1):
        for name in (("plain", "marked") if round_ % 2 else ("marked", "plain")):
            t0 = time.perf_counter()
            jax.block_until_ready(programs[name](x))
            if round_:
                times[name].append(time.perf_counter() - t0)
    sink.clear()
    extra = statistics.median(times["marked"]) - statistics.median(times["plain"])
    return max(0.0, extra / marks)


class ProfileHook:
    """The boundary hook of the profiled variant: fwd and bwd marks.

    The activation is assumed sharded on its leading (batch) dimension over
    all mesh axes, as GPTMoE's is; other leaves of a pytree activation too.
    ``sites``: only these (name, direction) marks (None: all); ``ordered``:
    see ``mark``. ``edges``: the collective edges it marks too
    (``collective_boundary``, keyed (layer, "fwd:dispatch.begin")): None,
    none; ``"all"``, every edge (the profiled step: a segment's idle spans
    between its collectives, ``Segment.spans``); ``"opening"``, the edges
    that open an idle span (``layer_profile.opens_span``: the threaded
    sender's span windows).
    """

    def __init__(self, mesh: Mesh, recorder: MarkSink,
                 sites: frozenset[tuple[str, str]] | None = None, ordered: bool = True,
                 edges: str | None = None) -> None:
        if edges not in (None, "all", "opening"):
            raise ValueError(f"ProfileHook edges must be None, 'all' or 'opening', got {edges!r}")
        self.mesh, self.recorder = mesh, recorder
        self.sites, self.ordered, self.edges = sites, ordered, edges
        self.names: list[str] = []  # boundaries in forward (trace) order

    def _specs(self, x: Any) -> Any:
        size = self.mesh.size

        def spec(leaf: jax.Array) -> P:
            if leaf.ndim == 0 or leaf.shape[0] % size:
                raise ValueError(
                    f"profiler: a boundary activation of shape {leaf.shape} cannot be split "
                    f"over the {size} devices on its leading dimension"
                )
            return P(tuple(self.mesh.axis_names))

        return jax.tree.map(spec, x)

    def __call__(self, x: Any, name: str) -> Any:
        if name not in self.names:
            self.names.append(name)
        specs = self._specs(x)
        mesh, rec, sites, ordered = self.mesh, self.recorder, self.sites, self.ordered

        def marker(direction: str) -> Callable[[Any], Any]:
            if sites is not None and (name, direction) not in sites:
                return lambda y: y
            return lambda y: mark(y, specs, mesh, rec, name, direction, ordered)

        return both_passes(x, marker(FWD), marker(BWD))

    def collective(self, x: Any, name: str, phase: str, axes: tuple[str, ...]) -> Any:
        """Marks the edges of a collective phase as ``edges`` says (inside the
        model's ``shard_map``; see the class docstring)."""
        if self.edges is None:
            return x

        def callback(direction: str) -> Callable | None:
            edge = f"{direction}:{phase}"
            if self.edges == "opening" and not opens_span(edge):
                return None
            return MarkKey(self.recorder, name, edge)

        return edge_marked(x, axes, callback(FWD), callback(BWD), self.ordered)


def _specs_of(shardings: Any) -> Any:
    return jax.tree.map(lambda s: s.spec, shardings)


def step_marks(trainer: TrainStep, recorder: MarkSink,
               ordered: bool = True) -> Callable[[Callable], Callable]:
    """The ``wrap`` of a step marked at its start and end: (STEP, START) on
    the batch, (STEP, END) on the new state and the metrics, into
    ``recorder`` (``ordered``: see ``mark``). Build it once per trainer and
    recorder: the trainer compiles one program per wrap object."""
    mesh, batch_spec = trainer.mesh, trainer.batch_sharding.spec
    state_specs = _specs_of(trainer.state_shardings)

    def wrap(body: Callable) -> Callable:
        def marked(state: Any, batch: jax.Array) -> tuple[Any, dict]:
            batch = mark(batch, batch_spec, mesh, recorder, STEP, START, ordered)
            new_state, metrics = body(state, batch)
            specs = (state_specs, jax.tree.map(lambda _: P(), metrics))  # metrics: replicated
            return mark((new_state, metrics), specs, mesh, recorder, STEP, END, ordered)

        return marked

    return wrap


class ProfiledStep:
    """The instrumented train step of one trainer and capacity-factor tuple.

    Built on ``trainer.step_fn(factors, hooks, wrap)``, so it is jitted with
    the plain step's shardings and donation; the plain step stays free of
    callbacks. Calls block until the step is done (the marks must be in).
    """

    def __init__(
        self,
        trainer: TrainStep,
        factors: tuple[float, ...],
        collectives_s: Mapping[str, float] | None = None,
        mark_cost_s: float = 0.0,
        tail_collective_s: float = 0.0,
    ) -> None:
        self.mesh: Mesh = trainer.mesh
        self.mark_cost_s, self.tail_collective_s = mark_cost_s, tail_collective_s
        self.recorder = Recorder()
        self.hook = ProfileHook(self.mesh, self.recorder, edges="all")
        self.collectives_s = dict(collectives_s) if collectives_s is not None else None
        self.jitted = trainer.step_fn(tuple(factors), hooks=(self.hook,),
                                      wrap=step_marks(trainer, self.recorder))

    def __call__(self, state: Any, batch: jax.Array) -> tuple[Any, dict, LayerProfile]:
        """Runs one profiled step.

        Returns:
          (new state, metrics, this process's LayerProfile of the step).
        """
        self.recorder.clear()
        t0 = time.perf_counter()
        new_state, metrics = self.jitted(state, batch)
        jax.block_until_ready((new_state, metrics))
        total = time.perf_counter() - t0
        step = int(np.asarray(new_state["step"].addressable_data(0))) - 1  # replicated
        profile = build_profile(step, total, self.hook.names, self.recorder.drain(),
                                self.collectives_s, self.mark_cost_s,
                                self.tail_collective_s)
        return new_state, metrics, profile


class _Variants:
    """One trainer's profiled variants and all-to-all timings."""

    def __init__(self) -> None:
        self.steps: dict[Any, ProfiledStep] = {}
        self.all_to_all_s: dict[tuple, float] = {}
        self.all_reduce_s: dict[tuple, float] = {}
        self.mark_cost_s: float | None = None  # time_marks on the trainer's mesh, once


_VARIANTS: weakref.WeakKeyDictionary[Any, _Variants] = weakref.WeakKeyDictionary()


def make_profiled_step(
    trainer: TrainStep,
    factors: Sequence[float],
    collectives: Mapping[str, Sequence[jax.ShapeDtypeStruct]] | None = None,
    collective_axis: str = "expert",
    reductions: Sequence[jax.ShapeDtypeStruct] | None = None,
) -> ProfiledStep:
    """The profiled variant of ``trainer.step_fn(factors)``, cached per factors.

    Args:
      trainer: the caller's ``TrainStep`` (its mesh, shardings and
        ``step_fn(factors, hooks, wrap)``).
      factors: the capacity factor of each MoE layer.
      collectives: optional {boundary name: per-device all-to-all buffers of
        that layer's forward}; each is timed in isolation over
        ``collective_axis`` to estimate the layer's collective time (see the
        module docstring). The model provides them (for GPTMoE:
        ``models.gpt.all_to_all_buffers``).
      collective_axis: the mesh axis the all-to-alls run over.
      reductions: optional per-device gradient buffers the step all-reduces
        over every device after the backward (the parameters every device
        holds); timed together in isolation (``probe.time_all_reduce``) and
        added to the TAIL segment's collective estimate, so the last window
        does not count that traffic as idle link.

    Returns:
      A callable (state, batch) -> (new state, metrics, LayerProfile); its
      profiles are net of the marks' cost (``time_marks``, measured once per
      trainer, at its first profiled variant).
    """
    factors = tuple(float(f) for f in factors)
    variants = _VARIANTS.setdefault(trainer, _Variants())
    reduce_key = _collectives_key({"": reductions} if reductions else None)
    key = (factors, _collectives_key(collectives), collective_axis, reduce_key)
    if key not in variants.steps:
        estimate, tail = collective_estimates(trainer, collectives, collective_axis, reductions)
        if variants.mark_cost_s is None:
            variants.mark_cost_s = time_marks(trainer.mesh)
        variants.steps[key] = ProfiledStep(trainer, factors, estimate, variants.mark_cost_s, tail)
    return variants.steps[key]


def collective_estimates(
    trainer: TrainStep,
    collectives: Mapping[str, Sequence[jax.ShapeDtypeStruct]] | None = None,
    collective_axis: str = "expert",
    reductions: Sequence[jax.ShapeDtypeStruct] | None = None,
) -> tuple[dict[str, float] | None, float]:
    """The collective time estimates a profile of ``trainer``'s step takes
    (``make_profiled_step``'s ``collectives`` and ``reductions``): {boundary
    name: its layer's all-to-all seconds} (None without ``collectives``) and
    the gradient all-reduce's seconds (0 without ``reductions``). Each buffer
    shape is timed once per trainer, in isolation (a collective in the mesh's
    sense: every process calls it at the same point)."""
    variants = _VARIANTS.setdefault(trainer, _Variants())
    estimate = None
    if collectives is not None:
        # One timing per buffer shape, shared by the variants (a layer's
        # dispatch and combine, and the layers that keep their capacity
        # when another layer's bucket changes, have the same buffers).
        timed = variants.all_to_all_s

        def seconds(b: jax.ShapeDtypeStruct) -> float:
            shape_key = (collective_axis, tuple(b.shape), str(b.dtype))
            if shape_key not in timed:
                timed[shape_key] = time_all_to_all(trainer.mesh, collective_axis, b)
            return timed[shape_key]

        estimate = {name: sum(seconds(b) for b in bufs) for name, bufs in collectives.items()}
    tail = 0.0
    if reductions:
        reduce_key = _collectives_key({"": reductions})
        if reduce_key not in variants.all_reduce_s:
            variants.all_reduce_s[reduce_key] = time_all_reduce(trainer.mesh, reductions)
        tail = variants.all_reduce_s[reduce_key]
    return estimate, tail


def _collectives_key(collectives: Mapping[str, Sequence[jax.ShapeDtypeStruct]] | None) -> Any:
    if collectives is None:
        return None
    return tuple(
        (name, tuple((tuple(b.shape), str(b.dtype)) for b in bufs))
        for name, bufs in sorted(collectives.items())
    )
