"""Greedy speculative output against vanilla, prompt by prompt, on the engine's default path.

``elesium bench`` times speculation under the engine's own tree policy; on a CPU whose tuned profile
picks a 3-node chain that would test only chains. This forces a dynamic tree (branching, up to
``--max-nodes`` nodes) so that every prompt also checks sibling nodes, and records for each prompt
whether the two outputs are identical, where they first differ, and both speeds.

    python benchmarks/greedy_equality.py --prompts tests/data/mt_bench_questions.jsonl --max-tokens 64 \\
        --max-nodes 16 --out benchmarks/cpu-2026-12-01-tree-step/equality_mt_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL with 'prompt' or MT-Bench 'turns'")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-nodes", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="float32: the eager reference; auto: the default path")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from elesium.inference.decoding.tree_policy import TreePolicy
    from elesium.inference.engine import Engine
    from elesium.inference.sampling import SamplingParams

    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] if "prompt" in r else r["turns"][0] for r in rows][: args.limit]
    started = time.perf_counter()
    engine = Engine.load(device=args.device, dtype=args.dtype)
    # A flat cost curve: the tree fills its budget, so branches are checked too (the tuned curve of a
    # CPU would shrink it to a chain).
    policy = TreePolicy(kind="dynamic", max_nodes=args.max_nodes)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    engine.generate(prompts[0], params, mode="vanilla")  # compile (or load) both graphs before timing
    engine.generate(prompts[0], params, mode="speculative", policy=policy)
    out = []
    for i, prompt in enumerate(prompts):
        t = time.perf_counter()
        vanilla = engine.generate(prompt, params, mode="vanilla")
        tv = time.perf_counter() - t
        t = time.perf_counter()
        spec = engine.generate(prompt, params, mode="speculative", policy=policy)
        ts = time.perf_counter() - t
        first = next((j for j, (a, b) in enumerate(zip(vanilla.token_ids, spec.token_ids)) if a != b), None)
        row = {"prompt": i, "identical": vanilla.token_ids == spec.token_ids, "first_difference": first,
               "tokens": len(vanilla.token_ids), "vanilla_tokens_per_s": len(vanilla.token_ids) / tv,
               "speculative_tokens_per_s": len(spec.token_ids) / ts, "tau": spec.mean_accepted,
               "mean_tree_size": statistics.mean(s.tree_size for s in spec.steps) if spec.steps else 0.0}
        out.append(row)
        print(f"[{i + 1}/{len(prompts)}] identical={row['identical']} tau {row['tau']:.2f} "
              f"vanilla {row['vanilla_tokens_per_s']:.1f} spec {row['speculative_tokens_per_s']:.1f} tok/s",
              flush=True)
    doc = {"engine": engine.describe(), "max_tokens": args.max_tokens, "max_nodes": args.max_nodes,
           "prompts": len(out), "identical": sum(r["identical"] for r in out),
           "median_vanilla_tokens_per_s": statistics.median(r["vanilla_tokens_per_s"] for r in out),
           "median_speculative_tokens_per_s": statistics.median(r["speculative_tokens_per_s"] for r in out),
           "median_tau": statistics.median(r["tau"] for r in out), "rows": out,
           "wall_s": round(time.perf_counter() - started, 1), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"identical {doc['identical']}/{len(out)}; median tau {doc['median_tau']:.2f}")


if __name__ == "__main__":
    main()
