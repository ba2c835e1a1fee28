"""Drafting's top-k over the vocabulary in two kernels, with the log-softmax shift fused in.

Why: each draft level asks for the ``k`` best tokens of up to ``width`` rows of 49,152 logits, with their
log-probabilities. ``torch.topk(torch.log_softmax(x))`` costs a softmax that writes the whole row back
and a multi-block radix select of ~14 kernels, per level; torch's slice-wise form
(``drafters/top_logprobs.top_logprobs`` with a chunk) launches fewer but longer kernels and measured
slower still on the H200 (BENCHMARKS §6j). Here a level is two launches:

1. grid ``(rows, chunks)``: each program reads one ``CHUNK``-wide slice of a row once, keeps its max and
   ``sum(exp(x - max))`` (the pieces of the row's logsumexp), and picks the slice's ``K`` best by ``K``
   rounds of max-and-mask in registers;
2. grid ``(rows,)``: each program merges the row's ``chunks * K`` survivors (a row's top ``K`` lie
   among its slices' top ``K``) by the same rounds, and subtracts the logsumexp merged from the slices'
   pieces.

Ties go to the lower vocabulary index, in both stages, so the result is deterministic. The values
equal ``log_softmax``'s up to float32 rounding of the logsumexp (a different summation order), so a
tree built from them can differ from the reference's only where two candidates' cumulative
log-probabilities tie to within that rounding; drafts only propose and verification is exact, so no
output distribution changes. The fingerprint names the form (``Engine.forward_path``).

``drafters.top_logprobs.top_logprobs_reference`` (``topk(log_softmax(x))``) is the definition it is
tested against (tests/test_topk_kernel.py through Triton's interpreter; tests/test_gpu.py on the H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BIG_INDEX = tl.constexpr(2**30)


@triton.jit
def _slice_topk_kernel(x_ptr, vals_ptr, idx_ptr, max_ptr, sum_ptr, V, stride_x, chunks,
                       K: tl.constexpr, CHUNK: tl.constexpr):
    """Grid ``(rows, chunks)``: one slice's ``K`` best (value, index) and its softmax pieces."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
    x = tl.load(x_ptr + row * stride_x + offs, mask=valid, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # an all -inf slice adds nothing to the sum
    s = tl.sum(tl.exp(x - m_safe), 0)
    piece = row * chunks + c
    tl.store(max_ptr + piece, m)
    tl.store(sum_ptr + piece, s)
    out = piece * K
    for j in tl.static_range(K):
        best = tl.max(x, 0)
        pick = tl.min(tl.where((x == best) & valid, offs, _BIG_INDEX), 0)
        tl.store(vals_ptr + out + j, best)
        tl.store(idx_ptr + out + j, pick)
        x = tl.where(offs == pick, float("-inf"), x)


@triton.jit
def _merge_topk_kernel(vals_ptr, idx_ptr, max_ptr, sum_ptr, out_idx_ptr, out_val_ptr, chunks,
                       K: tl.constexpr, CHUNKS_P2: tl.constexpr, CAND_P2: tl.constexpr):
    """Grid ``(rows,)``: the row's ``K`` best among its slices' survivors, shifted by its logsumexp."""
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_P2)
    m = tl.load(max_ptr + row * chunks + c, mask=c < chunks, other=float("-inf"))
    s = tl.load(sum_ptr + row * chunks + c, mask=c < chunks, other=0.0)
    top = tl.max(m, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.where(m == float("-inf"), 0.0, tl.exp(m - top_safe))
    lse = top_safe + tl.log(tl.sum(s * weights, 0))
    j = tl.arange(0, CAND_P2)
    n_cand = chunks * K
    v = tl.load(vals_ptr + row * n_cand + j, mask=j < n_cand, other=float("-inf"))
    ix = tl.load(idx_ptr + row * n_cand + j, mask=j < n_cand, other=_BIG_INDEX)
    for t in tl.static_range(K):
        best = tl.max(v, 0)
        pick = tl.min(tl.where(v == best, ix, _BIG_INDEX), 0)
        tl.store(out_idx_ptr + row * K + t, pick.to(tl.int64))
        tl.store(out_val_ptr + row * K + t, best - lse)
        v = tl.where(ix == pick, float("-inf"), v)


def topk_logprobs(logits: torch.Tensor, k: int, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64, float32 log-probabilities) of the ``k`` best tokens of each row, best first.

    Any leading shape; the last dimension is the vocabulary and must be contiguous. ``chunk`` (a power
    of two, at least ``k``) is the slice width of the first stage. Static shapes and no host syncs, so
    it can be captured in a CUDA graph. A row needs at least ``k`` finite logits (a vocabulary has).
    """
    if chunk < k or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two of at least k = {k}, got {chunk}")
    lead, v = logits.shape[:-1], logits.shape[-1]
    if k > v:
        raise ValueError(f"k = {k} exceeds the vocabulary of {v}")
    x = logits.reshape(-1, v)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    chunks = triton.cdiv(v, chunk)
    dev = x.device
    vals = torch.empty(rows, chunks * k, dtype=torch.float32, device=dev)
    idx = torch.empty(rows, chunks * k, dtype=torch.int32, device=dev)
    maxes = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    sums = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    out_idx = torch.empty(rows, k, dtype=torch.int64, device=dev)
    out_val = torch.empty(rows, k, dtype=torch.float32, device=dev)
    if rows:
        _slice_topk_kernel[(rows, chunks)](x, vals, idx, maxes, sums, v, x.stride(0), chunks, K=k,
                                           CHUNK=chunk, num_warps=4)
        _merge_topk_kernel[(rows,)](vals, idx, maxes, sums, out_idx, out_val, chunks, K=k,
                                    CHUNKS_P2=triton.next_power_of_2(chunks),
                                    CAND_P2=triton.next_power_of_2(chunks * k), num_warps=4)
    return out_idx.view(*lead, k), out_val.view(*lead, k)

