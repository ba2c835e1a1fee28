"""The ``elesium`` command line.

Each subcommand lives in ``elesium/cli/commands/<name>.py`` exposing ``register(subparsers)``; the
handler it sets returns an exit code. Expected failures (bad input, missing files) raise
``CliError`` or another ``elesium.errors.UserError`` (or ``FileNotFoundError`` for a path the user
gave) and become one line on stderr with exit code 1. Anything else is a bug and keeps its
traceback: a ``ValueError`` from deep inside the engine is not the user's to fix.

``-v`` shows the ``elesium`` logger's INFO lines (what the engine chose and why); warnings (e.g.
draft heads that do not match the model) are shown always.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from elesium.cli.errors import CliError
from elesium.errors import UserError

COMMANDS = ("generate", "bench", "tune", "train_heads", "eval_heads", "bench_state", "demo", "worker", "run",
            "resume", "workflows", "serve", "dev", "replay", "audit", "fit_classifier", "eval")


__all__ = ["CliError", "build_parser", "dispatch", "is_user_error", "main"]


# User-facing errors of modules that predate UserError, by module and name: looked up only in modules
# already imported, so that reporting an error never imports torch.
_LEGACY_USER_ERRORS = (
    ("elesium.inference.drafters.files", "HeadsMismatchError"),
    ("elesium.state.errors", "RedisURLError"),
    ("elesium.state.errors", "RedisUnavailableError"),
    ("elesium.state.errors", "EmbeddedServerError"),
)


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's to fix (one line, exit 1) rather than a bug (traceback)."""
    if isinstance(exc, (UserError, FileNotFoundError)):
        return True
    for module, name in _LEGACY_USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return True
    return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elesium", description="Elesium: exact speculative decoding for "
                                     "deterministic agent workflows.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log what the engine chose and why (mode, heads, profile) to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"elesium.cli.commands.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(getattr(args, "verbose", False))
    return dispatch(args)


def dispatch(args: argparse.Namespace) -> int:
    """Run the command's handler: user errors become one line and exit 1; bugs propagate."""
    from elesium.cli.tracing import check_exporter

    try:
        check_exporter(getattr(args, "command", None))
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("elesium: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug is re-raised with its traceback; nothing is recorded here
        if not is_user_error(exc):
            raise
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"elesium: error: {message}", file=sys.stderr)
        return 1


def _configure_logging(verbose: bool) -> None:
    """The ``elesium`` logger to stderr: warnings always, INFO with ``-v``; other libraries untouched."""
    logger = logging.getLogger("elesium")
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("elesium: %(levelname)s: %(message)s"))
        logger.addHandler(handler)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at each record (a redirected or captured stderr too)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass

