"""Tree attention: N new tokens attend to the whole prefix cache plus their own tree ancestors.

Layout contract shared by the reference, the Triton kernel and the model:

* ``q``: ``[B, Hq, N, D]`` queries of the N new tokens (tree nodes, or a plain chunk of a prompt).
* ``k_cache`` / ``v_cache``: ``[B, Hkv, S, D]`` static caches. The new tokens' keys and values have
  already been written at slots ``[prefix_len, prefix_len + N)``; slots past that are garbage.
* ``prefix_len``: a Python int, or a 0-d integer tensor on the device so that a CUDA graph can be
  captured once and replayed for any prefix length (no host synchronisation).
* ``ancestors``: ``[N, N]`` bool, ``ancestors[i, j]`` is true when node j is node i itself or one of
  its ancestors. A chain (lower-triangular) is ordinary causal attention.

Query heads ``h`` use KV head ``h // (Hq // Hkv)`` (grouped-query attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PrefixLen = int | torch.Tensor


def tree_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: PrefixLen,
    ancestors: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain-torch tree attention; the definition every fast path is tested against."""
    n = q.shape[2]
    if isinstance(prefix_len, int):
        # Eager callers know the length: attend over just the live slots.
        s = prefix_len + n
        k_cache, v_cache = k_cache[:, :, :s], v_cache[:, :, :s]
    mask = tree_attention_mask(prefix_len, ancestors, k_cache.shape[2])
    return masked_attention(q, k_cache, v_cache, mask, scale)


def tree_attention_mask(prefix_len: PrefixLen, ancestors: torch.Tensor, s: int) -> torch.Tensor:
    """The dense ``[N, S]`` boolean mask that the compact (prefix_len, ancestors) pair stands for."""
    n = ancestors.shape[0]
    cols = torch.arange(s, device=ancestors.device)
    rel = cols - prefix_len
    in_tree = (rel >= 0) & (rel < n)
    tree_part = ancestors[:, rel.clamp(0, n - 1)] & in_tree
    return tree_part | (cols < prefix_len)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Grouped-query attention under an explicit boolean mask (``[N, S]`` or ``[B, 1, N, S]``)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _triton_supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Shapes and dtypes the Triton kernel handles; everything else takes the reference."""
    if not (q.is_cuda and k_cache.is_cuda and v_cache.is_cuda):
        return False
    if q.dim() != 4 or k_cache.dim() != 4 or q.shape[1] % k_cache.shape[1] != 0:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return False
    if q.shape[2] > 256 or q.shape[3] not in (64, 128):
        return False
    return q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1


_BACKENDS = ("auto", "reference", "triton")
_backend_choice: str | None = None  # set once (Engine.load), not read from the environment per call


def set_backend(choice: str) -> None:
    """Force a tree-attention path for this process: "reference" or "triton" (debugging), or "auto".

    ``Engine.load`` calls this with ``Settings.tree_attention`` (``ELESIUM_TREE_ATTENTION`` /
    ``--tree-attention``); the choice is process-wide because the forward has no per-call settings.
    """
    global _backend_choice
    choice = choice.strip().lower()
    if choice not in _BACKENDS:
        raise ValueError(f"tree attention must be reference, triton or auto, not {choice!r}")
    _backend_choice = choice


def backend() -> str:
    """The forced path, or "auto"; read from ``Settings`` once when nothing set it before the first call."""
    if _backend_choice is None:
        from elesium.config import Settings

        set_backend(Settings.from_env().tree_attention)
    assert _backend_choice is not None
    return _backend_choice


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: PrefixLen,
    ancestors: torch.Tensor,
    scale: float | None = None,
    *,
    ancestor_bits: torch.Tensor | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA where it applies, the reference elsewhere.

    ``invariant`` (shape-invariant numerics, ``inference/runtime/invariant.py``) takes the kernel
    whose per-node result is bitwise the 1-token decode's, on CUDA for trees of <= 128 nodes;
    larger N (prefill chunks, which every decoding mode runs alike) take the ordinary path.

    The Triton module is imported lazily so that CPU-only installs never need Triton. Forcing
    ``triton`` on an unsupported input raises instead of silently falling back.
    ``ancestor_bits`` (optional, from ``triton_tree_attention.pack_ancestor_bits(ancestors)``)
    lets a caller whose tree topology is fixed pack once: packing costs 2-3 small kernels a call.
    The reference path ignores it and uses ``ancestors``.
    """
    choice = backend()
    if invariant and choice != "reference" and q.is_cuda and k_cache.is_cuda:
        from elesium.kernels import invariant_attention

        if invariant_attention.supports(q, k_cache, v_cache):
            return invariant_attention.invariant_tree_attention(q, k_cache, v_cache, prefix_len, ancestors,
                                                                scale)
    if choice == "reference":
        return tree_attention_reference(q, k_cache, v_cache, prefix_len, ancestors, scale)
    if choice == "triton" or _triton_supports(q, k_cache, v_cache):
        try:
            from elesium.kernels.triton_tree_attention import tree_attention_triton
        except ImportError:
            if choice == "triton":
                raise
            return tree_attention_reference(q, k_cache, v_cache, prefix_len, ancestors, scale)
        return tree_attention_triton(
            q, k_cache, v_cache, prefix_len, ancestors, scale, ancestor_bits=ancestor_bits
        )
    return tree_attention_reference(q, k_cache, v_cache, prefix_len, ancestors, scale)
