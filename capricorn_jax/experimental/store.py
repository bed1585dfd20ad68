"""The RAM store and its administration (reclaiming, sizing: ``python -m
capricorn_jax.stores`` and the launchers) and the pinned-host copy path.

Unstable: see ``capricorn_jax.experimental``."""

from capricorn_jax._faces import attach as _attach

# The names are in the stub beside this file (store.pyi), imported on first use.
__getattr__, __dir__, __all__ = _attach(__name__, __file__)
