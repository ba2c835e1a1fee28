"""Probe (not shipped, not wired into the engine): does attention over past features reach the head-1 goal?

Issue 3 asks head 1 for top-1 >= 0.60 / top-5 >= 0.80 on MT-Bench turn 1. Our MLP heads (Medusa and
Hydra) read only ``(h_t, x_{t+1})``: 0.42 / 0.67 on the 3,000-prompt data, 0.50 / 0.76 on the
8,000-prompt data (this probe: 0.47 / 0.69 and 0.61 / 0.84; HEADS.md). EAGLE's drafter adds one decoder
layer that attends over every earlier feature. This trains that head-1 predictor on the same
self-distillation data and KL objective as our heads, then scores it and the shipped heads' head 1
on the same greedy MT-Bench continuations, so the next design step rests on a measurement.

    python3 -P scripts/probe_eagle_head1.py DISTILL.jsonl.gz MT_BENCH.jsonl OUT.json [--seconds 200]

Needs CUDA and ``$ELESIUM_MODEL``. DISTILL is written first (as train-heads would) if it does not exist.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch
import torch.nn.functional as F
from torch import nn

from elesium.inference.distill import build_prompts, distill, generate_all, read_jsonl, write_jsonl
from elesium.inference.engine import Engine
from elesium.inference.head_training import cache_hidden_states, evaluate, read_eval_prompts
from elesium.inference.heads import load_heads
from elesium.inference.model import RMSNorm, apply_rope


class FeatureLayer(nn.Module):
    """EAGLE-1's drafter for one step: ``fc([h_t; e(x_{t+1})])`` then one causal decoder layer."""

    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.fc = nn.Linear(2 * hidden, hidden)
        self.attn_norm = RMSNorm(hidden, eps)
        self.wqkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden, eps)
        self.w13 = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, h: torch.Tensor, e: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, d = h.shape
        x = self.fc(torch.cat([h, e], dim=-1))
        q, k, v = self.wqkv(self.attn_norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, n, d))
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


def padded(seqs: list[list[int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = torch.tensor(s)
        valid[i, :len(s)] = True
    return tokens.to(dev), valid.to(dev)


def features(model, tokens: torch.Tensor) -> torch.Tensor:
    n = tokens.shape[1]
    with torch.no_grad():
        return model(tokens, torch.arange(n, device=tokens.device), model.new_cache(n, tokens.shape[0]), 0)


def predict(layer: FeatureLayer, model, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Logits for ``x_{t+2}`` at every t (the last column is junk: it has no ``x_{t+1}``)."""
    n = tokens.shape[1]
    nxt = torch.roll(tokens, -1, dims=1)
    pos = torch.arange(n, device=tokens.device)
    cos, sin = model.rope_cos[pos][None, None], model.rope_sin[pos][None, None]
    with torch.no_grad():
        e = model.embed(nxt)
    return model.logits(layer(h, e, cos, sin))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("distill")
    ap.add_argument("prompts")
    ap.add_argument("out")
    ap.add_argument("--seconds", type=float, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    engine = Engine.load(None, device="cuda", dtype="bfloat16", heads=None)
    model, tok = engine.model, engine.tokenizer
    cfg = model.config
    dev = model.device
    if not os.path.exists(args.distill):  # the same data train-heads distils (3000 template prompts, T 0 / 0.7)
        records = distill(model, tok, build_prompts(3000, seed=0), model_sha256=engine.weights_info.sha256,
                          batch_size=512)
        write_jsonl(args.distill, records)
        print(f"distilled {len(records)} sequences", flush=True)
    records = list(read_jsonl(args.distill))
    seqs = [list(r["prompt_ids"]) + list(r["response_ids"]) for r in records]
    layer = FeatureLayer(cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.rms_norm_eps).to(dev)
    opt = torch.optim.AdamW(layer.parameters(), lr=args.lr, betas=(0.9, 0.95))
    est_steps = 2000
    t0, step, losses = time.monotonic(), 0, []
    while time.monotonic() - t0 < args.seconds:
        lr = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / est_steps))))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = random.sample(seqs, args.batch)
        tokens, valid = padded(batch, dev)
        h = features(model, tokens)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            student = torch.log_softmax(predict(layer, model, tokens, h)[:, :-2].float(), -1)
        with torch.no_grad():
            teacher = torch.log_softmax(model.logits(h[:, 1:-1]).float(), -1)
        mask = valid[:, 2:]
        kl = (teacher.exp() * (teacher - student)).sum(-1)
        loss = (kl * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % 200 == 0:
            print(f"step {step} loss {sum(losses[-200:]) / 200:.3f} ({time.monotonic() - t0:.0f}s)", flush=True)
    train_s = time.monotonic() - t0

    # -- score on MT-Bench turn 1, beside the shipped heads, on the same greedy continuations ------
    prompts = read_eval_prompts(args.prompts)
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    answers = generate_all(model, ids, 256, eos_ids=tok.eos_ids, batch_size=80)
    hits1 = hits5 = count = 0
    layer.eval()
    for p, a in zip(ids, answers):
        seq = p + a
        tokens, _ = padded([seq], dev)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = predict(layer, model, tokens, features(model, tokens))[0].float()
        rows = torch.arange(len(p) - 1, len(seq) - 2, device=dev)  # t: x_{t+1} is an answer token, x_{t+2} exists
        if rows.numel() == 0:
            continue
        top = logits[rows].topk(5, -1).indices
        target = tokens[0, rows + 2]
        hits1 += int((top[:, 0] == target).sum())
        hits5 += int((top == target[:, None]).any(-1).sum())
        count += rows.numel()
    cache = cache_hidden_states(model, list(zip(ids, answers)), batch_size=80)
    shipped = {}
    for name, path in (("hydra_chain", None), ("medusa", "inference/heads/smollm2-135m-instruct-medusa")):
        heads = load_heads(path, base_sha256=engine.weights_info.sha256, device=dev, dtype=model.dtype)
        shipped[name] = evaluate(heads, model, cache)[0]
    result = {"eagle_head1": {"top1": hits1 / count, "top5": hits5 / count, "positions": count},
              "shipped_head1": shipped, "train": {"steps": step, "seconds": round(train_s, 1),
                                                  "final_loss": sum(losses[-100:]) / max(1, len(losses[-100:])),
                                                  "params": sum(p.numel() for p in layer.parameters()),
                                                  "sequences": len(seqs), "batch": args.batch, "lr": args.lr},
              "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
