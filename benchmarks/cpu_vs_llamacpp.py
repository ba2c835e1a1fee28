"""Elesium's CPU engine beside llama.cpp on the same GGUF, prompts and thread count, in one process.

Speed (default): for each prompt, greedy decoding of up to ``--max-tokens`` new tokens by each of our
modes (the default configuration: GGUF-block weights with the compiled step, vanilla; and speculative
when heads are loaded; with ``--compare`` also the float32 reference and the eager 4-bit path)
and by llama-cpp-python, in an order that rotates prompt by prompt, so every ratio compares runs that
were adjacent in time on a shared, noisy machine. tokens/s = new tokens / wall time, prompt
evaluation included, for both engines; figures are medians over prompts, and ratios are medians
of per-prompt ratios.

Quality (``--quality``): the fast path's greedy output against the float32 reference's on the same
prompts: the share of identical outputs, and the mean log-probability that each model gives to the
reference's tokens (teacher-forced), so users see what, if anything, the fast weights trade.

llama-cpp-python is an optional benchmark dependency (``pip install llama-cpp-python==0.3.36`` with
``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"``: a portable build; a
native one crashed here with an illegal instruction).

    python benchmarks/cpu_vs_llamacpp.py --prompts ../shared/data/mt_bench_questions.jsonl --limit 20 \\
        --out benchmarks/cpu-2026-11-30-fast/speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def load_prompts(path: Path, limit: int | None) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [r["turns"][0] if "turns" in r else r["prompt"] for r in rows]
    return prompts[:limit] if limit else prompts


def machine() -> dict[str, Any]:
    from elesium.inference.tuning.profile import cpu_signature

    return {"cpu": cpu_signature(), "cores_online": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
            "loadavg_start": os.getloadavg()}


def llama_tokens_per_s(llm: Any, ids: list[int], max_tokens: int, eos: set[int]) -> tuple[float, list[int]]:
    """Greedy decode from token ids with llama.cpp; tokens/s with the prompt's evaluation included."""
    llm.reset()
    out: list[int] = []
    start = time.perf_counter()
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if tok in eos:
            break
        out.append(tok)
        if len(out) >= max_tokens:
            break
    elapsed = time.perf_counter() - start
    return len(out) / elapsed, out


