"""Train and score the attention drafter (``drafters/attention_drafter.py``) on whole self-distilled
sequences.

Unlike the heads, which train on cached per-position hidden states, the drafter attends over every
earlier position, so each step runs the frozen base model over a batch of whole sequences and
trains on all of their positions at once:

    row t reads (h_t, x_{t+1}) and must match the base model's own distribution for x_{t+2},
    softmax(lm_head(h_{t+1})): a KL, like the heads' loss, so no 49k-wide targets are stored.

Batches depend only on (seed, step), so a resumed run draws exactly the batches it would have.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elesium.inference.drafters.attention_drafter import FeatureDrafter
from elesium.inference.runtime.model import Transformer
from elesium.inference.training.checkpoints import load_checkpoint, save_checkpoint

Log = Callable[[str], None]


@dataclass
class DrafterConfig:
    steps: int = 3000
    batch: int = 32                 # sequences per step (every position of each is trained on)
    lr: float = 1e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    eval_every: int = 1000
    ckpt_every: int = 1000
    eval_sequences: int = 256       # held-out sequences scored at each evaluation
    seed: int = 0
    resume: bool = False
    depth: int = 1                  # draft depths trained at once (> 1: the eagle drafter tree, unrolled)
    decay: float = 0.8              # depth d's loss weight is decay ** (d - 1)


def cosine_lr(step: int, steps: int, lr: float, warmup: int, min_lr_ratio: float) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` (the heads' schedule)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def padded(seqs: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``[B, W]`` tokens and the mask of real ones."""
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        valid[i, :len(s)] = True
    return tokens.to(device), valid.to(device)


