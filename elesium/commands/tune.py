"""``elesium tune``: measure this hardware and pick the tree; saves a per-device profile."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from elesium.commands.common import add_model_args, load_engine, read_prompt_file, settings_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune",
                       help="measure forward cost and head acceptance; choose the tree for this device")
    p.add_argument("--prompts", type=Path, default=None,
                   help="calibration prompts (JSONL 'prompt' or 'turns'); "
                   "default: 16 from the training templates")
    p.add_argument("--calibration", type=int, default=16,
                   help="number of template prompts when --prompts is not given")
    p.add_argument("--out", type=Path, default=None, help="also write the profile here")
    add_model_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from elesium.inference.training.distill import build_prompts
    from elesium.inference.tuning.profile import profile_path
    from elesium.inference.tuning.tuner import tune

    if args.prompts is not None:
        prompts = read_prompt_file(args.prompts)
    else:  # a seed the training set never uses, so calibration prompts are fresh draws
        prompts = [p["prompt"] for p in build_prompts(args.calibration, seed=7_777_777)]
    engine = load_engine(args, max_len=2048)
    profile = tune(engine, prompts, log=lambda m: print(m, file=sys.stderr, flush=True))
    settings = settings_from_args(args)  # --cache-dir, where the profile is looked up
    saved = profile.save(profile_path(settings.cache_dir, profile.model_sha256, engine.model.device,
                                      engine.model.dtype))
    print(f"profile saved to {saved}")
    if args.out is not None:
        print(f"profile saved to {profile.save(args.out)}")
    return 0
