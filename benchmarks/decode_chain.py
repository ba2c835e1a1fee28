"""Vanilla decoding on CUDA: the self-feeding chain against synchronous steps, side by side.

One engine, one process; for every prompt the two paths run back to back (the order alternating from
prompt to prompt), so the machine's drift hits both alike. Records each prompt's ms/token for both,
whether the tokens are identical, and the medians and the median of per-prompt ratios.

    python benchmarks/decode_chain.py --prompts tests/data/mt_bench_questions.jsonl --max-tokens 128 \\
        [--temperature 0.7] --out chain.json

Sampled runs are seeded with the prompt's index, so both paths must give the same tokens there too.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL with 'prompt' or MT-Bench 'turns'")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from elesium.inference.engine import Engine
    from elesium.inference.runtime.forward import CudaGraphRunner
    from elesium.inference.sampling import SamplingParams

    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] if "prompt" in r else r["turns"][0] for r in rows][: args.limit]
    engine = Engine.load(device="cuda")
    runner = engine.runner
    if not isinstance(runner, CudaGraphRunner):
        raise SystemExit("this compares CUDA-graph paths: the engine did not get a CUDA graph runner")
    def run(prompt: str, chains: bool, seed: int = 0) -> tuple[tuple[int, ...], float]:
        runner.chains = chains
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=seed)
        g = engine.generate(prompt, params, mode="vanilla")
        return g.token_ids, 1000.0 * g.elapsed_s / max(1, g.new_tokens)

    for chains in (True, False):  # capture both graphs before timing
        run(prompts[0], chains)
    out = []
    for i, prompt in enumerate(prompts):
        order = (True, False) if i % 2 == 0 else (False, True)
        res = {chains: run(prompt, chains, seed=i) for chains in order}
        (a, ms_chain), (b, ms_sync) = res[True], res[False]
        out.append({"prompt": i, "tokens": len(a), "identical": a == b,
                    "chain_ms_per_token": ms_chain, "sync_ms_per_token": ms_sync})
    runner.chains = True
    summary = {
        "prompts": len(out), "max_tokens": args.max_tokens, "temperature": args.temperature,
        "top_p": args.top_p, "identical": sum(r["identical"] for r in out),
        "chain_ms_per_token": statistics.median(r["chain_ms_per_token"] for r in out),
        "sync_ms_per_token": statistics.median(r["sync_ms_per_token"] for r in out),
        "speedup": statistics.median(r["sync_ms_per_token"] / r["chain_ms_per_token"] for r in out),
        "engine": engine.describe(),
    }
    args.out.write_text(json.dumps({"summary": summary, "prompts": out}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
