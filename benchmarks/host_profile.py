"""Where a decode step's host time goes: ``cProfile`` over whole generations, per Python function.

The step profile (``step_profile.py``) says how long the GPU waits for the host in a speculative step;
this says on what. Waiting for the GPU shows up inside the calls that synchronise (``.cpu()``,
``.tolist()``, ``.item()``), so their time is GPU time plus the host's, and the rest is pure host work.

Run: ``python3 -P benchmarks/host_profile.py --limit 4 --max-tokens 128 --out host_profile.json``
(the engine is built as ``elesium bench`` builds it). Prints the top functions by own time and by
cumulative time per mode; the JSON holds the same rows.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

from elesium.cli.commands.common import add_model_args, load_engine
from elesium.inference.prompts import read_prompts
from elesium.inference.sampling import SamplingParams


def rows(stats: pstats.Stats, key: str, limit: int, steps: int) -> list[dict[str, Any]]:
    """The top ``limit`` functions by ``key`` ("tottime" or "cumtime"), in µs per decode step."""
    entries = []
    for (path, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        entries.append({"function": f"{Path(path).name}:{line}({name})", "calls_per_step": calls / steps,
                        "own_us_per_step": 1e6 * tottime / steps, "cum_us_per_step": 1e6 * cumtime / steps})
    field = "own_us_per_step" if key == "tottime" else "cum_us_per_step"
    return sorted(entries, key=lambda e: -e[field])[:limit]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=Path, default=Path("tests/data/mt_bench_questions.jsonl"))
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("bench-out/host_profile.json"))
    add_model_args(p)
    opts = p.parse_args(argv)
    engine = load_engine(opts)
    prompts = read_prompts(opts.prompts, opts.limit)
    params = SamplingParams(max_tokens=opts.max_tokens, temperature=opts.temperature, seed=0)
    doc: dict[str, Any] = {"engine": engine.describe(), "prompts": len(prompts),
                           "max_tokens": opts.max_tokens, "temperature": opts.temperature, "modes": {},
                           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for mode in ("vanilla", "speculative"):
        if mode not in engine.modes:
            continue
        engine.generate(prompts[0], params, mode=mode)  # warm-up: graph capture, allocator
        profiler = cProfile.Profile()
        steps, tokens, start = 0, 0, time.perf_counter()
        for prompt in prompts:
            profiler.enable()
            result = engine.generate(prompt, params, mode=mode)
            profiler.disable()
            steps += len(result.steps)
            tokens += len(result.token_ids)
        wall = time.perf_counter() - start
        stats = pstats.Stats(profiler, stream=io.StringIO())
        doc["modes"][mode] = {"steps": steps, "tokens": tokens, "wall_s_profiled": wall,
                              "own": rows(stats, "tottime", opts.top, max(steps, 1)),
                              "cumulative": rows(stats, "cumtime", opts.top, max(steps, 1))}
        per_step = 1e3 * wall / max(steps, 1)
        print(f"\n== {mode}: {steps} steps, {tokens} tokens, {per_step:.3f} ms a step profiled")
        for title, key in (("own time", "own"), ("cumulative", "cumulative")):
            print(f"-- top by {title}, µs per step (calls per step)")
            for e in doc["modes"][mode][key]:
                us = e["own_us_per_step"] if key == "own" else e["cum_us_per_step"]
                print(f"{us:9.1f}  ({e['calls_per_step']:6.1f})  {e['function']}")
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
