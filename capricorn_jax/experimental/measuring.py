"""The transports and schedules the bench and the GPU check measure directly, and the
benchmark control ``ChannelReplication`` (a replica over the chunk channel after the step).

Unstable: see ``capricorn_jax.experimental``."""

from capricorn_jax._faces import attach as _attach

# The names are in the stub beside this file (measuring.pyi), imported on first use.
__getattr__, __dir__, __all__ = _attach(__name__, __file__)
