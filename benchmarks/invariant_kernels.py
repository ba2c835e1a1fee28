"""Time the shape-invariant kernels against the ones they replace, at the bundled model's shapes (CUDA).

Each case is captured in a CUDA graph of 20 calls and replayed (``triton.testing.do_bench_cudagraph``,
median), as the engine runs them: eager timing would measure Python launch overhead instead.
Prints one table; run on the device as ``python3 -P benchmarks/invariant_kernels.py``. For the matmul the
"legacy" column is the one fixed config every weight had before per-weight configs (issue 17,
``invariant_matmul.LEGACY``); the weight-streaming sweep behind the shipped configs is
``benchmarks/h200-2026-12-01-invariant-matmul/sweep.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from elesium.kernels.invariant_attention import invariant_tree_attention
from elesium.kernels.invariant_matmul import LEGACY, invariant_linear
from elesium.kernels.invariant_norm import invariant_rms_norm
from elesium.kernels.triton_tree_attention import tree_attention_triton

REPS = 20


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()

    def many() -> None:
        for _ in range(REPS):
            fn()

    return 1000 * triton.testing.do_bench_cudagraph(many, rep=200, return_mode="median") / REPS


def main() -> None:
    dev, bf = "cuda", torch.bfloat16
    rows = []
    for name, n_out, k in (("wqkv", 960, 576), ("wo", 576, 576), ("k/v", 192, 576), ("w13", 3072, 576),
                           ("w2", 576, 1536), ("lm_head", 49152, 576)):
        w = torch.randn(n_out, k, device=dev, dtype=bf) / k**0.5
        for m in (1, 16, 64, 128):
            x = torch.randn(m, k, device=dev, dtype=bf)
            rows.append((f"linear {name} M={m}", graph_us(lambda: F.linear(x, w)),
                         graph_us(lambda: invariant_linear(x, w)),
                         graph_us(lambda: invariant_linear(x, w, config=LEGACY))))
    weight = torch.randn(576, device=dev, dtype=bf)

    def torch_norm(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(x.dtype)

    for m in (1, 64):
        x = torch.randn(m, 576, device=dev, dtype=bf)
        rows.append((f"rmsnorm M={m}", graph_us(lambda: torch_norm(x)),
                     graph_us(lambda: invariant_rms_norm(x, weight, 1e-5))))
    cap = 8192
    k = torch.randn(1, 3, cap, 64, device=dev, dtype=bf)
    v = torch.randn(1, 3, cap, 64, device=dev, dtype=bf)
    for prefix in (600, 2000):
        for n in (1, 16, 64):
            q = torch.randn(1, 9, n, 64, device=dev, dtype=bf)
            anc = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
            p = torch.tensor(prefix, device=dev)
            rows.append((f"attention P={prefix} N={n}",
                         graph_us(lambda: tree_attention_triton(q, k, v, p, anc)),
                         graph_us(lambda: invariant_tree_attention(q, k, v, p, anc))))
    print(f"{'case':<28} {'current us':>11} {'invariant us':>13} {'ratio':>6} {'legacy us':>10}")
    for name, a, b, *legacy in rows:
        extra = f" {legacy[0]:>10.2f}" if legacy else ""
        print(f"{name:<28} {a:>11.2f} {b:>13.2f} {b / a:>6.2f}{extra}")


if __name__ == "__main__":
    main()
