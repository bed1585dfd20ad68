"""Accelerator profiles: how long each layer of a model takes on an accelerator.

One schema and one class (``AcceleratorProfile``) for both readers: the
emulated accelerator (``--accelerator=emulated --accelerator_profile=NAME|PATH``)
and the planner (``python -m launch.plan --accelerator_profile=NAME|PATH``, its presets).
A profile is JSON data (``profiles/NAME.json`` when shipped), one entry per
layer of the model it was derived for::

    {"name": ..., "accelerator": ..., "model": ..., "tokens_per_device": ...,
     "derivation": "how the numbers were obtained",
     "layers": [{"kind": "dense" | "moe",
                 "dense_fwd_ms", "dense_bwd_ms",     # attention (+ dense FFN)
                 "expert_fwd_ms", "expert_bwd_ms",   # experts at balanced load
                 "a2a_bytes_per_routed_token"}, ...]}

``expert_*_ms`` is the device's expert compute when every expert receives the
balanced share of tokens; a step's expert part scales with the busiest
expert's load over that share (grouped expert kernels pad every local expert
to the busiest one's rows, as capacity buffers do). The share is the paired
model's: routed token-expert assignments per step over the experts (the
emulation's ``layers.expert_scale``, the planner's ``simulate.segments``).
``a2a_bytes_per_routed_token``: what one routed token moves per all-to-all
after an MoE layer; the planner also puts a dense layer's bytes on the link
(training traffic modelled so, the ``gemini_paper`` preset), the emulation
moves only its model's own all-to-alls. Every number is finite and >= 0.

Pairing with a model config (``for_model``): the emulated model usually has
fewer layers than the profiled one, so the profile's layers are grouped in
order onto the emulated layers (emulated layer i takes profile layers
[i*N/n, (i+1)*N/n)) and each emulated layer waits its group's sum: the
emulated step lasts what the profiled model's step lasts, while its bytes
(state, all-to-alls) are the paired config's own. Alternative not taken:
scaling per-token costs down to the paired config's tokens, which would make
a small config's step a few milliseconds long, below the host's fixed costs,
i.e. not the paper's regime.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

PROFILE_DIR = Path(__file__).with_name("profiles")
DEFAULT_PROFILE = "a100_gpt_moe_350m_16e"
_FIELDS = ("dense_fwd_ms", "dense_bwd_ms", "expert_fwd_ms", "expert_bwd_ms")


@dataclasses.dataclass(frozen=True)
class LayerTimes:
    """One layer's compute on the accelerator (milliseconds).

    Attributes:
      kind: "dense" or "moe".
      dense_fwd_ms, dense_bwd_ms: the part that does not follow the routing.
      expert_fwd_ms, expert_bwd_ms: the experts' part at balanced load (0 for
        dense layers).
      a2a_bytes_per_routed_token: bytes one routed token moves per all-to-all
        in the profiled model (its d_model times the activation's bytes).
    """

    kind: str
    dense_fwd_ms: float
    dense_bwd_ms: float
    expert_fwd_ms: float = 0.0
    expert_bwd_ms: float = 0.0
    a2a_bytes_per_routed_token: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("dense", "moe"):
            raise ValueError(f"layer kind {self.kind!r} is not 'dense' or 'moe'")
        for name in (*_FIELDS, "a2a_bytes_per_routed_token"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value} is negative or not finite")

    @property
    def step_ms(self) -> float:
        """Forward plus backward at balanced load."""
        return sum(getattr(self, name) for name in _FIELDS)

    def dilated(self, time_scale: float) -> LayerTimes:
        """This layer's compute ``time_scale`` times longer (every ``*_ms``
        field; its bytes unchanged): the emulation under ``--time_scale``."""
        return dataclasses.replace(self, **{name: getattr(self, name) * time_scale
                                            for name in _FIELDS})


@dataclasses.dataclass(frozen=True)
class AcceleratorProfile:
    """A profiled model's layers on one accelerator (see the module docstring)."""

    name: str
    accelerator: str
    model: str
    tokens_per_device: int
    derivation: str
    layers: tuple[LayerTimes, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"accelerator profile {self.name!r} has no layers")

    @property
    def step_ms(self) -> float:
        """The profiled step's compute at balanced load."""
        return sum(layer.step_ms for layer in self.layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices (into ``layers``) of the MoE layers, in order."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.kind == "moe")

    def for_model(self, n_layers: int) -> tuple[LayerTimes, ...]:
        """The profile grouped onto ``n_layers`` emulated layers (module docstring)."""
        if n_layers < 1:
            raise ValueError(f"n_layers={n_layers} must be positive")
        total = len(self.layers)
        if n_layers > total:
            raise ValueError(f"profile {self.name!r} has {total} layers, fewer than the "
                             f"emulated model's {n_layers}")
        out = []
        for i in range(n_layers):
            group = self.layers[i * total // n_layers:(i + 1) * total // n_layers]
            sums = {name: sum(getattr(layer, name) for layer in group) for name in _FIELDS}
            moe = [layer for layer in group if layer.kind == "moe"]
            out.append(LayerTimes(
                kind="moe" if moe else "dense", **sums,
                a2a_bytes_per_routed_token=max(
                    (layer.a2a_bytes_per_routed_token for layer in moe), default=0.0)))
        return tuple(out)

    def on_layers(self, moe: tuple[bool, ...]) -> tuple[LayerTimes, ...]:
        """What the emulation waits per layer of a model whose layer i is MoE
        where ``moe[i]``: ``for_model``'s groups, a dense layer of the model
        taking its group's expert time as dense time (it has no experts to
        wait in), so the step's total is kept. ``layers.Emulation`` reads
        this, the planner through ``paired``."""
        out = []
        for times, is_moe in zip(self.for_model(len(moe)), moe, strict=True):
            if not is_moe and times.kind == "moe":
                times = dataclasses.replace(
                    times, kind="dense", dense_fwd_ms=times.dense_fwd_ms + times.expert_fwd_ms,
                    dense_bwd_ms=times.dense_bwd_ms + times.expert_bwd_ms,
                    expert_fwd_ms=0.0, expert_bwd_ms=0.0)
            out.append(times)
        return tuple(out)

    def paired(self, moe: tuple[bool, ...], *,
               a2a_bytes_per_routed_token: float | None = None) -> AcceleratorProfile:
        """This profile as the emulation waits it on a model whose layer i is
        MoE where ``moe[i]`` (``on_layers``), one entry per model layer: what
        the planner simulates of an emulated run. Its MoE layers move
        ``a2a_bytes_per_routed_token`` (None: the profile's, the profiled
        model's), its dense layers none."""
        layers = []
        for times in self.on_layers(moe):
            a2a = 0.0
            if times.kind == "moe":
                a2a = (times.a2a_bytes_per_routed_token if a2a_bytes_per_routed_token is None
                       else a2a_bytes_per_routed_token)
            layers.append(dataclasses.replace(times, a2a_bytes_per_routed_token=a2a))
        return dataclasses.replace(self, layers=tuple(layers))

    def to_json(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if f.name != "layers"},
                "layers": [dataclasses.asdict(layer) for layer in self.layers]}


def from_json(data: dict) -> AcceleratorProfile:
    """A profile from its JSON object; errors name the missing or bad field."""
    required = ("name", "accelerator", "model", "tokens_per_device", "derivation", "layers")
    missing = [key for key in required if key not in data]
    if missing:
        raise ValueError(f"accelerator profile lacks {missing}")
    layers = []
    for i, layer in enumerate(data["layers"]):
        try:
            layers.append(LayerTimes(**layer))
        except TypeError as err:
            raise ValueError(f"profile {data['name']!r} layer {i}: {err}") from None
    return AcceleratorProfile(
        name=str(data["name"]), accelerator=str(data["accelerator"]), model=str(data["model"]),
        tokens_per_device=int(data["tokens_per_device"]), derivation=str(data["derivation"]),
        layers=tuple(layers))


def available() -> list[str]:
    """The names of the shipped profiles."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load(name_or_path: str) -> AcceleratorProfile:
    """A shipped profile by name, or a profile JSON file by path.

    Raises:
      ValueError: neither a shipped name nor an existing file (the shipped
        names listed), or the file is not a valid profile.
    """
    path = Path(name_or_path)
    if not path.is_file():
        shipped = PROFILE_DIR / f"{name_or_path}.json"
        if not shipped.is_file():
            raise ValueError(f"accelerator profile {name_or_path!r} is neither a file nor a "
                             f"shipped profile ({', '.join(available())})")
        path = shipped
    return from_json(json.loads(path.read_text()))
