"""Drop-in names for Orbax's emergency checkpoint manager.

A training loop written against ``orbax.checkpoint.experimental.emergency
.checkpoint_manager`` switches to capricorn_jax by importing this module
under the same name and writing its options line with these classes::

    # from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency
    from capricorn_jax import emergency

    options = emergency.CheckpointManagerOptions(
        local=emergency.LocalCheckpointOptions(save_interval_steps=1),
        persistent=emergency.PersistentCheckpointOptions(save_interval_steps=10, max_to_keep=2),
        replicas=2)
    manager = emergency.CheckpointManager(local_dir, persistent_dir, global_mesh=mesh,
                                          abstract_state=abstract, options=options)

``CheckpointManager`` is ``capricorn_jax.TwoTierCheckpointManager`` and
``CheckpointManagerOptions`` is ``capricorn_jax.TwoTierOptions``: Orbax's field
names with Orbax's meaning where they have one here, refused by name
(``OptionRefused``) where they do not (``docs/guide.md``, "Switching from
Orbax's emergency manager", has the table).
"""

from capricorn_jax._src.persistent.emergency_options import (
    LocalCheckpointOptions,
    MultiprocessingOptions,
    OptionRefused,
    PersistentCheckpointOptions,
)
from capricorn_jax._src.persistent.emergency_options import (
    TwoTierOptions as CheckpointManagerOptions,
)
from capricorn_jax._src.strategies.two_tier import TwoTierCheckpointManager as CheckpointManager

__all__ = [
    "CheckpointManager",
    "CheckpointManagerOptions",
    "LocalCheckpointOptions",
    "MultiprocessingOptions",
    "OptionRefused",
    "PersistentCheckpointOptions",
]
