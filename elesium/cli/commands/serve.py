"""``elesium serve``: the API (LangGraph protocol, OpenAI-compatible, audit replay) under uvicorn.

Keys come from ``ELESIUM_API_KEYS`` / ``ELESIUM_API_KEYS_FILE``; without any, the server refuses to
start unless ``--no-auth`` is given, which it announces, so a forgotten variable never serves
everyone silently.

Runs go through the durable run queue in Redis. By default this process also executes them
(``--workers 1``); ``--workers 0`` makes it a pure API server, with ``elesium worker`` processes on
any machine doing the work. On SIGTERM uvicorn stops taking requests and in-flight runs get
``--grace`` seconds before they are handed back to the queue.
"""

from __future__ import annotations

import argparse
import signal
import sys

from elesium.cli.commands.common import add_model_args, load_engine


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve the API: LangGraph protocol, /v1/chat/completions, replay, metrics"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="accept requests without an API key (local use only; every caller is tenant 'default')",
    )
    p.add_argument("--workers", type=int, default=1,
                   help="queued runs this process executes at once (0: leave them to `elesium worker`)")
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
    add_model_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from elesium.api.app import create_app
    from elesium.api.settings import ApiSettings
    from elesium.cli.errors import CliError

    if not 0 < args.port < 65536:
        raise CliError(f"--port {args.port} is not a TCP port")
    for flag, value, low in (("--workers", args.workers, 0), ("--run-timeout", args.run_timeout, 0),
                             ("--lease-ttl", args.lease_ttl, 0.5), ("--grace", args.grace, 0)):
        if value < low:
            raise CliError(f"{flag} must be >= {low:g}, got {value:g}")
    try:
        settings = ApiSettings.from_env(auth=not args.no_auth)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    settings.self_tuning = settings.self_tuning or args.self_tuning
    settings.workers, settings.run_timeout_s, settings.queue_name = args.workers, args.run_timeout, args.queue
    settings.lease_ttl_s, settings.shutdown_grace_s = args.lease_ttl, args.grace
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
    engine = load_engine(args)
    app = create_app(settings, engine=engine)
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


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)
