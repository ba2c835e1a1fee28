"""``elesium train-heads``: self-distil the base model, train draft heads, write heads + manifest.

The defaults are the recipe of the shipped heads (Hydra, chain, 2 blocks, 8,000 prompts, 5,000 steps,
an attention drafter for level 1 trained for 3,000 steps, stored ``mixed``), so that ``elesium train-heads --device cuda`` reproduces them; a test holds the
defaults to the shipped manifest.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from elesium.commands.common import add_model_args, load_engine


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-heads", help="train draft heads for the loaded model (self-distillation)",
                       description="Generate self-distillation data (or read --data), cache the base model's "
                       "hidden states, train the heads and write heads.safetensors + manifest.json to --out. "
                       "The defaults are the shipped heads' recipe (HEADS.md).")
    p.add_argument("--out", type=Path, default=Path("heads-out"), help="output directory (default: heads-out)")
    p.add_argument("--data", type=Path, default=None,
                   help="distillation JSONL(.gz) from an earlier run (default: generate, save to OUT/distill.jsonl.gz)")
    p.add_argument("--prompts", type=int, default=8000, help="prompts to generate when --data is not given")
    p.add_argument("--distill-only", action="store_true",
                   help="stop once OUT/distill.jsonl.gz is written; the same command without this flag then "
                   "trains on it (lets a time-limited machine split the recipe)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap while distilling")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7],
                   help="one answer per prompt at each temperature (0 = greedy)")
    p.add_argument("--gen-batch", type=int, default=64, help="sequences per batched forward")
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=2, help="residual blocks per head")
    p.add_argument("--kind", choices=["medusa", "hydra"], default="hydra",
                   help="hydra: heads that also read the embeddings of the tokens drafted before them")
    p.add_argument("--conditioning", choices=["concat", "chain"], default="chain",
                   help="hydra only: concat (Hydra's: every earlier embedding) or chain (the previous head's output)")
    p.add_argument("--loss", choices=["kl", "ce"], default="kl",
                   help="kl: to the base model's distribution; ce: to the token in the data")
    p.add_argument("--decay", type=float, default=0.8, help="head k's loss weight is DECAY**k")
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=4096, help="positions per optimiser step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    p.add_argument("--time-budget", type=float, default=None, help="stop training after this many seconds")
    p.add_argument("--eval-prompts", type=Path, default=None,
                   help="JSONL (prompt / MT-Bench turns) to score the finished heads on")
    p.add_argument("--eval-max-tokens", type=int, default=256)
    p.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    p.add_argument("--storage", choices=["float", "int8", "int4", "mixed"], default="mixed",
                   help="weight matrices on disk: float (--save-dtype), int8 (per row), int4 (per 32 inputs) or "
                   "mixed (int8 for Hydra's skip matrices, int4 for the rest); the final evaluation scores the "
                   "weights as stored")
    p.add_argument("--drafter", choices=["attention", "none"], default="attention",
                   help="attention: also train an EAGLE-style attention drafter for the first draft level "
                   "(hydra heads only; HEADS.md); none: the heads alone")
    p.add_argument("--drafter-steps", type=int, default=3000)
    p.add_argument("--drafter-batch", type=int, default=32, help="whole sequences per drafter step")
    p.add_argument("--drafter-lr", type=float, default=1e-3)
    p.add_argument("--drafter-intermediate", type=int, default=None,
                   help="the drafter layer's MLP width (default: the base model's)")
    add_model_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from elesium.inference.training.head_training import TrainConfig, train

    for name in ("prompts", "steps", "batch_size", "gen_batch", "num_heads", "num_layers", "max_new_tokens",
                 "drafter_steps", "drafter_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.drafter_intermediate is not None and args.drafter_intermediate < 1:
        raise ValueError(f"--drafter-intermediate must be >= 1, got {args.drafter_intermediate}")
    if args.drafter != "none" and args.kind != "hydra":
        raise ValueError("--drafter attention drafts level 1 for hydra heads; add --drafter none for --kind medusa")
    if args.data is not None and not args.data.exists():
        raise FileNotFoundError(f"--data file not found: {args.data}")
    if args.eval_prompts is not None and not args.eval_prompts.exists():
        raise FileNotFoundError(f"--eval-prompts file not found: {args.eval_prompts}")
    cfg = TrainConfig(
        out=args.out, data=args.data, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
        temperatures=tuple(args.temperatures), gen_batch=args.gen_batch, num_heads=args.num_heads,
        num_layers=args.num_layers, kind=args.kind, conditioning=args.conditioning, loss=args.loss, decay=args.decay, steps=args.steps, batch_size=args.batch_size,
        lr=args.lr, warmup=min(args.warmup, args.steps), eval_every=args.eval_every, ckpt_every=args.ckpt_every,
        seed=args.seed, resume=args.resume, time_budget_s=args.time_budget, eval_prompts=args.eval_prompts,
        eval_max_tokens=args.eval_max_tokens, save_dtype=args.save_dtype, storage=args.storage,
        distill_only=args.distill_only, drafter=args.drafter, drafter_steps=args.drafter_steps,
        drafter_batch=args.drafter_batch, drafter_lr=args.drafter_lr, drafter_intermediate=args.drafter_intermediate,
        command="elesium train-heads " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["train-heads"] else []))
    engine = load_engine(args)
    train(cfg, engine, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(cfg.out)
    return 0
