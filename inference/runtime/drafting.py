"""The runner's view of draft heads: the two hooks it runs inside its forwards and captured graphs.

The runtime sits below the draft heads' package and may not name it; the heads (``Proposer``, which
extends this protocol) satisfy it structurally. Drafting happens at one of two
places in a step, and the runner only needs to know which:

* heads that read the hidden state alone are scored inside the verify forward, at every node, sharing
  its ``lm_head`` product (``fuses_drafts``, ``fused_states``): the next step's drafts are then a row
  lookup at the accepted node;
* heads that read the drafted path need the bonus token, chosen after the step, so they draft in a
  call of their own (``draft_tree``), which the CUDA runner replays as a captured graph and the tree
  chain captures inside its step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from elesium.inference.runtime.model import Transformer

DRAFT_TOPK = 10
"""Candidates per head computed in a fused step; trees use at most this many ranks."""

DrafterCache = tuple[torch.Tensor, torch.Tensor]
"""A drafter layer's own keys and values, slot for slot beside the base model's cache."""

Drafted = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(tokens, logprobs, parents)`` of a path-conditioned draft: ``HydraHeads.expand``'s layout."""


class StepDrafter(Protocol):
    """What a runner calls on the heads it holds."""

    num_heads: int
    """Draft depth: head k (1-based) guesses the token k places after the base model's next one."""
    fuses_drafts: bool
    """Whether the drafts come out of the verify forward (``fused_states``); else from ``draft_tree``."""

    def new_cache(self, max_len: int, device: torch.device) -> DrafterCache | None:
        """The heads' own cache for a runner whose rows reach slot ``max_len`` (None: they keep none)."""
        ...

    def fused_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every head's state ``[K, ..., H]`` for hidden states ``[..., H]``, to score through ``lm_head``."""
        ...

    def draft_tree(self, model: Transformer, rows: torch.Tensor, tokens: torch.Tensor,
                   start: int | torch.Tensor, last: torch.Tensor, width: int, topk: int,
                   cache: DrafterCache | None, topk_chunk: int | None = None,
                   levels: int | None = None) -> Drafted:
        """Advance the heads' cache over the rows written since they last drafted, then draft a tree.

        ``rows`` ``[R, H]`` are the hidden states of the accepted positions, at slots ``start...``;
        ``tokens`` ``[R]`` the token that followed each; row ``last`` (a ``[1]`` index tensor) is
        ``h_t`` and its token the chosen ``x_{t+1}``. Rows past ``last`` are padding (a graph runs a
        fixed R). An ``int`` start runs eagerly over the live slots; a 0-d tensor is static for capture.
        """
        ...


def scored_topk(model: Transformer, states: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k tokens and log-probabilities ``[..., heads, k]`` of head states ``[heads, ..., H]``."""
    logits = model.logits(states).movedim(0, -2)  # [..., heads, V]
    top = torch.topk(logits, k, dim=-1)
    return top.indices, top.values - torch.logsumexp(logits, dim=-1, keepdim=True)
