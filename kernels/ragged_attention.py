"""Invariant tree attention for many sequences in one launch (batched serving), each node bit-for-bit alone.

Why a ragged kernel rather than a padded ``[B, Hq, N, D]`` batch: the sequences of a serving batch have
different prefix lengths, live in arbitrary slots of a slot-major KV pool, and carry trees of different
sizes (most often one node: plain decode). Padding every tree to the largest one and every prefix to the
longest would waste programs and, worse, would make a sequence's launch depend on its neighbours. Here
``q`` holds the nodes of all sequences back to back (``T`` rows), and one program serves one node and
one KV head for one split, exactly as ``_invariant_split_kernel`` does for a single sequence.

Why the result is the single-sequence kernel's, bit for bit (and so the 1-token decode's): a program
visits its node's keys in the same *logical* order (prefix ``0 .. P-1``, then the node's ancestors
root-first, itself last), cut into the same ``BLOCK_N`` blocks counted from position 0, block ``b`` in
split ``b % NUM_SPLITS`` with ``NUM_SPLITS`` from the capacity alone (``num_splits_for``). It loads the
same query rows (its GQA group), the same keys into the same tile columns, runs the same
``_attend_block`` steps, and ``_tree_attn_merge_kernel`` merges the same partials in the same order.
The only differences are addresses: the KV base moves to the sequence's pool slot, and the node's
prefix comes from a device tensor. Neither touches a float.

Ragged indexing (all from device tensors, so a launch with fixed ``T`` can be captured in a CUDA graph
and replayed for any mix of prefixes, slots and trees): ``node_seq[t]`` names node ``t``'s sequence;
``seq_slots`` and ``seq_prefix`` give that sequence's pool slot and prefix length. The node's *local*
index is never needed: row ``t`` of ``ancestors`` already lists, by local index, the path nodes the node
sees (itself included, on its own local column), and local index ``i`` lives at slot position
``prefix + i``. So the mapping is one gather per program, with no CSR offsets and no search.

The ancestor rows may be narrower than ``MAX_TREE_NODES`` (a pure-decode batch can pass ``[T, 1]`` of
ones): the path scan then spans ``next_power_of_2(width)`` columns instead of 128. Counting path nodes is
integer arithmetic, so the scan's width cannot change a bit of the result.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from elesium.kernels.invariant_attention import (
    MAX_TREE_NODES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    num_splits_for,
)
from elesium.kernels.triton_tree_attention import LOG2E, _attend_block, _tree_attn_merge_kernel

_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit(do_not_specialize=["n_total"])
def _ragged_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    anc_ptr,
    node_seq_ptr,
    seq_slots_ptr,
    seq_prefix_ptr,
    part_o_ptr,
    part_lse_ptr,
    n_total,
    anc_width,
    stride_anc,
    qk_scale,
    stride_qh,
    stride_qn,
    stride_kslot,
    stride_kh,
    stride_ks,
    stride_vslot,
    stride_vh,
    stride_vs,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SCAN_NODES: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Grid ``(T, HKV, NUM_SPLITS)``: node (of any sequence), KV head, split.

    The body after the three index loads is ``_invariant_split_kernel``'s, line for line; keep the two
    in step (tests/test_ragged_attention.py compares them bitwise).
    """
    node = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)

    seq = tl.load(node_seq_ptr + node)
    # int64 pool offset: slots x heads x capacity x D passes 2^31 elements in large pools.
    kv_slot = tl.load(seq_slots_ptr + seq).to(tl.int64)
    prefix = tl.load(seq_prefix_ptr + seq).to(tl.int32)

    g = tl.arange(0, BLOCK_M)
    row_ok = g < GROUP
    h = hkv * GROUP + g
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(q_ptr + h[:, None] * stride_qh + node * stride_qn + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    # The node's path by local index, root-first (a parent precedes its children).
    # count[t] = how many path nodes are <= t.
    offs_t = tl.arange(0, SCAN_NODES)
    on_path = tl.load(anc_ptr + node * stride_anc + offs_t, mask=offs_t < anc_width, other=0).to(tl.int32)
    count = tl.cumsum(on_path, 0)
    length = prefix + tl.sum(on_path, 0)  # logical keys: prefix + depth + 1

    k_base = k_ptr + kv_slot * stride_kslot + hkv * stride_kh + offs_d[None, :]
    v_base = v_ptr + kv_slot * stride_vslot + hkv * stride_vh + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    no_tree = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int1)

    n_blocks = tl.cdiv(length, BLOCK_N)
    for blk in range(split, n_blocks, NUM_SPLITS):
        j = blk * BLOCK_N + offs_n
        pos = j
        if (blk + 1) * BLOCK_N > prefix:
            # Logical position prefix + k is the k-th path node (0-based), whose local index is the
            # number of t with count[t] <= k.
            rel = j - prefix
            idx = tl.sum((count[None, :] <= rel[:, None]).to(tl.int32), 1)
            pos = tl.where(rel >= 0, prefix + idx, j)
        acc, m_i, l_i = _attend_block(
            acc,
            m_i,
            l_i,
            q,
            k_base + pos[:, None] * stride_ks,
            v_base + pos[:, None] * stride_vs,
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
    # Rows in the merge kernel's order for batch 1 and n_nodes = T: (head, node).
    prow = h * n_total + node
    tl.store(part_lse_ptr + prow * NUM_SPLITS + split, lse, mask=row_ok)
    tl.store(part_o_ptr + (prow[:, None] * NUM_SPLITS + split) * HEAD_DIM + offs_d[None, :], out,
             mask=row_ok[:, None])


@triton.jit(do_not_specialize=["n_total", "per_seq", "chunks"])
def _ragged_causal_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    seq_slots_ptr,
    seq_prefix_ptr,
    part_o_ptr,
    part_lse_ptr,
    n_total,
    per_seq,
    chunks,
    qk_scale,
    stride_qh,
    stride_qn,
    stride_kslot,
    stride_kh,
    stride_ks,
    stride_vslot,
    stride_vh,
    stride_vs,
    GROUP: tl.constexpr,
    QUERIES: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Grid ``(num_seq * chunks, HKV, NUM_SPLITS)``: ``QUERIES`` consecutive nodes of one causal block
    (``QUERIES * GROUP`` tile rows, as many as fit ``BLOCK_M``), KV head, split.

    Row ``r`` is node ``r // GROUP`` of the chunk, query head ``r % GROUP`` of the KV head's group. Each
    row masks its own keys (``j < prefix + local + 1``), which is the per-node kernel's column mask for
    that node; the blocks past a row's own last one are all masked for it and leave its state as it was.
    """
    pid = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    seq = pid // chunks
    first = (pid % chunks) * QUERIES  # local index of the chunk's first node

    kv_slot = tl.load(seq_slots_ptr + seq).to(tl.int64)
    prefix = tl.load(seq_prefix_ptr + seq).to(tl.int32)

    r = tl.arange(0, BLOCK_M)
    local = first + r // GROUP
    row_ok = (r < QUERIES * GROUP) & (local < per_seq)
    h = hkv * GROUP + r % GROUP
    node = seq * per_seq + local
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(q_ptr + h[:, None] * stride_qh + node[:, None] * stride_qn + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    row_len = prefix + local + 1  # keys of node ``local``: the prefix, the block's nodes up to itself
    length = prefix + tl.minimum(first + QUERIES, per_seq)  # the chunk's last node's

    k_base = k_ptr + kv_slot * stride_kslot + hkv * stride_kh + offs_d[None, :]
    v_base = v_ptr + kv_slot * stride_vslot + hkv * stride_vh + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    n_blocks = tl.cdiv(length, BLOCK_N)
    for blk in range(split, n_blocks, NUM_SPLITS):
        j = blk * BLOCK_N + offs_n
        acc, m_i, l_i = _attend_block(
            acc,
            m_i,
            l_i,
            q,
            k_base + j[:, None] * stride_ks,
            v_base + j[:, None] * stride_vs,
            j < length,
            j[None, :] < row_len[:, None],
            qk_scale,
            MASK_COLS=True,
            MASK_TREE=True,
            IEEE=IEEE,
        )

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
    prow = h * n_total + node
    tl.store(part_lse_ptr + prow * NUM_SPLITS + split, lse, mask=row_ok)
    tl.store(part_o_ptr + (prow[:, None] * NUM_SPLITS + split) * HEAD_DIM + offs_d[None, :], out,
             mask=row_ok[:, None])


def _check(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    seq_slots: torch.Tensor,
    seq_prefix: torch.Tensor,
    node_seq: torch.Tensor,
    ancestors: torch.Tensor,
) -> str | None:
    """What is wrong with the arguments (shapes, dtypes and devices only: no device reads), or None.

    Values (slot numbers in range, prefixes that fit, topologically ordered ancestor rows with no
    column past the sequence's nodes) are the caller's contract: checking them would sync the host and
    break CUDA-graph capture.
    """
    if q.dim() != 3 or k_pool.dim() != 4:
        return f"q must be [Hq, T, D] and the pools [S, Hkv, capacity, D], got {tuple(q.shape)}, " \
               f"{tuple(k_pool.shape)}"
    if v_pool.shape != k_pool.shape:
        return f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} differ"
    hq, n_total, head_dim = q.shape
    hkv = k_pool.shape[1]
    if k_pool.shape[3] != head_dim or head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim of q ({head_dim}) and pools ({k_pool.shape[3]}) must match, one of " \
               f"{SUPPORTED_HEAD_DIMS}"
    if hkv == 0 or hq % hkv != 0:
        return f"query heads {hq} are not a multiple of KV heads {hkv}"
    if q.dtype not in SUPPORTED_DTYPES or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        return f"dtypes q {q.dtype}, k_pool {k_pool.dtype}, v_pool {v_pool.dtype} must be one of " \
               f"{SUPPORTED_DTYPES}, all the same"
    if q.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        return "the head dimension of q and the pools must be contiguous"
    if ancestors.dim() != 2 or ancestors.shape[0] != n_total:
        return f"ancestors {tuple(ancestors.shape)} must be [T={n_total}, nodes]"
    if not 1 <= ancestors.shape[1] <= MAX_TREE_NODES:
        return f"ancestors has {ancestors.shape[1]} columns: a tree holds 1 to {MAX_TREE_NODES} nodes"
    if node_seq.shape != (n_total,):
        return f"node_seq {tuple(node_seq.shape)} must be [T={n_total}]"
    if seq_slots.dim() != 1 or seq_prefix.shape != seq_slots.shape:
        return f"seq_slots {tuple(seq_slots.shape)} and seq_prefix {tuple(seq_prefix.shape)} must both be " \
               "[num_seq]"
    for name, t in (("seq_slots", seq_slots), ("seq_prefix", seq_prefix), ("node_seq", node_seq)):
        if t.dtype not in _INDEX_DTYPES:
            return f"{name} must be int32 or int64, got {t.dtype}"
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("ancestors", ancestors),
                    ("seq_slots", seq_slots), ("seq_prefix", seq_prefix), ("node_seq", node_seq)):
        if t.device != q.device:
            return f"{name} is on {t.device}, q on {q.device}"
    return None


class _Launch(NamedTuple):
    """What both ragged kernels' launches share: the output, the split count, ``scale`` in log2 units,
    the splits' partials, and the strides of ``q`` and the pools in the kernels' argument order."""

    out: torch.Tensor
    splits: int
    qk_scale: float
    part_o: torch.Tensor
    part_lse: torch.Tensor
    strides: tuple[int, ...]


def _launch(name: str, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float | None,
            num_splits: int | None, out: torch.Tensor | None) -> _Launch:
    """Check ``out`` and allocate what a launch needs; splits from the capacity unless given, as the
    single-sequence kernel's, so the two agree."""
    hq, n_total, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"{name}: out {tuple(out.shape)} {out.dtype} does not fit q {tuple(q.shape)} "
                         f"{q.dtype}")
    splits = num_splits_for(k_pool.shape[2]) if num_splits is None else num_splits
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    part_o = torch.empty((hq * n_total, splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((hq * n_total, splits), dtype=torch.float32, device=q.device)
    strides = (q.stride(0), q.stride(1), *k_pool.stride()[:3], *v_pool.stride()[:3])
    return _Launch(out, splits, scale * LOG2E, part_o, part_lse, strides)


def _merge(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, hq: int, n_total: int,
           splits: int) -> None:
    """The splits' partials into ``out``, in split order: the single-sequence kernel's merge."""
    # The merge kernel's rows are (b, h, node) of a [B, Hq, N, D] output: here B = 1 and N = T.
    _tree_attn_merge_kernel[(hq * n_total,)](
        part_o,
        part_lse,
        out,
        n_total,
        splits,
        0,
        out.stride(0),
        out.stride(1),
        HQ=hq,
        HEAD_DIM=out.shape[-1],
        SPLITS_P2=max(2, triton.next_power_of_2(splits)),
        SPLIT_CHUNK=16,
        num_warps=2,
    )


def ragged_tree_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    seq_slots: torch.Tensor,
    seq_prefix: torch.Tensor,
    node_seq: torch.Tensor,
    ancestors: torch.Tensor,
    scale: float | None = None,
    *,
    block_n: int = 64,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree attention of many sequences in one launch; node ``t``'s result equals, bitwise,
    ``invariant_tree_attention`` of its sequence alone (same ``block_n`` and ``num_splits``).

    ``q`` ``[Hq, T, D]``: the nodes of every sequence, a sequence's nodes contiguous and topologically
    ordered. ``k_pool``/``v_pool`` ``[S, Hkv, capacity, D]``: slot-major caches; sequence ``s`` uses
    slot ``seq_slots[s]``, whose positions ``0 .. seq_prefix[s] - 1`` hold its prefix and
    ``seq_prefix[s] + i`` its tree node ``i`` (written before the call). ``node_seq`` ``[T]``: each
    node's sequence. ``ancestors`` ``[T, W]`` bool, ``W <= MAX_TREE_NODES`` (normally 128): row ``t``
    marks, by local index, the nodes of ``t``'s own sequence that ``t`` sees, itself included; the
    columns past its sequence's node count must be False. Index tensors are int32 or int64 on
    ``q``'s device. ``num_splits`` defaults to ``num_splits_for(capacity)``, as the single-sequence
    kernel's does, so the two agree. ``out`` (``[Hq, T, D]``, unit last stride) receives the result.
    Nothing here reads the device, so a call with fixed ``T`` can be captured in a CUDA graph.
    """
    problem = _check(q, k_pool, v_pool, seq_slots, seq_prefix, node_seq, ancestors)
    if problem is not None:
        raise ValueError(f"ragged tree attention: {problem}")
    hq, n_total, head_dim = q.shape
    hkv = k_pool.shape[1]
    launch = _launch("ragged tree attention", q, k_pool, v_pool, scale, num_splits, out)
    if n_total == 0:
        return launch.out
    group = hq // hkv
    anc = ancestors.to(torch.bool).contiguous().view(torch.uint8)
    width = anc.shape[1]
    _ragged_split_kernel[(n_total, hkv, launch.splits)](
        q,
        k_pool,
        v_pool,
        anc,
        node_seq,
        seq_slots,
        seq_prefix,
        launch.part_o,
        launch.part_lse,
        n_total,
        width,
        anc.stride(0),
        launch.qk_scale,
        *launch.strides,
        HKV=hkv,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        NUM_SPLITS=launch.splits,
        SCAN_NODES=max(16, triton.next_power_of_2(width)),
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    _merge(launch.part_o, launch.part_lse, launch.out, hq, n_total, launch.splits)
    return launch.out


def ragged_causal_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    seq_slots: torch.Tensor,
    seq_prefix: torch.Tensor,
    scale: float | None = None,
    *,
    block_n: int = 64,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ragged_tree_attention`` for sequences that each add one causal block of ``N = T / num_seq`` nodes
    (prompt blocks): bitwise its result with lower-triangular ``ancestors``, in a fifth of the programs.

    Why: a prompt block's nodes all read the same keys, but the per-node kernel gives each node and KV
    head a program of its own whose 16-row tile holds the node's ``GROUP`` query heads (3 of 16 rows for
    SmolLM2), so a 64-token block loads its prefix 64 times over. Here a program takes as many of the
    block's consecutive nodes as its tile holds (``16 // GROUP``: 5), all heads of the group.

    Why the bits are the per-node kernel's: the tile is the same shape (``BLOCK_M`` rows, ``BLOCK_N`` keys,
    the same warps), so every ``tl.dot`` and row reduction runs the same instructions, and a row's values
    do not depend on the other rows of the tile. A row's keys are visited in the same ``BLOCK_N`` blocks
    in the same splits. Where the per-node kernel masks a column for the node, this one masks it for the
    row (``-inf`` before the softmax, so ``p = 0`` and the key or value there adds an exact zero); the
    blocks past a row's own are all masked for it, which multiplies its state by ``exp2(0) = 1`` and adds
    zeros. tests/test_ragged_attention.py holds the two kernels to it bitwise.

    ``q`` ``[Hq, T, D]``: sequence ``s``'s nodes are rows ``s * N .. (s + 1) * N - 1``, node ``i`` at slot
    position ``seq_prefix[s] + i`` of pool slot ``seq_slots[s]`` (keys written before the call); it sees
    the prefix and nodes ``0 .. i``. Nothing here reads the device, so it can be captured in a CUDA graph.
    """
    num_seq = seq_slots.shape[0] if seq_slots.dim() == 1 else 0
    n_total = q.shape[1] if q.dim() == 3 else 0
    if num_seq == 0 or n_total % num_seq != 0:
        raise ValueError(f"ragged causal attention: {n_total} nodes do not split into blocks of "
                         f"{num_seq} sequences")
    per_seq = n_total // num_seq
    if per_seq > MAX_TREE_NODES:
        raise ValueError(f"ragged causal attention: a block holds 1 to {MAX_TREE_NODES} nodes, got {per_seq}")
    # Stand-ins of the right shapes for the shared checks; allocated, never written (no kernel launch).
    node_seq = seq_slots.new_empty(1).expand(n_total)
    causal = torch.empty((1, 1), dtype=torch.bool, device=q.device).expand(n_total, 1)
    problem = _check(q, k_pool, v_pool, seq_slots, seq_prefix, node_seq, causal)
    if problem is not None:
        raise ValueError(f"ragged causal attention: {problem}")
    hq, _, head_dim = q.shape
    hkv = k_pool.shape[1]
    launch = _launch("ragged causal attention", q, k_pool, v_pool, scale, num_splits, out)
    group = hq // hkv
    block_m = max(16, triton.next_power_of_2(group))  # the per-node kernel's tile
    queries = block_m // group
    chunks = -(-per_seq // queries)
    _ragged_causal_split_kernel[(num_seq * chunks, hkv, launch.splits)](
        q,
        k_pool,
        v_pool,
        seq_slots,
        seq_prefix,
        launch.part_o,
        launch.part_lse,
        n_total,
        per_seq,
        chunks,
        launch.qk_scale,
        *launch.strides,
        GROUP=group,
        QUERIES=queries,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=launch.splits,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    _merge(launch.part_o, launch.part_lse, launch.out, hq, n_total, launch.splits)
    return launch.out


def ragged_tree_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    seq_slots: torch.Tensor,
    seq_prefix: torch.Tensor,
    node_seq: torch.Tensor,
    ancestors: torch.Tensor,
    scale: float | None = None,
    *,
    block_n: int = 64,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The contract of ``ragged_tree_attention`` in plain torch (float32 math, one node at a time).

    Node ``t`` of sequence ``s`` attends to its logical keys: slot ``seq_slots[s]`` positions
    ``0 .. seq_prefix[s] - 1``, then ``seq_prefix[s] + i`` for each ``i`` set in ``ancestors[t]``, in
    order; query head ``h`` uses KV head ``h // (Hq // Hkv)``. ``block_n`` and ``num_splits`` only shape
    the kernel's summation order and are ignored. Slow and host-synchronising: for tests.
    """
    del block_n, num_splits
    problem = _check(q, k_pool, v_pool, seq_slots, seq_prefix, node_seq, ancestors)
    if problem is not None:
        raise ValueError(f"ragged tree attention: {problem}")
    hq, n_total, head_dim = q.shape
    group = hq // k_pool.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    result = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    slots, prefixes, seqs = seq_slots.tolist(), seq_prefix.tolist(), node_seq.tolist()
    anc = ancestors.to(torch.bool)
    for t in range(n_total):
        s = seqs[t]
        prefix = prefixes[s]
        path = torch.nonzero(anc[t]).flatten().to(q.device)
        pos = torch.cat([torch.arange(prefix, device=q.device), prefix + path])
        k = k_pool[slots[s]][:, pos].float().repeat_interleave(group, 0)  # [Hq, L, D]
        v = v_pool[slots[s]][:, pos].float().repeat_interleave(group, 0)
        w = torch.softmax(torch.einsum("hd,hld->hl", q[:, t].float(), k) * scale, dim=-1)
        result[:, t] = torch.einsum("hl,hld->hd", w, v)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out
