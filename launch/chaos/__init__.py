"""``python -m launch.chaos``: randomized fault trials (the command and the trials' draw and
oracle: ``command``; its configuration: ``config``)."""
