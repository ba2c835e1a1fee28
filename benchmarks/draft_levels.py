"""Speculation with the drafting cut to the tree's depth, against full-depth drafting and vanilla.

One engine, one process; per prompt the three systems run back to back, the order rotating from prompt to
prompt. "full depth" restores the drafting before ``TreePolicy.draft_levels`` (every head's level, whatever
the tree can use) by patching that method for its runs only. The engine's own policy is used (on the
shipped CPU profile: the static two-draft chain), greedy. Records ms/token per prompt, tau, whether each
output equals vanilla's, and the medians (ratios: medians of per-prompt ratios).

    python benchmarks/draft_levels.py --prompts tests/data/mt_bench_questions.jsonl --limit 8 \\
        --max-tokens 64 --out draft_levels.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", type=Path, required=True)
    opts = p.parse_args(argv)

    from elesium.inference.decoding.tree_policy import TreePolicy
    from elesium.inference.engine import Engine
    from elesium.inference.prompts import read_prompts
    from elesium.inference.sampling import SamplingParams

    prompts = read_prompts(opts.prompts, opts.limit)
    engine = Engine.load(device=opts.device)
    trimmed = TreePolicy.draft_levels

    def full_depth(self: TreePolicy, heads: int) -> int:
        return heads

    def run(name: str, prompt: str) -> dict[str, Any]:
        TreePolicy.draft_levels = full_depth if name == "speculative_full_depth" else trimmed  # type: ignore[method-assign]
        try:
            mode = "vanilla" if name == "vanilla" else "speculative"
            g = engine.generate(prompt, SamplingParams(max_tokens=opts.max_tokens), mode=mode)
        finally:
            TreePolicy.draft_levels = trimmed  # type: ignore[method-assign]
        return {"tokens": list(g.token_ids), "ms": 1000.0 * g.elapsed_s / max(1, g.new_tokens),
                "tau": g.mean_accepted}

    names = ["vanilla", "speculative", "speculative_full_depth"]
    start = time.perf_counter()
    for name in names:  # compile and warm every path before timing
        run(name, prompts[0])
    warm_s = time.perf_counter() - start
    rows = []
    for i, prompt in enumerate(prompts):
        order = names[i % len(names):] + names[:i % len(names)]
        res = {name: run(name, prompt) for name in order}
        base = res["vanilla"]["tokens"]
        rows.append({name: {"ms_per_token": r["ms"], "tau": r["tau"], "identical": r["tokens"] == base}
                     for name, r in res.items()})
    summary: dict[str, Any] = {"prompts": len(rows), "max_tokens": opts.max_tokens,
                               "engine": engine.describe(), "policy": repr(engine.policy),
                               "warm_up_s": warm_s, "loadavg": os.getloadavg(),
                               "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    for name in names:
        summary[name] = {
            "ms_per_token": statistics.median(r[name]["ms_per_token"] for r in rows),
            "tau": statistics.median(r[name]["tau"] for r in rows),
            "identical_to_vanilla": sum(r[name]["identical"] for r in rows),
            "speedup_over_vanilla": statistics.median(
                r["vanilla"]["ms_per_token"] / r[name]["ms_per_token"] for r in rows)}
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps({"summary": summary, "prompts": rows}, indent=1, default=str))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("engine",)}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
