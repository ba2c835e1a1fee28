"""One token's matmuls of the bundled model's shape on the CPU, by row count and kernel.

Why: speculation pays on a CPU only if verifying N tree nodes costs little more than one token. This times
every linear layer of one forward (30 layers of fused QKV, output, fused gate|up, down, and the 49,152-row
``lm_head``, each layer its own weight so caches do not flatter it) at M = 1..32 rows for torch's int4 CPU
kernel (what the default path runs: random 4-bit codes, groups of 32, bfloat16 activations), bfloat16
weights through oneDNN (AMX where the CPU has it) and float32 through MKL. Medians of ``--repeats``.

    python benchmarks/cpu_matmul_rows.py --out bench-out/cpu_matmul_rows.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

LAYERS = 30
SHAPES = {(960, 576): LAYERS, (576, 576): LAYERS, (3072, 576): LAYERS, (576, 1536): LAYERS, (49152, 576): 1}


def timed(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from elesium.inference.tuning.profile import cpu_signature

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = {}
    for (n, k), count in SHAPES.items():
        dense = [torch.randn(n, k, generator=g) / k**0.5 for _ in range(count)]
        packed = []
        for _ in range(count):
            codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
            sz = (torch.rand(k // 32, n, 2, generator=g) * 0.02).to(torch.bfloat16)
            packed.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8), sz))
        weights[(n, k)] = ([w.bfloat16() for w in dense], dense, packed)
    rows_ms: dict[str, dict[int, float]] = {"int4 (torch CPU kernel)": {}, "bfloat16 (oneDNN)": {},
                                            "float32 (MKL)": {}}
    for m in (int(r) for r in args.rows.split(",")):
        total = dict.fromkeys(rows_ms, 0.0)
        for (n, k), (bf16, fp32, packed) in weights.items():
            x = torch.randn(m, k, generator=g)
            xb = x.bfloat16()
            total["int4 (torch CPU kernel)"] += timed(
                lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w, 32, sz) for w, sz in packed],
                args.repeats)
            total["bfloat16 (oneDNN)"] += timed(lambda: [torch.nn.functional.linear(xb, w) for w in bf16],
                                                args.repeats)
            total["float32 (MKL)"] += timed(lambda: [torch.nn.functional.linear(x, w) for w in fp32],
                                            args.repeats)
        for kernel, ms in total.items():
            rows_ms[kernel][m] = round(ms, 2)
        print(m, {kernel: round(ms, 2) for kernel, ms in total.items()}, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"cpu": cpu_signature(), "threads": args.threads, "torch": torch.__version__,
              "ms_per_forward_matmuls": rows_ms}
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
