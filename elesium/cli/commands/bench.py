"""``elesium bench``: vanilla against speculative decoding, side by side; writes bench.json + plots."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from elesium.cli.commands.common import add_model_args, load_engine, read_prompt_file


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure speculative decoding against vanilla on a prompt file")
    p.add_argument("--prompts", required=True, type=Path, help="JSONL with 'prompt', or MT-Bench 'turns'")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="base seed (default: the prompt's index)")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--mode", choices=["speculative", "medusa", "typical"], default="speculative",
                   help="the mode to time against vanilla (medusa: the old name of speculative); "
                   "names bench.json's keys")
    p.add_argument("--vanilla-only", action="store_true", help="time vanilla decoding alone")
    p.add_argument("--no-cuda-graphs", action="store_true", help="eager launches on CUDA (for comparison)")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    add_model_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from elesium.cli.errors import CliError
    from elesium.inference.records import normalize_mode
    from elesium.inference.sampling import SamplingParams
    from elesium.inference.tuning.benchmark import run_bench, write_plots

    mode = normalize_mode(args.mode)
    prompts = read_prompt_file(args.prompts, args.limit)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    engine = load_engine(args, cuda_graphs=False if args.no_cuda_graphs else None)
    if not args.vanilla_only and mode not in engine.modes:
        raise CliError(f"mode {mode!r} needs draft heads, and none are loaded for this model; "
                       "use --vanilla-only")

    def progress(i: int, row: dict) -> None:
        extra = f" speedup {row['speedup']:.2f}x tau {row['mean_accepted']:.2f}" if "speedup" in row else ""
        print(f"[{i + 1}/{len(prompts)}] vanilla {row['vanilla_ms_per_token']:.1f} ms/token{extra}",
              file=sys.stderr, flush=True)

    doc = run_bench(engine, prompts, params, mode, progress, vanilla_only=args.vanilla_only)
    # What was measured: heads (and their depth, through the sha256), profile, numerics, step form.
    doc["engine"] = engine.describe() | {"policy": {"max_nodes": engine.policy.max_nodes,
                                                    "expand_width": engine.policy.expand_width,
                                                    "topk": engine.policy.topk}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(doc, indent=1))
    write_plots(doc, args.out)
    summary = {k: doc[k] for k in ("prompts", "device", "dtype", "vanilla") if k in doc}
    if "speedup" in doc:
        summary |= {"speedup": doc["speedup"], mode: {k: v for k, v in doc[mode].items()
                                                       if k != "accept_rate_by_depth"},
                    "identical_outputs": doc["identical_outputs"]}
    print(json.dumps(summary, indent=1))
    return 0
