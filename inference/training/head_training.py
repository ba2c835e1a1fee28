"""Train Medusa heads on the base model's own outputs; score them against its greedy continuations.

``train`` reads top to bottom like nanoGPT's train.py: config, base model, data (self-distillation,
``distill.py``), hidden-state cache, heads, optimiser, loop (progress bar, periodic held-out eval,
resumable checkpoints), final evaluation, shipped weights + manifest.

Targets. The cache holds, for every position t of every answer (from the last prompt token on), the
base model's final-norm hidden state ``h_t`` and the token that followed, ``x_{t+1}``. Head k
(0-based) at t must predict ``x_{t+k+2}``, which is the stored next token of row ``t+k+1``; its KL
target is the base model's own distribution at ``t+k+1``, ``softmax(lm_head(h_{t+k+1}))``, which costs
one frozen projection instead of storing 49k-wide distributions. Loss = sum_k decay^k * loss_k.
"""

from __future__ import annotations

import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from elesium.inference.drafters.attention_drafter import FeatureDrafter
from elesium.inference.drafters.drafter_tree import DrafterTree
from elesium.inference.drafters.files import build_heads, read_manifest, save_heads
from elesium.inference.drafters.hydra import HeadsModule, HydraHeads
from elesium.inference.drafters.storage import round_trip
from elesium.inference.prompts import read_jsonl, read_prompts, write_jsonl
from elesium.inference.runtime.config import DTYPES
from elesium.inference.runtime.model import Transformer
from elesium.inference.training.checkpoints import load_checkpoint, save_checkpoint
from elesium.inference.training.distill import build_prompts, distill, generate_all
from elesium.inference.training.drafter_training import (
    DrafterConfig,
    cosine_lr,
    score_depths,
    score_drafter,
    train_drafter,
)
from elesium.inference.training.train_config import TrainConfig

Log = Callable[[str], None]


@dataclass
class HiddenCache:
    """Rows are answer positions: ``hidden[i] = h_t``, ``next_token[i] = x_{t+1}``, ``seq[i]`` = sequence."""

    hidden: torch.Tensor      # [T, H] in the model dtype
    next_token: torch.Tensor  # [T] long
    seq: torch.Tensor         # [T] long

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def path_tokens(self, rows: torch.Tensor, k: int) -> torch.Tensor:
        """``[B, k]``: ``x_{t+1} ... x_{t+k}`` for each row t (clamped at the end; mask with target_rows)."""
        j = (rows[:, None] + torch.arange(k, device=rows.device)).clamp(max=len(self) - 1)
        return self.next_token[j]

    def target_rows(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row of head k's target, valid) for 0-based head ``k``: row ``i + k + 1`` of the same sequence."""
        j = rows + k + 1
        inside = j < len(self)
        j = j.clamp(max=len(self) - 1)
        return j, inside & (self.seq[j] == self.seq[rows])


@torch.inference_mode()
def cache_hidden_states(model: Transformer, sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
                        batch_size: int = 32) -> HiddenCache:
    """Teacher-forced forward over (prompt, answer) pairs; keep rows t = P-1 .. L-2 (t+1 is an answer token).

    Right padding needs no mask: causal attention never looks ahead into the padding.
    """
    dev = model.device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]) + len(sequences[i][1]))
    hiddens, nexts, seqs, owners = [], [], [], []
    for lo in range(0, len(order), batch_size):
        idx = [i for i in order[lo:lo + batch_size] if len(sequences[i][1]) > 0]
        if not idx:
            continue
        full = [list(sequences[i][0]) + list(sequences[i][1]) for i in idx]
        width = max(len(f) for f in full)
        tokens = torch.zeros(len(idx), width, dtype=torch.long)
        for b, f in enumerate(full):
            tokens[b, :len(f)] = torch.tensor(f)
        tokens = tokens.to(dev)
        hidden = model(tokens, torch.arange(width, device=dev), model.new_cache(width, len(idx)), 0)
        for b, i in enumerate(idx):
            p, n = len(sequences[i][0]), len(full[b])
            hiddens.append(hidden[b, p - 1:n - 1])
            nexts.append(tokens[b, p:n])
            seqs.append(torch.full((n - p,), i, dtype=torch.long, device=dev))
            owners.append(i)
    if not hiddens:
        raise ValueError("no answer tokens to train or score on")
    # Restore sequence order so that row i + 1 is the next position of the same sequence.
    perm = sorted(range(len(seqs)), key=owners.__getitem__)
    return HiddenCache(torch.cat([hiddens[j] for j in perm]), torch.cat([nexts[j] for j in perm]),
                       torch.cat([seqs[j] for j in perm]))


