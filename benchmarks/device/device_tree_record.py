"""On CUDA: the captured tree step (decoding/tree_chain.py under CudaGraphRunner, compiled tree logic)
with tree recording on decodes the same tokens as without it, greedy and sampled, and every step it
takes records a tree holding the step's accepted path (issue 43, item 6).

Usage (on the device machine, from the repo root, with ``elesium`` importable):
    python3 benchmarks/device/device_tree_record.py
The tiny model of tests/spec_harness.py with random Hydra heads and drafter: no model file needed.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from elesium.inference.decoding.speculative import TreeDecoder  # noqa: E402
from elesium.inference.decoding.tree_policy import TreePolicy  # noqa: E402
from elesium.inference.runtime.forward import CudaGraphRunner  # noqa: E402
from elesium.inference.runtime.invariant import apply_invariant_numerics  # noqa: E402
from elesium.inference.sampling import Sampler, SamplingParams  # noqa: E402
from spec_harness import random_hydra_heads, tiny_model, with_random_drafter  # noqa: E402

PROMPT = [1, 3, 5, 2, 7, 4, 6, 0, 2, 5]


def decode(runner, heads, policy, params, seed, steps):
    dec = TreeDecoder(runner, heads, params, Sampler(seed), policy)
    with torch.inference_mode():
        got, records = [dec.prefill(PROMPT)], []
        for _ in range(steps):
            room = runner.cache.max_len - dec.offset
            if room < 1:
                break
            tokens, record = dec.step(room)
            got += tokens
            records.append(record)
    return got, records


def consistent(r) -> bool:
    """The record's tree has one entry per node and holds the accepted path and its tokens."""
    path = r.accepted_nodes
    return (r.tree is not None and len(r.tree.tokens) == r.tree_size
            and [r.tree.tokens[n] for n in path[1:]] == list(r.tokens[:-1])
            and all(r.tree.parents[c] == p for p, c in zip(path, path[1:])))


def main() -> None:
    model = apply_invariant_numerics(tiny_model(0).cuda(), True)
    hydra = random_hydra_heads(32, 3, seed=9, conditioning="chain")
    heads = with_random_drafter(hydra, model.config, seed=10).cuda()
    runner = CudaGraphRunner(model, model.new_cache(64), heads)
    base = TreePolicy(kind="dynamic", max_nodes=12, topk=3, expand_width=4, adapt=False)
    ok = True
    for temperature in (0.0, 0.8):
        params = SamplingParams(max_tokens=30, temperature=temperature, top_p=0.95 if temperature else 1.0)
        for seed in (1, 2, 3):
            plain, plain_records = decode(runner, heads, base, params, seed, 12)
            rec_policy = dataclasses.replace(base, record_trees=True)
            recorded, records = decode(runner, heads, rec_policy, params, seed, 12)
            same = plain == recorded
            trees = all(consistent(r) for r in records)
            chain = sum(1 for r in records if r.predicted == 0.0)
            ok &= same and trees and all(r.tree is None for r in plain_records)
            tau = sum(len(r.tokens) for r in records) / len(records)
            print(f"T={temperature} seed={seed}: same tokens {same}, trees consistent {trees}, "
                  f"chain steps {chain}/{len(records)}, tau {tau:.2f}")
    print("chains started", runner.tree_chains_started, "captured steps", len(runner.chain_graphs),
          "keys", [k[-1] for k in runner.chain_graphs])
    print("OK" if ok and runner.tree_chains_started else "FAILED")
    sys.exit(0 if ok and runner.tree_chains_started else 1)


if __name__ == "__main__":
    main()