def base_hidden(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """The frozen base model's hidden states ``[B, W, H]`` over whole sequences."""
    w = tokens.shape[1]
    with torch.no_grad():
        return model(tokens, torch.arange(w, device=tokens.device), model.new_cache(w, tokens.shape[0]), 0)


def drafter_logits(drafter: FeatureDrafter, model: Transformer,
                   tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(student logits ``[B, W-2, V]`` for x_{t+2} at rows t, base hidden states ``[B, W, H]``): depth 1."""
    logits, hidden = depth_logits(drafter, model, tokens, 1)
    return logits[0], hidden


def depth_features(drafter: FeatureDrafter, model: Transformer, tokens: torch.Tensor,
                   depth: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Student features ``[B, W-1, H]`` at rows t (drafting x_{t+2}), for each depth 1..``depth`` (row t
    of depth d drafted from the context up to t - d + 1: ``FeatureDrafter.unrolled``), and the base
    hidden states ``[B, W, H]``."""
    hidden = base_hidden(model, tokens)
    if depth == 1:
        return [drafter.sequence(model, hidden[:, :-1], tokens[:, 1:])], hidden
    return drafter.unrolled(model, hidden[:, :-1], tokens[:, 1:], depth), hidden


def depth_logits(drafter: FeatureDrafter, model: Transformer, tokens: torch.Tensor,
                 depth: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``depth_features`` through the lm_head: logits ``[B, W-2, V]`` per depth, and the hidden states."""
    feats, hidden = depth_features(drafter, model, tokens, depth)
    return [model.logits(f[:, :-1]) for f in feats], hidden


def drafter_loss(drafter: FeatureDrafter, model: Transformer, tokens: torch.Tensor,
                 valid: torch.Tensor, depth: int = 1, decay: float = 0.8) -> torch.Tensor:
    """Mean KL(base || drafter) over every row t whose x_{t+2} is a real token; with ``depth`` > 1,
    the sum over depths weighted ``decay ** (d - 1)``, each over the rows that have its context.

    Only real rows reach the 49k-wide lm_head (padding would cost memory at every depth)."""
    feats, hidden = depth_features(drafter, model, tokens, depth)
    rows = valid[:, 2:]
    with torch.no_grad():
        teacher = torch.log_softmax(model.logits(hidden[:, 1:-1][rows]), dim=-1)  # [M, V]
        probs = teacher.exp()
    position = torch.arange(rows.shape[1], device=rows.device).expand_as(rows)[rows]  # each real row's t
    total = torch.zeros((), device=tokens.device)
    for d, f in enumerate(feats, start=1):
        student = torch.log_softmax(model.logits(f[:, :-1][rows]), dim=-1)
        kl = (probs * (teacher - student)).sum(-1)
        counted = (position >= d - 1).to(kl.dtype)
        total = total + decay ** (d - 1) * (kl * counted).sum() / counted.sum().clamp(min=1)
    return total


@torch.no_grad()
def score_drafter(drafter: FeatureDrafter, model: Transformer,
                  pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                  batch_size: int = 32) -> dict[str, float]:
    """Top-1 / top-5 for x_{t+2} at the answer rows, the positions head 1 is scored on.

    Rows t = P-1 .. L-3 of each (prompt P, answer) pair: x_{t+1} is an answer token and x_{t+2}
    exists. That is exactly the set ``head_training.evaluate`` scores head 1 on.
    """
    return score_depths(drafter, model, pairs, 1, batch_size)[0]


@torch.no_grad()
def score_depths(drafter: FeatureDrafter, model: Transformer,
                 pairs: Sequence[tuple[Sequence[int], Sequence[int]]], depth: int,
                 batch_size: int = 32) -> list[dict[str, float]]:
    """``score_drafter`` for each depth 1..``depth``: depth d's row t drafts x_{t+2} from the context
    up to t - d + 1 along the true path (what the tree offers when levels 1..d-1 were drafted right).

    Every depth is scored on the same rows, answer rows whose drafting context (t - d + 1) still lies
    in the sequence, so the depths' scores are comparable: level d given levels before it right.
    """
    dev = model.device
    order = sorted((i for i, (_, a) in enumerate(pairs) if len(a) >= 2),
                   key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    hits1, hits5 = [0] * depth, [0] * depth
    count = 0
    for lo in range(0, len(order), batch_size):
        idx = order[lo:lo + batch_size]
        tokens, _ = padded([list(pairs[i][0]) + list(pairs[i][1]) for i in idx], dev)
        logits, _ = depth_logits(drafter, model, tokens, depth)
        for b, i in enumerate(idx):
            p, n = len(pairs[i][0]), len(pairs[i][0]) + len(pairs[i][1])
            rows = torch.arange(max(p - 1, depth - 1), n - 2, device=dev)
            target = tokens[b, rows + 2]
            for d in range(depth):
                top = logits[d][b, rows].topk(5, dim=-1).indices
                hits1[d] += int((top[:, 0] == target).sum())
                hits5[d] += int((top == target[:, None]).any(-1).sum())
            count += rows.numel()
    return [{"depth": d + 1, "top1": hits1[d] / max(count, 1), "top5": hits5[d] / max(count, 1),
             "positions": count} for d in range(depth)]


def train_drafter(drafter: FeatureDrafter, model: Transformer, train_seqs: Sequence[Sequence[int]],
                  val_pairs: Sequence[tuple[Sequence[int], Sequence[int]]], cfg: DrafterConfig, out: Path,
                  autocast: AbstractContextManager[Any], deadline: float | None = None,
                  log: Log = print) -> dict[str, Any]:
    """Train ``drafter`` in place; return what the manifest records (steps, time, history).

    Checkpoints go to ``out/drafter_ckpt.pt``; ``cfg.resume`` continues from there. ``deadline``
    (a ``time.monotonic()`` value) stops the loop early, keeping what was learnt.
    """
    from tqdm import tqdm

    if not train_seqs:
        raise ValueError("no sequences to train the drafter on")
    dev = model.device
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    ckpt_path = out / "drafter_ckpt.pt"
    step, history = 0, []
    if cfg.resume and ckpt_path.exists():
        step, history = load_checkpoint(ckpt_path, "drafter", drafter, opt, dev)
        log(f"drafter: resumed from {ckpt_path} at step {step}")

    def save_ckpt() -> None:
        save_checkpoint(ckpt_path, "drafter", drafter, opt, step, history)

    # An even spread of the held-out set: distillation files list every greedy answer before the
    # sampled ones, so a prefix would score greedy answers only.
    held = list(val_pairs)[::max(1, -(-len(val_pairs) // cfg.eval_sequences))] if cfg.eval_sequences else []
    t0 = time.monotonic()
    drafter.train()
    bar = tqdm(total=cfg.steps, initial=step, desc="train drafter (kl)", mininterval=5)
    while step < cfg.steps:
        if deadline is not None and time.monotonic() > deadline:
            log(f"drafter: time budget reached at step {step}; stopping early")
            break
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 500_009 + step)
        idx = torch.randint(len(train_seqs), (cfg.batch,), generator=gen).tolist()
        tokens, valid = padded([train_seqs[i] for i in idx], dev)
        lr = cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast:
            loss = drafter_loss(drafter, model, tokens, valid, cfg.depth, cfg.decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", lr=f"{lr:.2e}", refresh=False)
        if held and (step % cfg.eval_every == 0 or step == cfg.steps):
            drafter.eval()
            with autocast:
                scores = score_depths(drafter, model, held, cfg.depth)
            drafter.train()
            score = scores[0] if cfg.depth == 1 else scores
            history.append({"step": step, "train_loss": float(loss.detach()), "held_out": score})
            log(f"drafter step {step}: held-out by depth " + "  ".join(
                f"{s['top1']:.3f}/{s['top5']:.3f}" for s in scores))
        if step % cfg.ckpt_every == 0:
            save_ckpt()
    bar.close()
    save_ckpt()
    drafter.eval()
    return {"steps": step, "batch_sequences": cfg.batch, "lr": cfg.lr, "warmup": cfg.warmup,
            "schedule": "linear warmup + cosine", "optimizer": "AdamW(0.9, 0.95)", "loss": "kl",
            **({"depth": cfg.depth, "decay": cfg.decay, "unrolled": "training-time test (EAGLE-3)"}
               if cfg.depth > 1 else {}),
            "elapsed_s": round(time.monotonic() - t0, 1), "history": history}