def head_losses(heads: HeadsModule, model: Transformer, cache: HiddenCache, rows: torch.Tensor, loss: str,
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per head: mean loss, top-1 hits and top-5 hits over the valid rows (hits are 0/1 per row, valid only).

    Hydra heads are teacher-forced on the data's own tokens: head k reads ``x_{t+1} ... x_{t+k+1}``
    (a row whose target is valid has all of them in its sequence).
    """
    # [K, B, H]
    out = heads.teacher_forced(model, cache.hidden[rows], cache.path_tokens(rows, heads.num_heads))
    losses, top1, top5 = [], [], []
    for k in range(heads.num_heads):
        j, valid = cache.target_rows(rows, k)
        logits = model.logits(out[k][valid])
        target = cache.next_token[j][valid]
        if loss == "kl":
            with torch.no_grad():
                teacher = torch.log_softmax(model.logits(cache.hidden[j][valid]), dim=-1)
            student = torch.log_softmax(logits, dim=-1)
            per_row = (teacher.exp() * (teacher - student)).sum(-1)
        elif loss == "ce":
            per_row = F.cross_entropy(logits, target, reduction="none")
        else:
            raise ValueError(f"unknown loss {loss!r}; use kl or ce")
        losses.append(per_row.mean() if per_row.numel() else logits.sum() * 0)
        with torch.no_grad():
            best = logits.topk(5, dim=-1).indices
            top1.append((best[:, 0] == target).float())
            top5.append((best == target[:, None]).any(-1).float())
    return losses, top1, top5


@torch.no_grad()
def evaluate(heads: HeadsModule, model: Transformer, cache: HiddenCache, rows: torch.Tensor | None = None,
             loss: str = "ce", chunk: int = 4096) -> list[dict[str, float]]:
    """Per-head loss / top-1 / top-5 over ``rows`` (default: all), in chunks."""
    rows = torch.arange(len(cache), device=cache.hidden.device) if rows is None else rows
    sums = [[0.0, 0.0, 0.0, 0] for _ in range(heads.num_heads)]
    for lo in range(0, rows.numel(), chunk):
        losses, top1, top5 = head_losses(heads, model, cache, rows[lo:lo + chunk], loss)
        for k in range(heads.num_heads):
            n = top1[k].numel()
            sums[k][0] += float(losses[k]) * n
            sums[k][1] += float(top1[k].sum())
            sums[k][2] += float(top5[k].sum())
            sums[k][3] += n
    return [{"head": k + 1, "loss": s[0] / max(s[3], 1), "top1": s[1] / max(s[3], 1),
             "top5": s[2] / max(s[3], 1), "positions": s[3]} for k, s in enumerate(sums)]


def score_prompts(model: Transformer, tokenizer: Any, heads: HeadsModule, prompts: Sequence[str],
                  max_tokens: int = 256, batch_size: int = 16) -> dict[str, Any]:
    """Each head's top-1/top-5 against the base model's own greedy continuation of ``prompts`` (for an
    eagle drafter tree, each depth's, along the true path: ``score_depths``)."""
    ids = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    answers = generate_all(model, ids, max_tokens, eos_ids=tokenizer.eos_ids, batch_size=batch_size)
    pairs = list(zip(ids, answers))
    if isinstance(heads, DrafterTree):  # every level is the drafter's, scored along the true path
        depths = score_depths(heads.feature_drafter, model, pairs, heads.num_heads, batch_size=batch_size)
        rows = [{"head": d["depth"], "top1": round(d["top1"], 4), "top5": round(d["top5"], 4),
                 "positions": d["positions"], "source": "drafter"} for d in depths]
        return {"heads": rows, "tokens": sum(len(a) for a in answers), "prompts": len(prompts)}
    per_head = evaluate(heads, model, cache_hidden_states(model, pairs, batch_size=batch_size), loss="ce")
    rows = [{"head": h["head"], "top1": round(h["top1"], 4), "top5": round(h["top5"], 4),
             "positions": h["positions"]} for h in per_head]
    result: dict[str, Any] = {"heads": rows, "tokens": sum(len(a) for a in answers), "prompts": len(prompts)}
    drafter = heads.drafter
    if drafter is not None:  # the engine drafts level 1 with the drafter: that is head 1's score
        d = score_drafter(drafter, model, pairs, batch_size=batch_size)
        result["mlp_head1"] = rows[0]
        rows[0] = {"head": 1, "top1": round(d["top1"], 4), "top5": round(d["top5"], 4),
                   "positions": d["positions"], "source": "drafter"}
    return result


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr``."""
    return cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_ratio)


def hardware() -> dict[str, str]:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    cpu = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return {"device": gpu or cpu,
            "torch": torch.__version__, "python": platform.python_version()}


def train(cfg: TrainConfig, engine: Any, log: Log = print) -> dict[str, Any]:
    """Run the whole recipe; return the manifest written next to the heads in ``cfg.out``.

    With ``cfg.distill_only`` stop once the data file exists and return ``{"data": path}``: the data
    is reused by the next run on the same ``out``, so a long recipe can be split across calls.
    """
    from tqdm import tqdm

    if cfg.distill_only and cfg.data is not None:
        raise ValueError("--distill-only writes OUT/distill.jsonl.gz; with --data there is nothing to distil")
    if cfg.drafter not in ("none", "attention"):
        raise ValueError(f"unknown drafter {cfg.drafter!r}; use attention or none")
    if cfg.drafter != "none" and cfg.kind not in ("hydra", "eagle"):
        raise ValueError("the attention drafter drafts level 1 for hydra heads; use --kind hydra or "
                         "--drafter none")
    if cfg.kind == "eagle" and cfg.drafter == "none":
        raise ValueError("an eagle drafter tree is the attention drafter; it cannot go with --drafter none")
    t0 = time.monotonic()
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    cfg.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer, sha = engine.model, engine.tokenizer, engine.weights_info.sha256
    dev = model.device

    # -- data: the base model answers our prompts (or a saved distillation file) -------------------
    data_path = cfg.data or cfg.out / "distill.jsonl.gz"
    if cfg.data is None and not data_path.exists():
        prompts = build_prompts(cfg.prompts, seed=cfg.seed)
        log(f"distilling: {len(prompts)} prompts x temperatures {list(cfg.temperatures)}, "
            f"<= {cfg.max_new_tokens} new tokens, batch {cfg.gen_batch}")
        with tqdm(total=len(prompts) * len(cfg.temperatures), desc="distill", mininterval=5) as bar:
            records = distill(model, tokenizer, prompts, model_sha256=sha, max_new_tokens=cfg.max_new_tokens,
                              temperatures=cfg.temperatures, seed=cfg.seed, batch_size=cfg.gen_batch,
                              progress=bar.update)
        write_jsonl(data_path, records)
        log(f"distilled in {time.monotonic() - t0:.0f}s -> {data_path}")
    if cfg.distill_only:
        return {"data": str(data_path)}
    records = list(read_jsonl(data_path))
    foreign = {r.get("model_sha256") for r in records} - {sha}
    if foreign:
        raise ValueError(f"{data_path} was generated by base model(s) {sorted(foreign)}, "
                         f"not the loaded {sha}")

    # -- held-out split by prompt id (both samples of a prompt stay on one side) -------------------
    ids = sorted({r["id"] for r in records})
    random.Random(cfg.seed).shuffle(ids)
    val_ids = set(ids[:max(1, int(len(ids) * cfg.val_fraction))])
    split = {"train": [r for r in records if r["id"] not in val_ids],
             "val": [r for r in records if r["id"] in val_ids]}
    data_block = {"file": data_path.name, "prompts": len(ids), "sequences": len(records),
                  "temperatures": sorted({r["sampling"]["temperature"] for r in records}),
                  "max_new_tokens": max(r["sampling"]["max_new_tokens"] for r in records),
                  "tasks": _task_counts(records), "prompt_source": cfg.prompt_source,
                  "created": records[0].get("created") if records else None}
    if cfg.kind == "eagle":
        return _train_drafter_tree(cfg, engine, split, data_block, t0, log)
    caches = {name: cache_hidden_states(model, [(r["prompt_ids"], r["response_ids"]) for r in rs],
                                        batch_size=cfg.gen_batch)
              for name, rs in split.items()}
    train_cache, val_cache = caches["train"], caches["val"]
    log(f"cached hidden states: {len(train_cache):,} train / {len(val_cache):,} held-out positions "
        f"({time.monotonic() - t0:.0f}s)")

    # -- heads, optimiser, checkpoint ---------------------------------------------------------------
    heads = build_heads({"kind": cfg.kind, "hidden_size": model.config.hidden_size,
                         "num_heads": cfg.num_heads,
                         "num_layers": cfg.num_layers, "conditioning": cfg.conditioning}).to(dev)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    ckpt_path = cfg.out / "ckpt.pt"
    step, history = 0, []
    if cfg.resume and ckpt_path.exists():
        step, history = load_checkpoint(ckpt_path, "heads", heads, opt, dev)
        log(f"resumed from {ckpt_path} at step {step}")

    def save_ckpt() -> None:
        save_checkpoint(ckpt_path, "heads", heads, opt, step, history,
                        config={k: str(v) for k, v in asdict(cfg).items()})

    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    weights = [cfg.decay ** k for k in range(cfg.num_heads)]

    # -- training loop --------------------------------------------------------------------------------
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train ({cfg.loss})", mininterval=5)
    while step < cfg.steps:
        if cfg.time_budget_s is not None and time.monotonic() - t0 > cfg.time_budget_s:
            log(f"time budget of {cfg.time_budget_s:.0f}s reached at step {step}; stopping early")
            break
        # The batch depends only on (seed, step): a resumed run draws exactly the same batches.
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        rows = torch.randint(len(train_cache), (cfg.batch_size,), generator=gen).to(dev)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        with autocast:
            losses, _, _ = head_losses(heads, model, train_cache, rows, cfg.loss)
        total = sum(w * loss for w, loss in zip(weights, losses))
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{float(total.detach()):.3f}", lr=f"{lr_at(step - 1, cfg):.2e}", refresh=False)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            with autocast:
                held = evaluate(heads, model, val_cache)
            history.append({"step": step, "train_loss": float(total.detach()), "held_out": held})
            log(f"step {step}: " + "  ".join(f"h{h['head']} {h['top1']:.3f}/{h['top5']:.3f}" for h in held))
        if step % cfg.ckpt_every == 0:
            save_ckpt()
    bar.close()
    save_ckpt()
    drafter: FeatureDrafter | None = None
    drafter_block: dict[str, Any] = {}
    if cfg.drafter == "attention":
        torch.manual_seed(cfg.seed)
        drafter = FeatureDrafter.for_model(model.config, cfg.drafter_intermediate).to(dev)
        dcfg = DrafterConfig(steps=cfg.drafter_steps, batch=cfg.drafter_batch, lr=cfg.drafter_lr,
                             warmup=min(cfg.warmup, cfg.drafter_steps), eval_every=cfg.eval_every,
                             ckpt_every=cfg.ckpt_every, seed=cfg.seed, resume=cfg.resume)
        drafter_block = train_drafter(
            drafter, model, [list(r["prompt_ids"]) + list(r["response_ids"]) for r in split["train"]],
            [(r["prompt_ids"], r["response_ids"]) for r in split["val"]], dcfg, cfg.out, autocast,
            deadline=None if cfg.time_budget_s is None else t0 + cfg.time_budget_s, log=log)
    train_s = time.monotonic() - t0

    # -- final evaluation, of the weights exactly as shipped (save_dtype, storage), and the artefact --
    save_dtype = DTYPES[cfg.save_dtype]
    heads = heads.to(save_dtype).eval()
    if cfg.storage != "float":
        heads.load_state_dict(round_trip(heads.state_dict(), cfg.storage, save_dtype))
    held = evaluate(heads, model, val_cache)
    eval_block: dict[str, Any] = {"held_out": held}
    if drafter is not None:
        val_pairs = [(r["prompt_ids"], r["response_ids"]) for r in split["val"]]
        with autocast:
            unquantised = score_drafter(drafter, model, val_pairs)
        drafter = drafter.to(save_dtype).eval().requires_grad_(False)
        if cfg.storage != "float":
            drafter.load_state_dict(round_trip(drafter.state_dict(), cfg.storage, save_dtype))
        assert isinstance(heads, HydraHeads)  # train() checked: the drafter pairs with hydra heads
        heads.drafter = drafter
        eval_block["held_out_drafter"] = {"as_stored": score_drafter(drafter, model, val_pairs),
                                          "before_storage": unquantised}
        log("held-out head 1 (drafter): " + "  ".join(
            f"{k} {v['top1']:.3f}/{v['top5']:.3f}" for k, v in eval_block["held_out_drafter"].items()))
    data_block.update(train_positions=len(train_cache), held_out_positions=len(val_cache))
    training = {
        "loss": cfg.loss, "decay": cfg.decay, "steps": step, "batch_size": cfg.batch_size, "lr": cfg.lr,
        "warmup": cfg.warmup, "schedule": "linear warmup + cosine", "optimizer": "AdamW(0.9, 0.95)",
        "weight_decay": cfg.weight_decay, "seed": cfg.seed, "elapsed_s": round(train_s, 1),
        "data": data_block, **({"drafter": drafter_block} if drafter is not None else {})}
    return _write(cfg, engine, heads, training, eval_block, history, t0, log)


def _task_counts(records: Sequence[dict[str, Any]]) -> dict[str, int]:
    tasks: dict[str, int] = {}
    for r in records:
        tasks[r.get("task", "?")] = tasks.get(r.get("task", "?"), 0) + 1
    return dict(sorted(tasks.items()))


def _write(cfg: TrainConfig, engine: Any, heads: HeadsModule, training: dict[str, Any],
           eval_block: dict[str, Any], history: list[Any], t0: float, log: Log) -> dict[str, Any]:
    """Score on ``cfg.eval_prompts`` (as stored), write heads + manifest, return the manifest."""
    model, tokenizer = engine.model, engine.tokenizer
    if cfg.eval_prompts is not None:
        result = score_prompts(model, tokenizer, heads, read_prompts(cfg.eval_prompts), cfg.eval_max_tokens,
                               batch_size=max(1, min(cfg.gen_batch, 80)))
        eval_block["prompts"] = {"file": Path(cfg.eval_prompts).name, "max_tokens": cfg.eval_max_tokens,
                                 **result}
        log(f"{Path(cfg.eval_prompts).name}: " + "  ".join(
            f"h{h['head']} {h['top1']:.3f}/{h['top5']:.3f}" for h in result["heads"]))
    manifest = {
        "base_model": {"sha256": engine.weights_info.sha256,
                       "file": Path(str(engine.weights_info.source)).name,
                       "dtype_during_training": str(model.dtype).removeprefix("torch.")},
        "heads": {"vocab_size": model.config.vocab_size,
                  "hidden_state": "final-norm output of Transformer.forward",
                  "output_layer": "base model lm_head (shared, frozen)"},
        "training": training,
        "eval": eval_block, "history": history, "command": cfg.command, "hardware": hardware(), **cfg.extra,
    }
    save_heads(heads, cfg.out, manifest, storage=cfg.storage)
    log(f"wrote {cfg.out} (manifest.json and weights, {time.monotonic() - t0:.0f}s total)")
    return read_manifest(cfg.out)


def _train_drafter_tree(cfg: TrainConfig, engine: Any, split: dict[str, list[dict[str, Any]]],
                        data_block: dict[str, Any], t0: float, log: Log) -> dict[str, Any]:
    """``--kind eagle``: the attention drafter alone, unrolled over ``cfg.num_heads`` depths
    (``FeatureDrafter.unrolled``); no per-position hidden-state cache, no MLP heads.

    ``cfg.init_drafter`` starts from the drafter of another heads directory (e.g. the shipped Hydra
    heads' level-1 drafter), which already knows depth 1.
    """
    model, dev = engine.model, engine.model.device
    torch.manual_seed(cfg.seed)
    if cfg.init_drafter is not None:
        from elesium.inference.drafters.files import load_heads

        source = load_heads(cfg.init_drafter, base_sha256=engine.weights_info.sha256, device=dev)
        if source.drafter is None:
            raise ValueError(f"{cfg.init_drafter} holds no attention drafter to start from")
        drafter = source.drafter.float().requires_grad_(True)
        log(f"drafter: starting from {cfg.init_drafter}'s drafter")
    else:
        drafter = FeatureDrafter.for_model(model.config, cfg.drafter_intermediate).to(dev)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    dcfg = DrafterConfig(steps=cfg.drafter_steps, batch=cfg.drafter_batch, lr=cfg.drafter_lr,
                         warmup=min(cfg.warmup, cfg.drafter_steps), eval_every=cfg.eval_every,
                         ckpt_every=cfg.ckpt_every, seed=cfg.seed, resume=cfg.resume,
                         depth=cfg.num_heads, decay=cfg.decay)
    val_pairs = [(r["prompt_ids"], r["response_ids"]) for r in split["val"]]
    seqs = [list(r["prompt_ids"]) + list(r["response_ids"]) for r in split["train"]]
    block = train_drafter(drafter, model, seqs, val_pairs, dcfg, cfg.out, autocast,
                          deadline=None if cfg.time_budget_s is None else t0 + cfg.time_budget_s, log=log)
    train_s = time.monotonic() - t0
    with autocast:
        before = score_depths(drafter, model, val_pairs, cfg.num_heads)
    save_dtype = DTYPES[cfg.save_dtype]
    drafter = drafter.to(save_dtype).eval().requires_grad_(False)
    if cfg.storage != "float":
        drafter.load_state_dict(round_trip(drafter.state_dict(), cfg.storage, save_dtype))
    heads = DrafterTree(drafter, cfg.num_heads)
    eval_block: dict[str, Any] = {"held_out_by_depth": {"as_stored": score_depths(drafter, model, val_pairs,
                                                                                  cfg.num_heads),
                                                        "before_storage": before}}
    log("held-out by depth (as stored): " + "  ".join(
        f"{d['top1']:.3f}/{d['top5']:.3f}" for d in eval_block["held_out_by_depth"]["as_stored"]))
    training = {"kind": "eagle", **block, "seed": cfg.seed, "elapsed_s": round(train_s, 1),
                "data": data_block,
                **({"init_drafter": str(cfg.init_drafter)} if cfg.init_drafter is not None else {})}
    return _write(cfg, engine, heads, training, eval_block, block.get("history", []), t0, log)
