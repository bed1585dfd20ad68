"""A toy strategy added through the registry alone (tests/test_registry.py).

``toy``: the in-memory tier's after-step replication under its own name, each
``checkpoint`` event marked ``toy``. Named in ``CAPRICORN_STRATEGY_MODULES``,
every launcher (train, bench, chaos) and every process they start knows it:
nothing else in the repository names it.
"""

from __future__ import annotations

from capricorn_jax import InMemoryStrategy
from capricorn_jax.experimental import BuildArgs, StrategySpec, register


class ToyStrategy(InMemoryStrategy):
    def _event(self, version, report):
        return {**super()._event(version, report), "toy": True}


def _build(args: BuildArgs) -> ToyStrategy:
    assert args.checkpointer is not None
    return ToyStrategy(args.checkpointer, "toy")


register(StrategySpec("toy", _build, in_memory=True, label="toy (a test's)",
                      channel_paths=frozenset()))  # the in-graph exchange on every path