def speed(args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    from llama_cpp import Llama

    from elesium.inference.engine import Engine
    from elesium.inference.sampling import SamplingParams

    t0 = time.perf_counter()
    engine = Engine.load(device="cpu", max_len=2048)
    ours_load_s = time.perf_counter() - t0
    path = str(engine.weights_info.source)
    llm = Llama(model_path=path, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=2048,
                n_batch=512, verbose=False, seed=0)
    eos = set(engine.tokenizer.eos_ids) | {llm.token_eos()}
    modes = ["vanilla"] + (["speculative"] if engine.heads is not None and not args.vanilla_only else [])
    # --compare: other configurations of ours, vanilla, in the same rotation (each its own engine).
    others: dict[str, Engine] = {}
    if args.compare:
        from elesium.config import Settings

        others["reference"] = Engine.load(device="cpu", dtype="float32", heads=None, max_len=2048)
        others["eager_4bit"] = Engine.load(device="cpu", heads=None, max_len=2048,
                                           settings=Settings.from_env().with_overrides(cpu_compile="off"))
    systems = [*modes, *others, "llama.cpp"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    warm = engine.encode_prompt(prompts[0])
    t0 = time.perf_counter()
    engine.generate(prompts[0], SamplingParams(max_tokens=8), mode="vanilla")
    ours_first_generation_s = time.perf_counter() - t0  # includes the compiled step's compile or cache load
    for other in others.values():
        other.generate(prompts[0], SamplingParams(max_tokens=8), mode="vanilla")
    if "speculative" in modes:
        engine.generate(prompts[0], SamplingParams(max_tokens=8), mode="speculative")
    llama_tokens_per_s(llm, warm, 8, eos)
    rows = []
    for i, prompt in enumerate(prompts):
        ids = engine.encode_prompt(prompt)
        order = systems[i % len(systems):] + systems[:i % len(systems)]
        row: dict[str, Any] = {"prompt": i, "prompt_tokens": len(ids)}
        for system in order:
            if system == "llama.cpp":
                tps, toks = llama_tokens_per_s(llm, ids, args.max_tokens, eos)
                row["llama.cpp"] = {"tokens_per_s": tps, "tokens": len(toks)}
                row["llama_ids"] = toks
            elif system in others:
                g = others[system].generate(prompt, params, mode="vanilla")
                row[system] = {"tokens_per_s": g.tokens_per_s, "tokens": g.new_tokens}
                row[f"{system}_ids"] = list(g.token_ids)
            else:
                g = engine.generate(prompt, params, mode=system)
                row[system] = {"tokens_per_s": g.tokens_per_s, "tokens": g.new_tokens}
                row[f"{system}_ids"] = list(g.token_ids)
        row["loadavg"] = os.getloadavg()[0]
        for m in [*modes, *others]:
            row[f"{m}_over_llama"] = row[m]["tokens_per_s"] / row["llama.cpp"]["tokens_per_s"]
        for name in others:
            row[f"vanilla_over_{name}"] = row["vanilla"]["tokens_per_s"] / row[name]["tokens_per_s"]
        if "reference" in others:
            row["vanilla_equals_reference"] = row["vanilla_ids"] == row["reference_ids"]
        if "speculative" in modes:
            row["spec_equals_vanilla"] = row["speculative_ids"] == row["vanilla_ids"]
        row["vanilla_equals_llama"] = row["vanilla_ids"] == row["llama_ids"]
        rows.append(row)
        print(f"[{i + 1}/{len(prompts)}] " + " ".join(f"{s} {row[s]['tokens_per_s']:.1f}" for s in systems)
              + f" tok/s, load {row['loadavg']:.1f}", file=sys.stderr, flush=True)
    summary: dict[str, Any] = {
        s: {"tokens_per_s_median": statistics.median(r[s]["tokens_per_s"] for r in rows),
            "tokens": sum(r[s]["tokens"] for r in rows)} for s in systems}
    for m in [*modes, *others]:
        summary[f"{m}_over_llama_median"] = statistics.median(r[f"{m}_over_llama"] for r in rows)
    for name in others:
        summary[f"vanilla_over_{name}_median"] = statistics.median(r[f"vanilla_over_{name}"] for r in rows)
    if "reference" in others:
        summary["vanilla_equals_reference"] = sum(r["vanilla_equals_reference"] for r in rows)
    if "speculative" in modes:
        summary["spec_equals_vanilla"] = sum(r["spec_equals_vanilla"] for r in rows)
    summary["vanilla_equals_llama"] = sum(r["vanilla_equals_llama"] for r in rows)
    summary["loadavg_median"] = statistics.median(r["loadavg"] for r in rows)
    return {"engine": engine.describe(), "others": {k: e.describe() for k, e in others.items()},
            "ours_load_s": ours_load_s, "ours_first_generation_s": ours_first_generation_s,
            "summary": summary,
            "per_prompt": [{k: v for k, v in r.items() if not k.endswith("_ids")} for r in rows]}


def _teacher_forced_logprob(model: Any, ids: list[int], target: list[int]) -> float:
    """Mean log-probability of ``target`` after ``ids`` under ``model`` (one forward over both)."""
    seq, target = list(ids) + list(target), list(target)
    with torch.inference_mode():
        cache = model.new_cache(len(seq) + 1)
        hidden = model(torch.tensor([seq]), torch.arange(len(seq)), cache, 0)[0]
        logp = torch.log_softmax(model.logits(hidden[len(ids) - 1:-1]), dim=-1)
        return logp.gather(1, torch.tensor(target)[:, None]).mean().item()


def quality(args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    from elesium.inference.engine import Engine
    from elesium.inference.sampling import SamplingParams

    ref = Engine.load(device="cpu", dtype="float32", heads=None, max_len=2048)
    fast = Engine.load(device="cpu", heads=None, max_len=2048)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows = []
    for i, prompt in enumerate(prompts):
        ids = ref.encode_prompt(prompt)
        a = list(ref.generate(prompt, params, mode="vanilla").token_ids)
        b = list(fast.generate(prompt, params, mode="vanilla").token_ids)
        common = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        row = {"prompt": i, "identical": a == b, "common_prefix": common, "tokens": len(a),
               "ref_logprob_ref": _teacher_forced_logprob(ref.model, ids, a) if a else 0.0,
               "fast_logprob_ref": _teacher_forced_logprob(fast.model, ids, a) if a else 0.0}
        rows.append(row)
        print(f"[{i + 1}/{len(prompts)}] identical {row['identical']} prefix {common}/{len(a)} "
              f"logprob ref {row['ref_logprob_ref']:.4f} fast {row['fast_logprob_ref']:.4f}",
              file=sys.stderr, flush=True)
    n = sum(r["tokens"] for r in rows)
    return {"reference": ref.describe(), "fast": fast.describe(), "prompts": len(rows),
            "identical": sum(r["identical"] for r in rows),
            "mean_logprob_ref_tokens": {
                "reference": sum(r["ref_logprob_ref"] * r["tokens"] for r in rows) / max(1, n),
                "fast": sum(r["fast_logprob_ref"] * r["tokens"] for r in rows) / max(1, n)},
            "median_common_prefix": statistics.median(r["common_prefix"] for r in rows),
            "per_prompt": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=Path, required=True,
                   help="MT-Bench JSONL ('turns') or JSONL with 'prompt'")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vanilla-only", action="store_true", help="leave out our speculative mode")
    p.add_argument("--compare", action="store_true",
                   help="also our float32 reference and the 4-bit path without the compiled step, vanilla")
    p.add_argument("--quality", action="store_true", help="fast path against the float32 reference instead")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.limit)
    doc = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "max_tokens": args.max_tokens, "prompts": len(prompts), "machine": machine()}
    doc |= quality(args, prompts) if args.quality else speed(args, prompts)
    doc["machine"]["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    keys = ("prompts", "identical", "mean_logprob_ref_tokens")
    print(json.dumps(doc.get("summary") or {k: doc[k] for k in keys}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
