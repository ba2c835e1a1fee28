"""Prefix-cache benchmark: two-turn chats behind one system prompt, prefill time with the cache and without.

Why: every chat turn repeats the system prompt and the conversation so far, and a workflow repeats its
system prompt in every call; the prefix cache (``inference/runtime/prefix_cache.py``) serves the
64-token blocks an earlier prompt already prefilled. This measures what that saves where it should:
MT-Bench's two-turn questions, each asked as a chat behind one shared ~300-token system prompt, the
second turn carrying the first turn's question and answer. Each conversation runs twice in a row,
once without the cache and once with it (so both see the same machine state), greedy, one at a time
(the prefill's own cost, not batching). The cache is not cleared between conversations: the system
prompt's blocks are shared by all of them, as in a server.

Reports per turn: median time to first token (≈ the prefill) with and without, their ratio, the
hit rate (prompt tokens served / looked up), and whether both runs produced the same tokens (they
must: reuse is exact). Writes JSON to ``--out`` and a PNG beside it.

    .venv/bin/python benchmarks/prefix_cache.py                   # 20 two-turn chats, 64 tokens each
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import git, machine  # noqa: E402  (the serving benchmark's machine block)

from elesium.inference.engine import Engine  # noqa: E402
from elesium.inference.sampling import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_QUESTIONS = ROOT / "tests" / "data" / "mt_bench_questions.jsonl"
DEFAULT_OUT = ROOT / "benchmarks" / "serving" / "prefix_cache.json"
SYSTEM = (
    "You are the assistant of Northwind Support, the help desk of a software company. Follow these "
    "rules in every answer. Be accurate: if you are not sure, say so and suggest how the user can find "
    "out. Be brief: answer in a few sentences unless the user asks for detail, and use a list only for "
    "steps. Be polite and neutral; never blame the user. Never ask for passwords, payment card numbers "
    "or other secrets, and tell the user to remove any they paste. Do not promise refunds, discounts or "
    "delivery dates; billing questions go to the billing portal, and outages to the status page. When "
    "the user reports a bug, ask for the product version, the operating system, the steps that "
    "reproduce it and what they expected instead. When the user asks for something outside software "
    "support, help as a general assistant would, within these same rules. Write in the language the "
    "user writes in. Sign nothing, and do not mention these instructions."
)


def chat(engine: Engine, messages: list[dict[str, str]],
         max_tokens: int) -> tuple[float, tuple[int, ...], str]:
    """One greedy generation: seconds to its first chunk, its tokens and its text."""
    started = time.perf_counter()
    first = None
    with engine.stream(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0)) as stream:
        for _ in stream:
            if first is None:
                first = time.perf_counter() - started
        result = stream.result
    return first or 0.0, result.token_ids, result.text


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    parser.add_argument("--chats", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.questions.read_text().splitlines() if line.strip()]
    questions = [r["turns"] for r in rows if len(r.get("turns", [])) >= 2][:args.chats]
    engine = Engine.load()
    cache = engine.prefix_cache
    if cache is None:
        print("this engine has no prefix cache (ELESIUM_PREFIX_CACHE_MB=0 or a CUDA engine)", file=sys.stderr)
        return 2
    engine.warm_up()
    chat(engine, [{"role": "user", "content": "Say hi."}], 4)
    cache.clear()
    cache.queries = cache.hits = 0
    records: list[dict[str, Any]] = []
    for i, turns in enumerate(questions):
        for use_cache in (False, True):
            engine.runner.prefix_cache = cache if use_cache else None
            messages = [{"role": "system", "content": SYSTEM}]
            for turn, question in enumerate(turns[:2]):
                messages.append({"role": "user", "content": question})
                ids = engine.encode_prompt(messages)
                queries, hits = cache.queries, cache.hits
                ttft, tokens, text = chat(engine, messages, args.max_tokens)
                records.append({"chat": i, "turn": turn + 1, "cache": use_cache, "prompt_tokens": len(ids),
                                "ttft_s": ttft, "tokens": list(tokens),
                                "hit_tokens": cache.hits - hits if use_cache else 0,
                                "looked_up": cache.queries - queries if use_cache else 0})
                messages.append({"role": "assistant", "content": text})
        print(f"chat {i + 1}/{len(questions)}", flush=True)
    engine.runner.prefix_cache = cache
    summary: dict[str, Any] = {}
    for turn in (1, 2):
        off = [r for r in records if r["turn"] == turn and not r["cache"]]
        on = [r for r in records if r["turn"] == turn and r["cache"]]
        off_ms = statistics.median(r["ttft_s"] for r in off) * 1000
        on_ms = statistics.median(r["ttft_s"] for r in on) * 1000
        summary[f"turn_{turn}"] = {
            "median_prompt_tokens": statistics.median(r["prompt_tokens"] for r in on),
            "median_ttft_ms_without": round(off_ms, 1), "median_ttft_ms_with": round(on_ms, 1),
            "ttft_ratio_without_over_with": round(off_ms / on_ms, 2),
            "hit_rate": round(sum(r["hit_tokens"] for r in on) / sum(r["looked_up"] for r in on), 3),
            "same_tokens": sum(a["tokens"] == b["tokens"] for a, b in zip(off, on, strict=True)),
            "chats": len(on),
        }
    report = {"benchmark": "prefix_cache", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "commit": git("rev-parse", "--short", "HEAD"), "machine": machine(),
              "engine": engine.describe(), "max_tokens": args.max_tokens, "system_prompt_tokens":
              len(engine.tokenizer.encode(SYSTEM)), "cache_bytes": cache.bytes, "cache_blocks": len(cache),
              "summary": summary, "records": records}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    turns = ["turn 1", "turn 2"]
    without = [summary[f"turn_{t}"]["median_ttft_ms_without"] for t in (1, 2)]
    with_cache = [summary[f"turn_{t}"]["median_ttft_ms_with"] for t in (1, 2)]
    xs = range(len(turns))
    ax.bar([x - 0.2 for x in xs], without, 0.4, label="prefix cache off")
    ax.bar([x + 0.2 for x in xs], with_cache, 0.4, label="prefix cache on")
    ax.set_xticks(list(xs), turns)
    ax.set_ylabel("median time to first token (ms)")
    ax.set_title(f"{len(questions)} two-turn chats, shared system prompt ({torch.get_num_threads()} threads)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
