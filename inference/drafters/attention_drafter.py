"""An EAGLE-style first draft level: one decoder layer over every past position's feature.

Why it exists. Hydra heads guess ``x_{t+2}`` from ``(h_t, x_{t+1})`` alone; on MT-Bench their head 1
stops near 0.50 top-1 however long they train (HEADS.md). EAGLE (Li et al. 2024) reads the same two
inputs at *every* earlier position and lets one causal attention layer look back over them:

    f_t = Block(fc([h_t; e(x_{t+1})]))    attending over f-inputs at positions 0 .. t
    x_{t+2} ~ lm_head(f_t)                 (the base model's frozen, shared lm_head)

Here it replaces only the first draft level. The Hydra chain still drafts levels 2..K from its own
head-1 state, so heads and drafter train independently and either can be swapped.

Inference keeps the drafter's own one-layer KV cache, slot for slot beside the base model's: after
each verification step the accepted nodes' hidden states, each paired with the token that followed
it, are appended (``forward`` with an offset), and the last row's output drafts the next step's
level 1. Rejected branches never enter it, so it needs no tree mask.

Two paths compute the same function, both through the base model's own ``Block``: ``forward``
(cached, any offset, CUDA-graph friendly) and ``sequence`` (``Block.causal``: whole sequences at once
with fused causal attention, for training and scoring). ``tests/test_feature_drafter.py`` holds them to each
other.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from elesium.inference.runtime.config import ModelConfig
from elesium.inference.runtime.model import Block, Offset, Transformer


class FeatureDrafter(nn.Module):
    """``fc`` (2H -> H) and one decoder layer shaped like the base model's (GQA, RoPE, SwiGLU)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layer_config = dataclasses.replace(config, num_layers=1)
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h)
        self.layer = Block(self.layer_config)

    @classmethod
    def for_model(cls, base: ModelConfig, intermediate_size: int | None = None) -> FeatureDrafter:
        """A drafter sized like one layer of ``base`` (optionally with a narrower MLP)."""
        return cls(dataclasses.replace(base, intermediate_size=intermediate_size or base.intermediate_size))

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> FeatureDrafter:
        """Rebuild from ``config()`` (a manifest's ``heads.drafter`` block)."""
        if cfg.get("kind", "attention") != "attention":
            raise ValueError(f"unknown drafter kind {cfg.get('kind')!r}; this version knows 'attention'")
        return cls(ModelConfig(vocab_size=1, hidden_size=int(cfg["hidden_size"]),
                               intermediate_size=int(cfg["intermediate_size"]), num_layers=1,
                               num_heads=int(cfg["num_heads"]), num_kv_heads=int(cfg["num_kv_heads"]),
                               head_dim=int(cfg["head_dim"]), rms_norm_eps=float(cfg["rms_norm_eps"]),
                               qkv_bias=bool(cfg.get("qkv_bias", False))))

    def config(self) -> dict[str, Any]:
        c = self.layer_config
        return {"kind": "attention", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
                "rms_norm_eps": c.rms_norm_eps, "qkv_bias": c.qkv_bias}

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def new_cache(self, max_len: int, device: torch.device | str,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[1, kv_heads, max_len, head_dim]`` (batch 1), zeroed like ``KVCache``."""
        c = self.layer_config
        shape = (1, c.num_kv_heads, max_len, c.head_dim)
        return torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)

    def inputs(self, model: Transformer, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """``fc([h_t; e(x_{t+1})])`` in the drafter's dtype."""
        e = model.embed(next_tokens)
        return self.fc(torch.cat([hidden.to(self.dtype), e.to(self.dtype)], dim=-1))

    def forward(self, model: Transformer, hidden: torch.Tensor, next_tokens: torch.Tensor,
                positions: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, offset: Offset,
                ancestors: torch.Tensor) -> torch.Tensor:
        """Cached path: rows ``[B, N]`` go to slots ``offset...`` and attend to every slot before them
        plus their ``ancestors`` (causal for the engine). Returns features ``[B, N, H]`` in ``hidden``'s
        dtype."""
        cos, sin = model.rope_cos[positions][None, None], model.rope_sin[positions][None, None]
        x = self.inputs(model, hidden, next_tokens)
        return self.layer(x, cos, sin, k_cache, v_cache, offset, ancestors, None).to(hidden.dtype)

    def prefill_rows(self, model: Transformer, hidden: torch.Tensor, next_tokens: list[int], start: int,
                     cache: tuple[torch.Tensor, torch.Tensor], chunk: int) -> None:
        """Write prompt rows into ``cache``: ``hidden[i]`` (slot ``start + i``) paired with
        ``next_tokens[i]``, in chunks of ``chunk`` rows so the mask stays ``[chunk, prefix + chunk]``."""
        dev = model.device
        tokens = torch.tensor(next_tokens, device=dev)
        for lo in range(0, len(next_tokens), chunk):
            hi = min(lo + chunk, len(next_tokens))
            positions = torch.arange(start + lo, start + hi, device=dev)
            self(model, hidden[None, lo:hi], tokens[None, lo:hi], positions, *cache, start + lo,
                 model.causal(hi - lo))

    def advance(self, model: Transformer, rows: torch.Tensor, tokens: torch.Tensor, start: Offset,
                last: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Take in the rows accepted since the last step (``StepDrafter.draft_tree``'s ``rows`` to
        ``last``) and return row ``last``'s feature ``[1, H]``, which drafts level 1.

        Rows past ``last`` are padding (a graph runs a fixed R): they write slots that the next call
        overwrites, and causal attention keeps them out of the real rows."""
        if cache is None:
            raise ValueError("these heads carry a drafter, but no drafter cache was given")
        r = rows.shape[0]
        # Clamp only matters for padding rows at the very end of the context.
        positions = (start + torch.arange(r, device=rows.device)).clamp(max=model.rope_cos.shape[0] - 1)
        feats = self(model, rows[None], tokens[None], positions, *cache, start, model.causal(r))[0]
        return feats.index_select(0, last)

    def sequence(self, model: Transformer, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Whole sequences ``[B, N]`` from position 0, no cache: ``forward``'s function through the same
        ``Block`` with fused causal attention (and a backward pass) for training. Right padding is
        harmless: nothing looks ahead."""
        pos = torch.arange(hidden.shape[1], device=hidden.device)
        cos, sin = model.rope_cos[pos][None, None], model.rope_sin[pos][None, None]
        return self.layer.causal(self.inputs(model, hidden, next_tokens), cos, sin).to(hidden.dtype)

    def unrolled(self, model: Transformer, hidden: torch.Tensor, next_tokens: torch.Tensor,
                 depth: int) -> list[torch.Tensor]:
        """Features ``[B, N, H]`` for draft depths 1..``depth``, each row reading what it would read at
        draft time: EAGLE-3's training-time test, for training and scoring a drafter of every depth.

        Row ``r`` of depth ``d`` drafts ``x_{r+2}`` from the context accepted up to ``t = r - d + 1``:
        its input is ``fc([f^{d-1}_{r-1}; e(x_{r+1})])`` (its parent's feature, not the base model's
        hidden state) and it attends to depth-1 entries ``0..t`` plus its own chain of ancestors, the
        depth-``m`` entry at ``t + m - 1`` for ``m = 2..d``. That is exactly what ``DrafterTree.expand``
        computes through the cache when the drafted path is the true one, so the loss at every depth
        is the loss of the drafter as it runs. Rows ``r < d - 1`` have no such context; callers mask
        them. ``sequence`` is depth 1 of this.
        """
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        n = hidden.shape[1]
        dev = hidden.device
        pos = torch.arange(n, device=dev)
        cos, sin = model.rope_cos[pos][None, None], model.rope_sin[pos][None, None]
        attn, c = self.layer.attn, self.layer_config
        group = c.num_heads // c.num_kv_heads
        feats: list[torch.Tensor] = []
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        state = hidden
        for d in range(1, depth + 1):
            if d > 1:  # row r reads its parent's feature, row r - 1 of the depth before
                state = torch.cat([torch.zeros_like(feats[-1][:, :1]), feats[-1][:, :-1]], dim=1)
            x = self.inputs(model, state, next_tokens)
            q, k, v = attn.project(self.layer.attn_norm(x), cos, sin)
            keys.append(k.repeat_interleave(group, dim=1))
            values.append(v.repeat_interleave(group, dim=1))
            if d == 1:
                out = torch.nn.functional.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True)
            else:
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=unrolled_mask(n, d, dev))
            x = x + attn.merge(out)
            feats.append((x + self.layer.mlp(x)).to(hidden.dtype))
        return feats


def unrolled_mask(n: int, depth: int, device: torch.device) -> torch.Tensor:
    """``[n, depth * n]``: which entries row ``r`` of ``depth`` sees among depths 1..depth's entries.

    Depth-1 entries ``j <= r - depth + 1`` (the accepted context) and, in block ``m`` (depth ``m + 1``),
    the single entry ``r - depth + 1 + m``: the row's ancestors and, in the last block, itself.
    """
    r = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    blocks = [j <= r - depth + 1] + [j == r - depth + 1 + m for m in range(1, depth)]
    return torch.cat(blocks, dim=1)
