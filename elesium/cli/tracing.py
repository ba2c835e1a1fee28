"""The startup check of ``ELESIUM_OTEL_EXPORTER`` for the commands that export spans.

``elesium serve`` and ``elesium worker`` trace the runs they execute when the variable is set; an unknown
exporter, or ``otlp`` without its package, is one line and exit 1 before the model loads, rather than a
traceback once the server is starting.
"""

from __future__ import annotations

import os

from elesium.cli.errors import CliError

TRACED_COMMANDS = ("serve", "worker")


def check_exporter(command: str | None) -> None:
    """Raise :class:`CliError` when ``command`` exports spans and ``ELESIUM_OTEL_EXPORTER`` cannot be used."""
    exporter = os.environ.get("ELESIUM_OTEL_EXPORTER", "").strip()
    if command not in TRACED_COMMANDS or not exporter:
        return
    from elesium.api.tracing import exporter_problem

    problem = exporter_problem(exporter)
    if problem is not None:
        raise CliError(problem)
