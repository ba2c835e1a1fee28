"""``elesium generate``: one prompt in, streamed text (or one JSON object) out.

``--mode`` defaults to the engine's own choice (``Engine.default_mode``: speculative when draft heads
are loaded and this device's tuning profile found speculation faster, vanilla otherwise), so the
command, the library and the shipped profiles agree. An explicit speculative mode on an engine
without heads is an error, never a silent vanilla run. ``--json`` states what the engine chose and why.
"""

from __future__ import annotations

import argparse
import json
import sys

from elesium.cli.commands.common import add_model_args, load_engine

MODES = ("vanilla", "speculative", "typical", "medusa")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate an answer to one prompt")
    p.add_argument("prompt", help="the user message (rendered with the chat template unless --raw)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="decoding mode (default: the engine's, which follows this device's tuning profile); "
                   "speculative (alias medusa) is exact tree verification; 'typical' is Medusa's relaxed "
                   "acceptance and NOT distribution-exact")
    p.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (the result, and what the engine chose and why), not text")
    add_model_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from elesium.cli.errors import CliError
    from elesium.inference.sampling import SamplingParams

    if not args.prompt.strip():
        raise CliError("prompt is empty")
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop))
    except ValueError as exc:  # the parameters' own validation: the user's to fix
        raise CliError(str(exc)) from None
    engine = load_engine(args)
    mode = engine.resolve_mode(args.mode)  # a speculative mode without heads raises, in one line
    stream = engine.stream(args.prompt, params, mode=mode, raw=args.raw)
    with stream:
        for chunk in stream:
            if not args.json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    result = stream.result
    if args.json:
        chosen = engine.describe()
        chosen["mode"] = mode
        chosen["mode_reason"] = "--mode given" if args.mode is not None else chosen["mode_reason"]
        print(json.dumps(result.to_dict() | {"engine": chosen}))
    else:
        sys.stdout.write("\n")
    return 0
