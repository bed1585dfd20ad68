"""``python -m launch.chaos``: randomized fault trials (the command: ``command``; its
configuration: ``config``; the trials' draw: ``draw``; the jobs and the watch over their
persistent steps: ``jobs``; the checks: ``checks``; the oracle of what must survive each
fault: ``oracle``)."""
