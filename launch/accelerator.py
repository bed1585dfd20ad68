"""What the accelerator flag group (``--accelerator``, ``--accelerator_profile``,
defined in ``launch.cli_flags``) builds: None for the real model, or the
emulated accelerator (``models.emulation``) for the model config.

``--accelerator=emulated`` runs every layer's heavy compute as a native wait
of the profile's duration (holding no core), while processes, all-to-alls,
the state's bytes and the whole checkpoint path stay real (BUILD_NOTES
"The emulated accelerator"). ``--accelerator_profile`` names a shipped
profile (``models/emulation/profiles/NAME.json``) or a profile file.
"""

from __future__ import annotations

import dataclasses
import math

from launch.errors import FlagError
from models import routing_bias
from models.emulation.profile import DEFAULT_PROFILE, load

ACCELERATORS = ("none", "emulated")


def check(accelerator: str, profile: str, time_scale: float = 1.0) -> None:
    """Raises ValueError naming the bad flag (before any process starts)."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"--accelerator={accelerator!r}: one of {', '.join(ACCELERATORS)}")
    if profile and accelerator != "emulated":
        raise ValueError(f"--accelerator_profile={profile!r} needs --accelerator=emulated")
    if not (math.isfinite(time_scale) and time_scale >= 1):
        raise ValueError(f"--time_scale must be a number >= 1 (the emulated compute and the "
                         f"links that many times slower), got {time_scale:g}")
    if time_scale != 1 and accelerator != "emulated":
        raise ValueError(f"--time_scale={time_scale:g} needs --accelerator=emulated: only the "
                         f"emulated compute can be dilated, not --accelerator={accelerator}")
    if accelerator == "emulated":
        load(profile or DEFAULT_PROFILE)


def emulation(accelerator: str, profile: str, cfg, time_scale: float = 1.0):
    """The model's ``emulation`` argument: None, or the profile on ``cfg``
    (``time_scale``: every wait that many times longer)."""
    if accelerator != "emulated":
        return None
    from models.emulation.layers import Emulation

    return Emulation.for_config(load(profile or DEFAULT_PROFILE), cfg, time_scale)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AcceleratorConfig:
    """--accelerator / --accelerator_profile (train, bench, chaos).

    ``none`` (the default) computes on the devices for real. ``emulated`` runs
    each layer's heavy compute as a wait of the profile's duration
    (``launch.accelerator``, ``models.emulation``); ``profile`` names a shipped
    profile or a profile file (checked here, before any process starts).
    ``time_scale`` (launch.bench's ``--time_scale``): every emulated wait
    that many times longer (>= 1; other than 1 only when emulated).
    """

    accelerator: str = "none"
    profile: str = ""
    time_scale: float = 1.0

    def __post_init__(self) -> None:

        try:
            check(self.accelerator, self.profile, self.time_scale)
        except ValueError as err:
            raise FlagError(str(err)) from None


def resolve_routing_bias(value: str, accelerator: str, workload: str) -> str:
    """``--routing_bias`` resolved against ``--accelerator`` and ``--workload``
    (``models.routing_bias.resolve``); raises FlagError naming the bad value."""

    try:
        return routing_bias.resolve(value, accelerator=accelerator, workload=workload)
    except ValueError as err:
        raise FlagError(str(err)) from None
