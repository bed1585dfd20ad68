"""``python -m launch.train``: training on the simulated cluster (the command: ``command``;
its configuration, fault plan and injector, supervisor and persistent tier beside it)."""
