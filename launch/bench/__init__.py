"""``python -m launch.bench``: strategies side by side (the command: ``command``; its
configuration, runner, report, records, step statistics and recovery timing beside it)."""
