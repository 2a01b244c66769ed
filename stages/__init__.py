"""Typed stages, one kind per file; port types in stages/types.py."""

from graph.stage import In, Out, Stage  # noqa: F401  (the stage contract, re-exported for stage authors)
