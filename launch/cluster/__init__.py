"""The simulated cluster: the launcher's side of running hosts as processes.

``processes`` starts the hosts (one process each, jax.distributed on
loopback, CPU pinning, the job ended when one host fails); ``netns`` puts
each behind a tc-shaped link in its own network namespace; ``supervisor``
runs a training job over attempts (restarting every host after a fault);
``faults`` injects the faults (kills, wipes, corruption, stalls);
``console`` shows the hosts' lines; ``cpu_account`` accounts CPU time by
thread group. The commands (``launch.train``, ``launch.bench``,
``launch.chaos``) sit one level up. Grouped here so that a reader finds the
cluster apart from the commands; alternative not taken: one flat launch/
folder, where these six modules sat among the commands and experiments.
"""
