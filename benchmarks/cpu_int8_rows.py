"""One decoder layer's three big matmuls on the CPU by row count: int8 x int8 -> int32 (``torch._int_mm``,
oneDNN) against bfloat16 ``linear``, random data of the bundled model's shapes (QKV 960x576, gate|up
3072x576, down 576x1536). A sizing measurement for issue 19: whether an int8 path would be flat in the rows a
verification forward holds (it is not a shipped path). Medians of 50 calls, µs.

    python benchmarks/cpu_int8_rows.py [--threads 2] [--rows 1 4 16 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

SHAPES = ((576 + 2 * 192, 576), (3072, 576), (576, 1536))


def median_us(fn: Callable[[], object], n: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {}
    for m in args.rows:
        int8 = bf16 = 0.0
        for n, k in SHAPES:
            a = torch.randint(-127, 127, (m, k), dtype=torch.int8)
            b = torch.randint(-127, 127, (k, n), dtype=torch.int8)
            x, w = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
            int8 += median_us(lambda a=a, b=b: torch._int_mm(a, b))
            bf16 += median_us(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        out[m] = {"int8_int_mm_us": round(int8), "bf16_linear_us": round(bf16)}
    print(json.dumps({"threads": args.threads, "torch": torch.__version__, "layer_us_by_rows": out}))


if __name__ == "__main__":
    main()
