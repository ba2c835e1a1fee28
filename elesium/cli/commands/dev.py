"""``elesium dev``: ``elesium serve`` for a ``langgraph.json`` project, restarted when its files change.

A watcher in this process polls the project file, its env file and every ``*.py`` under the project's
folder and its local dependencies (modification time and size, every ``--poll`` seconds), and runs
``elesium serve --config ...`` with the same options as a child process: a change stops the child
(SIGTERM, the server's graceful shutdown) and starts a fresh one, so every restart imports the graphs
anew and a broken edit only costs the one-line error until the next save. No extra dependency: uvicorn's
own reloader watches only ``*.py`` without ``watchfiles``, which this environment does not have.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from elesium.cli.commands.serve import add_serve_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dev", help="serve a langgraph.json project, restarting when its files change")
    add_serve_args(p)
    p.add_argument("--poll", type=float, default=1.0, help="seconds between looks at the files (default 1)")
    p.set_defaults(handler=run)


def serve_argv(parser_actions: list[argparse.Action], args: argparse.Namespace, config: Path) -> list[str]:
    """``elesium serve`` with the options given to ``dev`` (those at their defaults left out)."""
    argv = [sys.executable, "-m", "elesium.cli"]
    if getattr(args, "verbose", False):
        argv.append("-v")
    argv += ["serve", "--config", str(config)]
    for action in parser_actions:
        if not action.option_strings or action.dest in ("help", "config", "no_config", "poll", "handler"):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def snapshot(files: list[Path]) -> dict[Path, tuple[int, int]]:
    out = {}
    for path in files:
        try:
            st = path.stat()
        except OSError:
            continue
        out[path] = (st.st_mtime_ns, st.st_size)
    return out


def run(args: argparse.Namespace) -> int:
    from elesium.cli.errors import CliError
    from elesium.cli.projects import config_path
    from elesium.graphs.project import read_config

    if args.no_config:
        raise CliError("elesium dev serves a langgraph.json project; use elesium serve for the built-ins")
    config = config_path(args)
    if config is None:
        raise CliError("no ./langgraph.json here: pass --config PATH (elesium serve: the built-ins)")
    if args.poll <= 0:
        raise CliError(f"--poll must be > 0, got {args.poll:g}")
    project = read_config(config)  # a malformed file is one line now, before any server starts
    parser = argparse.ArgumentParser(add_help=False)
    add_serve_args(parser)
    argv = serve_argv(parser._actions, args, project.path)

    def files() -> list[Path]:
        try:
            return read_config(project.path).watched_files()
        except Exception:  # noqa: BLE001 - a broken edit of the file: keep watching the file itself
            return [project.path]

    def stop_on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # the server child is stopped below, not orphaned

    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    child: subprocess.Popen[bytes] | None = None
    seen = snapshot(files())
    print(f"elesium dev: watching {len(seen)} file(s) under {project.root}", file=sys.stderr)
    try:
        while True:
            if child is None:
                child = subprocess.Popen(argv, env=dict(os.environ))
            time.sleep(args.poll)
            now = snapshot(files())
            if now != seen:
                moved = set(now) ^ set(seen) | {p for p in now if now.get(p) != seen.get(p)}
                changed = sorted(os.path.relpath(p, project.root) for p in moved)
                seen = now
                print(f"elesium dev: {', '.join(changed[:5])} changed; restarting", file=sys.stderr)
                _stop(child, args.grace)
                child = None
                continue
            if child.poll() is not None:
                print(f"elesium dev: the server exited ({child.returncode}); waiting for a change",
                      file=sys.stderr)
                while snapshot(files()) == seen:
                    time.sleep(args.poll)
                seen = snapshot(files())
                child = None
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        if child is not None:
            _stop(child, args.grace)
    return 0


def _stop(child: subprocess.Popen[bytes], grace: float) -> None:
    if child.poll() is not None:
        return
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(timeout=grace + 10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
