"""The tier protocol: the checkpointer, its writers and status round, retention,
recovery, PEC, and the doors the strategies and the persistent tier use."""
