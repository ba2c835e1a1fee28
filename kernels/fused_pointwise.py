"""The decode step's elementwise work in three kernels a layer instead of ~22.

Why: after the invariant matmul (BENCHMARKS §6c) a bf16 vanilla step on the H200 spends 0.93 ms of
its 1.75 ms of GPU time in ~665 pointwise kernels, ~1.4 us each: RoPE alone is a cast, a negation,
a concatenation, two products, a sum and a cast for q and again for k, then four more kernels write
the cache. Each kernel here does one row's work in one program, so a row's result never depends on
how many rows the forward holds (the property the invariant matmul and attention keep), and the
arithmetic is the model's reference arithmetic: fp32 inside, one rounding to the model dtype where
the reference rounds.

* ``rope_qkv_to_cache``: split the fused QKV projection, rotate q and k (rotate_half layout), write k
  and v into the cache at ``offset + i`` (an int, or a 0-d device tensor for CUDA graphs) and return
  q as ``[B, Hq, N, D]``.
* ``add_rms_norm``: the residual add and the next RMSNorm: ``s = x + d`` (rounded to the dtype, as the
  reference's add is) and ``rms_norm(s)``.
* ``swiglu``: ``silu(gate) * up`` from the fused gate|up projection, with the reference's two roundings.

Each has its plain-torch definition beside it (``*_reference``); tests run both on random inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["offset_val", "n_tokens"])
def _rope_qkv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, offset_ptr, offset_val, slots_ptr,
                     n_tokens, stride_xb, stride_xn, stride_qb, stride_qh, stride_qn,
                     stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                     HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                     OFFSET_FROM_PTR: tl.constexpr, ROW_SLOTS: tl.constexpr):
    """Grid ``(B * N, HQ + 2 * HKV)``: one token's one head.

    ``ROW_SLOTS``: row ``b`` writes cache row ``slots[b]`` from its own offset ``offset_ptr[b]`` (many
    sequences of a slot pool, one launch); otherwise row ``b`` writes cache row ``b`` from one offset.
    Only addresses differ between the two: the rotation's arithmetic is the same.
    """
    row = tl.program_id(0)
    head = tl.program_id(1)
    b = row // n_tokens
    n = row % n_tokens
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF)
    src = qkv_ptr + b * stride_xb + n * stride_xn + head * HEAD_DIM
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + HALF + offs).to(tl.float32)
    cache_b = b
    if ROW_SLOTS:
        cache_b = tl.load(slots_ptr + b).to(tl.int64)
        slot = tl.load(offset_ptr + b).to(tl.int64) + n
    elif OFFSET_FROM_PTR:
        slot = tl.load(offset_ptr).to(tl.int64) + n
    else:
        slot = offset_val + n
    if head < HQ + HKV:
        trig = (b * n_tokens + n) * HEAD_DIM
        c1 = tl.load(cos_ptr + trig + offs)
        c2 = tl.load(cos_ptr + trig + HALF + offs)
        s1 = tl.load(sin_ptr + trig + offs)
        s2 = tl.load(sin_ptr + trig + HALF + offs)
        # The reference: x * cos + rotate_half(x) * sin, each product rounded before the sum.
        lo = x1 * c1 + (-x2) * s1
        hi = x2 * c2 + x1 * s2
        if head < HQ:
            dst = q_ptr + b * stride_qb + head * stride_qh + n * stride_qn
        else:
            dst = k_ptr + cache_b * stride_kb + (head - HQ) * stride_kh + slot * stride_ks
        tl.store(dst + offs, lo.to(q_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, hi.to(q_ptr.dtype.element_ty))
    else:
        dst = v_ptr + cache_b * stride_vb + (head - HQ - HKV) * stride_vh + slot * stride_vs
        tl.store(dst + offs, x1.to(v_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, x2.to(v_ptr.dtype.element_ty))


def rope_qkv_to_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, offset: int | torch.Tensor, num_heads: int,
                      num_kv_heads: int, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotated queries ``[B, Hq, N, D]``; rotated keys and values written at cache slots ``offset + i``.

    ``qkv``: ``[B, N, (Hq + 2 Hkv) D]`` (the fused projection, q then k then v); ``cos``/``sin``:
    ``[B, N, D]`` float32 (any view with those sizes and contiguous rows); caches ``[B, Hkv, S, D]``.
    ``q_out``: where the queries go (a view with unit last stride, e.g. a slice of a larger buffer, in the
    caches' dtype), saving the copy into it; returned.
    """
    if isinstance(offset, torch.Tensor):
        return _rope_launch(qkv, cos, sin, k_cache, v_cache, offset, 0, None, num_heads, num_kv_heads, q_out)
    return _rope_launch(qkv, cos, sin, k_cache, v_cache, None, int(offset), None, num_heads, num_kv_heads,
                        q_out)


