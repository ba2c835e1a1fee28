"""Self-distillation data for Medusa heads: our own prompts, answered by the base model itself.

Heads must predict what *this* model will say, not what a human wrote, so the training text is the
base model's own output (Medusa's "self-distillation"). The prompts come from templates
(``elesium/data/distill_templates.jsonl``): enterprise tasks (summarise, classify, extract JSON,
emails, SQL, code, arithmetic, rewrite, plans, Q&A) x domains (IT tickets, incidents, approvals, HR,
finance, support, sales, security, logistics, legal, product), and about as many general-assistant
tasks (stories, poems, roleplay, advice, STEM, maths, coding, puzzles, extraction, humanities,
editing, translation, how-to, chat). The general ones are there because heads trained on enterprise
templates alone generalised poorly to open chat: with 8,000 of these prompts instead of 3,000
enterprise-heavy ones (and 5,000 training steps instead of 2,000), MT-Bench head-1 top-1 of the same
heads went from 0.42 to 0.48 (HEADS.md). They are deliberately NOT MT-Bench, which is the evaluation set.
Everything is deterministic for a seed.

Generation is batched: prompts of different lengths are left-padded into one ``[B, P]`` block and
``kv_valid`` hides the padding slots, so each row sees exactly what it would see alone.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from elesium.inference.runtime.model import Transformer

SLOT = re.compile(r"\{(\w+)\}")
# Slots filled with fresh random values rather than picked from a list.
_INT_SLOTS = {"a": (12, 480), "b": (3, 95), "c": (50, 900), "num": (2, 60), "mm": (10, 59),
              "amount": (120, 98000)}


def templates_path() -> Path:
    return Path(str(resources.files("elesium") / "data" / "distill_templates.jsonl"))


def load_templates(path: str | Path | None = None,
                   ) -> tuple[dict[str, list[str]], dict[str, dict], dict[str, list[str]]]:
    """(global slots, domain -> slots, task -> templates) from the templates JSONL."""
    global_slots: dict[str, list[str]] = {}
    domains: dict[str, dict] = {}
    tasks: dict[str, list[str]] = {}
    for line in Path(path or templates_path()).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "task" in rec:
            tasks[rec["task"]] = rec["templates"]
        elif "domain" in rec:
            domains[rec["domain"]] = rec["slots"]
        else:
            global_slots.update(rec["slots"])
    return global_slots, domains, tasks


def _render(template: str, slots: dict[str, list[str]], rng: random.Random, depth: int = 0) -> str:
    """Fill ``{slot}`` placeholders; slot values may contain placeholders themselves (one level)."""
    names = rng.sample(slots["name"], 3)

    def fill(m: re.Match[str]) -> str:
        key = m.group(1)
        if key in _INT_SLOTS:
            return str(rng.randint(*_INT_SLOTS[key]))
        if key in ("name", "name2", "name3"):
            return names[("name", "name2", "name3").index(key)]
        if key == "text":
            facts = rng.sample(slots["fact"], rng.randint(3, min(5, len(slots["fact"]))))
            return " ".join(_render(f, slots, rng, depth + 1) for f in facts)
        if key == "labels":
            return ", ".join(slots["labels"])
        if key == "table_name":
            return rng.choice(slots["table"]).split("(")[0]
        if key == "concept2":
            return rng.choice(slots["concept"])
        if key not in slots:
            raise KeyError(f"template slot {{{key}}} has no values in the templates file")
        value = rng.choice(slots[key])
        return _render(value, slots, rng, depth + 1) if depth < 1 and "{" in value else value

    return SLOT.sub(fill, template)


def build_prompts(n: int, seed: int = 0, path: str | Path | None = None) -> list[dict[str, str]]:
    """``n`` distinct prompts ``{"id", "task", "domain", "prompt"}``, the same for the same seed."""
    global_slots, domains, tasks = load_templates(path)
    rng = random.Random(seed)
    task_names, domain_names = sorted(tasks), sorted(domains)
    seen: set[str] = set()
    out: list[dict[str, str]] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"the templates yield only {len(out)} distinct prompts; asked for {n}")
        task, domain = rng.choice(task_names), rng.choice(domain_names)
        slots = {**global_slots, **domains[domain]}
        prompt = _render(rng.choice(tasks[task]), slots, rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"id": f"p{len(out):05d}", "task": task, "domain": domain, "prompt": prompt})
    return out


# -- batched generation ---------------------------------------------------------------------------
@torch.inference_mode()
def generate_batch(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   eos_ids: Iterable[int], temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> list[list[int]]:
    """Continue every prompt (greedy, or sampled at ``temperature``); each row stops after an EOS token.

    Rows are left-padded to a common length P: row b's real tokens sit in slots ``[pad_b, P)`` with
    RoPE positions ``0 ..``, and ``kv_valid`` marks the pad slots invisible. Returned continuations
    include the EOS token when one was produced.
    """
    dev, bsz = model.device, len(prompts)
    lens = [len(p) for p in prompts]
    if min(lens) < 1:
        raise ValueError("every prompt needs at least one token")
    width = max(lens)
    pad = torch.tensor([width - n for n in lens], device=dev)
    tokens = torch.zeros(bsz, width, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        tokens[b, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
    cache = model.new_cache(width + max_new_tokens, batch=bsz)
    slots = torch.arange(cache.max_len, device=dev)
    # future slots are marked valid now; unwritten ones are never live
    kv_valid = slots[None, :] >= pad[:, None]
    positions = (torch.arange(width, device=dev)[None, :] - pad[:, None]).clamp(min=0)
    eos = torch.tensor(sorted(set(eos_ids)), device=dev)

    hidden = model(tokens, positions, cache, 0, kv_valid=kv_valid)[:, -1]
    out = torch.zeros(bsz, max_new_tokens, dtype=torch.long, device=dev)
    done = torch.zeros(bsz, dtype=torch.bool, device=dev)
    steps = 0
    for i in range(max_new_tokens):
        logits = model.logits(hidden)
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            nxt = logits.argmax(-1)
        out[:, i] = nxt
        steps = i + 1
        done |= torch.isin(nxt, eos)
        if i + 1 == max_new_tokens or bool(done.all()):
            break
        pos = (width + i - pad)[:, None]
        hidden = model(nxt[:, None], pos, cache, width + i, kv_valid=kv_valid)[:, -1]
    result: list[list[int]] = []
    eos_set = set(eos.tolist())
    for row in out[:, :steps].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in eos_set), len(row))
        result.append(row[:cut])
    return result


def generate_all(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 eos_ids: Iterable[int], temperature: float = 0.0, seed: int = 0, batch_size: int = 64,
                 progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """``generate_batch`` over many prompts, batched by similar length (less padding), original order kept.

    One device generator seeded with ``seed`` draws every sample, so a run repeats on the same hardware.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    generator = torch.Generator(device=model.device).manual_seed(seed)
    results: list[list[int]] = [[] for _ in prompts]
    eos = list(eos_ids)
    for lo in range(0, len(order), batch_size):
        idx = order[lo:lo + batch_size]
        outs = generate_batch(model, [prompts[i] for i in idx], max_new_tokens, eos_ids=eos,
                              temperature=temperature, generator=generator)
        for i, o in zip(idx, outs):
            results[i] = o
        if progress is not None:
            progress(len(idx))
    return results


