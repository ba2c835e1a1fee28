"""Tree attention whose result for a node is bit-for-bit the 1-token decode of that node.

Why the ordinary kernel (``triton_tree_attention``) cannot give that, even with a fixed split count:
it reduces the prefix ``[0, P)`` in splits and the tree keys in a separate split. Vanilla decoding of
the same token, at depth d of the tree, has those d ancestors in its prefix (``P' = P + d``), so the
same keys land in different blocks and splits, are summed in a different order, and the last bits
of the output differ. In bf16 that flips greedy choices: speculative output drifts from vanilla.

Here a node's keys are visited in *logical* order, the sequence it would see if decoded alone:
prefix slots ``0 .. P-1``, then its ancestors root-first, then itself (``L = P + depth + 1`` keys).
That sequence is cut into fixed ``BLOCK_N``-key blocks counted from position 0, and block ``b``
belongs to split ``b % NUM_SPLITS``, with ``NUM_SPLITS`` a function of the cache capacity only.
Each block's keys are loaded through a per-node slot map (identity in the prefix; the k-th
ancestor's slot past it), so a node of a 64-node tree and the same token decoded alone load the
same values into the same columns of the same blocks, run the same online softmax, and merge the
same partials in the same order: equal bits, on any N, with ``prefix_len`` in a device tensor or not.

One program serves one node and one KV head (its GQA group's query heads are the rows of the tile),
so the prefix is re-read per node. That costs bandwidth only in verification (N programs) and the
reads of one layer's KV hit L2 for the models this engine ships.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from elesium.kernels.triton_tree_attention import LOG2E, _attend_block, _tree_attn_merge_kernel

MAX_TREE_NODES = 128  # the largest CUDA-graph bucket; larger N (prefill chunks) take the ordinary path
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["prefix_val", "n_nodes"])
def _invariant_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    anc_ptr,
    prefix_ptr,
    part_o_ptr,
    part_lse_ptr,
    prefix_val,
    n_nodes,
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
    NUM_SPLITS: tl.constexpr,
    MAX_NODES: tl.constexpr,
    PREFIX_FROM_PTR: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Grid ``(N, B * HKV, NUM_SPLITS)``: node, (batch, KV head), split."""
    node = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // HKV
    hkv = pid_bh % HKV

    g = tl.arange(0, BLOCK_M)
    row_ok = g < GROUP
    h = hkv * GROUP + g
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    if PREFIX_FROM_PTR:
        prefix = tl.load(prefix_ptr).to(tl.int32)
    else:
        prefix = prefix_val

    q = tl.load(q_ptr + b * stride_qb + h[:, None] * stride_qh + node * stride_qn + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    # The node's path: ancestors (itself included) in index order, which is root-first because a
    # parent always precedes its children. count[t] = how many path nodes are <= t.
    offs_t = tl.arange(0, MAX_NODES)
    on_path = tl.load(anc_ptr + node * n_nodes + offs_t, mask=offs_t < n_nodes, other=0).to(tl.int32)
    count = tl.cumsum(on_path, 0)
    length = prefix + tl.sum(on_path, 0)  # logical keys: prefix + depth + 1

    k_base = k_ptr + b * stride_kb + hkv * stride_kh + offs_d[None, :]
    v_base = v_ptr + b * stride_vb + hkv * stride_vh + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    no_tree = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int1)

    n_blocks = tl.cdiv(length, BLOCK_N)
    for blk in range(split, n_blocks, NUM_SPLITS):
        j = blk * BLOCK_N + offs_n
        slot = j
        if (blk + 1) * BLOCK_N > prefix:
            # Logical position prefix + k is the k-th path node (0-based), whose index is the number
            # of t with count[t] <= k.
            rel = j - prefix
            idx = tl.sum((count[None, :] <= rel[:, None]).to(tl.int32), 1)
            slot = tl.where(rel >= 0, prefix + idx, j)
        acc, m_i, l_i = _attend_block(
            acc,
            m_i,
            l_i,
            q,
            k_base + slot[:, None] * stride_ks,
            v_base + slot[:, None] * stride_vs,
            j < length,
            no_tree,
            qk_scale,
            MASK_COLS=True,
            MASK_TREE=False,
            IEEE=IEEE,
        )

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
    prow = (b * HQ + h) * n_nodes + node
    tl.store(part_lse_ptr + prow * NUM_SPLITS + split, lse, mask=row_ok)
    tl.store(part_o_ptr + (prow[:, None] * NUM_SPLITS + split) * HEAD_DIM + offs_d[None, :], out,
             mask=row_ok[:, None])


