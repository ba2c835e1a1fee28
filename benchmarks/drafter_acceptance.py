"""The whole drafter decoding, on prompt files: what ``elesium eval-heads --tree`` reports.

For each file: greedy speculative decoding under the engine's tree policy and as a top-1 chain, tokens
per step (tau) and acceptance by depth (``tuning/benchmark.drafter_acceptance``). The engine is built as
``elesium bench`` builds it (shipped heads and profile). ``eval-heads`` adds each head's top-1 / top-5;
this script exists for machines without the CLI's dependencies (the GPU device lacks langgraph, which
``elesium.cli`` imports).

Run: ``python3 -P benchmarks/drafter_acceptance.py --prompts A.jsonl B.jsonl --max-tokens 128 --out out.json``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from elesium.cli.commands.common import add_model_args, load_engine
from elesium.inference.prompts import read_prompts
from elesium.inference.tuning.benchmark import drafter_acceptance


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=Path, nargs="+", required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, required=True)
    add_model_args(p)
    opts = p.parse_args(argv)
    engine = load_engine(opts)
    doc = {"engine": engine.describe(), "max_tokens": opts.max_tokens, "files": {},
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for path in opts.prompts:
        prompts = read_prompts(path, None)
        start = time.perf_counter()
        result = drafter_acceptance(engine, prompts, opts.max_tokens)
        doc["files"][path.name] = {"prompts": len(prompts), "seconds": time.perf_counter() - start, **result}
        for name, d in result.items():
            print(f"{path.name} {name}: tau {d['tau']:.3f}, mean tree {d['mean_tree_size']:.1f}, "
                  f"steps {d['steps']}, accepted by depth {d['accept_rate_by_depth']}"
                  + (f", given the depth before {d['conditional']}" if "conditional" in d else ""),
                  flush=True)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
