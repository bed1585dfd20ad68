"""The in-graph chunk path (GPU): the executor that places each window's
collective-permutes in the jitted step, the compiled scheduled steps, the
window clock, the XLA flags and the compiled schedule's check. Builds on
``plan/`` only, never on ``threaded/``."""
