"""Prompt evaluation and decoding apart, ours against llama.cpp, on the same GGUF, prompts and threads.

``cpu_vs_llamacpp.py`` times whole generations (prompt evaluation included), which is what a user sees;
this splits them, so a comparison says where each engine spends its time, and it measures a llama.cpp
build whose batched prompt evaluation does not run (``--llama-decode-only``: seen with the AMX build on a
Sapphire Rapids VM, where evaluating more than one token at once stopped the process with an illegal
instruction).

For each prompt, in rotating order: ours, prompt evaluation = the first token's latency of a greedy
generation (prefill and one step) and decoding = (whole generation - that) / (tokens - 1), the engine's
default configuration; llama.cpp, prompt evaluation = one ``eval`` of the prompt ids, decoding = one
``eval`` per token (the greedy tokens our engine produced, so both read the same contexts). Medians over
prompts.

    PYTHONPATH=<llama-cpp-python> python benchmarks/cpu_prefill_decode.py \\
        --prompts tests/data/mt_bench_questions.jsonl --limit 10 --out bench-out/prefill_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-decode-only", action="store_true",
                   help="llama.cpp evaluates the prompt one token at a time and reports no prompt figure")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    import llama_cpp

    from elesium.inference.engine import Engine
    from elesium.inference.sampling import SamplingParams
    from elesium.inference.tuning.profile import cpu_signature

    torch.set_num_threads(args.threads)
    engine = Engine.load(device="cpu", max_len=2048)
    llm = llama_cpp.Llama(model_path=str(engine.weights_info.source), n_threads=args.threads,
                          n_threads_batch=args.threads, n_ctx=2048, n_batch=512, verbose=False, seed=0)
    rows_in = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [r["turns"][0] if "turns" in r else r["prompt"] for r in rows_in][:args.limit]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    engine.generate(prompts[0], SamplingParams(max_tokens=4), mode="vanilla")  # compile or load the graph

    def ours(prompt: str) -> dict[str, Any]:
        first = engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), mode="vanilla")
        whole = engine.generate(prompt, greedy, mode="vanilla")
        n = len(whole.token_ids)
        return {"prompt_ms": 1e3 * first.elapsed_s,
                "decode_ms_per_token": 1e3 * (whole.elapsed_s - first.elapsed_s) / max(1, n - 1),
                "tokens": list(whole.token_ids)}

    def llama(ids: list[int], tokens: list[int]) -> dict[str, Any]:
        llm.reset()
        t0 = time.perf_counter()
        if args.llama_decode_only:
            for tok in ids:
                llm.eval([tok])
        else:
            llm.eval(ids)
        t1 = time.perf_counter()
        for tok in tokens:
            llm.eval([tok])
        t2 = time.perf_counter()
        return {"prompt_ms": None if args.llama_decode_only else 1e3 * (t1 - t0),
                "decode_ms_per_token": 1e3 * (t2 - t1) / max(1, len(tokens))}

    rows = []
    for i, prompt in enumerate(prompts):
        ids = engine.encode_prompt(prompt)
        if i % 2 == 0:
            a = ours(prompt)
            b = llama(ids, a["tokens"])
        else:
            warm = ours(prompt)  # llama.cpp replays our tokens, so ours runs first; time it again after
            b = llama(ids, warm["tokens"])
            a = ours(prompt)
        rows.append({"prompt": i, "prompt_tokens": len(ids), "tokens": len(a.pop("tokens")), "ours": a,
                     "llama.cpp": b, "loadavg": os.getloadavg()[0]})
        print(json.dumps(rows[-1]), flush=True)

    def med(system: str, key: str) -> float | None:
        vals = [r[system][key] for r in rows if r[system][key] is not None]
        return statistics.median(vals) if vals else None

    summary = {s: {k: med(s, k) for k in ("prompt_ms", "decode_ms_per_token")} for s in ("ours", "llama.cpp")}
    result = {"machine": {"cpu": cpu_signature(), "threads": args.threads, "torch": torch.__version__},
              "llama_cpp": {"version": llama_cpp.__version__,
                            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                            "decode_only": args.llama_decode_only},
              "engine": engine.describe(), "max_tokens": args.max_tokens, "summary": summary,
              "per_prompt": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
