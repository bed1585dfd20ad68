"""The threaded chunk path (CPU): the chunk channel and its hello, the window
marks, the version bookkeeping, the pacing rules (pure), the sender and the
receiver. Builds on ``plan/`` only, never on ``in_graph/``."""
