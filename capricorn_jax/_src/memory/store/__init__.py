"""The arena store: a host's versions in slots on a RAM disk, its lifecycle and
admin, and the copies into it."""
