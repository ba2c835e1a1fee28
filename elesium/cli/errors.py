"""The command line's own user error, apart from ``elesium.cli`` so that its commands can raise it
without importing the module that imports them."""

from __future__ import annotations

from elesium.errors import UserError


class CliError(UserError):
    """A user-facing error raised by a command: printed as one line, exit code 1."""
