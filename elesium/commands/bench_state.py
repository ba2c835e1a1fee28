"""``elesium bench-state``: ms per checkpointed LangGraph super-step, Redis against in-memory."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-state", help="benchmark the Redis checkpointer against InMemorySaver")
    p.add_argument("--out", default="bench-out", help="directory for state_bench.json")
    p.add_argument("--steps", type=int, default=None, help="super-steps to time per saver")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from elesium.state.bench import main

    argv = ["--out", args.out] + (["--steps", str(args.steps)] if args.steps else [])
    return main(argv)
