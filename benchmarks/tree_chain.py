"""Speculative decoding on CUDA: the self-feeding tree step against the host tree step and vanilla,
side by side, greedy or sampled.

One engine, one process; for every prompt each system runs back to back, the order rotating from
prompt to prompt, so the machine's drift hits all alike. Systems: vanilla (its own chain), the host
tree step (``runner.tree_chains = False``: the engine's tuned dynamic trees), and the device tree
step (``runtime/tree_chain.py``) at each ``--nodes`` size. Records each prompt's ms/token, tokens per
step (tau) and whether the tokens equal vanilla's; then the medians over prompts and the medians of
per-prompt ratios to vanilla. At ``--temperature`` > 0 every system samples with prompt i's seed i
(as ``elesium bench`` does), so "identical" is recorded only for greedy runs.

    python benchmarks/tree_chain.py --prompts tests/data/mt_bench_questions.jsonl --max-tokens 128 \\
        --nodes 16,32,48 --out tree_chain.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL with 'prompt' or MT-Bench 'turns'")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--nodes", default="16,32", help="device tree sizes to run (comma-separated)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--eager-logic", action="store_true",
                    help="also run each chain with its tree logic as eager kernels (not torch.compile)")
    ap.add_argument("--topk-chunk", type=int, default=None,
                    help="also run each chain with the drafting's top-k selected in slices of this width "
                    "(top_logprobs.top_logprobs; the vocabulary's width: the shifted form alone)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from elesium.inference.engine import Engine
    from elesium.inference.runtime.forward import CudaGraphRunner
    from elesium.inference.sampling import SamplingParams

    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] if "prompt" in r else r["turns"][0] for r in rows][: args.limit]
    engine = Engine.load(device="cuda")
    runner = engine.runner
    if not isinstance(runner, CudaGraphRunner) or engine.heads is None:
        raise SystemExit("this compares CUDA-graph tree steps: no CUDA graph runner or no heads")
    greedy = args.temperature == 0.0
    systems: dict[str, tuple[str, bool, object, bool, int | None]] = {
        "vanilla": ("vanilla", True, None, True, None), "host_tree": ("speculative", False, None, True, None)}
    for n in (int(x) for x in args.nodes.split(",")):
        policy = dataclasses.replace(engine.policy, max_nodes=n)
        systems[f"chain_{n}"] = ("speculative", True, policy, True, None)
        if args.eager_logic:
            systems[f"chain_{n}_eager_logic"] = ("speculative", True, policy, False, None)
        if args.topk_chunk is not None:
            systems[f"chain_{n}_topk_chunk_{args.topk_chunk}"] = ("speculative", True, policy, True,
                                                                  args.topk_chunk)

    def run(prompt: str, name: str, seed: int) -> dict:
        mode, chains, policy, compiled, chunk = systems[name]
        runner.tree_chains = chains
        runner.compile_tree_logic = compiled
        runner.draft_topk_chunk = chunk
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed)
        g = engine.generate(prompt, params, mode=mode, policy=policy)
        return {"tokens": g.token_ids, "ms": 1000.0 * g.elapsed_s / max(1, g.new_tokens),
                "tau": g.mean_accepted}

    default_chunk = runner.draft_topk_chunk  # restored after the runs
    for name in systems:  # capture every graph before timing
        run(prompts[0], name, 0)
    names = list(systems)
    out = []
    for i, prompt in enumerate(prompts):
        order = names[i % len(names):] + names[:i % len(names)]
        res = {name: run(prompt, name, i) for name in order}
        base = res["vanilla"]["tokens"]
        out.append({"prompt": i, "tokens": len(base)} | {
            name: {"ms_per_token": r["ms"], "tau": r["tau"], "identical": greedy and r["tokens"] == base}
            for name, r in res.items()})
    runner.tree_chains = runner.compile_tree_logic = True
    runner.draft_topk_chunk = default_chunk
    summary: dict = {"prompts": len(out), "max_tokens": args.max_tokens, "temperature": args.temperature,
                     "engine": engine.describe(), "host_policy_max_nodes": engine.policy.max_nodes}
    for name in names:
        summary[name] = {
            "ms_per_token": statistics.median(r[name]["ms_per_token"] for r in out),
            "tau": statistics.median(r[name]["tau"] for r in out),
            "identical_to_vanilla": sum(r[name]["identical"] for r in out),
            "speedup_over_vanilla": statistics.median(
                r["vanilla"]["ms_per_token"] / r[name]["ms_per_token"] for r in out)}
    args.out.write_text(json.dumps({"summary": summary, "prompts": out}, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "engine"}))


if __name__ == "__main__":
    main()