def rope_qkv_to_slots(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                      v_pool: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor, num_heads: int,
                      num_kv_heads: int, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """``rope_qkv_to_cache`` for rows of different sequences: row ``b``'s keys and values go to pool row
    ``slots[b]`` at positions ``offsets[b] + i``; the queries come back as ``[B, Hq, N, D]``.

    ``k_pool``/``v_pool``: ``[S, Hkv, capacity, D]`` (one layer of a slot pool); ``slots`` and
    ``offsets``: ``[B]`` int32/int64 device tensors (nothing is read back, so a call can be captured
    in a CUDA graph). A row's queries and cache entries are bit for bit what ``rope_qkv_to_cache``
    gives that row alone in a cache of its own.
    """
    b = qkv.shape[0]
    if slots.shape != (b,) or offsets.shape != (b,):
        raise ValueError(f"slots {tuple(slots.shape)} and offsets {tuple(offsets.shape)} must both be [{b}]")
    return _rope_launch(qkv, cos, sin, k_pool, v_pool, offsets, 0, slots, num_heads, num_kv_heads, q_out)


def _rope_launch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, offset_ptr: torch.Tensor | None, offset_val: int,
                 slots: torch.Tensor | None, num_heads: int, num_kv_heads: int,
                 q_out: torch.Tensor | None) -> torch.Tensor:
    """Check the shapes and launch ``_rope_qkv_kernel``: offsets from ``offset_ptr`` (one, or one per row
    with ``slots``) or the constant ``offset_val``."""
    b, n, width = qkv.shape
    d = k_cache.shape[-1]
    if width != (num_heads + 2 * num_kv_heads) * d or qkv.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads} + 2 x {num_kv_heads} heads "
                         f"of {d}")
    cos = cos.reshape(b, n, d).float().contiguous()
    sin = sin.reshape(b, n, d).float().contiguous()
    if q_out is None:
        q = torch.empty((b, num_heads, n, d), dtype=qkv.dtype, device=qkv.device)
    elif q_out.shape != (b, num_heads, n, d) or q_out.stride(-1) != 1 or q_out.dtype != k_cache.dtype:
        raise ValueError(f"q_out {tuple(q_out.shape)} {q_out.dtype} is not a [B, Hq, N, D] view with unit "
                         f"last stride in the caches' dtype {k_cache.dtype}")
    else:
        q = q_out
    if b * n:
        pointer = offset_ptr if offset_ptr is not None else cos  # never read when OFFSET_FROM_PTR is off
        rows = slots if slots is not None else pointer  # never read when ROW_SLOTS is off
        _rope_qkv_kernel[(b * n, num_heads + 2 * num_kv_heads)](
            qkv, cos, sin, q, k_cache, v_cache, pointer, offset_val, rows, n,
            qkv.stride(0), qkv.stride(1), q.stride(0), q.stride(1), q.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            HQ=num_heads, HKV=num_kv_heads, HEAD_DIM=d, OFFSET_FROM_PTR=offset_ptr is not None,
            ROW_SLOTS=slots is not None, num_warps=1)
    return q


