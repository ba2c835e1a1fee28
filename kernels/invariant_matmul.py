"""A matmul whose every output row is bit-for-bit independent of how many rows the product has.

Why: speculative verification runs the model over N tree nodes at once, vanilla decoding over one
token. cuBLAS picks a different kernel (tile shape, split-K, reduction order) for M = 1 than for
M = 64, so a node's logits in the N-row product differ in the last bits from the 1-row product,
and in bf16 that flips enough argmaxes that greedy speculative output drifts from vanilla. Here
the launch configuration is a constant: one tile shape, a fixed ``BLOCK_K`` walked in order from
k = 0, fp32 accumulation, no split-K, and one compiled binary for every M (``M`` and the row
strides are not specialised on). Each output element is then the same sequence of operations on
the same inputs whatever M is ("Defeating Nondeterminism in LLM Inference", Thinking Machines
Lab, 2025, calls this batch invariance).

``invariant_linear`` computes ``x @ weight.T + bias`` like ``torch.nn.functional.linear``;
``linear_reference`` is the fp32 definition it is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64
BLOCK_N = 64
GROUP_M = 8
# fp32 runs the dot in IEEE fp32 (no tf32) and holds smaller K tiles to stay in registers.
_BLOCK_K = {torch.float32: 32, torch.float16: 64, torch.bfloat16: 64}
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit(do_not_specialize=["M", "stride_am", "stride_cm"])
def _invariant_matmul_kernel(
    a_ptr,
    b_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
):
    """``C[M, N] = A[M, K] @ B[N, K]^T (+ bias)``; grid ``cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)``."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped tile order (L2 reuse of B across neighbouring M tiles); it changes which program
    # computes a tile, never how a tile is computed.
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inputs the kernel takes: float16/bfloat16/float32 of one dtype, matching inner sizes, no autograd."""
    return (
        x.dtype in _BLOCK_K
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and x.shape[-1] == weight.shape[1]
        and x.device == weight.device
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` over ``x``'s last dimension; each row's result is independent of the others.

    ``x``: ``[..., K]``; ``weight``: ``[N, K]``; ``bias``: ``[N]`` or None. Output in ``x.dtype``,
    accumulated in fp32. No backward: callers that need gradients use ``F.linear``.
    """
    if not supports(x, weight):
        raise ValueError(f"invariant_linear: unsupported inputs {tuple(x.shape)} {x.dtype} @ "
                         f"{tuple(weight.shape)} {weight.dtype}")
    k = x.shape[-1]
    n = weight.shape[0]
    a = x.reshape(-1, k)
    m = a.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
    _invariant_matmul_kernel[grid](
        a,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=_BLOCK_K[x.dtype],
        GROUP_M=GROUP_M,
        IEEE=x.dtype == torch.float32,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out.view(*x.shape[:-1], n)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: the product in float32 (float64 for float64 inputs), rounded once to ``x.dtype``."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(acc) @ weight.to(acc).T
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)
