"""``--config langgraph.json``: which graphs ``serve``, ``dev``, ``run``, ``resume``, ``replay``,
``workflows``, ``worker`` and ``eval`` see.

With ``--config FILE`` (or a directory holding ``langgraph.json``) they see exactly the graphs that file
names, as ``langgraph dev`` does; without it, ``./langgraph.json`` when the working directory has one
(said on stderr), else the built-in workflows. ``--no-config`` keeps the built-ins regardless.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_config_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("project")
    group.add_argument("--config", default=None, metavar="langgraph.json",
                       help="serve the graphs a LangGraph project file names (default: ./langgraph.json when "
                       "present, else the built-in workflows)")
    group.add_argument("--no-config", action="store_true",
                       help="the built-in workflows, even where ./langgraph.json exists")


def config_path(args: argparse.Namespace, *, announce: bool = True) -> Path | None:
    """The project file the command uses, or None for the built-in workflows."""
    from elesium.cli.errors import CliError
    from elesium.graphs.project import find_config

    explicit = getattr(args, "config", None)
    if getattr(args, "no_config", False):
        if explicit is not None:
            raise CliError("--config and --no-config exclude each other")
        return None
    path = find_config(explicit)
    if path is not None and explicit is None and announce:
        print(f"elesium: graphs from {path} (--no-config: the built-in workflows)", file=sys.stderr)
    return path


def load_project_env(args: argparse.Namespace) -> None:
    """The project's ``env``, before anything reads the environment (the graphs load later)."""
    from elesium.graphs.project import apply_env, read_config

    path = config_path(args, announce=False)
    if path is not None:
        apply_env(read_config(path))


def registry_from_args(args: argparse.Namespace) -> Any:
    """The registry the command serves (imports the project's graphs; a bad one is one line, exit 1)."""
    from elesium.graphs.project import project_registry

    return project_registry(config_path(args))
