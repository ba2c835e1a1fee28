"""``elesium serve``: the API (LangGraph protocol, OpenAI-compatible, audit replay) under uvicorn.

Keys come from ``ELESIUM_API_KEYS`` / ``ELESIUM_API_KEYS_FILE``; without any, the server refuses to
start unless ``--no-auth`` is given, which it announces, so a forgotten variable never serves
everyone silently.

Runs go through the durable run queue in Redis. By default this process also executes them, as
many at once as the engine decodes in one step (``--workers N`` to choose); ``--workers 0`` makes
it a pure API server, with ``elesium worker`` processes on any machine doing the work. On SIGTERM
uvicorn stops taking requests and in-flight runs get ``--grace`` seconds before they are handed back
to the queue.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING

from elesium.cli.commands.common import add_model_args, load_engine
from elesium.cli.heap import freeze_startup_heap
from elesium.cli.projects import add_config_args, load_project_env, registry_from_args

if TYPE_CHECKING:
    from elesium.api.settings import ApiSettings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve the API: LangGraph protocol, /v1/chat/completions, replay, metrics"
    )
    add_serve_args(p)
    p.set_defaults(handler=run)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """``serve``'s options (``elesium dev`` takes the same and hands them to the server it restarts)."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="accept requests without an API key (local use only; every caller is tenant 'default')",
    )
    p.add_argument("--workers", type=int, default=None,
                   help="queued runs this process executes at once (default: as many as the engine "
                   "decodes in one step, 16 on the CPU, else 1; 0: leave them to `elesium worker`)")
    p.add_argument("--queue", default="default", help="the run queue (default: default)")
    p.add_argument("--run-timeout", type=float, default=0.0,
                   help="seconds a run may execute before it is stopped as timeout (0: no limit)")
    p.add_argument("--lease-ttl", type=float, default=15.0,
                   help="seconds a run's claim lives without a heartbeat (a dead worker's runs resume after)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds in-flight runs get to finish on shutdown before they are handed back")
    p.add_argument("--self-tuning", action="store_true",
                   help="API runs use and learn per-node tree calibrations (also ELESIUM_SELF_TUNING=1); "
                   "give every server and worker of a deployment the same setting")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest /v1/chat/completions prompt in tokens (also ELESIUM_MAX_PROMPT_TOKENS; "
                   "default and 0: the model's context less the request's max_tokens)")
    p.add_argument("--max-tokens-cap", type=int, default=None,
                   help="largest max_tokens a chat completion may ask for (also ELESIUM_MAX_TOKENS_CAP; "
                   "default 1024)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="larger request bodies answer 413 (also ELESIUM_MAX_BODY_BYTES; default 256000)")
    add_config_args(p)
    add_model_args(p)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from elesium.api.app import create_app
    from elesium.api.settings import ApiSettings
    from elesium.cli.errors import CliError

    if not 0 < args.port < 65536:
        raise CliError(f"--port {args.port} is not a TCP port")
    limits = (("--max-prompt-tokens", args.max_prompt_tokens, 0),
              ("--max-tokens-cap", args.max_tokens_cap, 1), ("--max-body-bytes", args.max_body_bytes, 0))
    for flag, value, low in (("--workers", args.workers or 0, 0), ("--run-timeout", args.run_timeout, 0),
                             ("--lease-ttl", args.lease_ttl, 0.5), ("--grace", args.grace, 0),
                             *((f, v, lo) for f, v, lo in limits if v is not None)):
        if value < low:
            raise CliError(f"{flag} must be >= {low:g}, got {value:g}")
    load_project_env(args)  # a project's env may hold the server's own variables (ELESIUM_API_KEYS, ...)
    try:
        settings = ApiSettings.from_env(auth=not args.no_auth)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    settings.self_tuning = settings.self_tuning or args.self_tuning
    settings.workers, settings.run_timeout_s = args.workers or 0, args.run_timeout
    settings.queue_name = args.queue
    settings.lease_ttl_s, settings.shutdown_grace_s = args.lease_ttl, args.grace
    apply_limit_flags(settings, args)
    if settings.auth and not settings.api_keys:
        raise CliError(
            "no API keys: set ELESIUM_API_KEYS=key=tenant,... or ELESIUM_API_KEYS_FILE, "
            "or pass --no-auth for local use"
        )
    if not settings.auth:
        print(
            "elesium serve: AUTH DISABLED (--no-auth): every request is tenant 'default'; do not expose "
            f"{args.host}:{args.port}",
            file=sys.stderr,
        )
    else:
        print(
            f"elesium serve: {len(settings.api_keys)} API key(s), "
            f"{len(set(settings.api_keys.values()))} tenant(s)",
            file=sys.stderr,
        )
    registry = registry_from_args(args)  # the project's graphs, imported before the model loads
    print(f"elesium serve: graphs: {', '.join(w.name for w in registry.list())}", file=sys.stderr)
    engine = load_engine(args)
    if args.workers is None:  # every run the engine can batch gets a thread to drive it
        settings.workers = engine.batcher.slots if engine.batcher is not None else 1
    # Before the first request: a graph compiled by a request makes every request beside it wait.
    print(f"elesium serve: engine warmed up in {engine.warm_up():.1f} s", file=sys.stderr)
    app = create_app(settings, engine=engine, registry=registry)
    freeze_startup_heap()
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again for the handler it found.
    # The default handler would kill the process there, before atexit stops the embedded Valkey (left
    # running, re-parented to PID 1); this one ends it as a normal exit, so atexit runs.
    previous = signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                    timeout_graceful_shutdown=int(args.grace) + 5)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def apply_limit_flags(settings: ApiSettings, args: argparse.Namespace) -> None:
    """The limit flags given on the command line win over the environment's values."""
    if args.max_prompt_tokens is not None:
        settings.max_prompt_tokens = args.max_prompt_tokens or None
    if args.max_tokens_cap is not None:
        settings.max_tokens_cap = args.max_tokens_cap
    if args.max_body_bytes is not None:
        settings.max_body_bytes = args.max_body_bytes


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)
