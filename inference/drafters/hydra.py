"""Hydra heads (Ankner et al. 2024): draft heads that also read the tokens drafted before them.

A Medusa head guesses ``x_{t+1+k}`` from ``h_t`` alone, blind to which tokens it is guessing *after*;
that is why its accuracy falls so fast with k. A Hydra head k also reads the input embeddings of
``x_{t+1} ... x_{t+k}``: the base model's own next token (already chosen when the step starts) and
the drafts on the path so far. Drafting becomes sequential over depth, one small MLP and one
``lm_head`` product per level, but every level is conditioned on the candidate it extends.

Two ways of carrying the path, both measured (HEADS.md):

* ``concat`` (Hydra's): head k's first block reads ``[h_t; e_1; ...; e_k]``, so its input grows by
  one embedding per depth.
* ``chain`` (recurrent, like ReDrafter): head k reads ``[s_{k-1}; e_k]`` where ``s_{k-1}`` is the
  previous head's output (``s_0 = h_t``); constant width, so smaller and cheaper.

The first block of a head is ``y = R z + SiLU(W z + b)``: ``R`` maps the wider input back to the
hidden size and starts as ``[I 0 ...]``, ``W, b`` start at zero, so an untrained Hydra head, like an
untrained Medusa head, returns ``h_t`` (resp. ``s_{k-1}``) and predicts ``lm_head(h_t)``. Further
blocks are Medusa's ``x + SiLU(W x + b)``, each with its own weights. Output goes through the base
model's frozen, shared ``lm_head``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from elesium.inference.drafters.attention_drafter import FeatureDrafter
from elesium.inference.drafters.drafter_tree import DrafterTree
from elesium.inference.drafters.medusa import MedusaHeads, ResBlock
from elesium.inference.drafters.path_proposer import PathProposer
from elesium.inference.drafters.top_logprobs import best_paths, level_candidates
from elesium.inference.runtime.drafting import Drafted, DrafterCache
from elesium.inference.runtime.model import Transformer

Conditioning = Literal["concat", "chain"]


class ConditionedBlock(nn.Module):
    """``R z + SiLU(W z + b)`` for ``z = [state; embeddings]``; ``R = [I 0 ...]``, ``W, b = 0`` at init."""

    def __init__(self, in_features: int, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, hidden_size)
        self.skip = nn.Linear(in_features, hidden_size, bias=False)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        with torch.no_grad():
            self.skip.weight.zero_()
            self.skip.weight[:, :hidden_size].copy_(torch.eye(hidden_size))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.skip(z) + F.silu(self.linear(z))


class HydraHeads(PathProposer, nn.Module):
    """``num_heads`` sequentially dependent heads over the final-norm hidden state.

    Example (teacher forcing, as in training and ``eval-heads``)::

        out = heads.teacher_forced(model, hidden, next_tokens)   # hidden [B, H], next_tokens [B, K]
        logits = model.logits(out)                               # [K, B, V]; head k saw next_tokens[:, :k+1]
    """

    # The ``drafters.protocol.Proposer`` members that are not modules or methods (``PathProposer``'s
    # too): drafts depend on the path, so the engine drafts per step, after verification.
    source_sha256: str = ""  # set by load_heads to the files' sha256 (drafter's file included)
    logit_scale: float = 1.0  # as DrafterTree.logit_scale

    def __init__(self, hidden_size: int, num_heads: int = 4, num_layers: int = 1,
                 conditioning: Conditioning = "concat") -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 1, got {num_heads} and {num_layers}")
        if conditioning not in ("concat", "chain"):
            raise ValueError(f"unknown conditioning {conditioning!r}; use concat or chain")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.conditioning: Conditioning = conditioning
        widths = [(k + 2 if conditioning == "concat" else 2) * hidden_size for k in range(num_heads)]
        self.heads = nn.ModuleList(
            nn.Sequential(ConditionedBlock(w, hidden_size),
                          *[ResBlock(hidden_size) for _ in range(num_layers - 1)])
            for w in widths)
        # Optional attention drafter for level 1 (``attention_drafter.py``); stored in its own file.
        self.drafter: FeatureDrafter | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.heads[0][0].linear.weight.dtype

    def advance(self, k: int, state: torch.Tensor,
                embedding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head ``k`` (0-based) on ``state`` plus the previous token's embedding: (output, next state)."""
        z = torch.cat([state, embedding.to(state.dtype)], dim=-1)
        out = self.heads[k](z)
        return out, (z if self.conditioning == "concat" else out)

    def teacher_forced(self, model: Transformer, hidden: torch.Tensor,
                       next_tokens: torch.Tensor) -> torch.Tensor:
        """Every head's output ``[K, ..., H]`` (in ``hidden``'s dtype) along the given path.

        ``next_tokens[..., j]`` is ``x_{t+1+j}``; head k reads ``x_{t+1} ... x_{t+1+k}`` and guesses
        ``x_{t+2+k}``, exactly what it sees at draft time when that path is the drafted one.
        """
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden size {hidden.shape[-1]} does not match the heads' {self.hidden_size}")
        state = hidden.to(self.dtype)
        outs = []
        for k in range(self.num_heads):
            out, state = self.advance(k, state, model.embed(next_tokens[..., k]))
            outs.append(out)
        return torch.stack(outs).to(hidden.dtype)

    def expand(self, model: Transformer, hidden: torch.Tensor, token: torch.Tensor, width: int,
               topk: int, first: torch.Tensor | None = None, topk_chunk: int | None = None,
               levels: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft a candidate tree level by level, keeping the ``width`` best paths at each level.

        Static shapes and no host syncs, so a CUDA graph can capture it. ``hidden`` is ``h_t`` ``[H]``,
        ``token`` the chosen ``x_{t+1}`` (a one-element long tensor). Returns, for levels 0..K-1,
        ``tokens`` and ``logprobs`` ``[rows, topk]`` and ``parents`` ``[rows]``, all concatenated
        over levels (level 0 has 1 row, the others ``width``); a row's parent is the flat index
        ``row * topk + rank`` of the candidate it extends in the previous level (-1 for level 0).
        The expansion keeps the paths with the highest total log-probability (EAGLE-2's rule).

        ``first`` (``[1, H]``, the drafter's feature for this position) replaces head 1's output as
        the source of level 0's candidates; head 1 still runs, because its output is the state that
        head 2 was trained to read.

        ``levels``: draft only the first this many levels (default: one per head). A tree that cannot
        be deeper (a static tree's depth, or a dynamic one of few nodes) needs no more, and the levels
        it gets are the same as in a full expansion: a level depends on the levels before it only.

        ``topk_chunk``: each level's top-k through ``top_logprobs.top_logprobs`` (a shift of the top
        logits, selected in slices of this width) instead of ``topk(log_softmax)``; the same
        candidates up to exact ties at the k-th place, cheaper on CUDA.
        """
        state = hidden.reshape(1, -1).to(self.dtype)
        tok = token.reshape(1)
        cum = torch.zeros(1, device=hidden.device)
        parent = torch.full((1,), -1, dtype=torch.long, device=hidden.device)
        all_tokens, all_logprobs, all_parents = [], [], []
        depth = self.num_heads if levels is None else max(1, min(levels, self.num_heads))
        for k in range(depth):
            out, state = self.advance(k, state, model.embed(tok))
            scored = first if k == 0 and first is not None else out
            # lm_head's own dtype: every top-k form reads it as float32 (model.logits would copy it first).
            logits = model.lm_head(scored.to(hidden.dtype))
            top_tokens, top_values = level_candidates(logits, topk, topk_chunk, self.logit_scale)
            all_tokens.append(top_tokens)
            all_logprobs.append(top_values)
            all_parents.append(parent)
            if k + 1 == depth:
                break
            best, rows, cum = best_paths(cum, top_values, width, topk)
            state, tok, parent = state[rows], top_tokens.flatten()[best], best
        return torch.cat(all_tokens), torch.cat(all_logprobs), torch.cat(all_parents)

    def draft_tree(self, model: Transformer, rows: torch.Tensor, tokens: torch.Tensor,
                   start: int | torch.Tensor, last: torch.Tensor, width: int, topk: int,
                   cache: DrafterCache | None, topk_chunk: int | None = None,
                   levels: int | None = None) -> Drafted:
        """``StepDrafter.draft_tree``: the drafter (if any) reads the new rows and proposes level 1, then
        the heads expand the tree from ``h_t`` and ``x_{t+1}`` (row ``last``)."""
        drafter = self.drafter
        first = None if drafter is None else drafter.advance(model, rows, tokens, start, last, cache)
        hidden, token = rows.index_select(0, last)[0], tokens.index_select(0, last)
        return self.expand(model, hidden, token, width, topk, first, topk_chunk, levels)

    def config(self) -> dict[str, int | str]:
        return {"kind": "hydra", "num_heads": self.num_heads, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size, "conditioning": self.conditioning}


HeadsModule = MedusaHeads | HydraHeads | DrafterTree
"""Any concrete kind, as built, trained and saved (``drafters.protocol.Proposer`` is what decoding
sees)."""
