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
and (2) returns a dummy scalar that is tied to the activation with
``lax.optimization_barrier``, so whatever consumes the activation waits for
the mark, which pins it before the next layer. The backward marks come from a
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
When the caller names each layer's all-to-all buffers (``collectives``; see
``gpt_moe_all_to_alls``), each one is timed *in isolation* on the same mesh
axis and the layer's ``collective_s`` is that estimate (the forward runs the
all-to-alls, the backward their transposes, the same shapes); ``compute_s`` is
the measured duration minus it, so waiting for a slower peer counts as
compute. Without ``collectives`` both are None. Gradient all-reduces of
replicated parameters are not split out.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

FWD, BWD = "fwd", "bwd"
STEP = "step"
START, END = "start", "end"
HEAD, TAIL = "head", "tail"

EventKey = tuple[str, str]  # (boundary name or STEP, FWD | BWD | START | END)


@dataclasses.dataclass(frozen=True)
class Segment:
    """The wall time between two consecutive marks of one step.

    Attributes:
      name: the boundary closing the layer (``"block3"``), or HEAD / TAIL.
      direction: FWD or BWD (see the module docstring for HEAD and TAIL).
      start_s: when the segment began, seconds after the step's start mark.
      duration_s: its length in seconds.
      collective_s: estimated all-to-all time inside it, or None if unknown.
    """

    name: str
    direction: str
    start_s: float
    duration_s: float
    collective_s: float | None = None

    @property
    def compute_s(self) -> float | None:
        """duration_s minus the collective estimate (None without one)."""
        if self.collective_s is None:
            return None
        return max(0.0, self.duration_s - self.collective_s)


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """One profiled step of one process.

    Attributes:
      step: the train step (``state["step"]`` before the update).
      total_s: host wall time of the call, dispatch to outputs ready.
      segments: in execution order; they tile [start mark, end mark].
      devices: local devices whose marks were merged.
    """

    step: int
    total_s: float
    segments: tuple[Segment, ...]
    devices: int = 1

    @property
    def span_s(self) -> float:
        """Time from the start mark to the end mark (sum of the segments)."""
        return sum(s.duration_s for s in self.segments)

    def durations(self) -> dict[EventKey, float]:
        """{(name, direction): duration_s} of every segment."""
        return {(s.name, s.direction): s.duration_s for s in self.segments}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerProfile:
        segments = tuple(Segment(**s) for s in d["segments"])
        return cls(int(d["step"]), float(d["total_s"]), segments, int(d.get("devices", 1)))

    @classmethod
    def from_json(cls, text: str) -> LayerProfile:
        return cls.from_dict(json.loads(text))


