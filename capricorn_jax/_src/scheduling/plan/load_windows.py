"""The windows of a step at a new expert load, predicted instead of profiled.

Capricorn's re-partition without an instrumented step: when the expert load
shifts, each MoE layer's segment takes what the detector's cost model
(duration ~ a + b * max tokens on one expert, fitted on the profiles seen)
predicts at the new load, less the all-to-all estimate of the profile the
schedule was planned on; every other window keeps its profiled length (it
does not follow the load). The partitioner then fills these windows as it
fills profiled ones.

The model answers only near what it has seen: its slope is known and the new
load lies within the loads it has seen, widened by ``margin``. Elsewhere the
answer is None and the caller profiles: a profile both answers and teaches
the model the new load. A window the model got wrong shows as a spill in the
moved steps, and capricorn's spill request profiles then.

Design choice: the prediction replaces the profile only for a filled
schedule's re-partition (the profiled windows stay the plan's base).
Alternative not taken: predicting every window from a global step-time model,
which would move windows that do not depend on the load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from capricorn_jax._src.profiling.detector import DynamicityDetector
from capricorn_jax._src.profiling.layer_profile import LayerProfile, Segment, moe_segments
from capricorn_jax._src.scheduling.plan.partitioner import Window, windows_from_profile

MODEL_MARGIN = 0.5
"""How far past the loads a cost model has seen (a fraction, each side) its
prediction still stands in for a profile. Wide because a new capacity bucket
is reached exactly when the load leaves the range seen (at 0.1 the emulated
2x2 bench re-planned from the model 0 times in 30 steps: every shift left the
range), and a window the model overestimates spills and asks for a profile."""


def windows_at(profile: LayerProfile, predicted: Callable[[int, str], float | None],
               moe_layers: Sequence[int], spans: bool = False) -> list[Window] | None:
    """``profile``'s windows (``windows_from_profile``) with each MoE
    segment's at its predicted duration; None when some prediction is None.

    A segment's window is the predicted duration less the profile's
    all-to-all estimate. Its span windows (``spans``) keep their measured
    lengths but for the change, predicted less profiled duration, which goes
    to its interior spans (between two collectives: the experts' compute,
    the part that follows the load), in proportion to their idle time (all
    spans when it has no interior one). No window falls below 0.

    Args:
      profile: the profile a schedule is planned on.
      predicted: (MoE layer index, direction) -> seconds of its segment.
      moe_layers: the model's MoE layer indices.
      spans: span windows where the profile measured them.
    """
    layer_of = moe_segments(profile, moe_layers)
    segments = {(s.name, s.direction): s for s in profile.segments}
    change: dict[tuple[str, str], float] = {}
    for key, layer in layer_of.items():
        seconds = predicted(layer, key[1])
        if seconds is None:
            return None
        change[key] = seconds - segments[key].duration_s
    out = []
    for window in windows_from_profile(profile, spans):
        key = (window.name, window.direction)
        seg = segments[key]
        if key not in change:
            out.append(window)
        elif not (spans and seg.spans):
            idle = change[key] + seg.duration_s - (seg.collective_s or 0.0)
            out.append(dataclasses.replace(window, duration_s=max(0.0, idle)))
        else:
            out.append(dataclasses.replace(
                window, duration_s=max(0.0, window.duration_s + _share(seg, window.edge)
                                       * change[key])))
    return out


def _share(segment: Segment, edge: str) -> float:
    """The share of a segment's predicted change that its span opened at
    ``edge`` takes (see ``windows_at``)."""
    spans = list(segment.spans or ())
    interior = spans[1:-1] or spans
    if edge not in {s.edge for s in interior}:
        return 0.0
    total = sum(s.idle_s for s in interior)
    if total <= 0:
        return 1.0 / len(interior)
    return next(s.idle_s for s in interior if s.edge == edge) / total


def windows_at_load(profile: LayerProfile, detector: DynamicityDetector, tokens_per_expert: Any,
                    moe_layers: Sequence[int], margin: float = MODEL_MARGIN,
                    spans: bool = False) -> list[Window] | None:
    """``profile``'s windows with each MoE window predicted at this load.

    Args:
      profile: the profile the schedule in force was planned on (its
        windows, order and all-to-all estimates).
      detector: the DynamicityDetector whose cost models are keyed
        (MoE layer index, direction).
      tokens_per_expert: [moe_layers, experts] load now.
      moe_layers: the model's MoE layer indices.
      margin: see ``MODEL_MARGIN``.
      spans: span windows (``windows_at``).

    Returns:
      The windows in step order (a predicted window below 0 is 0), or None
      when some MoE window's model does not cover this load.
    """
    peaks = detector.max_load(tokens_per_expert)

    def predicted(layer: int, direction: str) -> float | None:
        model = detector.cost_models.get((layer, direction))
        if model is None or not model.covers(peaks[layer], margin):
            return None
        return model.predict(peaks[layer])

    return windows_at(profile, predicted, moe_layers, spans)
