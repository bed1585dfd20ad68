"""One-off measurements behind the numbers in BUILD_NOTES.md, each a script:

    python -m launch.experiments.NAME --help

bandwidth (copy bandwidths), moe_load (MoE layer time against expert load),
orbax_rss (host RAM of a persistent save), pec_accuracy (PEC under repeated
failures), plot_profile (a profiled run's plot), speculation_quality (the
dynamicity detector's recall and cost), transfer_alt (the rejected transport).

Design choice: they live apart from the launcher's roles (``launch.train``,
``launch.bench`` and the modules they run on) because nothing there imports
them; they reach internal library names only through
``capricorn_jax.experimental``. The alternative, one flat ``launch`` folder,
put these beside the entry points and hid which modules a run depends on.
"""
