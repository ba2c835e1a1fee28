"""Triton tree attention for the Medusa verification pass (split-K, GQA-packed, bitmask ancestors).

Why this shape of kernel:

* The work is a decode-like attention: few queries (N <= 256 tree nodes) against a long prefix.
  The cost is reading K/V once, so each KV block is loaded once per KV head and used by every
  query head of its GQA group: the group's ``G`` heads x ``N`` nodes are packed into the M rows
  of one tile (row ``r`` is head ``r // N`` of the group, node ``r % N``).
* One (batch, KV head) has far too few rows to fill the GPU, so the prefix is split across CTAs
  (flash-decoding). The number of splits is fixed from static shapes (cache capacity ``S``, ``N``)
  so the grid never depends on data; each split sizes its own range from ``prefix_len`` read in
  the kernel, and splits with nothing to do write an empty partial. That keeps the launch
  capturable in a CUDA graph for any prefix length.
* The prefix is attended in full (no mask, except the tail block); the tree part is one extra
  split that reads the N new keys at ``[prefix_len, prefix_len + N)`` and masks them with the
  ancestor relation packed as int32 bit words ``bits[i, j // 32] >> (j % 32) & 1`` -- never a
  dense ``N x (prefix + N)`` mask.
* A second small kernel merges the partial ``(log2-sum-exp, normalised output)`` pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_TREE_NODES = 256

# Bit weights of one int32 word. Bit 31 weighs -2**31 so that every sum of distinct bits stays in
# int32 range: the sum of a row's set bits is exactly its two's-complement word, with no overflow.
_BIT_WEIGHTS_CACHE: dict[torch.device, torch.Tensor] = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    w = _BIT_WEIGHTS_CACHE.get(device)
    if w is None:
        vals = [1 << i for i in range(31)] + [-(1 << 31)]
        w = torch.tensor(vals, dtype=torch.int32, device=device)
        _BIT_WEIGHTS_CACHE[device] = w
    return w


def pack_ancestor_bits(ancestors: torch.Tensor) -> torch.Tensor:
    """Pack ``ancestors [N, N] bool`` into ``[N, ceil(N / 32)] int32`` words, torch ops only.

    Bit ``j % 32`` of word ``j // 32`` in row ``i`` is ``ancestors[i, j]``. No host sync and no
    data-dependent shapes, so it can run inside a captured CUDA graph. The topology of a Medusa
    tree is usually fixed: callers may pack once and pass the words to ``tree_attention_triton``.
    """
    n = ancestors.shape[0]
    words = (n + 31) // 32
    anc = ancestors.to(torch.bool)
    if words * 32 != n:
        anc = torch.nn.functional.pad(anc, (0, words * 32 - n))
    w = _bit_weights(anc.device)
    # Call-time device lookup above is host-only; the first call per device creates the weights,
    # so do that outside graph capture (the dispatcher's warm-up call does).
    return torch.where(anc.view(n, words, 32), w, 0).sum(-1, dtype=torch.int32)


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,
    k_ptrs,
    v_ptrs,
    col_ok,
    allowed,
    qk_scale,
    MASK_COLS: tl.constexpr,
    MASK_TREE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One online-softmax step over a KV block; log2 domain, guarded against all-masked rows."""
    if MASK_COLS:
        k = tl.load(k_ptrs, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    if MASK_TREE:
        s = tl.where(allowed, s, float("-inf"))
    elif MASK_COLS:
        s = tl.where(col_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no allowed key so far keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["prefix_val", "n_nodes"])
def _tree_attn_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bits_ptr,
    prefix_ptr,
    part_o_ptr,
    part_lse_ptr,
    prefix_val,
    n_nodes,
    n_words,
    num_prefix_splits,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREFIX_FROM_PTR: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Grid ``(m_tiles, B * HKV, num_prefix_splits + 1)``; the last split is the tree part."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // HKV
    hkv = pid_bh % HKV

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * n_nodes
    g = rows // n_nodes
    node = rows % n_nodes
    h = hkv * GROUP + g
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    if PREFIX_FROM_PTR:
        prefix = tl.load(prefix_ptr).to(tl.int32)
    else:
        prefix = prefix_val

    q_ptrs = q_ptr + b * stride_qb + h[:, None] * stride_qh + node[:, None] * stride_qn + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    k_base = k_ptr + b * stride_kb + hkv * stride_kh + offs_d[None, :]
    v_base = v_ptr + b * stride_vb + hkv * stride_vh + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    no_tree = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int1)

    if pid_s < num_prefix_splits:
        # In-kernel split sizing: every split gets an equal share of the live prefix blocks.
        n_blocks = tl.cdiv(prefix, BLOCK_N)
        per_split = tl.cdiv(n_blocks, num_prefix_splits)
        start = pid_s * per_split * BLOCK_N
        end = tl.minimum(start + per_split * BLOCK_N, prefix)
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for start_n in range(start, full_end, BLOCK_N):
            cols = start_n + offs_n
            acc, m_i, l_i = _attend_block(
                acc,
                m_i,
                l_i,
                q,
                k_base + cols[:, None] * stride_ks,
                v_base + cols[:, None] * stride_vs,
                cols < end,
                no_tree,
                qk_scale,
                MASK_COLS=False,
                MASK_TREE=False,
                IEEE=IEEE,
            )
        if full_end < end:
            cols = full_end + offs_n
            acc, m_i, l_i = _attend_block(
                acc,
                m_i,
                l_i,
                q,
                k_base + cols[:, None] * stride_ks,
                v_base + cols[:, None] * stride_vs,
                cols < end,
                no_tree,
                qk_scale,
                MASK_COLS=True,
                MASK_TREE=False,
                IEEE=IEEE,
            )
    else:
        # The tree part: the N new keys, each row masked by its ancestor bit words.
        for start_j in range(0, n_nodes, BLOCK_N):
            rel = start_j + offs_n
            col_ok = rel < n_nodes
            word = tl.load(
                bits_ptr + node[:, None] * n_words + (rel // 32)[None, :],
                mask=row_ok[:, None] & col_ok[None, :],
                other=0,
            )
            allowed = ((word >> (rel % 32)[None, :]) & 1) != 0
            cols = prefix + rel
            acc, m_i, l_i = _attend_block(
                acc,
                m_i,
                l_i,
                q,
                k_base + cols[:, None] * stride_ks,
                v_base + cols[:, None] * stride_vs,
                col_ok,
                allowed,
                qk_scale,
                MASK_COLS=True,
                MASK_TREE=True,
                IEEE=IEEE,
            )

    # Partial result: normalised output and log2-sum-exp (-inf for an empty split).
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
    num_splits = num_prefix_splits + 1
    prow = (b * HQ + h) * n_nodes + node
    tl.store(part_lse_ptr + prow * num_splits + pid_s, lse, mask=row_ok)
    o_ptrs = part_o_ptr + (prow[:, None] * num_splits + pid_s) * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["n_nodes"])