def rope_qkv_to_slots_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                                offsets: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The definition: each row through ``rope_qkv_to_cache_reference`` on its own pool row."""
    qs = []
    for b in range(qkv.shape[0]):
        s = int(slots[b])
        qs.append(rope_qkv_to_cache_reference(qkv[b:b + 1], cos[b:b + 1], sin[b:b + 1], k_pool[s:s + 1],
                                              v_pool[s:s + 1], int(offsets[b]), num_heads, num_kv_heads))
    return torch.cat(qs)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as the model defines it (``runtime.model.apply_rope``), restated here because
    kernels import nothing from the engine: ``x`` ``[B, H, N, D]``, ``cos``/``sin`` ``[B, 1, N, D]``
    float32, the rotation in float32 and the result in ``x``'s dtype. Tests hold the two to each other."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def rope_qkv_to_cache_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor, offset: int | torch.Tensor,
                                num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The definition: the model's ``Attention.project`` and cache write."""
    b, n, _ = qkv.shape
    d = k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    cos, sin = cos.reshape(b, 1, n, d).float(), sin.reshape(b, 1, n, d).float()
    q = rope_reference(q.reshape(b, n, num_heads, d).transpose(1, 2), cos, sin)
    k = rope_reference(k.reshape(b, n, num_kv_heads, d).transpose(1, 2), cos, sin)
    slots = offset + torch.arange(n, device=qkv.device)
    k_cache.index_copy_(2, slots, k)
    v_cache.index_copy_(2, slots, v.reshape(b, n, num_kv_heads, d).transpose(1, 2))
    return q


@triton.jit(do_not_specialize=["dim", "eps"])
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, dim, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < dim
    x = tl.load(x_ptr + row * dim + offs, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * dim + offs, mask=ok, other=0.0).to(tl.float32)
    s = (x + d).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * dim + offs, s, mask=ok)
    sf = s.to(tl.float32)
    mean_sq = tl.sum(sf * sf, 0) / dim
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    normed = sf * (1.0 / tl.sqrt(mean_sq + eps)) * w
    tl.store(out_ptr + row * dim + offs, normed.to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta))``, the sum rounded to ``x.dtype`` before it is normalised."""
    if x.shape != delta.shape or x.dtype != delta.dtype:
        raise ValueError(f"residual {tuple(x.shape)} {x.dtype} and update {tuple(delta.shape)} "
                         f"{delta.dtype} differ")
    dim = x.shape[-1]
    xs, ds = x.contiguous(), delta.contiguous()
    total = torch.empty_like(xs)
    out = torch.empty_like(xs)
    rows = xs.numel() // dim if dim else 0
    if rows:
        _add_rms_norm_kernel[(rows,)](xs, ds, weight, total, out, dim, eps,
                                      BLOCK=triton.next_power_of_2(dim), num_warps=4)
    return total, out


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from elesium.kernels.invariant_norm import rms_norm_reference

    total = x + delta
    return total, rms_norm_reference(total, weight, eps)


@triton.jit(do_not_specialize=["inner"])
def _swiglu_kernel(x_ptr, out_ptr, inner, BLOCK: tl.constexpr):
    """Grid ``(rows, cdiv(inner, BLOCK))``."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inner
    gate = tl.load(x_ptr + row * 2 * inner + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inner + inner + offs, mask=ok, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * inner + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [..., 2 I]`` (gate first), output ``[..., I]``."""
    inner = gate_up.shape[-1] // 2
    x = gate_up.contiguous()
    out = torch.empty((*x.shape[:-1], inner), dtype=x.dtype, device=x.device)
    rows = x.numel() // (2 * inner) if inner else 0
    if rows:
        block = 1024
        _swiglu_kernel[(rows, triton.cdiv(inner, block))](x, out, inner, BLOCK=block, num_warps=4)
    return out


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The definition: the model's ``Block.mlp`` between its two projections."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
