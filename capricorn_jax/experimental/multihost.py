"""Small cross-host agreements, the distributed client, the address a host
advertises and the job's secret the launchers use.

Unstable: see ``capricorn_jax.experimental``."""

from capricorn_jax._faces import attach as _attach

# The names are in the stub beside this file (multihost.pyi), imported on first use.
__getattr__, __dir__, __all__ = _attach(__name__, __file__)
