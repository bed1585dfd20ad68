"""What the moved steps' windows tell a scheduled strategy's plan.

Every moved version reports, per filled window, the idle time its step gave
against the plan (``transfers.window_spills``). ``WindowFeedback`` holds the
two uses capricorn makes of those records: the spill count (a window spilled
in most of host 0's last ``SPILL_WINDOW`` moved versions, agreed through the
checkpointer's status round: ask the driver for a profile) and the expert
windows' model (``scheduling.window_model``: re-plan at the next step's load
without a profile, issue 38). Gemini only reports the spills.

Design choice: a base class of ``ScheduledStrategy`` (``strategies.scheduled``)
holding these methods over the strategy's own state, apart from the moving of
the chunks (packing, the two chunk paths, spreading a version, committing),
so each module reads as one concept. Alternative not taken: an object of its
own owning the spill deque and the model, which would move that state out of
the strategy that re-partitions on it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from capricorn_jax._src.memory.tier.writer_door import TierWriter
from capricorn_jax._src.multihost.agree import agree_measured
from capricorn_jax._src.profiling.layer_profile import LayerProfile, moe_segments
from capricorn_jax._src.scheduling.plan.partitioner import Window
from capricorn_jax._src.scheduling.plan.window_model import WindowModel, moved_windows, window_key
from capricorn_jax._src.strategies.base import TrainStep

SPILL_WINDOW = 4
"""capricorn, both paths: the moved versions over which host 0 counts the
ones in which a window spilled; more than half of them ask for a profile."""
SPILL_TOLERANCE_S = 0.001
"""A window spills when its chunks' modelled link time exceeds its measured
idle time by more than this (the marks' own jitter on this box is ~0.1-1 ms)."""
SPILL_LATE_BYTES = 64 << 10
"""Where the bytes of a window are measured (the threaded deadline sender's
records), a spilled window counts only when more than this many of its bytes
met the collective that closed it (one deadline frame,
``threaded.PIECE_BYTES``): a window shorter than planned otherwise only
carried its bytes on, which costs the step nothing."""


class WindowFeedback:
    """The spill count and the window model of a scheduled strategy (see the
    module docstring); ``ScheduledStrategy`` sets the state below."""

    kind: str
    ckpt: TierWriter
    train: TrainStep
    spans: bool
    repartitions: list[int]
    spill_requests: list[int]
    window_model: WindowModel
    window_model_replans: list[int]
    _planned_on: LayerProfile | None
    _plan_windows: list[Window]
    _modelled_windows: list | None
    _spills: collections.deque[bool]
    _wants_profile: bool
    _repartition: Callable[[int, list, str], dict[str, Any]]

    def _expert_windows(self) -> dict[str, int]:
        """Window key -> MoE layer (row of ``tokens_per_expert``) of the plan's
        expert windows: each MoE segment's interior spans (between its
        dispatch and its combine), the part of the layer the load changes."""
        if self._planned_on is None or not self.spans:
            return {}
        layer_of = moe_segments(self._planned_on, self.train.moe_layers)
        out = {}
        for seg in self._planned_on.segments:
            key = (seg.name, seg.direction)
            if key in layer_of and seg.spans and len(seg.spans) > 2:
                for span in seg.spans[1:-1]:
                    out[window_key(Window(seg.name, seg.direction, 0.0, span.edge))] = \
                        layer_of[key]
        return out

    def _observe_windows(self, records: list[dict[str, Any]],
                         tokens_per_expert: np.ndarray | None) -> None:
        """Feeds the window model the expert windows this step measured, at
        the load of the step that moved them."""
        experts = self._expert_windows()
        if self.kind != "capricorn" or tokens_per_expert is None or not experts:
            return
        peaks = np.asarray(tokens_per_expert).max(axis=-1)
        for record in records:
            layer = experts.get(record["window"])
            if layer is not None:
                self.window_model.observe(record["window"], float(peaks[layer]),
                                          record["observed_s"])

    def _replan_by_window_model(self, step: int, tokens_per_expert: np.ndarray
                                ) -> dict[str, Any] | None:
        """capricorn's re-plan from its expert windows' model (issue 38): the
        plan's windows with each expert window that the next step's load moves
        beyond its noise (``window_model.moved_windows``) at its predicted
        idle time. Host 0's answer is every host's (one agreement: this is
        called on every host at the same steps). None: the model cannot say
        (no fit covers the load): the caller tries its segment models."""
        experts = self._expert_windows()
        mine: dict[int, float] | None = None
        if experts and self._plan_windows:
            peaks = np.asarray(tokens_per_expert).max(axis=-1)
            loads = {key: float(peaks[layer]) for key, layer in experts.items()}
            fits = {key: f for key in experts if (f := self.window_model.fit_of(key))}
            mine = moved_windows(self._plan_windows, loads, fits)
        (code,) = agree_measured([-1.0 if mine is None else float(len(mine))],
                                 what="window_model")
        if code < 0:
            return None
        if code == 0:
            return {}  # every expert window within its noise: the plan stands
        windows = [dataclasses.replace(w, duration_s=(mine or {}).get(i, w.duration_s))
                   for i, w in enumerate(self._plan_windows)]
        self._modelled_windows = windows
        self._spills.clear()
        self.window_model_replans.append(step)
        return self._repartition(step, windows, "window_model")

    def _note_spills(self, windows: list[dict[str, Any]]) -> None:
        """Counts this host's recent spilled versions into the status note of
        the save about to run: (schedules so far) * 1000 + spilled versions
        among the last ``SPILL_WINDOW`` under the schedule in force."""
        # The modelled spill (a window shorter than planned), not the measured
        # lateness alone: a new profile fixes the first; the second also holds
        # the link model's error, which a profile would not change. With the
        # deadline sender (bytes measured per window) a spill counts only when
        # it cost: bytes met the collective (issue 38: at R 0.79 capricorn
        # re-profiled 31 of 207 steps, 21 KB per step meeting a collective).
        self._spills.append(any(
            w["spill_s"] > SPILL_TOLERANCE_S
            and (w.get("bytes_late") is None or w["bytes_late"] > SPILL_LATE_BYTES)
            for w in windows))
        self.ckpt.note_status(len(self.repartitions) * 1000 + sum(self._spills))

    def _check_spills(self, version: int) -> None:
        """capricorn: when host 0's note (agreed through the save's status
        round, the same on every host, no collective of its own) says a
        window spilled in most of its last ``SPILL_WINDOW`` moved versions
        under the schedule in force, the strategy asks the driver for a
        profile (``profile_requested``) and re-plans on the step's present
        timing. Gemini keeps its schedule: it only reports the spills."""
        note = self.ckpt.agreed_note
        if self.kind != "capricorn" or note is None or self._wants_profile:
            return
        if note // 1000 == len(self.repartitions) and note % 1000 > SPILL_WINDOW // 2:
            self._wants_profile = True
            self.spill_requests.append(version)

    def profile_requested(self) -> bool:
        """capricorn: the windows its schedule filled spilled in most of the
        last checked steps (the same answer on every host)."""
        return self._wants_profile
