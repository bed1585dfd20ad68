"""The launchers' one error for a flag value that cannot work.

Its own module so that every module checking flags (``cli_flags``,
``accelerator``, the commands' configs) imports it without importing each
other (``cli_flags`` imports ``accelerator`` for its choices).
"""

from __future__ import annotations


class FlagError(ValueError):
    """A flag value that cannot work, named in the message."""
