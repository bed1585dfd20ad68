"""Names for the project's own tools; may change.

The launchers, the planner and the tests reach a few internal names that are
not part of the stable API in ``capricorn_jax``: they are re-exported here, by
audience, so that nothing outside the library imports ``capricorn_jax._src``:

* ``planning``: the decisions the planner and the bench replay (placement,
  retention, PEC selection, profiling policy and cache, the partitioner);
* ``store``: the RAM store's administration and the pinned copy path;
* ``testing``: fault injection (``FaultHooks``);
* ``profiling``: what the profiling driver runs inside (``LayerProfile``,
  ``DynamicityDetector``, ``make_profiled_step``, ``CollectiveProbe``,
  ``StepOutcome``);
* ``strategies``: the strategy registry (``register``, ``spec``, ``specs``,
  ``StrategySpec``, ``BuildArgs``): the launchers add the baselines there;
* ``measuring``: transports and schedules measured directly, and
  ``ChannelReplication`` (a benchmark control, not in the stable face);
* ``multihost``: small cross-host agreements, the distributed client, the job's secret.

Every name is also importable from ``capricorn_jax.experimental`` itself.
Design choice: one explicit package of unstable names rather than widening the
public API (whose names are a promise) or letting tools import private modules
(which ties them to the package layout).
"""

from capricorn_jax._faces import attach as _attach

# The names are in the stub beside this file (__init__.pyi), imported on first use.
__getattr__, __dir__, __all__ = _attach(__name__, __file__)
