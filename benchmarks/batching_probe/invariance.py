"""Issue 38 probe: is a row's output of the default CPU step independent of the other rows in the forward?

Default engine (``Engine.load()``: gguf-blocks int4 weights, compiled step). Checks, all bitwise
(``torch.equal`` on float32 logits):
  A. compiled step, M rows = one sequence's tree: root node's logits alone (N=1 graph) vs as the root of a
     star tree of N = 2, 4, 8, 16 nodes (other nodes random tokens); a depth-1 node across tree sizes and
     against its vanilla (chain) computation.
  B. eager ``step_forward`` with B sequences in the batch dimension (1 + 1, 3, 7, 15 others, each with its
     own prompt's cache, same offset): sequence 0's logits vs alone.
  C. eager ``step_forward`` vs the compiled step (N = 1 and a tree), and vs ``Transformer.forward``.
  D. the attention window: W = 256 vs 512 vs 1024 for the same row (eager and compiled).
  E. op level: Int4GroupLinear (wqkv, wo, w13, w2, lm_head) row i of an M-row call vs alone, M up to 64;
     RMSNorm; SDPA (``masked_attention``, the eager prefill / reference path) row vs alone.
  F. prefill chunking: one chunk vs chunks of 16 / 100 (eager ``Transformer.forward``): the cache's K/V.

    .venv/bin/python benchmarks/batching_probe/invariance.py --out benchmarks/batching_probe/invariance.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from elesium.inference.engine import Engine
from elesium.inference.runtime.cpu_step import step_forward
from elesium.kernels.tree_attention import masked_attention, tree_attention_mask

PROMPTS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences.",
    "Draft a professional email seeking your supervisor's feedback on the quarterly financial report.",
    "Imagine you are writing a blog post comparing two popular smartphone models.",
    "Write a persuasive email to convince your introverted friend to volunteer as a guest speaker.",
    "Describe a vivid and unique character, using strong imagery and creative language.",
    "Write a descriptive paragraph about a bustling marketplace, incorporating sensory details.",
    "Could you write a captivating short story beginning with the sentence: The old abandoned house",
    "Craft an intriguing opening paragraph for a fictional short story about time travel.",
    "Help me construct a catchy, yet scientifically accurate, headline for an article on "
    "renewable bio-energy.",
    "Edit the following paragraph to correct any grammatical errors: She didn't remembre where is her purse.",
    "Describe five key principles in evaluating an argument in analytical writing.",
    "Which methods did Socrates employ to challenge the prevailing thoughts of his time?",
    "What are some business etiquette norms when doing business in Japan?",
    "Suggest five award-winning documentary films with brief background descriptions for "
    "aspiring filmmakers.",
    "Pretend yourself to be Elon Musk in all the following conversations. Speak like him. Why go to Mars?",
    "Embrace the role of Sheldon from The Big Bang Theory. What is your opinion on hand dryers?",
]


def eq(a: torch.Tensor, b: torch.Tensor) -> dict:
    return {"equal": bool(torch.equal(a, b)), "max_abs_diff": float((a.float() - b.float()).abs().max())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": "2-core CPU, shared",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    t0 = time.perf_counter()
    eng = Engine.load()
    res["load_s"] = round(time.perf_counter() - t0, 2)
    res["engine"] = eng.describe()
    runner, model = eng.runner, eng.model
    gen = torch.Generator().manual_seed(0)

    with torch.inference_mode():
        ids = [eng.encode_prompt(p) for p in PROMPTS]
        L = min(len(x) for x in ids)
        ids = [x[:L] for x in ids]
        res["common_prompt_len"] = L
        # ---- A: compiled step, rows of one tree ----------------------------------------------------
        runner.prefill(ids[0])
        tok = int(model.logits(runner.prefill(ids[0])[-1]).argmax())
        t = time.perf_counter()
        alone = runner.decode([tok], [L], L).logits[0].clone()
        res["A_first_1tok_call_s"] = round(time.perf_counter() - t, 2)
        x1 = int(torch.randint(0, 49152, (1,), generator=gen))
        # vanilla chain: tok at L (already written by the call above), then x1 at L + 1
        chain_x1 = runner.decode([x1], [L + 1], L + 1).logits[0].clone()
        A = {}
        for n in (2, 4, 8, 16):
            toks = [tok, x1] + torch.randint(0, 49152, (n - 2,), generator=gen).tolist()
            anc = torch.eye(n, dtype=torch.bool)
            anc[:, 0] = True
            t = time.perf_counter()
            out = runner.decode(toks, [L] + [L + 1] * (n - 1), L, anc)
            dt = time.perf_counter() - t
            A[n] = {
                "root_vs_alone": eq(out.logits[0], alone),
                "depth1_node_vs_vanilla_chain": eq(out.logits[1], chain_x1),
                "call_s": round(dt, 3),
            }
        res["A_compiled_tree_rows"] = A

        # ---- B: eager step_forward, B sequences in the batch dimension ------------------------------
        caches = []
        for x in ids:
            c = model.new_cache(512)
            model(torch.tensor([x]), torch.arange(L), c, 0)
            caches.append(c)
        W = 256
        first = [int(torch.randint(0, 49152, (1,), generator=gen)) for _ in ids]

        def eager_batch(bsz: int, width: int = W) -> torch.Tensor:
            kw = torch.cat([c.k[:, :, :, :width] for c in caches[:bsz]], dim=1)
            vw = torch.cat([c.v[:, :, :, :width] for c in caches[:bsz]], dim=1)
            return step_forward(
                model,
                torch.tensor([first[:bsz]]).T.contiguous(),
                torch.tensor([L]),
                torch.tensor(L),
                kw,
                vw,
                torch.ones(1, 1, dtype=torch.bool),
            )[1]

        solo = eager_batch(1)[0, 0]
        B = {}
        for bsz in (2, 4, 8, 16):
            t = time.perf_counter()
            lg = eager_batch(bsz)
            B[bsz] = {"seq0_vs_alone": eq(lg[0, 0], solo), "call_s": round(time.perf_counter() - t, 3)}
            # every other row against its own solo run (a few)
        res["B_eager_batch_dim"] = B
        others = {}
        lg16 = eager_batch(16)
        for j in (1, 5, 15):
            kw, vw = caches[j].k[:, :, :, :W], caches[j].v[:, :, :, :W]
            s = step_forward(
                model,
                torch.tensor([[first[j]]]),
                torch.tensor([L]),
                torch.tensor(L),
                kw,
                vw,
                torch.ones(1, 1, dtype=torch.bool),
            )[1][0, 0]
            others[j] = eq(lg16[j, 0], s)
        res["B_eager_batch16_row_j_vs_alone"] = others

        # ---- C: eager vs compiled; D: window width -------------------------------------------------
        runner.prefill(ids[0])
        kw, vw = runner.cache.k[:, :, :, :256], runner.cache.v[:, :, :, :256]
        eager1 = step_forward(
            model,
            torch.tensor([[tok]]),
            torch.tensor([L]),
            torch.tensor(L),
            kw,
            vw,
            torch.ones(1, 1, dtype=torch.bool),
        )[1][0, 0]
        comp1 = runner.decode([tok], [L], L).logits[0].clone()
        n = 4
        toks = [tok, x1, 11, 12]
        anc = torch.eye(n, dtype=torch.bool)
        anc[:, 0] = True
        pos = [L] + [L + 1] * 3
        runner.prefill(ids[0])
        kw, vw = runner.cache.k[:, :, :, :256].clone(), runner.cache.v[:, :, :, :256].clone()
        eager4 = step_forward(model, torch.tensor([toks]), torch.tensor(pos), torch.tensor(L), kw, vw, anc)[
            1
        ][0]
        comp4 = runner.decode(toks, pos, L, anc).logits.clone()
        runner.prefill(ids[0])
        plain = model.logits(model(torch.tensor([[tok]]), torch.tensor([L]), runner.cache, L)[0])[0]
        res["C_eager_vs_compiled"] = {
            "n1": eq(eager1, comp1),
            "tree4_all_rows": eq(eager4, comp4),
            "eager_step_vs_Transformer_forward_n1": eq(eager1, plain),
        }
        D = {}
        runner.prefill(ids[0])
        base = None
        for width in (256, 512, 1024):
            kw, vw = runner.cache.k[:, :, :, :width], runner.cache.v[:, :, :, :width]
            e = step_forward(
                model,
                torch.tensor([[tok]]),
                torch.tensor([L]),
                torch.tensor(L),
                kw,
                vw,
                torch.ones(1, 1, dtype=torch.bool),
            )[1][0, 0]
            if base is None:
                base = e
            D[f"eager_W{width}_vs_W256"] = eq(e, base)
        # compiled with a forced window: call the compiled function directly
        for width in (256, 512, 1024):
            kw, vw = runner.cache.k[:, :, :, :width], runner.cache.v[:, :, :, :width]
            torch._dynamo.mark_dynamic(kw, 3)
            torch._dynamo.mark_dynamic(vw, 3)
            c = runner.graphs["one"](
                runner.model, torch.tensor([[tok]]), torch.tensor([L]), torch.tensor(L), kw, vw,
                model.causal(1)
            )[1][0, 0]
            D[f"compiled_W{width}_vs_eager_W256"] = eq(c, base)
        res["D_window_width"] = D

        # ---- E: op level ----------------------------------------------------------------------------
        E: dict = {}
        layer = model.layers[3]
        mods = {
            "wqkv": layer.attn.wqkv,
            "wo": layer.attn.wo,
            "w13": layer.w13,
            "w2": layer.w2,
            "lm_head": model.lm_head,
        }
        for name, mod in mods.items():
            k_in = mod.in_features
            x = torch.randn(64, k_in, generator=gen).to(torch.bfloat16).float()
            solo_rows = torch.cat([mod(x[i : i + 1]) for i in range(64)])
            E[name] = {}
            for m in (2, 3, 4, 5, 7, 8, 16, 17, 32, 64):
                E[name][m] = bool(torch.equal(mod(x[:m]), solo_rows[:m]))
        norm = layer.attn_norm
        x = torch.randn(64, 576, generator=gen)
        E["rmsnorm_eager"] = {
            m: bool(torch.equal(norm(x[:m]), torch.cat([norm(x[i : i + 1]) for i in range(m)])))
            for m in (2, 4, 16, 64)
        }
        # SDPA rows: 9 query heads, 3 kv heads, keys 300, causal chunk of m rows vs each row alone
        q = torch.randn(1, 9, 64, 64, generator=gen)
        kk = torch.randn(1, 3, 300, 64, generator=gen)
        vv = torch.randn(1, 3, 300, 64, generator=gen)
        sd = {}
        for m in (2, 8, 64):
            pre = 300 - m
            mask = tree_attention_mask(pre, torch.ones(m, m, dtype=torch.bool).tril(), 300)
            full = masked_attention(q[:, :, :m], kk, vv, mask)
            rows_ok = True
            for i in range(m):
                mi = tree_attention_mask(pre + i, torch.ones(1, 1, dtype=torch.bool), pre + i + 1)
                r = masked_attention(q[:, :, i : i + 1], kk[:, :, : pre + i + 1], vv[:, :, : pre + i + 1], mi)
                rows_ok &= bool(torch.equal(full[:, :, i], r[:, :, 0]))
            sd[m] = rows_ok
        E["sdpa_masked_rows_vs_alone"] = sd
        res["E_ops"] = E

        # ---- F: prefill chunking -------------------------------------------------------------------
        long_ids = eng.encode_prompt(" ".join(PROMPTS))
        F = {"prompt_len": len(long_ids)}
        ref = model.new_cache(512)
        h_ref = model(torch.tensor([long_ids]), torch.arange(len(long_ids)), ref, 0)[0]
        for chunk in (16, 100):
            c = model.new_cache(512)
            hs = []
            for lo in range(0, len(long_ids), chunk):
                part = long_ids[lo : lo + chunk]
                hs.append(model(torch.tensor([part]), torch.arange(lo, lo + len(part)), c, lo)[0])
            h = torch.cat(hs)
            n_ = len(long_ids)
            F[chunk] = {
                "kv_equal": bool(
                    torch.equal(c.k[:, :, :, :n_], ref.k[:, :, :, :n_])
                    and torch.equal(c.v[:, :, :, :n_], ref.v[:, :, :, :n_])
                ),
                "last_hidden": eq(h[-1], h_ref[-1]),
                "layer0_k_equal": bool(torch.equal(c.k[0, :, :, :n_], ref.k[0, :, :, :n_])),
                "max_abs_kv_diff": float((c.k[:, :, :, :n_] - ref.k[:, :, :, :n_]).abs().max()),
            }
        res["F_prefill_chunking"] = F
    res["total_s"] = round(time.perf_counter() - t0, 1)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
