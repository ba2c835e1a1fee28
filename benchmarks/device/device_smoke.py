"""Quick CUDA checks before the timed runs.

* CUDA-graph replay equals eager, and speculative greedy equals vanilla greedy, in bf16 and fp32
  (mismatches are reported with the base model's top-2 logit margin at the first differing token).
* Where a decode step's time goes: graph replay alone against the whole step.
"""

import json
import os
import statistics
import sys
import time

import torch

from elesium.inference.engine import Engine
from elesium.inference.sampling import SamplingParams

prompts = [json.loads(line)["turns"][0] for line in open(sys.argv[1] if len(sys.argv) > 1 else
                                                          ".lead-carry/mt_bench_questions.jsonl")][:8]


def margin(engine: Engine, prompt: str, tokens: tuple[int, ...], k: int) -> float:
    ids = engine.encode_prompt(prompt) + list(tokens[:k])
    cache = engine.model.new_cache(len(ids) + 1)
    with torch.inference_mode():
        h = engine.model(torch.tensor([ids], device="cuda"), torch.arange(len(ids), device="cuda"), cache,
                         0)[0]
        top = torch.topk(engine.model.logits(h[-1]), 2).values
    return float(top[0] - top[1])


for dtype in os.environ.get("SMOKE_DTYPES", "bfloat16 float32").split():
    start = time.time()
    graphs = Engine.load(device="cuda", dtype=dtype)
    eager = Engine.load(device="cuda", dtype=dtype, cuda_graphs=False)
    print(f"[{dtype}] loaded in {time.time() - start:.1f}s; heads: {graphs.heads is not None}")
    print(f"  drafter: {getattr(graphs.heads, 'drafter', None) is not None}")
    same_graph = same_spec = same_steps = 0
    for p in prompts:
        params = SamplingParams(max_tokens=96)
        a = graphs.generate(p, params, mode="vanilla")
        b = eager.generate(p, params, mode="vanilla")
        c = graphs.generate(p, params, mode="medusa")
        d = eager.generate(p, params, mode="medusa")
        same_graph += a.token_ids == b.token_ids
        same_spec += a.token_ids == c.token_ids
        # Same drafts in the graph and eager drafting paths -> the same trees and acceptances.
        same_steps += [s.accepted_nodes for s in c.steps] == [s.accepted_nodes for s in d.steps]
        if a.token_ids != c.token_ids:
            k = next(i for i, (x, y) in enumerate(zip(a.token_ids, c.token_ids)) if x != y)
            print(f"  medusa/vanilla diverge at token {k}: top-2 logit margin there "
                  f"{margin(eager, p, a.token_ids, k):.4f}")
    print(f"  graphs==eager: {same_graph}/{len(prompts)}; medusa==vanilla (greedy): "
          f"{same_spec}/{len(prompts)}; "
          f"medusa steps graphs==eager: {same_steps}/{len(prompts)}")

engine = Engine.load(device="cuda")
engine.generate(prompts[0], SamplingParams(max_tokens=8), mode="medusa")
runner = engine.runner
for n in (1, 16, 64):
    runner.decode(list(range(n)), list(range(600, 600 + n)), 600, torch.ones(n, n, dtype=torch.bool).tril(),
                  drafts=n > 1)
    graph = runner._graphs[(next(b for b in runner.buckets if b >= n), n > 1 and runner.fuses_drafts)][0]
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(50):
        graph.replay()
    ev[1].record()
    torch.cuda.synchronize()
    replay = ev[0].elapsed_time(ev[1]) / 50
    times = []
    for _ in range(30):
        t = time.perf_counter()
        out = runner.decode(list(range(n)), list(range(600, 600 + n)), 600,
                            torch.ones(n, n, dtype=torch.bool).tril(),
                            drafts=n > 1)
        out.greedy.tolist()
        times.append(1000 * (time.perf_counter() - t))
    print(f"N={n}: graph replay {replay:.3f} ms (GPU), decode() incl. host work + readback "
          f"{statistics.median(times):.3f} ms")
if getattr(engine.heads, "conditioned", False):  # Hydra: the per-step drafting replay, with readback
    n_rows = runner.draft_rows  # the worst case: every level accepted last step
    h = torch.zeros(n_rows, engine.model.config.hidden_size, device="cuda", dtype=engine.model.dtype)
    times = []
    for i in range(33):
        t = time.perf_counter()
        outs = runner.expand(engine.heads, h, [1 + i] * n_rows, 600, engine.policy.expand_width, 10)
        [o.tolist() for o in outs]
        times.append(1000 * (time.perf_counter() - t))
    print(f"hydra drafting ({n_rows} drafter rows, width {engine.policy.expand_width}, top-10) incl. "
          f"readback: {statistics.median(times[3:]):.3f} ms")
gen = engine.generate(prompts[1], SamplingParams(max_tokens=128), mode="vanilla")
print(f"vanilla step (whole loop): {1000 * gen.elapsed_s / gen.new_tokens:.3f} ms/token; "
      f"median StepRecord {1000 * statistics.median(s.elapsed_s for s in gen.steps):.3f} ms")
gen = engine.generate(prompts[1], SamplingParams(max_tokens=128), mode="medusa")
print(f"medusa: {1000 * gen.elapsed_s / gen.new_tokens:.3f} ms/token, tau {gen.mean_accepted:.2f}, "
      f"median step {1000 * statistics.median(s.elapsed_s for s in gen.steps):.3f} ms, "
      f"mean tree {statistics.mean(s.tree_size for s in gen.steps):.1f}")
