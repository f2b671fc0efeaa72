"""Errors a user can cause, each carrying the CLI exit code it maps to.

The CLI turns a ``HetforgeError`` into one readable line and its exit code; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations


class HetforgeError(Exception):
    """A failure the user can act on (exit code 1)."""

    exit_code = 1


class UsageError(HetforgeError):
    """Bad input: unknown name, out-of-range value, wrong file (exit code 2)."""

    exit_code = 2


class CaptureError(HetforgeError):
    """``torch.export`` could not capture the model (exit code 1)."""


class ModelFolderError(HetforgeError):
    """A local model folder is missing a file or holds a corrupt one (exit code 1)."""
