"""What the heads that draft after the bonus token share: Hydra heads and the drafter tree.

Their drafts depend on the path drafted so far, so a step's tree can only be expanded once the step
chose ``x_{t+1}``; the runner runs that expansion (``ForwardRunner.expand``, a replayed graph on CUDA)
through their ``draft_tree``. Where they carry an attention drafter, its cache sits beside the base
model's, slot for slot, and takes in the accepted positions before each expansion and the prompt at
prefill.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from elesium.inference.drafters.protocol import DraftContext, Proposal
from elesium.inference.runtime import forward as runtime_forward
from elesium.inference.runtime.drafting import DrafterCache

if TYPE_CHECKING:
    from elesium.inference.drafters.attention_drafter import FeatureDrafter
    from elesium.inference.runtime.drafting import Drafted
    from elesium.inference.runtime.model import Transformer


class PathProposer:
    """The ``Proposer`` members of path-conditioned heads; a subclass supplies ``draft_tree``."""

    fuses_drafts = False
    num_heads: int
    drafter: FeatureDrafter | None
    scratch_slots = 0
    """Drafter-cache slots the heads may write past the last real row (the drafter tree's level rows)."""

    def draft_tree(self, model: Transformer, rows: torch.Tensor, tokens: torch.Tensor,
                   start: int | torch.Tensor, last: torch.Tensor, width: int, topk: int,
                   cache: DrafterCache | None, topk_chunk: int | None = None,
                   levels: int | None = None) -> Drafted:
        raise NotImplementedError

    def new_cache(self, max_len: int, device: torch.device) -> DrafterCache | None:
        drafter = self.drafter
        if drafter is None:
            return None
        return drafter.new_cache(max_len + self.scratch_slots, device, drafter.dtype)

    def fused_states(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} read the drafted path, so they draft after the step "
                        "(draft_tree), not inside its forward")

    def prefill(self, runner: runtime_forward.ForwardRunner, hidden: torch.Tensor, next_tokens: list[int],
                start: int = 0) -> None:
        drafter = self.drafter
        if drafter is None or not next_tokens:
            return
        if self is not runner.heads or runner.drafter_cache is None:
            raise ValueError("the drafter's cache belongs to the runner's own heads")
        # Read at call time: the prompt reaches the drafter in the chunks the base model's prefill uses.
        drafter.prefill_rows(runner.model, hidden, next_tokens, start, runner.drafter_cache,
                             runtime_forward.PREFILL_CHUNK)

    def propose(self, runner: runtime_forward.ForwardRunner, context: DraftContext, topk: int, width: int,
                levels: int) -> Proposal:
        """One drafting pass from ``(h_t, x_{t+1})``, after the drafter (if any) read the positions the
        last step accepted."""
        tokens, logprobs, parents = runner.expand(self, context.rows, context.row_tokens, context.row_start,
                                                  width, topk, levels)
        return Proposal(tokens, logprobs, parents, width)
