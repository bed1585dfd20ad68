"""The planner behind ``python -m launch.plan``: a simulated cluster on which
the library's own decisions (partitioner, placement's retention, detector,
profiling policy, PEC's dynamic K) run over an expert-load trace.

Modules: ``inputs`` (the frozen inputs and the profile schema), ``events``
(the discrete-event core), ``traces`` (load traces), ``simulate`` (one
strategy over N steps), ``presets`` (the papers' clusters), ``validate``
(predicted against measured bench runs).
"""
