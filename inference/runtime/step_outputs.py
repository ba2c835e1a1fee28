"""What one verification forward yields; its own module so that the chains can read it without the runners."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepOutputs:
    """One verification forward's results, all still on the model's device.

    ``draft_tokens`` / ``draft_logprobs`` (``[N, heads, DRAFT_TOPK]``) are the heads' proposals at
    every node, present when the runner fuses drafting into the step (``StepDrafter.fuses_drafts``):
    the next step's drafts are then a row lookup at the accepted node instead of another round of
    launches.
    """

    hidden: torch.Tensor
    logits: torch.Tensor
    greedy: torch.Tensor
    draft_tokens: torch.Tensor | None = None
    draft_logprobs: torch.Tensor | None = None
