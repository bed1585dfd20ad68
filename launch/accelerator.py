"""The accelerator flag group (``--accelerator``, ``--accelerator_profile``) and
what it builds: None for the real model, or the emulated accelerator
(``models.emulation``) for the model config.

``--accelerator=emulated`` runs every layer's heavy compute as a native wait
of the profile's duration (holding no core), while processes, all-to-alls,
the state's bytes and the whole checkpoint path stay real (BUILD_NOTES
"The emulated accelerator"). ``--accelerator_profile`` names a shipped
profile (``models/emulation/profiles/NAME.json``) or a profile file.
"""

from __future__ import annotations

from absl import flags

from models.emulation.profile import DEFAULT_PROFILE, available, load

ACCELERATORS = ("none", "emulated")


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the two flags in ``fv`` (each entry point calls it once)."""
    flags.DEFINE_enum("accelerator", "none", list(ACCELERATORS),
                      "none: the model computes on the simulated devices; emulated: each "
                      "layer's compute is a wait of the accelerator profile's duration.",
                      flag_values=fv)
    flags.DEFINE_string("accelerator_profile", "",
                        f"--accelerator=emulated: a shipped profile ({', '.join(available())}; "
                        f"default {DEFAULT_PROFILE}) or a profile JSON file.", flag_values=fv)


def check(accelerator: str, profile: str) -> None:
    """Raises ValueError naming the bad flag (before any process starts)."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"--accelerator={accelerator!r}: one of {', '.join(ACCELERATORS)}")
    if profile and accelerator != "emulated":
        raise ValueError(f"--accelerator_profile={profile!r} needs --accelerator=emulated")
    if accelerator == "emulated":
        load(profile or DEFAULT_PROFILE)


def emulation(accelerator: str, profile: str, cfg):
    """The model's ``emulation`` argument: None, or the profile on ``cfg``."""
    if accelerator != "emulated":
        return None
    from models.emulation.layers import Emulation

    return Emulation.for_config(load(profile or DEFAULT_PROFILE), cfg)


def profile_name(accelerator: str, profile: str) -> str | None:
    """The profile's name for records (None without emulation)."""
    return load(profile or DEFAULT_PROFILE).name if accelerator == "emulated" else None
