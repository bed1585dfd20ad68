"""``python -m launch.stores``: the library's store command, kept under its old
name for existing scripts; the command ships with the library as
``python -m capricorn_jax.stores`` (same flags, same output)."""

from __future__ import annotations

from absl import app

from capricorn_jax import stores

define_flags = stores.define_flags
run = stores.run
main = stores.main

if __name__ == "__main__":
    stores.define_flags()
    app.run(stores.main)
