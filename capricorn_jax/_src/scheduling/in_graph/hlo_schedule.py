"""Where the compiled scheduled step puts each window's collective-permute.

The in-graph path (``executor.InStepSender``) relies on XLA to issue each
chunk's collective-permute once its window opens and to run it while the
window's layer computes. Whether it does is visible only in the compiled,
scheduled module: ``jit(...).lower(...).compile().as_text()`` prints the entry
computation's instructions in schedule order (``is_scheduled=true``). This
module parses that text (pure functions over a string) and checks, per window:

* ``after_tie``: the permute depends, through its operands, on compute of the
  layer whose output opens the window (the tie survived compilation: an
  optimizer that folded ``max(x) > inf`` away would free the permute to move
  to the start of the step);
* ``placed``: it is issued before its window's layer finishes;
* ``overlapped`` (asynchronous form only, GPU: ``collective-permute-start`` /
  ``collective-permute-done``): some of the layer's compute is scheduled
  between its start and its done, so the bytes move while the layer computes.
  The done may come before the layer ends: XLA:GPU's latency-hiding scheduler
  keeps one asynchronous collective in flight by default, so it closes the
  permute before the layer's next all-to-all, which is the idle window's end
  (measured on an sm_90 compile, ``launch/gpu_bench.py``). XLA:CPU emits one
  synchronous ``collective-permute`` (None here: it cannot overlap).

A layer's first instruction is no guide (XLA schedules weight-only work such
as casts early, measured: block 1's first forward instruction came before
block 0's last), so placement is judged by dependencies and by the layer's
end: its last instruction the next layer depends on (``layer_ends``).

A layer's compute is every instruction whose ``op_name`` carries the layer's
scope under the differentiated model: ``.../jvp(Model)/block1/...`` forward,
``.../transpose(jvp(Model))/block1/...`` backward. Permutes inside the model
are told apart the same way (``jvp`` forward, ``transpose`` backward, neither:
the step's start and the tail) and matched to windows in schedule order within
each group, which is the order their data dependencies impose.

Alternative not taken: reading a profiler trace of a GPU run, which shows the
overlap as it happened but needs the GPU; the schedule is what the compiler
promises and this check runs wherever the module compiles.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from capricorn_jax._src.scheduling.plan.partitioner import Schedule
from capricorn_jax._src.scheduling.plan.sites import AFTER, START, site_of

PAYLOAD_CRC = ("<payload crc>", "bwd")
"""The window of the permute that carries each payload's CRC32C after every chunk."""

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?:^|\s)([a-z][a-z0-9_\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SCOPE = re.compile(r"(transpose\()?jvp\([^)/]*\)\)?/([^/]+)")
_OPERAND = re.compile(r"%([\w.\-]+)")
# Instructions that do no work of their own; not counted as a layer's compute.
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-start",
         "copy-done", "after-all", "opt-barrier"}

Layer = tuple[str, str]  # (scope, "fwd" | "bwd")


@dataclasses.dataclass(frozen=True)
class Instr:
    """One instruction of the scheduled entry computation."""

    index: int
    name: str
    opcode: str
    op_name: str
    operands: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Permute:
    """A collective-permute: issued at ``start``, complete at ``done`` (equal
    for the synchronous form); ``group``: "fwd", "bwd" or "outside" the model."""

    start: int
    done: int
    group: str
    asynchronous: bool


def _operand_list(text: str) -> str:
    """The text up to the parenthesis that closes an opcode's operand list."""
    depth = 1
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return text[:i]
    return text


def entry_instructions(hlo_text: str) -> list[Instr]:
    """The ENTRY computation's instructions, in printed (schedule) order.

    Raises:
      ValueError: the text has no ENTRY computation.
    """
    at = hlo_text.find("\nENTRY ")
    if at < 0:
        if not hlo_text.startswith("ENTRY "):
            raise ValueError("no ENTRY computation in the HLO text")
        at = 0
    out: list[Instr] = []
    for line in hlo_text[at:].split("\n")[1:]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if not m:
            continue
        rest = m.group(2)
        op = _OPCODE.search(rest)
        if op is None:
            continue
        name = _OP_NAME.search(rest)
        args = _operand_list(rest[op.end():])
        out.append(Instr(len(out), m.group(1), op.group(1), name.group(1) if name else "",
                         tuple(_OPERAND.findall(args))))
    return out


def layer_of(op_name: str) -> Layer | None:
    """(scope, direction) of an instruction inside the differentiated model."""
    m = _SCOPE.search(op_name)
    if m is None:
        return None
    return m.group(2), "bwd" if m.group(1) else "fwd"


def layer_spans(instrs: list[Instr]) -> dict[Layer, tuple[int, int]]:
    """{layer: (first, last) index of its compute} (permutes and free ops excluded)."""
    spans: dict[Layer, tuple[int, int]] = {}
    for ins in instrs:
        if ins.opcode in _FREE or ins.opcode.startswith("collective-permute"):
            continue
        layer = layer_of(ins.op_name)
        if layer is None or layer[0] == "ppermute":
            continue
        first, _ = spans.get(layer, (ins.index, ins.index))
        spans[layer] = (first, ins.index)
    return spans


def _group(op_name: str) -> str:
    if "transpose(" in op_name:
        return "bwd"
    return "fwd" if "jvp(" in op_name else "outside"


def permutes(instrs: list[Instr]) -> list[Permute]:
    """Every collective-permute, synchronous or as a start/done pair, by start.

    Raises:
      ValueError: a ``collective-permute-done`` names no start, or a start has
        no done.
    """
    starts: dict[str, Instr] = {}
    out = []
    for ins in instrs:
        # A combined permute (XLA's combiner merged several) counts once per operand.
        if ins.opcode == "collective-permute":
            out += [Permute(ins.index, ins.index, _group(ins.op_name), False)] * max(
                1, len(ins.operands))
        elif ins.opcode == "collective-permute-start":
            starts[ins.name] = ins
        elif ins.opcode == "collective-permute-done":
            start = next((starts.pop(o) for o in ins.operands if o in starts), None)
            if start is None:
                raise ValueError(f"{ins.name}: collective-permute-done of no start "
                                 f"(operands {ins.operands})")
            out += [Permute(start.index, ins.index, _group(start.op_name), True)] * max(
                1, len(start.operands))
    if starts:
        raise ValueError(f"collective-permute-start without a done: {sorted(starts)}")
    return sorted(out, key=lambda p: p.start)


@dataclasses.dataclass(frozen=True)
class WindowSpec:
    """What one window's permutes should do.

    Attributes:
      window: the window's (name, direction), for the report.
      group: the permutes' group: "fwd", "bwd" or "outside".
      count: how many permutes (chunks) it sends.
      tie: the layer whose output the permutes wait for (None: none).
      layer: the layer they should overlap (None: not a model layer).
    """

    window: tuple[str, str]
    group: str
    count: int
    tie: Layer | None
    layer: Layer | None


@dataclasses.dataclass(frozen=True)
class WindowCheck:
    """The check of one permute of a window (module docstring)."""

    window: tuple[str, str]
    start: int
    done: int
    after_tie: bool
    placed: bool
    overlapped: bool | None

    @property
    def ok(self) -> bool:
        """Placement holds and, where the form can overlap, it does."""
        return self.after_tie and self.placed and self.overlapped is not False


def _ancestors(instrs: list[Instr]) -> list[int]:
    """Per instruction, the bitset of the instructions it depends on (operands,
    transitively); the printed order is a schedule, so operands come first."""
    index = {ins.name: ins.index for ins in instrs}
    anc = [0] * len(instrs)
    for ins in instrs:
        bits = 0
        for o in ins.operands:
            j = index.get(o)
            if j is not None and j < ins.index:
                bits |= anc[j] | (1 << j)
        anc[ins.index] = bits
    return anc


def layer_ends(instrs: list[Instr], order: list[Layer]) -> dict[Layer, int]:
    """Where each layer of ``order`` (execution order) ends: the first
    instruction of the next layer that consumes its compute (the layer's
    output is in use from there on). Its own last instruction is no guide:
    XLA:GPU fuses forward ops recomputed in the backward pass under the
    forward op's name, so a forward layer's name reaches into the backward
    pass. The last layer of ``order`` ends at its last instruction."""
    anc = _ancestors(instrs)
    members = _members(instrs)
    ends = {}
    for i, layer in enumerate(order):
        if layer not in members:
            continue
        mine = members[layer]
        ends[layer] = mine.bit_length() - 1
        nxt = members.get(order[i + 1], 0) if i + 1 < len(order) else 0
        while nxt:
            low = nxt & -nxt
            k = low.bit_length() - 1
            if anc[k] & mine:
                ends[layer] = k
                break
            nxt ^= low
    return ends


def _members(instrs: list[Instr]) -> dict[Layer, int]:
    """{layer: bitset of its compute instructions}."""
    spans = layer_spans(instrs)
    out: dict[Layer, int] = {}
    for ins in instrs:
        layer = layer_of(ins.op_name)
        if layer in spans and ins.opcode not in _FREE \
                and not ins.opcode.startswith("collective-permute"):
            out[layer] = out.get(layer, 0) | (1 << ins.index)
    return out


def check_windows(hlo_text: str, specs: Iterable[WindowSpec],
                  order: list[Layer] | None = None) -> list[WindowCheck]:
    """Checks every window's permutes in the scheduled module ``hlo_text``.

    ``after_tie``: the permute depends (through its operands) on compute of
    the tie layer, i.e. the tie survived compilation; ``placed``: it is
    issued before its layer ends (its output, ``layer_ends``); ``overlapped``
    (asynchronous form): some of the layer's compute is scheduled between its
    start and its done.

    Args:
      specs: the windows in schedule order (within a group, the order their
        permutes are issued in).
      order: the layers in execution order (``layer_order``): a layer then
        ends at its output (``layer_ends``); None: at its last instruction.

    Raises:
      ValueError: the module's permutes do not match ``specs`` (per group
        counts), or a spec names a layer the module has no compute for.
    """
    instrs = entry_instructions(hlo_text)
    spans = layer_spans(instrs)
    anc = _ancestors(instrs)
    members = _members(instrs)
    ends = {layer: last for layer, (_, last) in spans.items()}
    ends.update(layer_ends(instrs, order or []))
    found: dict[str, list[Permute]] = {}
    for p in permutes(instrs):
        found.setdefault(p.group, []).append(p)
    specs = list(specs)
    want: dict[str, int] = {}
    for s in specs:
        want[s.group] = want.get(s.group, 0) + s.count
    got = {g: len(ps) for g, ps in found.items()}
    if {g: n for g, n in want.items() if n} != got:
        raise ValueError(f"permutes per group in the module {got} != the schedule's {want}")
    out = []
    taken = {g: 0 for g in found}
    for s in specs:
        for layer in (s.tie, s.layer):
            if layer is not None and layer not in spans:
                raise ValueError(f"window {s.window}: no compute of layer {layer} in the module "
                                 f"(layers: {sorted(spans)})")
        for _ in range(s.count):
            p = found[s.group][taken[s.group]]
            taken[s.group] += 1
            after_tie = s.tie is None or bool(anc[p.start] & members[s.tie])
            placed = s.layer is None or p.start < ends[s.layer]
            overlapped = None
            if p.asynchronous and s.layer is not None:
                between = ((1 << p.done) - 1) & ~((1 << (p.start + 1)) - 1)
                overlapped = bool(members[s.layer] & between)
            out.append(WindowCheck(s.window, p.start, p.done, after_tie, placed, overlapped))
    return out


def summary(checks: list[WindowCheck]) -> dict:
    """JSON-ready: counts and the windows that failed."""
    return {
        "permutes": len(checks),
        "asynchronous": sum(c.overlapped is not None for c in checks),
        "placed": sum(c.after_tie and c.placed for c in checks),
        "overlapped": sum(bool(c.overlapped) for c in checks),
        "ok": all(c.ok for c in checks),
        "failed": [dataclasses.asdict(c) for c in checks if not c.ok],
    }


def layer_order(boundaries: list[str]) -> list[Layer]:
    """The layers in execution order: forward, then backward in reverse."""
    return [(b, "fwd") for b in boundaries] + [(b, "bwd") for b in reversed(boundaries)]


def window_specs(schedule: Schedule, boundaries: list[str]) -> list[WindowSpec]:
    """The ``WindowSpec`` of each window of ``schedule`` (and of its tail), in
    the order their permutes are issued within each group, for the step that
    ``executor.InStepSender(..., schedule, boundaries)`` builds.

    A window named after a layer overlaps that layer's compute; "head" and
    "tail" overlap compute outside the layers (no layer check). Its permutes
    wait for the layer output (forward) or cotangent (backward) at the
    boundary that opens it (``sites.site_of``).
    """
    last = len(boundaries) - 1
    keyed = []
    for window, chunks in zip(schedule.windows, schedule.chunks, strict=True):
        if not chunks:
            continue
        name, direction = window.name, window.direction
        site, _ = site_of(window, boundaries)
        key: tuple[int, ...]  # step order: (phase, position in it[, tail last])
        if direction == "fwd":
            if site == START[0]:
                spec = WindowSpec((name, "fwd"), "outside", len(chunks), None, (name, "fwd"))
                key = (0, 0)
            else:
                layer = None if name == "head" else (name, "fwd")
                spec = WindowSpec((name, "fwd"), "fwd", len(chunks), (site, "fwd"), layer)
                key = (1, boundaries.index(site))
        else:
            i = boundaries.index(site)
            tie = (boundaries[i + 1], "bwd") if i < last else None
            layer = None if name == "tail" else (name, "bwd")
            spec = WindowSpec((name, "bwd"), "bwd", len(chunks), tie, layer)
            key = (2, last - i, name == "tail")
        keyed.append((key, spec))
    if schedule.tail:
        # Tied to every reception so far: the newest waits for the cotangent
        # at block 0's output, i.e. block 1's backward.
        tie = (boundaries[1], "bwd") if len(boundaries) > 1 else None
        keyed.append(((3, 0), WindowSpec(AFTER, "outside", len(schedule.tail), tie, None)))
    if keyed:
        # The sender's payload CRC32C, one permute after every chunk (the
        # integrity rule: ``executor.InStepSender.finish``); no layer to overlap.
        keyed.append(((4, 0), WindowSpec(PAYLOAD_CRC, "outside", 1, None, None)))
    return [s for _, s in sorted(keyed, key=lambda ks: ks[0])]


def memory_report(compiled) -> dict:
    """The compiled program's memory (``compiled.memory_analysis()``) in bytes,
    and its peak: arguments + outputs - aliased (donated) + temporaries.
    Empty where the backend gives no analysis."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    out = {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "host_output_bytes": int(getattr(stats, "host_output_size_in_bytes", 0)),
    }
    out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                         + out["temp_bytes"])
    return out