class Recorder:
    """Host-side sink of the marks' timestamps (thread-safe).

    Callbacks of different devices run on different threads. The callback
    only stamps the time and keeps its operand; reading the operand (the
    device index) waits for ``drain``, off the step's timeline (reading it
    in the callback cost ~50 us per device and mark on CPU). Each mark is kept
    once, at its first timestamp, per (name, direction, device).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._raw: list[tuple[str, str, Any, float]] = []

    def record(self, name: str, direction: str, tag: Any) -> np.ndarray:
        """The callback body: stamps the time; returns the dummy scalar.

        Args:
          name, direction: the mark's key (bound when the step is traced).
          tag: float32[2] (device index, probe of the marked data).
        """
        now = time.perf_counter()
        with self._lock:
            self._raw.append((name, direction, tag, now))
        return _ZERO

    def clear(self) -> None:
        with self._lock:
            self._raw.clear()

    def drain(self) -> dict[tuple[str, str, int], float]:
        """{(name, direction, device): first timestamp} recorded so far; forgets them."""
        with self._lock:
            raw, self._raw = self._raw, []
        times: dict[tuple[str, str, int], float] = {}
        for name, direction, tag, t in raw:
            key = (name, direction, int(np.asarray(tag)[0]))
            times[key] = min(t, times.get(key, t))
        return times


_ZERO = np.zeros((), np.float32)


def _probe(leaves: Sequence[jax.Array]) -> jax.Array:
    """A float32 scalar that depends on every (non-empty) leaf."""
    parts = [leaf.ravel()[0].astype(jnp.float32) for leaf in leaves if leaf.size]
    return functools.reduce(jnp.add, parts, jnp.zeros((), jnp.float32))


def mark(tree: Any, specs: Any, mesh: Mesh, recorder: Recorder, name: str, direction: str) -> Any:
    """Emits a per-device ordered callback that depends on ``tree``; returns it.

    Args:
      tree: a pytree of arrays sharded over ``mesh``.
      specs: a PartitionSpec per leaf of ``tree`` (a matching pytree), the
        leaves' current shardings, so the shard_map moves no data.
      mesh: the mesh; the callback runs once per device of it.
      recorder: where the callback stamps (name, direction, device, time).
      name, direction: the mark's key.

    Returns:
      ``tree``, unchanged in value, tied to the callback's result so its
      consumers run after the callback.
    """
    leaves, treedef = jax.tree.flatten(tree)
    flat_specs = treedef.flatten_up_to(specs)
    axes = tuple(mesh.axis_names)
    callback = functools.partial(recorder.record, name, direction)
    dummy = jax.ShapeDtypeStruct((), jnp.float32)

    def body(*local: jax.Array) -> tuple[jax.Array, ...]:
        device = jax.lax.axis_index(axes).astype(jnp.float32)  # exact below 2**24
        tag = jnp.stack([device, _probe(local)])  # one operand: one transfer
        result = io_callback(callback, dummy, tag, ordered=True)
        local, _ = jax.lax.optimization_barrier((local, result))
        return local

    # check_vma=False: a replicated leaf (spec P()) passes through unchanged,
    # so it is still replicated on the way out.
    out = jax.shard_map(
        body, mesh=mesh, in_specs=tuple(flat_specs), out_specs=tuple(flat_specs),
        check_vma=False,
    )(*leaves)
    return jax.tree.unflatten(treedef, out)


class ProfileHook:
    """The boundary hook of the profiled variant: fwd and bwd marks.

    The activation is assumed sharded on its leading (batch) dimension over
    all mesh axes, as GPTMoE's is; other leaves of a pytree activation too.
    """

    def __init__(self, mesh: Mesh, recorder: Recorder) -> None:
        self.mesh, self.recorder = mesh, recorder
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
        mesh, rec = self.mesh, self.recorder

        @jax.custom_vjp
        def ident(y):
            return mark(y, specs, mesh, rec, name, FWD)

        def fwd(y):
            return mark(y, specs, mesh, rec, name, FWD), None

        def bwd(_, g):
            return (mark(g, specs, mesh, rec, name, BWD),)

        ident.defvjp(fwd, bwd)
        return ident(x)


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
        callback_fwd = functools.partial(self.recorder.record, name, f"{FWD}:{phase}")
        callback_bwd = functools.partial(self.recorder.record, name, f"{BWD}:{phase}")

        def stamp(tree: Any, callback: Callable) -> Any:
            leaves, treedef = jax.tree.flatten(tree)
            device = jax.lax.axis_index(axes).astype(jnp.float32)
            tag = jnp.stack([device, _probe(leaves)])
            result = io_callback(callback, jax.ShapeDtypeStruct((), jnp.float32), tag,
                                 ordered=True)
            leaves, _ = jax.lax.optimization_barrier((leaves, result))
            return jax.tree.unflatten(treedef, leaves)

        @jax.custom_vjp
        def ident(y):
            return stamp(y, callback_fwd)

        def fwd(y):
            return stamp(y, callback_fwd), None

        def bwd(_, g):
            return (stamp(g, callback_bwd),)

        ident.defvjp(fwd, bwd)
        return ident(x)

    def phase_seconds(self) -> dict[tuple[str, str, str], float]:
        """{(layer, direction, collective): seconds} of the one step stamped
        since the last call (forgets its stamps): per device the time from the
        phase's first edge to its second in that direction, the slowest
        device's. A phase missing an edge on some device is left out."""
        times = self.recorder.drain()
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


def event_order(names: Sequence[str]) -> list[EventKey]:
    """The marks of one step in the order they must fire."""
    return (
        [(STEP, START)]
        + [(n, FWD) for n in names]
        + [(n, BWD) for n in reversed(names)]
        + [(STEP, END)]
    )


def _segment_keys(names: Sequence[str]) -> list[EventKey]:
    """The (name, direction) of the segment that each mark after START closes."""
    fwd = [(n, FWD) for n in names]
    bwd = [(n, BWD) for n in reversed(names[1:])]
    return fwd + [(HEAD, FWD)] + bwd + [(TAIL, BWD)]


def merge_devices(times: Mapping[tuple[str, str, int], float]) -> dict[EventKey, float]:
    """Per mark, the time its last device passed it; for START, its first.

    The step begins on this host when its first device begins (devices are
    launched one after the other: ~2 ms apart on 4 CPU devices), and every
    later mark is passed when all local devices passed it.
    """
    merged: dict[EventKey, float] = {}
    for (name, direction, _), t in times.items():
        pick = min if direction == START else max
        merged[(name, direction)] = pick(t, merged.get((name, direction), t))
    return merged


