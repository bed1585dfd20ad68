"""Runs ``launch.bench`` (``python -m launch.bench``); its usage is the command's docstring."""

from launch.bench import command

__doc__ = command.__doc__  # what absl prints as the command's usage
command._run()
