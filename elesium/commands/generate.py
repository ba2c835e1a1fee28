"""``elesium generate``: one prompt in, streamed text (or one JSON object) out."""

from __future__ import annotations

import argparse
import json
import sys

from elesium.commands.common import add_model_args, load_engine


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate an answer to one prompt")
    p.add_argument("prompt", help="the user message (rendered with the chat template unless --raw)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--mode", choices=["vanilla", "medusa", "typical"], default="medusa",
                   help="decoding mode; 'typical' is Medusa's relaxed acceptance and NOT distribution-exact")
    p.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_model_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from elesium.inference.sampling import SamplingParams

    if not args.prompt.strip():
        raise ValueError("prompt is empty")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop))
    engine = load_engine(args)
    mode = args.mode if args.mode in engine.modes else "vanilla"
    stream = engine.stream(args.prompt, params, mode=mode, raw=args.raw)
    for chunk in stream:
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    result = stream.result
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        sys.stdout.write("\n")
    return 0
