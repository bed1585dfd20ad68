"""Runs ``launch.chaos`` (``python -m launch.chaos``); its usage is the command's docstring."""

from launch.chaos import command

__doc__ = command.__doc__  # what absl prints as the command's usage
command._run()
