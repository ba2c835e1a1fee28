"""Flags shared by the subcommands that load a model."""

from __future__ import annotations

import argparse
from typing import Any

from elesium.config import Settings


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", help="GGUF file or HF safetensors directory (default: $ELESIUM_MODEL, "
                       "else the bundled SmolLM2-135M-Instruct)")
    group.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None,
                       help="default: $ELESIUM_DEVICE, else auto (CUDA when available)")
    group.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                       help="default: $ELESIUM_DTYPE, else float32 on CPU and bfloat16 on CUDA")
    group.add_argument("--heads", default=None,
                       help="draft heads directory (default: the shipped heads, when trained for this model; "
                       "'none': vanilla decoding only)")


def load_engine(args: argparse.Namespace, **kwargs: Any):  # -> Engine (import kept lazy for --help speed)
    from elesium.inference.engine import Engine

    settings = Settings.from_env()
    heads = getattr(args, "heads", None)
    kwargs.setdefault("heads", "default" if heads is None else None if heads == "none" else heads)
    return Engine.load(args.model, device=args.device or settings.device, dtype=args.dtype or settings.dtype,
                       settings=settings, **kwargs)
