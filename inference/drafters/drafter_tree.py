"""An attention drafter for every depth (EAGLE's design): the drafter feeds its own features back.

Why it exists. With Hydra heads only level 1 reads real features (the attention drafter); levels 2..K
guess from an MLP state, and on the H200 depths 3 and 4 accept 0.24 and 0.13 of the time (BENCHMARKS
§6j). Here the one drafter layer (``attention_drafter.FeatureDrafter``) drafts every level:

    level 1   f_t      = Layer(fc([h_t; e(x_{t+1})]))          over the accepted entries 0..t
    level k   f'_{t+k-1} = Layer(fc([f_parent; e(x̂_{t+k})]))   over entries 0..t plus its ancestors

so a level-k candidate is conditioned on the real context, the whole drafted path and the features
that drafted it. Training unrolls the same computation over whole sequences
(``FeatureDrafter.unrolled``: EAGLE-3's training-time test), so the drafter learns to read its own
features rather than the base model's.

The tree is expanded as in ``HydraHeads.expand`` (EAGLE-2: keep the ``width`` paths of highest
cumulative log-probability per level) and returned in the same layout, so everything downstream (the
tree choice, verification, acceptance) is shared. Level rows are written to a scratch region at the end
of the drafter's cache, past every real slot, and attend to the accepted slots plus the scratch slots
of their own ancestors under an explicit mask. Shapes are static and nothing syncs, so CUDA graphs
capture it.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from elesium.inference.drafters.attention_drafter import FeatureDrafter
from elesium.inference.drafters.top_logprobs import top_logprobs, top_logprobs_reference
from elesium.inference.runtime.model import Transformer
from elesium.kernels.tree_attention import masked_attention

MAX_WIDTH = 32
"""Most paths one level may keep: the scratch region holds ``(depth - 1) * MAX_WIDTH`` slots."""


class DrafterTree(nn.Module):
    """``depth`` draft levels, every one drafted by ``drafter`` (manifest kind ``eagle``)."""

    conditioned: Literal[True] = True
    source_sha256: str = ""  # set by load_heads to the drafter file's sha256

    def __init__(self, drafter: FeatureDrafter, depth: int = 5) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"need depth >= 1, got {depth}")
        self.drafter: FeatureDrafter | None = drafter
        self.num_heads = depth

    @property
    def feature_drafter(self) -> FeatureDrafter:
        assert self.drafter is not None  # always set: the drafter is this module
        return self.drafter

    @property
    def hidden_size(self) -> int:
        return self.feature_drafter.layer_config.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self.feature_drafter.dtype

    @property
    def scratch_slots(self) -> int:
        """Drafter-cache slots the levels past the first need, after every real slot."""
        return (self.num_heads - 1) * MAX_WIDTH

    def config(self) -> dict[str, Any]:
        return {"kind": "eagle", "num_heads": self.num_heads, "num_layers": 1,
                "hidden_size": self.hidden_size}

    def teacher_forced(self, model: Transformer, hidden: torch.Tensor,
                       next_tokens: torch.Tensor) -> torch.Tensor:
        """Not defined: every level attends over the whole context, not over ``h_t`` alone. Score
        whole sequences with ``FeatureDrafter.unrolled`` (``tuner.head_acceptance`` and ``eval-heads``
        do)."""
        raise TypeError("eagle drafters read the whole context; use FeatureDrafter.unrolled on sequences")

    def expand(self, model: Transformer, first: torch.Tensor, token: torch.Tensor, width: int, topk: int,
               cache: tuple[torch.Tensor, torch.Tensor], root: torch.Tensor, live: int | None = None,
               topk_chunk: int | None = None,
               levels: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft a tree from ``first`` (``[1, H]``, the drafter's feature at the accepted position
        ``root``, a ``[1]`` slot that is also its RoPE position) and ``token`` (``x_{t+1}``, which
        ``first`` was computed with). Returns ``HydraHeads.expand``'s layout.

        ``cache`` is the drafter's ``(k, v)``; the scratch region is its last ``scratch_slots``
        slots. ``live``: attend over only the first this many slots plus the scratch region (eager
        calls, which know how far the context reaches); None: the whole cache (CUDA graphs).
        """
        if width > MAX_WIDTH:
            raise ValueError(f"expand width {width} exceeds the drafter tree's scratch of {MAX_WIDTH} "
                             "per level")
        k_cache, v_cache = cache
        capacity = k_cache.shape[2]
        base = capacity - self.scratch_slots
        dev = first.device
        depth = self.num_heads if levels is None else max(1, min(levels, self.num_heads))
        cols = torch.arange(capacity, device=dev)
        select = None
        if live is not None:  # the live context and the scratch region, nothing between them
            cols = select = torch.cat([cols[:min(live, base)], cols[base:]])
        prefix = cols <= root  # [S]: accepted slots, the same for every row

        scored = state = first.to(model.dtype)
        cum = torch.zeros(1, device=dev)
        parent = torch.full((1,), -1, dtype=torch.long, device=dev)
        path = torch.empty(1, 0, dtype=torch.long, device=dev)  # scratch slots of each row's ancestors
        all_tokens, all_logprobs, all_parents = [], [], []
        for k in range(depth):
            logits = model.logits(scored)
            if topk_chunk is None:
                top_tokens, top_values = top_logprobs_reference(logits, topk)
            else:
                top_tokens, top_values = top_logprobs(logits, topk, topk_chunk)
            all_tokens.append(top_tokens)
            all_logprobs.append(top_values)
            all_parents.append(parent)
            if k + 1 == depth:
                break
            total = (cum[:, None] + top_values).flatten()
            best = torch.topk(total, min(width, total.numel())).indices
            rows = torch.div(best, topk, rounding_mode="floor")
            n = best.numel()
            slots = base + k * MAX_WIDTH + torch.arange(n, device=dev)
            path = torch.cat([path[rows], slots[:, None]], dim=1)
            visible = prefix[None, :] | (cols[None, :, None] == path[:, None, :]).any(-1)
            state = self._level(model, state[rows], top_tokens.flatten()[best], root + 1 + k, k_cache,
                                v_cache, slots, select, visible).to(model.dtype)
            scored, cum, parent = state, total[best], best
        return torch.cat(all_tokens), torch.cat(all_logprobs), torch.cat(all_parents)

    def _level(self, model: Transformer, state: torch.Tensor, tokens: torch.Tensor, position: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, select: torch.Tensor | None,
               visible: torch.Tensor) -> torch.Tensor:
        """One level's rows through the drafter layer: write their keys at ``slots``, attend under
        ``visible`` (``[rows, S]`` over the slots ``select``, or over the whole cache), return their
        features ``[rows, H]``."""
        drafter = self.feature_drafter
        layer = drafter.layer
        pos = position.expand(tokens.shape[0])
        cos, sin = model.rope_cos[pos][None, None], model.rope_sin[pos][None, None]
        x = drafter.inputs(model, state[None], tokens[None])
        q, k, v = layer.attn.project(layer.attn_norm(x), cos, sin)
        k_cache.index_copy_(2, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(2, slots, v.to(v_cache.dtype))
        keys, values = k_cache, v_cache
        if select is not None:
            keys, values = k_cache.index_select(2, select), v_cache.index_select(2, select)
        x = x + layer.attn.merge(masked_attention(q, keys, values, visible[None, None]))
        return (x + layer.mlp(x))[0]
