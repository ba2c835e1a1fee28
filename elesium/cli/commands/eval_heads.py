"""``elesium eval-heads``: each draft head (Medusa or Hydra)'s top-1/top-5 against the base model's
greedy continuation, and the whole drafter's acceptance by depth when it decodes (``--tree``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from elesium.cli.commands.common import add_model_args, load_engine, read_prompt_file


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-heads", help="score Medusa heads on a prompt set",
                       description="Generate the base model's greedy continuation of every prompt and score "
                       "how often head k's top-1 / top-5 contains the token k+1 past the next one.")
    p.add_argument("--prompts", type=Path, required=True,
                   help="JSONL with a 'prompt' field, or MT-Bench's 'turns' (first turn used)")
    p.add_argument("--max-tokens", type=int, default=256, help="greedy continuation length per prompt")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per batched forward")
    p.add_argument("--tree", action=argparse.BooleanOptionalAction, default=True,
                   help="also decode each prompt speculatively (greedy) and report the whole drafter's "
                   "tokens per step and acceptance by depth, under the engine's tree policy and as a top-1 "
                   "chain (default: on; --no-tree skips the two extra passes)")
    p.add_argument("--json", action="store_true",
                   help='print {"heads": [{"head", "top1", "top5"}...], "tokens", '
                   '"drafter": {"tree", "chain"}}')
    add_model_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from elesium.cli.errors import CliError
    from elesium.inference.drafters.drafter_tree import apply_draft_depth
    from elesium.inference.drafters.files import load_heads
    from elesium.inference.training.head_training import score_prompts

    if args.max_tokens < 2:
        raise CliError(f"--max-tokens must be >= 2 (a head needs a token past the next one), "
                       f"got {args.max_tokens}")
    if args.batch_size < 1:
        raise CliError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.heads == "none":
        raise CliError("--heads none leaves nothing to score; give a heads directory, or omit --heads "
                       "for the shipped heads")
    prompts = read_prompt_file(args.prompts)
    # The heads are loaded below, where a mismatch must raise (and --draft-depth applies to them).
    engine = load_engine(args, heads=None, draft_depth=None)
    heads = load_heads(args.heads, base_sha256=engine.weights_info.sha256, device=engine.model.device,
                       dtype=engine.model.dtype)
    if args.draft_depth is not None:
        apply_draft_depth(heads, args.draft_depth)
    result = score_prompts(engine.model, engine.tokenizer, heads, prompts, args.max_tokens, args.batch_size)
    if args.tree:
        from elesium.inference.tuning.benchmark import drafter_acceptance

        previous, engine.heads = engine.heads, heads
        try:
            result["drafter"] = drafter_acceptance(engine, prompts, args.max_tokens)
        finally:
            engine.heads = previous
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['prompts']} prompts, {result['tokens']} greedy tokens")
    print("head  top-1   top-5   positions")
    for h in result["heads"]:
        label = "  (attention drafter)" if h.get("source") == "drafter" else ""
        print(f"{h['head']:>4}  {h['top1']:.3f}   {h['top5']:.3f}   {h['positions']}{label}")
    if "mlp_head1" in result:
        h = result["mlp_head1"]
        print(f"   1  {h['top1']:.3f}   {h['top5']:.3f}   {h['positions']}  "
              "(Hydra MLP head 1, not used for drafting)")
    for name, d in result.get("drafter", {}).items():
        what = "the engine's tree policy" if name == "tree" else "a chain of top-1 drafts"
        by_depth = " / ".join(f"{r:.3f}" for r in d["accept_rate_by_depth"])
        given = " / ".join(f"{r:.3f}" for r in d.get("conditional", []))
        print(f"decoding under {what}: tau {d['tau']:.3f} over {d['steps']} steps, mean tree "
              f"{d['mean_tree_size']:.1f}; accepted by depth {by_depth}"
              + (f"; given the depth before {given}" if given else ""))
    return 0
