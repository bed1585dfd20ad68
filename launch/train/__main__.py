"""Runs ``launch.train`` (``python -m launch.train``); its usage is the command's docstring."""

from launch.train import command

__doc__ = command.__doc__  # what absl prints as the command's usage
command._run()
