"""The model's forward with the elementwise work fused (``kernels/fused_pointwise.py``): CUDA only.

Why a second forward and not patched modules: the fusions cross module boundaries. A layer's
residual add and the next layer's RMSNorm become one kernel, so the loop carries ``(residual,
normed)`` from one layer into the next, and the final norm is fused into the last layer's add.
Per layer this runs the three projections' and the MLP's four matmuls, one RoPE + cache-write
kernel, the attention (written straight into the ``[B, N, Hq, D]`` layout ``wo`` reads), two
add + norm kernels and one SwiGLU kernel: ~9 launches against ~30 in ``Transformer.forward``.

It computes the same function as ``Transformer.forward`` (tests compare the two on random models)
and keeps shape-invariant numerics: every fused kernel works one row per program, so a tree node's
result is still bit-for-bit its 1-token decode's. ``Transformer.forward`` takes this path when
``model.fused_pointwise`` is set (``apply_invariant_numerics`` sets it with the invariant kernels),
the inputs are on CUDA and there is no padding mask (``kv_valid``).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from elesium.inference.runtime.config import ModelConfig
from elesium.kernels.fused_pointwise import add_rms_norm, rope_qkv_to_cache, swiglu

Offset = int | torch.Tensor
"""``runtime.model.Offset``: the first cache slot of the new tokens."""


class FusedModel(Protocol):
    """The parts of ``Transformer`` this forward reads. Structural, because ``Transformer.forward``
    calls into this module: naming the class here would make the two modules import each other."""

    config: ModelConfig
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    layers: nn.ModuleList
    norm: nn.Module
    embed: nn.Module


class FusedCache(Protocol):
    """``runtime.model.KVCache``'s per-layer keys and values ``[layers, B, kv_heads, max_len, D]``."""

    k: torch.Tensor
    v: torch.Tensor


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, offset: Offset,
            ancestors: torch.Tensor, invariant: bool,
            block_at: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Attention output as ``[B, N, Hq * D]``: written in place by the invariant kernel, else copied.

    ``block_at`` (slot and prefix as ``[1]`` tensors; one sequence's causal block of a prompt) takes the
    ragged causal kernel, whose programs hold several of the block's nodes: bitwise the per-node kernel's
    result (``kernels/ragged_attention.py``), so a prompt's keys and hidden states do not depend on the
    path."""
    from elesium.kernels import invariant_attention
    from elesium.kernels.tree_attention import backend, tree_attention

    b, hq, n, d = q.shape
    if invariant and backend() != "reference" and invariant_attention.supports(q, k_cache, v_cache):
        out = torch.empty((b, n, hq, d), dtype=q.dtype, device=q.device)
        if block_at is not None:
            from elesium.kernels.ragged_attention import ragged_causal_attention

            ragged_causal_attention(q[0], k_cache, v_cache, *block_at, out=out[0].transpose(0, 1))
        else:
            invariant_attention.invariant_tree_attention(q, k_cache, v_cache, offset, ancestors,
                                                         out=out.transpose(1, 2))
        return out.view(b, n, hq * d)
    out = tree_attention(q, k_cache, v_cache, offset, ancestors, invariant=invariant)
    return out.transpose(1, 2).reshape(b, n, hq * d)


def fused_forward(model: FusedModel, tokens: torch.Tensor, positions: torch.Tensor, cache: FusedCache,
                  offset: Offset, ancestors: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """``Transformer.forward`` (same arguments, no ``kv_valid``) with fused elementwise kernels;
    ``causal``: ``ancestors`` is known to be lower-triangular (the caller passed none)."""
    c = model.config
    b, n = tokens.shape
    pos = positions if positions.dim() == 2 else positions[None]
    cos = model.rope_cos[pos].expand(b, n, c.head_dim)
    sin = model.rope_sin[pos].expand(b, n, c.head_dim)
    layers = model.layers
    block_at = None
    if causal and b == 1 and n > 1:  # built once, not in each layer
        prefix = (offset.reshape(1) if isinstance(offset, torch.Tensor)
                  else torch.full((1,), offset, dtype=torch.int32, device=tokens.device))
        block_at = (torch.zeros(1, dtype=prefix.dtype, device=tokens.device), prefix)
    x = model.embed(tokens)
    normed = layers[0].attn_norm(x)
    for i, layer in enumerate(layers):
        attn = layer.attn
        q = rope_qkv_to_cache(attn.wqkv(normed), cos, sin, cache.k[i], cache.v[i], offset,
                              c.num_heads, c.num_kv_heads)
        heads_out = _attend(q, cache.k[i], cache.v[i], offset, ancestors, attn.invariant, block_at)
        x, normed = add_rms_norm(x, attn.wo(heads_out), layer.mlp_norm.weight, layer.mlp_norm.eps)
        following = layers[i + 1].attn_norm if i + 1 < len(layers) else model.norm
        x, normed = add_rms_norm(x, layer.w2(swiglu(layer.w13(normed))), following.weight, following.eps)
    return normed