def build_profile(
    step: int,
    total_s: float,
    names: Sequence[str],
    times: Mapping[tuple[str, str, int], float],
    collectives_s: Mapping[str, float] | None = None,
) -> LayerProfile:
    """Turns one step's timestamps into a LayerProfile.

    Args:
      step: the step's index.
      total_s: host wall time of the call.
      names: the boundaries in forward order (at least one).
      times: {(name, direction, device): perf_counter seconds} from a Recorder.
      collectives_s: estimated collective seconds per boundary name, applied to
        both directions of that layer; others get None.

    Raises:
      RuntimeError: a mark is missing or the marks are out of order.
    """
    if not names:
        raise RuntimeError("profiler: no layer boundary was traced in the step")
    merged = merge_devices(times)
    order = event_order(names)
    missing = [k for k in order if k not in merged]
    if missing:
        raise RuntimeError(f"profiler: marks missing for {missing}")
    stamps = [merged[k] for k in order]
    if any(b < a for a, b in zip(stamps, stamps[1:], strict=False)):
        raise RuntimeError(f"profiler: marks out of order: {list(zip(order, stamps, strict=True))}")
    layer_of = {(n, d): n for n in names for d in (FWD, BWD)}
    layer_of[(TAIL, BWD)] = names[0]
    segments = []
    for key, t0, t1 in zip(_segment_keys(names), stamps[:-1], stamps[1:], strict=True):
        layer = layer_of.get(key)
        coll = None if collectives_s is None or layer is None else collectives_s.get(layer)
        segments.append(Segment(key[0], key[1], t0 - stamps[0], t1 - t0, coll))
    devices = len({d for (_, _, d) in times})
    return LayerProfile(step, total_s, tuple(segments), devices)


def _specs_of(shardings: Any) -> Any:
    return jax.tree.map(lambda s: s.spec, shardings)


class ProfiledStep:
    """The instrumented train step of one trainer and capacity-factor tuple.

    Built on ``trainer.step_fn(factors, hooks, wrap)``, so it is jitted with
    the plain step's shardings and donation; the plain step stays free of
    callbacks. Calls block until the step is done (the marks must be in).
    """

    def __init__(
        self,
        trainer: Any,
        factors: tuple[float, ...],
        collectives_s: Mapping[str, float] | None = None,
    ) -> None:
        self.mesh: Mesh = trainer.mesh
        self.recorder = Recorder()
        self.hook = ProfileHook(self.mesh, self.recorder)
        self.collectives_s = dict(collectives_s) if collectives_s is not None else None
        self._batch_spec = trainer.batch_sharding.spec
        self._state_specs = _specs_of(trainer.state_shardings)
        self.jitted = trainer.step_fn(tuple(factors), hooks=(self.hook,), wrap=self._wrap)

    def _wrap(self, body: Callable) -> Callable:
        mesh, rec = self.mesh, self.recorder

        def profiled(state: Any, batch: jax.Array) -> tuple[Any, dict]:
            batch = mark(batch, self._batch_spec, mesh, rec, STEP, START)
            new_state, metrics = body(state, batch)
            specs = (self._state_specs, jax.tree.map(lambda _: P(), metrics))  # metrics: replicated
            return mark((new_state, metrics), specs, mesh, rec, STEP, END)

        return profiled

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
                                self.collectives_s)
        return new_state, metrics, profile