def distill(model: Transformer, tokenizer: Any, prompts: Sequence[dict[str, str]], *, model_sha256: str,
            max_new_tokens: int = 256, temperatures: Sequence[float] = (0.0, 0.7), seed: int = 0,
            batch_size: int = 64, progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """The base model's answers to every prompt at every temperature, as JSONL-ready records with
    provenance."""
    ids = [tokenizer.encode_chat([{"role": "user", "content": p["prompt"]}]) for p in prompts]
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    eos = sorted(tokenizer.eos_ids)
    records: list[dict[str, Any]] = []
    for j, temp in enumerate(temperatures):
        outs = generate_all(model, ids, max_new_tokens, eos_ids=eos, temperature=temp, seed=seed + j,
                            batch_size=batch_size, progress=progress)
        for p, pid, out in zip(prompts, ids, outs):
            records.append({
                **p, "prompt_ids": pid, "response_ids": out,
                "response": tokenizer.decode(out, skip_special_tokens=True),
                "finish": "eos" if out and out[-1] in tokenizer.eos_ids else "length",
                "sampling": {"temperature": temp, "max_new_tokens": max_new_tokens, "seed": seed + j},
                "model_sha256": model_sha256, "dtype": str(model.dtype).removeprefix("torch."),
                "device": model.device.type, "created": created})
    return records
