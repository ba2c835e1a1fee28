"""What one tree step's drafting costs, part by part, on the loaded engine (CPU or CUDA).

Drafting a tree is, for path-conditioned heads with an attention drafter: the drafter layer over the rows
the last step accepted, then per level a head MLP, a product with the 49,152-wide ``lm_head`` and a top-k
over the vocabulary (``HydraHeads.expand``). This times each part alone, eagerly and in the engine's
own weights (``model.logits`` is the engine's ``lm_head``: int4 blocks on the default CPU path, the
invariant matmul under invariant numerics on CUDA), at the shapes a step uses (level 0: one row; later
levels: ``--width`` rows), plus:

* the two top-k forms of ``drafters/top_logprobs.py`` against the reference ``topk(log_softmax)``;
* a dense product with only ``--vocab`` rows of the ``lm_head`` (a draft vocabulary, as EAGLE-3 drafts
  over 32k of 128k tokens), to size what such a vocabulary would save. It is a measurement of a product
  of that shape, not of a shipped path: no draft vocabulary exists yet.

Medians over ``--repeats`` calls, alternating the variants call by call; µs.

    python benchmarks/draft_cost.py [--width 8] [--topk 8] [--levels 2 4] [--repeats 200] \\
        [--out draft_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    def run(fn: Callable[[], Any]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return 1e6 * (time.perf_counter() - start)

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=8, help="rows of every level after the first")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--rows", type=int, default=3, help="accepted rows the drafter layer reads")
    p.add_argument("--vocab", type=int, nargs="+", default=[4096, 8192, 16384],
                   help="draft vocabulary sizes to size the lm_head product for")
    p.add_argument("--chunk", type=int, default=1024, help="top_logprobs' slice width")
    p.add_argument("--levels", type=int, nargs="*", default=[],
                   help="also time the whole expansion cut to these depths (HydraHeads.expand(levels))")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", type=Path, default=None)
    opts = p.parse_args(argv)

    from elesium.inference.drafters.top_logprobs import top_logprobs, top_logprobs_reference
    from elesium.inference.engine import Engine

    engine = Engine.load(device=opts.device)
    model, heads = engine.model, engine.heads
    if heads is None or not getattr(heads, "conditioned", False):
        raise SystemExit("draft_cost.py measures path-conditioned heads; the engine loaded none")
    dev, dtype = model.device, model.dtype
    h = model.config.hidden_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    one = (torch.randn(1, h, generator=gen) * 0.5).to(dev, dtype)
    wide = (torch.randn(opts.width, h, generator=gen) * 0.5).to(dev, dtype)
    tokens = torch.randint(0, model.config.vocab_size, (opts.width,), generator=gen).to(dev)
    tied = model.config.tie_word_embeddings
    weight = model.embed.weight if tied else getattr(model.lm_head, "weight", None)
    if weight is None:
        raise SystemExit("no dense lm_head weight to take draft-vocabulary rows from")
    subsets = {v: weight[:v].detach().to(dtype).contiguous() for v in opts.vocab}
    logits_one, logits_wide = model.logits(one), model.logits(wide)
    run = timer(dev)

    parts: dict[str, Callable[[], Any]] = {
        "head MLP, 1 row": lambda: heads.advance(0, one, model.embed(tokens[:1])),
        f"head MLP, {opts.width} rows": lambda: heads.advance(1, wide, model.embed(tokens)),
        "lm_head, 1 row": lambda: model.logits(one),
        f"lm_head, {opts.width} rows": lambda: model.logits(wide),
        "topk(log_softmax), 1 row": lambda: top_logprobs_reference(logits_one, opts.topk),
        f"topk(log_softmax), {opts.width} rows": lambda: top_logprobs_reference(logits_wide, opts.topk),
        "shifted top-k, 1 row": lambda: top_logprobs(logits_one, opts.topk),
        f"shifted top-k, {opts.width} rows": lambda: top_logprobs(logits_wide, opts.topk),
        f"sliced top-k ({opts.chunk}), 1 row": lambda: top_logprobs(logits_one, opts.topk, opts.chunk),
        f"sliced top-k ({opts.chunk}), {opts.width} rows":
            lambda: top_logprobs(logits_wide, opts.topk, opts.chunk),
        "whole expand (drafter feature given)":
            lambda: heads.expand(model, one[0], tokens[:1], opts.width, opts.topk, one),
    }
    for lv in opts.levels:
        parts[f"whole expand, {lv} levels"] = (
            lambda lv=lv: heads.expand(model, one[0], tokens[:1], opts.width, opts.topk, one, levels=lv))
    for v, w in subsets.items():
        parts[f"dense {v}-row lm_head, 1 row"] = lambda w=w: torch.nn.functional.linear(one, w).float()
        parts[f"dense {v}-row lm_head, {opts.width} rows"] = (
            lambda w=w: torch.nn.functional.linear(wide, w).float())
    if heads.drafter is not None:
        cache = heads.drafter.new_cache(256, dev, dtype)
        rows = wide[:opts.rows][None]
        positions = torch.arange(opts.rows, device=dev) + 100
        parts[f"drafter layer, {opts.rows} rows"] = lambda: heads.drafter(
            model, rows, tokens[None, :opts.rows], positions, *cache, 100, model.causal(opts.rows))

    times: dict[str, list[float]] = {name: [] for name in parts}
    with torch.inference_mode():
        for fn in parts.values():  # warm-up (and first-call allocations) before timing
            fn()
        names = list(parts)
        for i in range(opts.repeats):
            for name in names[i % len(names):] + names[:i % len(names)]:
                times[name].append(run(parts[name]))
    medians = {name: statistics.median(v) for name, v in times.items()}
    levels = heads.num_heads
    per_step = {
        "lm_head": medians["lm_head, 1 row"] + (levels - 1) * medians[f"lm_head, {opts.width} rows"],
        "topk(log_softmax)": medians["topk(log_softmax), 1 row"]
        + (levels - 1) * medians[f"topk(log_softmax), {opts.width} rows"],
        "sliced top-k": medians[f"sliced top-k ({opts.chunk}), 1 row"]
        + (levels - 1) * medians[f"sliced top-k ({opts.chunk}), {opts.width} rows"],
    }
    for v in opts.vocab:
        dense = f"dense {v}-row lm_head"
        per_step[dense] = medians[f"{dense}, 1 row"] + (levels - 1) * medians[f"{dense}, {opts.width} rows"]
    doc = {"engine": engine.describe(), "device": str(dev), "dtype": str(dtype), "levels": levels,
           "width": opts.width, "topk": opts.topk, "repeats": opts.repeats,
           "threads": torch.get_num_threads(),
           "loadavg": os.getloadavg(), "median_us": medians, "per_step_us": per_step,
           "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    if opts.out is not None:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"device {dev}, {dtype}, {levels} levels, width {opts.width}, top {opts.topk}; medians of "
          f"{opts.repeats}, µs")
    for name, us in medians.items():
        print(f"  {name:<44} {us:10.1f}")
    print("per step (level 0 at 1 row, the others at the width):")
    for name, us in per_step.items():
        print(f"  {name:<44} {us:10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