def make_profiled_step(
    trainer: Any,
    factors: Sequence[float],
    collectives: Mapping[str, Sequence[jax.ShapeDtypeStruct]] | None = None,
    collective_axis: str = "expert",
) -> ProfiledStep:
    """The profiled variant of ``trainer.step_fn(factors)``, cached per factors.

    Args:
      trainer: a launch.trainer.Trainer (uses its mesh, shardings and
        ``step_fn(factors, hooks, wrap)``).
      factors: the capacity factor of each MoE layer.
      collectives: optional {boundary name: per-device all-to-all buffers of
        that layer's forward}; each is timed in isolation over
        ``collective_axis`` to estimate the layer's collective time (see the
        module docstring). ``gpt_moe_all_to_alls`` builds it for GPTMoE.
      collective_axis: the mesh axis the all-to-alls run over.

    Returns:
      A callable (state, batch) -> (new state, metrics, LayerProfile).
    """
    factors = tuple(float(f) for f in factors)
    # Kept on the trainer (whose own step cache holds these variants anyway),
    # so they live and die with it.
    per_trainer = vars(trainer).setdefault("_profiled_steps", {})
    key = (factors, _collectives_key(collectives), collective_axis)
    if key not in per_trainer:
        estimate = None
        if collectives is not None:
            # One timing per buffer shape, shared by the variants (a layer's
            # dispatch and combine, and the layers that keep their capacity
            # when another layer's bucket changes, have the same buffers).
            timed = vars(trainer).setdefault("_all_to_all_s", {})

            def seconds(b: jax.ShapeDtypeStruct) -> float:
                shape_key = (collective_axis, tuple(b.shape), str(b.dtype))
                if shape_key not in timed:
                    timed[shape_key] = time_all_to_all(trainer.mesh, collective_axis, b)
                return timed[shape_key]

            estimate = {name: sum(seconds(b) for b in bufs) for name, bufs in collectives.items()}
        per_trainer[key] = ProfiledStep(trainer, factors, estimate)
    return per_trainer[key]


def _collectives_key(collectives: Mapping[str, Sequence[jax.ShapeDtypeStruct]] | None) -> Any:
    if collectives is None:
        return None
    return tuple(
        (name, tuple((tuple(b.shape), str(b.dtype)) for b in bufs))
        for name, bufs in sorted(collectives.items())
    )


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

    def median_s(fn: Callable) -> float:
        jax.block_until_ready(fn(x))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    one, many = median_s(program(1)), median_s(program(1 + chain))
    return max(0.0, (many - one) / chain)


def gpt_moe_all_to_alls(
    trainer: Any, factors: Sequence[float]
) -> dict[str, list[jax.ShapeDtypeStruct]]:
    """The per-device all-to-all buffers of each MoE block of models.gpt.GPTMoE.

    Each MoE layer sends a [num_experts, capacity, d_model] buffer out
    (dispatch) and one back (combine), in the activation dtype (float32).
    """
    from models.config import capacity  # the model's adapter; the rest is model-free

    cfg = trainer.cfg
    out: dict[str, list[jax.ShapeDtypeStruct]] = {}
    for layer, factor in zip(cfg.moe_layers, factors, strict=True):
        cap = capacity(cfg, trainer.tokens_per_group, factor)
        buf = jax.ShapeDtypeStruct((cfg.num_experts, cap, cfg.d_model), jnp.float32)
        out[f"block{layer}"] = [buf, buf]
    return out


def measure_overhead(
    trainer: Any, factors: Sequence[float], state: Any, batch: jax.Array,
    steps: int = 10, warmup: int = 2,
) -> tuple[Any, dict[str, float]]:
    """Times the plain and the profiled step, alternating, on the same batch.

    Each round runs one plain and one profiled step (the order alternating
    between rounds), each to block_until_ready; ``warmup`` rounds (compile
    included) are not counted. Medians over ``steps`` rounds.

    Args:
      trainer: the Trainer; ``state`` is donated step after step.
      factors: the capacity factors of both variants.
      state, batch: the starting state (consumed) and the batch of every step.
      steps, warmup: timed and untimed rounds.

    Returns:
      (the final state, {"plain_s", "profiled_s", "overhead" (profiled/plain -
      1), "span_over_total" (median of the profiles' span_s / total_s)}).
    """
    plain, profiled = trainer.step_fn(factors), make_profiled_step(trainer, factors)

    def run_plain(state: Any) -> tuple[Any, LayerProfile | None]:
        state, metrics = plain(state, batch)
        jax.block_until_ready((state, metrics))
        return state, None

    def run_profiled(state: Any) -> tuple[Any, LayerProfile | None]:
        state, _, profile = profiled(state, batch)
        return state, profile

    times: dict[str, list[float]] = {"plain": [], "profiled": []}
    coverage = []
    for round_ in range(warmup + steps):
        order = [("plain", run_plain), ("profiled", run_profiled)]
        for name, run in order[:: 1 if round_ % 2 else -1]:
            t0 = time.perf_counter()
            state, profile = run(state)
            if round_ >= warmup:
                times[name].append(time.perf_counter() - t0)
                if profile is not None:
                    coverage.append(profile.span_s / profile.total_s)
    p, q = statistics.median(times["plain"]), statistics.median(times["profiled"])
    return state, {"plain_s": p, "profiled_s": q, "overhead": q / p - 1.0,
                   "span_over_total": statistics.median(coverage)}
