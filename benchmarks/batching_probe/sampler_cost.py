"""Issue 38 probe: the host cost of picking one token from a 49,152-wide logit row (``sampling.py``),
and whether the seeded uniforms are a position-addressable stream (block draws == sequential draws).

    .venv/bin/python benchmarks/batching_probe/sampler_cost.py \
        --out benchmarks/batching_probe/sampler_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from elesium.inference.sampling import Sampler, SamplingParams, sample_from, target_probs


def tm(f, n: int = 20) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(1e3 * (time.perf_counter() - t))
    return round(statistics.median(ts), 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    lg = torch.randn(49152) * 3
    res: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": "2-core CPU, shared",
        "loadavg": os.getloadavg(),
    }
    for threads in (torch.get_num_threads(), 1):
        torch.set_num_threads(threads)
        r = {}
        r["argmax_ms"] = tm(lambda: int(lg.argmax()))
        r["T0.7_ms"] = tm(lambda: sample_from(target_probs(lg, SamplingParams(temperature=0.7)), 0.3))
        r["T0.7_top_p0.95_ms"] = tm(
            lambda: sample_from(target_probs(lg, SamplingParams(temperature=0.7, top_p=0.95)), 0.3)
        )
        r["T0.7_top_k50_ms"] = tm(
            lambda: sample_from(target_probs(lg, SamplingParams(temperature=0.7, top_k=50)), 0.3)
        )
        p = torch.softmax(lg / 0.7, -1)
        r["sort_49152_ms"] = tm(lambda: torch.sort(p, descending=True))
        r["topk_1024_ms"] = tm(lambda: torch.topk(p, 1024))
        res[f"threads_{threads}"] = r
    s = Sampler(7)
    res["sequential_uniforms_equal_block_draw"] = [s.uniform() for _ in range(64)] == Sampler(7).uniforms(
        64
    ).tolist()
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