def _tree_attn_merge_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    n_nodes,
    num_splits,
    stride_ob,
    stride_oh,
    stride_on,
    HQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
):
    """One program per (b, h, node) row: merge split partials weighted by 2^(lse - max lse).

    The lse vector is small and read whole; the [splits, D] outputs are streamed in chunks of
    SPLIT_CHUNK so register use stays bounded however many splits the launch has.
    """
    prow = tl.program_id(0)
    node = prow % n_nodes
    bh = prow // n_nodes
    h = bh % HQ
    b = bh // HQ
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    lse_row = part_lse_ptr + prow * num_splits
    lse = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.math.exp2(lse - m), 0)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    offs_c = tl.arange(0, SPLIT_CHUNK)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        sc = s0 + offs_c
        ok = sc < num_splits
        w = tl.math.exp2(tl.load(lse_row + sc, mask=ok, other=float("-inf")) - m)
        o = tl.load(
            part_o_ptr + (prow * num_splits + sc[:, None]) * HEAD_DIM + offs_d[None, :],
            mask=ok[:, None],
            other=0.0,
        )
        acc += tl.sum(o * w[:, None], 0)
    res = acc / denom
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + node * stride_on + offs_d, res.to(out_ptr.dtype.element_ty)
    )


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and the static split count; a pure function of shapes, never of data."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_prefix_splits: int


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_config(
    batch: int,
    hq: int,
    hkv: int,
    n_nodes: int,
    head_dim: int,
    capacity: int,
    dtype: torch.dtype,
    device: torch.device,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_prefix_splits: int | None = None,
) -> LaunchConfig:
    """Pick tiles from static shapes; any field may be forced (the benchmark sweeps them).

    From the H200 sweeps at 32K prefix (kernels/NOTES.md, runs 2-3, CUDA-graph timing):
    head_dim 64 runs best with 64-row tiles and 4 warps, head_dim 128 with 128-row tiles and
    8 warps; 3 pipeline stages beat 2. The split count must fill the chip in ONE wave of prefix
    CTAs, never a little more: with 128-row tiles one CTA fits per SM, and 144 CTAs on 132 SMs
    ran 1.5x slower than 128 (the 12 leftovers form a second full-length wave). So splits =
    floor(resident CTA slots / CTAs per split), with 2 slots per SM only for the small D=64 tile.
    """
    rows = (hq // hkv) * n_nodes
    if block_m is None:
        block_m = 64 if head_dim == 64 or rows <= 64 or dtype == torch.float32 else 128
    if block_n is None:
        block_n = 64 if dtype != torch.float32 or head_dim == 64 else 32
    if num_warps is None:
        num_warps = 4 if block_m == 64 else 8
    if num_stages is None:
        num_stages = 3
    if num_prefix_splits is None:
        base = triton.cdiv(rows, block_m) * batch * hkv
        slots = _sm_count(device) * (2 if block_m == 64 and head_dim == 64 else 1)
        max_splits = max(1, triton.cdiv(capacity, 2 * block_n))  # >= 2 blocks per split at capacity
        num_prefix_splits = max(1, min(slots // base, max_splits, 128))
    return LaunchConfig(block_m, block_n, num_warps, num_stages, num_prefix_splits)


def tree_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: int | torch.Tensor,
    ancestors: torch.Tensor | None,
    scale: float | None = None,
    *,
    ancestor_bits: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Tree attention through the Triton kernels; same contract as ``tree_attention_reference``.

    ``ancestor_bits`` (from ``pack_ancestor_bits``) skips the packing when the tree is fixed.
    ``prefix_len`` may be a 0-d integer tensor on the device: it is read inside the kernel.
    """
    batch, hq, n_nodes, head_dim = q.shape
    _, hkv, capacity, _ = k_cache.shape
    if hq % hkv != 0:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
    if head_dim not in SUPPORTED_HEAD_DIMS or n_nodes > MAX_TREE_NODES or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported shape/dtype: N={n_nodes}, D={head_dim}, {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError("q, k_cache and v_cache must share a dtype")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the head dimension must be contiguous")
    group = hq // hkv
    if ancestor_bits is None:
        if ancestors is None:
            raise ValueError("need ancestors or ancestor_bits")
        ancestor_bits = pack_ancestor_bits(ancestors)
    ancestor_bits = ancestor_bits.contiguous()
    if config is None:
        config = choose_config(batch, hq, hkv, n_nodes, head_dim, capacity, q.dtype, q.device)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)

    if isinstance(prefix_len, torch.Tensor):
        prefix_ptr, prefix_val, from_ptr = prefix_len, 0, True
    else:
        prefix_ptr, prefix_val, from_ptr = ancestor_bits, int(prefix_len), False

    num_splits = config.num_prefix_splits + 1
    rows_total = batch * hq * n_nodes
    part_o = torch.empty((rows_total, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((rows_total, num_splits), dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must match q's shape and dtype, with a contiguous head dimension")

    m_tiles = triton.cdiv(group * n_nodes, config.block_m)
    grid = (m_tiles, batch * hkv, num_splits)
    _tree_attn_split_kernel[grid](
        q,
        k_cache,
        v_cache,
        ancestor_bits,
        prefix_ptr,
        part_o,
        part_lse,
        prefix_val,
        n_nodes,
        ancestor_bits.shape[1],
        config.num_prefix_splits,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HQ=hq,
        HKV=hkv,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        PREFIX_FROM_PTR=from_ptr,
        IEEE=q.dtype == torch.float32,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    _tree_attn_merge_kernel[(rows_total,)](
        part_o,
        part_lse,
        out,
        n_nodes,
        num_splits,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        HQ=hq,
        HEAD_DIM=head_dim,
        SPLITS_P2=max(2, triton.next_power_of_2(num_splits)),
        SPLIT_CHUNK=16,
        num_warps=2,
    )
    return out
