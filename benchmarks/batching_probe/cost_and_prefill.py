"""Issue 38 probe: the default CPU step's cost against rows per forward, and prefill through the step.

1. Cost curve (question 5): the compiled step (``CompiledCpuRunner.decode``, what vanilla and tree steps run)
   with N rows of one sequence (a star tree: N - 1 siblings under the root), N in 1..64, context ~300 tokens,
   reps interleaved across sizes so that load from other processes spreads over all sizes; and the int4
   matmuls alone (all 30 layers' wqkv/wo/w13/w2 plus the 49,152-row lm_head at M rows).
2. Prefill through the compiled step (chain ancestors) in chunks of 16, 32, 64: is the cache's K/V the same
   bits whatever the chunking (chunked prefill and prefix-cache reuse need that), and its cost per token
   against today's eager ``Transformer.forward`` prefill (SDPA, one chunk).
3. Compiled step at windows 256/512/1024 against itself (padding a row's window is free of bit changes?).

    .venv/bin/python benchmarks/batching_probe/cost_and_prefill.py \
        --out benchmarks/batching_probe/cost_and_prefill.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from elesium.inference.engine import Engine

TEXT = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
    "and must-see attractions. Draft a professional email seeking your supervisor's feedback on the "
    "quarterly financial report you prepared. Ask specifically about the data analysis, presentation "
    "style, and the clarity of conclusions drawn. Keep the email short and to the point. Imagine you are "
    "writing a blog post comparing two popular smartphone models. Develop an outline for the blog post, "
    "including key points and subheadings to effectively compare and contrast the features, performance, "
    "and user experience of the two models. Please answer in fewer than 200 words. Write a persuasive "
    "email to convince your introverted friend, who dislikes public speaking, to volunteer as a guest "
    "speaker at a local event. Use compelling arguments and address potential objections."
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    res: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": "2-core CPU, shared",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "loadavg_start": os.getloadavg(),
    }
    t0 = time.perf_counter()
    eng = Engine.load()
    runner, model = eng.runner, eng.model
    ids = eng.encode_prompt(TEXT)
    P = len(ids)
    res["prompt_tokens"] = P
    gen = torch.Generator().manual_seed(1)
    sizes = (1, 2, 4, 8, 16, 32, 64)
    with torch.inference_mode():
        t = time.perf_counter()
        hidden = runner.prefill(ids)
        res["eager_prefill_ms"] = round(1e3 * (time.perf_counter() - t), 1)
        tok = int(model.logits(hidden[-1]).argmax())
        # warm both graphs
        t = time.perf_counter()
        runner.decode([tok], [P], P)
        res["first_call_1tok_graph_s"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        anc = torch.eye(2, dtype=torch.bool)
        anc[:, 0] = True
        runner.decode([tok, 5], [P, P + 1], P, anc)
        res["first_call_tree_graph_s"] = round(time.perf_counter() - t, 2)
        times: dict[int, list[float]] = {n: [] for n in sizes}
        trees = {}
        for n in sizes:
            a = torch.eye(n, dtype=torch.bool)
            a[:, 0] = True
            trees[n] = (
                [tok] + torch.randint(0, 49152, (n - 1,), generator=gen).tolist(),
                [P] + [P + 1] * (n - 1),
                a,
            )
            runner.decode(trees[n][0], trees[n][1], P, None if n == 1 else a)  # first call of this size
        for _ in range(args.reps):
            for n in sizes:
                toks, pos, a = trees[n]
                t = time.perf_counter()
                runner.decode(toks, pos, P, None if n == 1 else a)
                times[n].append(1e3 * (time.perf_counter() - t))
        res["compiled_step_ms"] = {
            n: {"median": round(statistics.median(v), 2), "min": round(min(v), 2)} for n, v in times.items()
        }
        base = min(times[1])
        res["compiled_step_min_ratio_to_1"] = {n: round(min(v) / base, 2) for n, v in times.items()}
        # int4 matmuls alone at M rows: every layer's four linears + lm_head
        mm: dict[int, list[float]] = {n: [] for n in sizes}
        xs = {n: torch.randn(n, 576, generator=gen) for n in sizes}
        inter = model.layers[0].w2.in_features
        x2 = {n: torch.randn(n, inter, generator=gen) for n in sizes}
        for _ in range(5):
            for n in sizes:
                t = time.perf_counter()
                for layer in model.layers:
                    layer.attn.wqkv(xs[n])
                    layer.attn.wo(xs[n])
                    layer.w13(xs[n])
                    layer.w2(x2[n])
                model.lm_head(xs[n])
                mm[n].append(1e3 * (time.perf_counter() - t))
        res["int4_matmuls_ms_min"] = {n: round(min(v), 2) for n, v in mm.items()}

        # ---- prefill through the compiled step ------------------------------------------------------
        pre: dict = {}
        ref_k = ref_v = None
        for chunk in (16, 32, 64):
            runner.cache.k.zero_()
            runner.cache.v.zero_()
            t = time.perf_counter()
            last = None
            for lo in range(0, P, chunk):
                part = ids[lo : lo + chunk]
                n = len(part)
                out = runner.decode(part, list(range(lo, lo + n)), lo, model.causal(n) if n > 1 else None)
                last = out.logits[-1].clone()
            dt = time.perf_counter() - t
            k, v = runner.cache.k[:, :, :, :P].clone(), runner.cache.v[:, :, :, :P].clone()
            if ref_k is None:
                ref_k, ref_v, ref_last = k, v, last
            pre[chunk] = {
                "ms_per_token": round(1e3 * dt / P, 2),
                "kv_equal_to_chunk16": bool(torch.equal(k, ref_k) and torch.equal(v, ref_v)),
                "last_logits_equal_to_chunk16": bool(torch.equal(last, ref_last)),
            }
        res["eager_prefill_ms_per_token"] = round(res["eager_prefill_ms"] / P, 2)
        res["prefill_through_compiled_step"] = pre

        # ---- compiled step vs itself across window widths ------------------------------------------
        runner.prefill(ids[:100])
        outs = {}
        for width in (256, 512, 1024):
            kw, vw = runner.cache.k[:, :, :, :width], runner.cache.v[:, :, :, :width]
            torch._dynamo.mark_dynamic(kw, 3)
            torch._dynamo.mark_dynamic(vw, 3)
            outs[width] = runner.graphs["one"](
                runner.model, torch.tensor([[tok]]), torch.tensor([100]), torch.tensor(100), kw, vw,
                model.causal(1)
            )[1][0, 0].clone()
        res["compiled_window_invariance"] = {w: bool(torch.equal(outs[w], outs[256])) for w in outs}
    res["loadavg_end"] = os.getloadavg()
    res["total_s"] = round(time.perf_counter() - t0, 1)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
