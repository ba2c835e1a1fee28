"""``elesium bench-state``: ms per checkpointed LangGraph super-step, Redis against in-memory.

The measurement lives in ``elesium.cli.benchmarks.state_saver``; it is imported only when the command runs,
so ``elesium --help`` does not pay for langgraph.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-state", help="benchmark the Redis checkpointer against InMemorySaver")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for state_bench.json")
    p.add_argument("--steps", type=int, default=3000, help="super-steps timed per configuration")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from elesium.cli.benchmarks.state_saver import bench_checkpointer

    doc = bench_checkpointer(args.out, steps=args.steps)
    for name, row in doc["results"].items():
        print(f"{name:24s} p50 {row['p50_ms']:.3f} ms  p90 {row['p90_ms']:.3f} ms  per super-step")
    print(f"wrote {args.out / 'state_bench.json'}")
    return 0
