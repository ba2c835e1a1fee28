"""``elesium tune``: measure this hardware and these heads, and pick the tree that is fastest here.

Sequoia's observation is that the best tree depends on two curves: how the verification forward's
cost grows with the number of tree nodes (flat on a GPU until compute saturates; steep on a CPU),
and how likely each (depth, rank) draft is to be accepted. We measure both, choose the static tree
that maximises expected tokens per millisecond, then run static and dynamic trees side by side on
calibration prompts and keep the faster. Calibration prompts come from the training templates
(never from MT-Bench, which is the evaluation set).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from elesium.inference.decoding.tree import Tree
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.drafters.drafter_tree import DrafterTree
from elesium.inference.runtime.forward import TREE_BUCKETS
from elesium.inference.sampling import SamplingParams
from elesium.inference.tuning.profile import (
    TuneProfile,
    best_static_tree,
    device_kind,
    profile_weights,
    weights_of,
)

if TYPE_CHECKING:
    from elesium.inference.engine import Engine


def _sync(engine: Engine) -> None:
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()


def random_tree(size: int, rng: random.Random) -> Tree:
    parents = [-1] + [rng.randrange(max(0, i - 4), i) for i in range(1, size)]
    depths = [0] * size
    for i in range(1, size):
        depths[i] = depths[parents[i]] + 1
    return Tree(tuple(parents), tuple(depths), tuple([-1] + [0] * (size - 1)))


@torch.inference_mode()
def forward_cost_curve(engine: Engine, prefix_len: int = 500, sizes: Sequence[int] = TREE_BUCKETS,
                       repeats: int = 7) -> dict[int, float]:
    """Median ms of one verification forward of N tree nodes over a ``prefix_len`` cache."""
    rng = random.Random(0)
    vocab = engine.model.config.vocab_size
    engine.runner.prefill([rng.randrange(vocab) for _ in range(prefix_len)])
    out: dict[int, float] = {}
    for n in sizes:
        if prefix_len + n > engine.cache.max_len:
            break
        tree = random_tree(n, rng)
        tokens = [rng.randrange(vocab) for _ in range(n)]
        args = (tokens, [prefix_len + d for d in tree.depths], prefix_len, tree.ancestors())
        drafts = n > 1  # a 1-node "tree" is a vanilla step; real trees draft for the next step
        for _ in range(2):
            engine.runner.decode(*args, drafts=drafts)
        times = []
        for _ in range(repeats):
            _sync(engine)
            start = time.perf_counter()
            engine.runner.decode(*args, drafts=drafts)
            _sync(engine)
            times.append(1000 * (time.perf_counter() - start))
        out[n] = statistics.median(times)
    return out


@torch.inference_mode()
def head_acceptance(engine: Engine, prompts: Sequence[str], max_tokens: int = 96,
                    topk: int = 10) -> list[list[float]]:
    """acceptance[d][r]: how often head d+1's rank-r token equals the base model's greedy token."""
    heads, model = engine.heads, engine.model
    assert heads is not None
    hits = torch.zeros(heads.num_heads, topk)
    total = 0
    for prompt in prompts:
        gen = engine.generate(prompt, SamplingParams(max_tokens=max_tokens), mode="vanilla")
        ids = engine.encode_prompt(prompt) + list(gen.token_ids)
        start = len(ids) - len(gen.token_ids) - 1  # hidden at the last prompt token predicts gen[0]
        cache = model.new_cache(len(ids) + 1)
        hidden = model(torch.tensor([ids], device=model.device), torch.arange(len(ids), device=model.device),
                       cache, 0)[0]
        target = torch.tensor(ids, device=model.device)
        rows = torch.arange(start, len(ids) - 1 - heads.num_heads, device=model.device)
        if rows.numel() == 0:
            continue
        ahead = rows[:, None] + torch.arange(heads.num_heads, device=model.device)
        if isinstance(heads, DrafterTree):  # every level drafted from the true path, unrolled
            feats = heads.feature_drafter.unrolled(model, hidden[None, :-1], target[None, 1:],
                                                   heads.num_heads)
            out = torch.stack([f[0][rows + d] for d, f in enumerate(feats)])  # depth d+1 drafts from t at t+d
        else:
            # Hydra heads read the true path so far (x_{t+1} ...), as they do when that path was drafted.
            out = heads.teacher_forced(model, hidden[rows], target[ahead + 1])  # [heads, rows, H]
        drafter = heads.drafter
        if drafter is not None and not isinstance(heads, DrafterTree):  # level 1 is the drafter's: score that
            # row t reads (h_t, x_{t+1})
            feats = drafter.sequence(model, hidden[None, :-1], target[None, 1:])[0]
            out = torch.cat([feats[rows][None], out[1:]])
        top = torch.topk(model.logits(out), topk, dim=-1).indices  # [heads, rows, topk]
        truth = target[ahead + 2].T  # [heads, rows]
        hits += (top == truth[..., None]).float().sum(1).cpu()
        total += rows.numel()
    return (hits / max(1, total)).tolist()


def tune(engine: Engine, prompts: Sequence[str], *, ab_prompts: int = 6, ab_tokens: int = 64,
         log: Callable[[str], None] = print) -> TuneProfile:
    if engine.heads is None:
        raise ValueError("tuning needs Medusa heads for this model (train them with `elesium train-heads`)")
    log("measuring the verification forward's cost curve ...")
    curve = forward_cost_curve(engine)
    log("  " + ", ".join(f"{n}: {ms:.2f} ms" for n, ms in curve.items()))
    log(f"measuring head acceptance on {len(prompts)} calibration prompts ...")
    acceptance = head_acceptance(engine, prompts)
    log("  top-1 by head: " + ", ".join(f"{row[0]:.2f}" for row in acceptance))
    sizes, costs = list(curve), list(curve.values())
    profile = TuneProfile(device_kind=device_kind(engine.model.device),
                          dtype=str(engine.model.dtype).removeprefix("torch."),
                          model_sha256=engine.weights_info.sha256 if engine.weights_info else "",
                          heads_sha256=engine.heads.source_sha256,
                          weights=profile_weights(weights_of(engine.model),
                                                  getattr(engine, "forward_path", "eager")),
                          cost_sizes=sizes, cost_ms=costs, step_overhead_ms=0.0, acceptance=acceptance,
                          created=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    # Per-step overhead (heads, tree building, verification, compaction) from a real generation.
    probe = TreePolicy(kind="static", static_paths=((0,),), cost=profile.cost_curve())
    engine.policy = probe
    gen = engine.generate(prompts[0], SamplingParams(max_tokens=32), mode="speculative")
    profile.step_overhead_ms = max(0.0, statistics.median(1000 * s.elapsed_s for s in gen.steps)
                                   - profile.cost_curve()(2))
    paths, expected = best_static_tree(acceptance, profile.cost_curve(), max_nodes=max(sizes))
    profile.static_paths, profile.expected_tokens_per_step = paths, expected
    log(f"  step overhead {profile.step_overhead_ms:.2f} ms; best static tree: {len(paths) + 1} nodes, "
        f"expected {expected:.2f} tokens/step")
    # Side by side, rotating the order: the static tree, dynamic trees under several size caps, and
    # vanilla. The caps are measured rather than modelled because host work (building the tree,
    # staging its mask, walking it) grows with the tree and the cost curve above does not see it.
    caps = sorted({c for c in (8, 16, 32, 64, max(sizes)) if c <= max(sizes)})
    arms = [("static", 0)] + [("dynamic", c) for c in caps] + [("vanilla", 0)]
    rates: dict[tuple[str, int], list[float]] = {arm: [] for arm in arms}
    for i, prompt in enumerate(prompts[:ab_prompts]):
        for kind, cap in arms[i % len(arms):] + arms[:i % len(arms)]:
            if kind != "vanilla":
                profile.kind, profile.max_nodes = kind, cap or profile.max_nodes
                engine.policy = profile.policy()
            mode = "vanilla" if kind == "vanilla" else "speculative"
            gen = engine.generate(prompt, SamplingParams(max_tokens=ab_tokens), mode=mode)
            rates[(kind, cap)].append(gen.tokens_per_s)
    medians = {arm: statistics.median(v) for arm, v in rates.items()}
    best = max((arm for arm in arms if arm[0] != "vanilla"), key=medians.__getitem__)
    profile.kind, profile.max_nodes = best[0], best[1] or min(max(sizes), max(8, 2 * (len(paths) + 1)))
    profile.speculate = medians[best] > medians[("vanilla", 0)]
    engine.policy = profile.policy()
    log("  tokens/s " + ", ".join(f"{k}{'<=' + str(c) if c else ''} {medians[(k, c)]:.1f}" for k, c in arms)
        + f": using {profile.kind}" + (f" (<= {profile.max_nodes} nodes)" if profile.kind == "dynamic"
                                       else "")
        + ("" if profile.speculate else "; vanilla by default"))
    return profile
