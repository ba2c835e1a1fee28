"""The ``elesium`` command line.

Each subcommand lives in ``elesium/commands/<name>.py`` exposing ``register(subparsers)``; the
handler it sets returns an exit code. Expected failures (bad input, missing files) raise
``CliError`` or ``ValueError``/``FileNotFoundError`` and become one line on stderr with exit code 1;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS = ("generate", "bench", "tune", "train_heads", "eval_heads", "bench_state", "demo", "worker", "run",
            "resume", "workflows")


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 1."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elesium", description="Elesium: exact speculative decoding for "
                                     "deterministic agent workflows.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"elesium.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"elesium.commands.{name}":
                continue  # not built yet
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("elesium: interrupted", file=sys.stderr)
        return 130
    except (CliError, ValueError, FileNotFoundError, OSError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"elesium: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
