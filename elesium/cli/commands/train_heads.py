"""``elesium train-heads``: self-distil the base model, train draft heads, write heads + manifest.

The defaults are ``TrainConfig``'s, which are the recipe of the shipped heads (Hydra, chain, 2 blocks,
8,000 prompts, 5,000 steps, an attention drafter for level 1 trained for 3,000 steps, stored
``mixed``), so that ``elesium train-heads --device cuda`` reproduces them; a test holds the defaults
to the shipped manifest.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from elesium.cli.commands.common import add_model_args, add_state_args, load_engine, settings_from_args
from elesium.inference.training.train_config import TrainConfig


def register(sub: argparse._SubParsersAction) -> None:
    d = TrainConfig()  # the flags' defaults are the library's: one recipe
    p = sub.add_parser("train-heads", help="train draft heads for the loaded model (self-distillation)",
                       description="Generate self-distillation data (or read --data), cache the base model's "
                       "hidden states, train the heads and write heads.safetensors + manifest.json to --out. "
                       "The defaults are the shipped heads' recipe (HEADS.md).")
    p.add_argument("--out", type=Path, default=d.out, help="output directory (default: heads-out)")
    p.add_argument("--data", type=Path, default=d.data,
                   help="distillation JSONL(.gz) from an earlier run "
                   "(default: generate, save to OUT/distill.jsonl.gz)")
    p.add_argument("--from-log", action="store_true",
                   help="distil from the service's own traffic instead of generating: every LLM call of "
                   "the succeeded runs in the acceptance log (prompt and answer), written to "
                   "OUT/from-log.jsonl.gz")
    p.add_argument("--workflow", default=None,
                   help="with --from-log: only this workflow's runs (default: all)")
    p.add_argument("--exclude-prompts", action="store_true",
                   help="with --from-log: train on the answers alone; no prompt token reaches the data file")
    p.add_argument("--prefix", default="elesium",
                   help="with --from-log: key root of the runs and acceptance logs (default: elesium)")
    p.add_argument("--prompts", type=int, default=d.prompts,
                   help="prompts to generate when --data is not given")
    p.add_argument("--distill-only", action="store_true",
                   help="stop once OUT/distill.jsonl.gz is written; the same command without this flag then "
                   "trains on it (lets a time-limited machine split the recipe)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help="answer length cap while distilling")
    p.add_argument("--temperatures", type=float, nargs="+", default=list(d.temperatures),
                   help="one answer per prompt at each temperature (0 = greedy)")
    p.add_argument("--gen-batch", type=int, default=d.gen_batch, help="sequences per batched forward")
    p.add_argument("--num-heads", type=int, default=d.num_heads)
    p.add_argument("--num-layers", type=int, default=d.num_layers, help="residual blocks per head")
    p.add_argument("--kind", choices=["medusa", "hydra", "eagle"], default=d.kind,
                   help="hydra: heads that also read the embeddings of the tokens drafted before them; "
                   "eagle: no heads, the attention drafter drafts all --num-heads levels from its own "
                   "features (trained unrolled over them; --drafter-* flags apply)")
    p.add_argument("--conditioning", choices=["concat", "chain"], default=d.conditioning,
                   help="hydra only: concat (Hydra's: every earlier embedding) or chain "
                   "(the previous head's output)")
    p.add_argument("--loss", choices=["kl", "ce"], default=d.loss,
                   help="kl: to the base model's distribution; ce: to the token in the data")
    p.add_argument("--decay", type=float, default=d.decay, help="head k's loss weight is DECAY**k")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="positions per optimiser step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    p.add_argument("--time-budget", type=float, default=d.time_budget_s,
                   help="stop training after this many seconds")
    p.add_argument("--eval-prompts", type=Path, default=d.eval_prompts,
                   help="JSONL (prompt / MT-Bench turns) to score the finished heads on")
    p.add_argument("--eval-max-tokens", type=int, default=d.eval_max_tokens)
    p.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default=d.save_dtype)
    p.add_argument("--storage", choices=["float", "int8", "int4", "mixed"], default=d.storage,
                   help="weight matrices on disk: float (--save-dtype), int8 (per row), int4 (per 32 inputs) "
                   "or mixed (int8 for Hydra's skip matrices, int4 for the rest); the final evaluation "
                   "scores the weights as stored")
    p.add_argument("--drafter", choices=["attention", "none"], default=d.drafter,
                   help="attention: also train an EAGLE-style attention drafter for the first draft level "
                   "(hydra heads only; HEADS.md); none: the heads alone")
    p.add_argument("--drafter-steps", type=int, default=d.drafter_steps)
    p.add_argument("--drafter-batch", type=int, default=d.drafter_batch,
                   help="whole sequences per drafter step")
    p.add_argument("--drafter-lr", type=float, default=d.drafter_lr)
    p.add_argument("--drafter-intermediate", type=int, default=d.drafter_intermediate,
                   help="the drafter layer's MLP width (default: the base model's)")
    p.add_argument("--init-drafter", type=Path, default=d.init_drafter,
                   help="--kind eagle: start from the attention drafter of this heads directory "
                   "(e.g. the shipped heads) instead of from scratch")
    add_model_args(p)
    add_state_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from elesium.cli.errors import CliError
    from elesium.inference.training.head_training import train

    for name in ("prompts", "steps", "batch_size", "gen_batch", "num_heads", "num_layers", "max_new_tokens",
                 "drafter_steps", "drafter_batch"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.drafter_intermediate is not None and args.drafter_intermediate < 1:
        raise CliError(f"--drafter-intermediate must be >= 1, got {args.drafter_intermediate}")
    if args.drafter != "none" and args.kind == "medusa":
        raise CliError("--drafter attention drafts level 1 for hydra heads; "
                       "add --drafter none for --kind medusa")
    if args.kind == "eagle" and args.drafter == "none":
        raise CliError("--kind eagle is the attention drafter itself; it cannot go with --drafter none")
    if args.init_drafter is not None and args.kind != "eagle":
        raise CliError("--init-drafter goes with --kind eagle")
    if args.init_drafter is not None and not args.init_drafter.exists():
        raise FileNotFoundError(f"--init-drafter directory not found: {args.init_drafter}")
    if not args.from_log:
        only = (("--workflow", args.workflow is not None), ("--exclude-prompts", args.exclude_prompts))
        for flag, given in only:
            if given:
                raise CliError(f"{flag} goes with --from-log")
    elif args.data is not None or args.distill_only:
        raise CliError("--from-log reads its data from the runs; it goes with neither --data nor "
                       "--distill-only")
    elif args.workflow is not None:
        from elesium.graphs.registry import UnknownWorkflowError
        from elesium.graphs.workflows import default_registry

        try:
            default_registry().get(args.workflow)
        except UnknownWorkflowError as exc:
            raise CliError(str(exc)) from None
    if args.data is not None and not args.data.exists():
        raise FileNotFoundError(f"--data file not found: {args.data}")
    if args.eval_prompts is not None and not args.eval_prompts.exists():
        raise FileNotFoundError(f"--eval-prompts file not found: {args.eval_prompts}")
    cfg = TrainConfig(
        out=args.out, data=args.data, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
        temperatures=tuple(args.temperatures), gen_batch=args.gen_batch, num_heads=args.num_heads,
        num_layers=args.num_layers, kind=args.kind, conditioning=args.conditioning, loss=args.loss,
        decay=args.decay, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        warmup=min(args.warmup, args.steps), eval_every=args.eval_every, ckpt_every=args.ckpt_every,
        seed=args.seed, resume=args.resume, time_budget_s=args.time_budget, eval_prompts=args.eval_prompts,
        eval_max_tokens=args.eval_max_tokens, save_dtype=args.save_dtype, storage=args.storage,
        distill_only=args.distill_only, drafter=args.drafter, drafter_steps=args.drafter_steps,
        drafter_batch=args.drafter_batch, drafter_lr=args.drafter_lr,
        drafter_intermediate=args.drafter_intermediate, init_drafter=args.init_drafter,
        command="elesium train-heads " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["train-heads"] else []))
    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    engine = load_engine(args)
    if args.from_log:
        cfg.data, cfg.prompt_source = traffic_data(args, engine.weights_info.sha256, say)
    train(cfg, engine, log=say)
    print(cfg.out)
    return 0


def traffic_data(args: argparse.Namespace, model_sha256: str, say: Callable[[str], None]) -> tuple[Path, str]:
    """``--from-log``: the succeeded runs' LLM calls as a distillation file in OUT; (path, prompt source)."""
    from elesium.cli.errors import CliError
    from elesium.graphs.traffic import records_from_log
    from elesium.inference.prompts import write_jsonl
    from elesium.state.acceptance_log import AcceptanceLog, Retention
    from elesium.state.connection import default_url
    from elesium.state.runs import RunRegistry

    url = default_url(settings_from_args(args))
    runs = RunRegistry.from_url(url, prefix=f"{args.prefix}:runs")
    log = AcceptanceLog.from_url(url, prefix=f"{args.prefix}:acc", retention=Retention(maxlen=None))
    data = records_from_log(runs, log, model_sha256=model_sha256, workflow=args.workflow,
                            include_prompts=not args.exclude_prompts)
    if len({r["id"] for r in data.records}) < 2:
        which = f" of {args.workflow}" if args.workflow else ""
        raise CliError(f"--from-log needs LLM calls from at least 2 succeeded runs{which} of this model "
                       f"(one is held out); found {data.describe()}")
    say(f"from the log: {data.describe()}")
    path = write_jsonl(args.out / "from-log.jsonl.gz", data.records)
    workflows = sorted({r["task"].split("/")[0] for r in data.records})
    what = "answers only (--exclude-prompts)" if args.exclude_prompts else "prompts and answers"
    return path, f"the acceptance log: {data.runs} succeeded runs of {', '.join(workflows)}, {what}"
