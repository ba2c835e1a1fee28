"""The one base class of the errors a user can cause and fix.

The CLI prints a ``UserError`` as one line and exits 1, and the API answers it with a 4xx; anything
else is a bug and keeps its traceback. Concrete errors also subclass the built-in type they used to
be (``ValueError``, ``FileNotFoundError``), so callers that catch those keep working. Nothing here
imports torch, so the CLI can name these types without loading the engine.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input or configuration, with a message that says what to change."""


class SettingsError(UserError, ValueError):
    """An environment variable or flag holds a value Elesium does not accept."""
