"""Side-by-side speed measurement: vanilla and speculative decoding on the same prompts, one process.

Noise on shared machines is large and slow, so the two modes alternate order prompt by prompt and
every figure is a median of per-prompt values; the speedup is the median of per-prompt ratios
(both runs of a prompt are adjacent in time, so they share the machine's state).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.records import DecodeMode, Generation, normalize_mode
from elesium.inference.sampling import SamplingParams

if TYPE_CHECKING:
    from elesium.inference.engine import Engine


def _ms_per_token(g: Generation) -> float:
    return 1000.0 * g.elapsed_s / max(1, g.new_tokens)


def acceptance_by_depth(generations: Sequence[Generation]) -> list[float]:
    """For each depth d, the share of steps whose tree reached d that accepted a draft there."""
    hits: list[int] = []
    seen: list[int] = []
    for g in generations:
        for s in g.steps:
            for d, accepted in enumerate(s.accepted_by_depth):
                while len(seen) <= d:
                    seen.append(0)
                    hits.append(0)
                seen[d] += 1
                hits[d] += int(accepted)
    return [h / s if s else 0.0 for h, s in zip(hits, seen)]


def drafter_acceptance(engine: Engine, prompts: Sequence[str], max_tokens: int) -> dict[str, Any]:
    """The whole drafter decoding, greedy: tokens per step (tau) and acceptance by depth.

    Top-1 / top-5 of each head against the true continuation says how good a head is alone; what
    speculation earns depends on the drafts of every depth conditioned on the drafter's own earlier
    drafts. So this decodes: once under the engine's tree policy (``tree``: what ``bench`` would see),
    and once with a chain of top-1 drafts as deep as the heads go (``chain``: independent of the tree
    policy and the hardware profile). ``accept_rate_by_depth[d]``: of the steps whose tree reached
    depth d + 1, the share that accepted a draft there; for the chain also ``conditional[d]``: the
    same share among the steps that accepted depth d.
    """
    if engine.heads is None:
        raise ValueError("drafter acceptance needs draft heads on the engine")
    depth = engine.heads.num_heads
    chain = TreePolicy(kind="static", static_paths=tuple((0,) * d for d in range(1, depth + 1)), adapt=False)
    params = SamplingParams(max_tokens=max_tokens)
    out: dict[str, Any] = {}
    for name, policy in (("tree", None), ("chain", chain)):
        gens = [engine.generate(p, params, mode="speculative", policy=policy) for p in prompts]
        steps = [s for g in gens for s in g.steps]
        rates = acceptance_by_depth(gens)
        out[name] = {"steps": len(steps), "tokens": sum(g.new_tokens for g in gens),
                     "tau": sum(s.accepted_length for s in steps) / max(1, len(steps)),
                     "mean_tree_size": sum(s.tree_size for s in steps) / max(1, len(steps)),
                     "accept_rate_by_depth": [round(r, 4) for r in rates]}
        if name == "chain":
            out[name]["conditional"] = [round(r / prev, 4) if prev else 0.0
                                        for r, prev in zip(rates, [1.0, *rates[:-1]], strict=True)]
    return out


def run_bench(engine: Engine, prompts: Sequence[str], params: SamplingParams,
              mode: DecodeMode = "speculative",
              progress: Callable[[int, dict[str, Any]], None] | None = None,
              vanilla_only: bool = False) -> dict[str, Any]:
    """Run both modes on every prompt; return the ``bench.json`` document.

    The speculative mode's figures sit under keys named after it: ``doc[mode]``, and per prompt
    ``{mode}_tokens`` / ``{mode}_ms_per_token``, with ``mode`` "speculative" or "typical". bench.json
    files written before the mode's rename say "medusa" there (BENCHMARKS.md lists the fields).
    """
    mode = normalize_mode(mode)
    if mode == "vanilla":
        raise ValueError("run_bench compares a speculative mode against vanilla; use vanilla_only=True to "
                         "time vanilla")
    # Warm-up: CUDA graphs, allocator, kernel selection stay out of the numbers.
    warm = SamplingParams(max_tokens=8, temperature=params.temperature, seed=0)
    engine.generate(prompts[0], warm, mode="vanilla")
    if not vanilla_only:
        engine.generate(prompts[0], warm, mode=mode)
    rows: list[dict[str, Any]] = []
    vanilla: list[Generation] = []
    spec: list[Generation] = []
    for i, prompt in enumerate(prompts):
        p = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                           max_tokens=params.max_tokens, seed=params.seed if params.seed is not None else i)
        order: list[DecodeMode] = ["vanilla"] if vanilla_only else (
            ["vanilla", mode] if i % 2 == 0 else [mode, "vanilla"])
        out: dict[str, Generation] = {}
        for m in order:
            if engine.model.device.type == "cuda":
                torch.cuda.synchronize()
            out[m] = engine.generate(prompt, p, mode=m)
        v = out["vanilla"]
        vanilla.append(v)
        row: dict[str, Any] = {"prompt": i, "vanilla_tokens": v.new_tokens,
                               "vanilla_ms_per_token": _ms_per_token(v)}
        if not vanilla_only:
            s = out[mode]
            spec.append(s)
            row |= {f"{mode}_tokens": s.new_tokens, f"{mode}_ms_per_token": _ms_per_token(s),
                    "mean_accepted": s.mean_accepted, "speedup": _ms_per_token(v) / _ms_per_token(s),
                    "identical": v.token_ids == s.token_ids}
        rows.append(row)
        if progress is not None:
            progress(i, row)
    dev = engine.model.device
    doc: dict[str, Any] = {
        "prompts": len(prompts),
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "device": (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                   else f"cpu ({torch.get_num_threads()} threads)"),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "cuda_graphs": type(engine.runner).__name__ == "CudaGraphRunner",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "vanilla": _summary(vanilla),
        "per_prompt": rows,
    }
    if not vanilla_only:
        doc[mode] = _summary(spec) | {
            "mean_accepted": statistics.median(g.mean_accepted for g in spec),
            "mean_accepted_pooled": sum(s.accepted_length for g in spec for s in g.steps)
            / max(1, sum(len(g.steps) for g in spec)),
            "mean_tree_size": sum(s.tree_size for g in spec for s in g.steps)
            / max(1, sum(len(g.steps) for g in spec)),
            "accept_rate_by_depth": acceptance_by_depth(spec),
        }
        doc["mode"] = mode
        doc["speedup"] = statistics.median(r["speedup"] for r in rows)
        doc["identical_outputs"] = sum(r["identical"] for r in rows) if params.temperature == 0 else None
    return doc


def _summary(gens: Sequence[Generation]) -> dict[str, float]:
    return {
        "tokens_per_s": statistics.median(g.tokens_per_s for g in gens),
        "ms_per_token": statistics.median(_ms_per_token(g) for g in gens),
        "tokens": sum(g.new_tokens for g in gens),
    }


def write_plots(doc: dict[str, Any], out: Path) -> list[Path]:
    """speedup.png (per prompt) and acceptance.png (by depth)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mode = doc.get("mode")
    if mode is None:
        return []
    paths = []
    rows = doc["per_prompt"]
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.bar([r["prompt"] for r in rows], [r["speedup"] for r in rows], color="#3b7dd8")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(doc["speedup"], color="#d8453b", linestyle="--", label=f"median {doc['speedup']:.2f}x")
    ax.set_xlabel("prompt")
    ax.set_ylabel(f"{mode} speedup over vanilla")
    ax.set_title(f"{doc['device']}, {doc['dtype']}, T={doc['temperature']}, {doc['max_tokens']} tokens")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    rates = doc[mode]["accept_rate_by_depth"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(range(1, len(rates) + 1), rates, color="#3bd88a")
    ax.set_xlabel("tree depth")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"tau = {doc[mode]['mean_accepted_pooled']:.2f}")
    fig.tight_layout()
    paths.append(out / "acceptance.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
