"""The schedule's pure decisions: windows, the link model, the partitioner and
its searches, the sites where windows open, the load forecast, the policies the
planner replays, the spill records and the per-window byte accounting.

No module here imports JAX (``tests/test_layering.py``, through every library
module it reaches): the planner (``launch.plan``) replays these decisions
without a device, and ``in_graph/`` and ``threaded/`` build on them.
"""
