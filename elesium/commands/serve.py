"""``elesium serve``: the API (LangGraph protocol, OpenAI-compatible, audit replay) under uvicorn.

Keys come from ``ELESIUM_API_KEYS`` / ``ELESIUM_API_KEYS_FILE``; without any, the server refuses to
start unless ``--no-auth`` is given, which it announces, so a forgotten variable never serves
everyone silently.
"""

from __future__ import annotations

import argparse
import sys

from elesium.commands.common import add_model_args, load_engine


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
    add_model_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from elesium.api.app import create_app
    from elesium.api.settings import ApiSettings
    from elesium.cli import CliError

    if not 0 < args.port < 65536:
        raise CliError(f"--port {args.port} is not a TCP port")
    settings = ApiSettings.from_env(auth=not args.no_auth)
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
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