def num_splits_for(capacity: int) -> int:
    """Splits of a node's key blocks: from the cache capacity alone (static), never from N or the prefix.

    One split per 512 slots of capacity, at most 8: a 1-token decode of an 8K cache then runs
    ``8 * Hkv`` programs, and a verify's N-fold programs stay few enough for the merge to be cheap.
    """
    return max(1, min(8, capacity // 512))


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Shapes this kernel takes: CUDA (or the interpreter), N <= 128, head_dim 64/128, one dtype."""
    return (
        q.dim() == 4
        and k_cache.dim() == 4
        and q.shape[1] % k_cache.shape[1] == 0
        and q.shape[2] <= MAX_TREE_NODES
        and q.shape[3] in SUPPORTED_HEAD_DIMS
        and q.dtype in SUPPORTED_DTYPES
        and k_cache.dtype == q.dtype
        and v_cache.dtype == q.dtype
        and q.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
    )


def invariant_tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: int | torch.Tensor,
    ancestors: torch.Tensor,
    scale: float | None = None,
    *,
    block_n: int = 64,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree attention (``tree_attention_reference``'s contract) with per-node results invariant in N.

    ``ancestors`` must be topologically ordered (a node's ancestors have smaller indices), as every
    tree and chain the engine builds is. ``out`` (``[B, Hq, N, D]``, any strides with a unit last
    one) receives the result: a transposed view of a ``[B, N, Hq, D]`` buffer lets the output
    projection read it without a copy.
    """
    batch, hq, n_nodes, head_dim = q.shape
    _, hkv, capacity, _ = k_cache.shape
    if not supports(q, k_cache, v_cache):
        raise ValueError(f"invariant tree attention: unsupported q {tuple(q.shape)} {q.dtype}, "
                         f"cache {tuple(k_cache.shape)} {k_cache.dtype}")
    group = hq // hkv
    splits = num_splits_for(capacity) if num_splits is None else num_splits
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    anc = ancestors.to(torch.bool).contiguous().view(torch.uint8)
    if isinstance(prefix_len, torch.Tensor):
        prefix_ptr, prefix_val, from_ptr = prefix_len, 0, True
    else:
        prefix_ptr, prefix_val, from_ptr = anc, int(prefix_len), False
    rows_total = batch * hq * n_nodes
    part_o = torch.empty((rows_total, splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((rows_total, splits), dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"invariant tree attention: out {tuple(out.shape)} {out.dtype} does not fit q")
    _invariant_split_kernel[(n_nodes, batch * hkv, splits)](
        q,
        k_cache,
        v_cache,
        anc,
        prefix_ptr,
        part_o,
        part_lse,
        prefix_val,
        n_nodes,
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
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        MAX_NODES=MAX_TREE_NODES,
        PREFIX_FROM_PTR=from_ptr,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    _tree_attn_merge_kernel[(rows_total,)](
        part_o,
        part_lse,
        out,
        n_nodes,
        splits,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        HQ=hq,
        HEAD_DIM=head_dim,
        SPLITS_P2=max(2, triton.next_power_of_2(splits)),
        SPLIT_CHUNK=16,
        num_warps=2,
    )
    return out
