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
from collections.abc import Sequence
from typing import Any

from capricorn_jax._src.profiling.detector import DynamicityDetector
from capricorn_jax._src.profiling.layer_profile import LayerProfile, moe_segments
from capricorn_jax._src.scheduling.partitioner import Window, windows_from_profile

MODEL_MARGIN = 0.5
"""How far past the loads a cost model has seen (a fraction, each side) its
prediction still stands in for a profile. Wide because a new capacity bucket
is reached exactly when the load leaves the range seen (at 0.1 the emulated
2x2 bench re-planned from the model 0 times in 30 steps: every shift left the
range), and a window the model overestimates spills and asks for a profile."""


def windows_at_load(profile: LayerProfile, detector: DynamicityDetector, tokens_per_expert: Any,
                    moe_layers: Sequence[int], margin: float = MODEL_MARGIN
                    ) -> list[Window] | None:
    """``profile``'s windows with each MoE window predicted at this load.

    Args:
      profile: the profile the schedule in force was planned on (its
        windows, order and all-to-all estimates).
      detector: the DynamicityDetector whose cost models are keyed
        (MoE layer index, direction).
      tokens_per_expert: [moe_layers, experts] load now.
      moe_layers: the model's MoE layer indices.
      margin: see ``MODEL_MARGIN``.

    Returns:
      The windows in step order (a predicted window below 0 is 0), or None
      when some MoE window's model does not cover this load.
    """
    layer_of = moe_segments(profile, moe_layers)
    collective = {(s.name, s.direction): s.collective_s or 0.0 for s in profile.segments}
    peaks = detector.max_load(tokens_per_expert)
    out = []
    for window in windows_from_profile(profile):
        key = (window.name, window.direction)
        if key not in layer_of:
            out.append(window)
            continue
        layer = layer_of[key]
        model = detector.cost_models.get((layer, window.direction))
        if model is None or not model.covers(peaks[layer], margin):
            return None
        predicted = model.predict(peaks[layer])
        assert predicted is not None, "a model that covers a load has points"
        out.append(dataclasses.replace(window,
                                       duration_s=max(0.0, predicted - collective[key])))
    return out
