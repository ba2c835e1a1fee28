"""The eagle drafter tree (every level drafted by the attention drafter) against the shipped heads, side
by side in one process: vanilla, the shipped heads under their tuned policy, and the drafter tree under
the same policy at each ``--nodes`` size.

Two engines share the process (one per heads directory; the model is small), so every system runs each
prompt back to back, the order rotating from prompt to prompt. Records per prompt ms/token, tokens per
step (tau) and, greedy, whether the tokens equal vanilla's; then medians over prompts, medians of
per-prompt ratios to vanilla, pooled tau and acceptance by depth (``tuning.benchmark.acceptance_by_depth``).
Also what one step's drafting costs with each (``runner.expand`` on three accepted rows at slot 200, as a
step calls it: a graph replay on CUDA, eager on the CPU; median of ``--draft-repeats`` calls, alternating).

    python benchmarks/drafter_tree.py --heads DIR --prompts tests/data/mt_bench_questions.jsonl \\
        --max-tokens 128 --nodes 32,48 --out drafter_tree.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=Path, required=True, help="the drafter tree's directory")
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL with 'prompt' or MT-Bench 'turns'")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--nodes", default="32", help="tree sizes for the drafter tree (comma-separated)")
    ap.add_argument("--width", type=int, default=None, help="paths kept per level (default: the policy's)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--draft-repeats", type=int, default=50)
    ap.add_argument("--shipped-nodes", type=int, default=None,
                    help="tree size for the shipped heads (default: their tuned policy's)")
    ap.add_argument("--plain-levels", action="store_true",
                    help="also the drafter tree with its levels unfused (tree_N_plain), a third engine: the "
                         "A/B of the fused levels, which are the default on CUDA")
    ap.add_argument("--logit-scales", default="",
                    help="also the drafter tree with each level's draft distribution softmax(s * logits), "
                         "for each comma-separated s (tree_N_lsS, one engine each): draft-side calibration")
    ap.add_argument("--depths", default="",
                    help="also the drafter tree drafting each comma-separated number of levels (tree_N_dD, "
                         "one engine per depth; the manifest's depth is tree_N): how deep a tree pays")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch

    from elesium.inference.engine import Engine
    from elesium.inference.sampling import SamplingParams
    from elesium.inference.tuning.benchmark import acceptance_by_depth

    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] if "prompt" in r else r["turns"][0] for r in rows][: args.limit]
    old = Engine.load(device=args.device)
    new = Engine.load(device=args.device, heads=args.heads)
    if old.heads is None or new.heads is None:
        raise SystemExit("needs the shipped heads and the drafter tree")
    greedy = args.temperature == 0.0
    plain: Engine | None = None
    scales = [float(x) for x in args.logit_scales.split(",") if x.strip()]
    scaled: dict[float, Engine] = {}
    deep: dict[int, Engine] = {}
    for depth in (int(x) for x in args.depths.split(",") if x.strip()):
        if depth != new.heads.num_heads:
            deep[depth] = Engine.load(device=args.device, heads=args.heads, draft_depth=depth)
    systems: dict[str, tuple[Engine, str, object]] = {
        "vanilla": (old, "vanilla", None), "shipped": (old, "speculative", old.policy)}
    if args.shipped_nodes is not None:
        old.policy = dataclasses.replace(old.policy, max_nodes=args.shipped_nodes)
        systems["shipped"] = (old, "speculative", old.policy)
    for n in (int(x) for x in args.nodes.split(",")):
        width = args.width or old.policy.expand_width
        policy = dataclasses.replace(old.policy, max_nodes=n, expand_width=width)
        systems[f"tree_{n}"] = (new, "speculative", policy)
        if args.plain_levels:
            if plain is None:
                plain = Engine.load(device=args.device, heads=args.heads)
                plain.heads.fused_levels = False
            systems[f"tree_{n}_plain"] = (plain, "speculative", policy)
        for scale in scales:
            if scale not in scaled:
                scaled[scale] = Engine.load(device=args.device, heads=args.heads)
                scaled[scale].heads.logit_scale = scale
            systems[f"tree_{n}_ls{scale:g}"] = (scaled[scale], "speculative", policy)
        for depth, engine in deep.items():
            systems[f"tree_{n}_d{depth}"] = (engine, "speculative", policy)

    def run(prompt: str, name: str, seed: int):
        engine, mode, policy = systems[name]
        if engine.model.device.type == "cuda":
            torch.cuda.synchronize()
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed)
        return engine.generate(prompt, params, mode=mode, policy=policy)

    for name in systems:  # capture every graph before timing
        run(prompts[0], name, 0)
    names = list(systems)
    out, gens = [], {name: [] for name in names}
    for i, prompt in enumerate(prompts):
        order = names[i % len(names):] + names[:i % len(names)]
        res = {name: run(prompt, name, i) for name in order}
        base = res["vanilla"].token_ids
        for name, g in res.items():
            gens[name].append(g)
        out.append({"prompt": i, "tokens": len(base)} | {
            name: {"ms_per_token": 1000.0 * g.elapsed_s / max(1, g.new_tokens), "tau": g.mean_accepted,
                   "identical": greedy and g.token_ids == base} for name, g in res.items()})
    summary: dict = {"prompts": len(out), "max_tokens": args.max_tokens, "temperature": args.temperature,
                     "engine_shipped": old.describe(), "engine_tree": new.describe(),
                     "policy": {"max_nodes": old.policy.max_nodes, "expand_width": old.policy.expand_width,
                                "topk": old.policy.topk}}
    for name in names:
        steps = [s for g in gens[name] for s in g.steps]
        summary[name] = {
            "ms_per_token": statistics.median(r[name]["ms_per_token"] for r in out),
            "tau": statistics.median(r[name]["tau"] for r in out),
            "tau_pooled": sum(s.accepted_length for s in steps) / max(1, len(steps)),
            "identical_to_vanilla": sum(r[name]["identical"] for r in out),
            "speedup_over_vanilla": statistics.median(
                r["vanilla"]["ms_per_token"] / r[name]["ms_per_token"] for r in out)}
        if name != "vanilla":
            summary[name]["accept_rate_by_depth"] = [round(x, 4) for x in acceptance_by_depth(gens[name])]
    summary["drafting_ms_per_step"] = drafting_cost(old, new, args.draft_repeats, plain, deep)
    args.out.write_text(json.dumps({"summary": summary, "prompts": out}, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if not k.startswith("engine")}))


def drafting_cost(old, new, repeats: int, plain=None, deep=None) -> dict[str, float]:
    """Median ms of one step's drafting (``runner.expand``) for each engine's heads, under the shipped
    heads' policy, the calls rotating (``tree_plain``: the drafter tree with unfused levels; ``tree_dD``:
    drafting D levels)."""
    import time

    import torch

    engines = {"shipped": old, "tree": new} | ({"tree_plain": plain} if plain is not None else {})
    engines |= {f"tree_d{d}": e for d, e in (deep or {}).items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for i in range(repeats + 2):
            names = list(engines)
            for name in names[i % len(names):] + names[:i % len(names)]:
                engine = engines[name]
                model, policy = engine.model, old.policy
                rows = torch.randn(3, model.config.hidden_size, generator=gen) * 0.5
                rows = rows.to(model.device, model.dtype)
                levels = policy.draft_levels(engine.heads.num_heads)
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                engine.runner.expand(engine.heads, rows, [11, 12, 13], 200, policy.expand_width,
                                     policy.draft_topk(), levels)
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                if i >= 2:  # the first calls capture graphs
                    times[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


if __name__ == "__main__":
    main()
