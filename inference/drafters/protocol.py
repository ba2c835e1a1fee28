"""The one interface the tree decoder drafts through: ``Proposer.propose``, in the manner of vLLM's
spec-decode proposers.

Every kind of draft heads (Medusa ``medusa.py``, Hydra ``hydra.py`` with or without the attention
drafter, the drafter tree ``drafter_tree.py``) is a ``Proposer``. The decoder hands each step the same
``DraftContext`` (the positions accepted since the last proposal and, where the verify forward
already scored the heads, those drafts) and gets back a ``Proposal`` in one layout; it never asks
which kind it holds. What differs between the kinds stays behind the methods:

* where the drafts are computed: inside the verify forward (heads that read the hidden state alone,
  ``fuses_drafts``) or after the bonus token is chosen (path-conditioned heads, ``draft_tree``,
  which the runner may replay as a CUDA graph and the tree chain captures inside its step);
* what they keep between steps: nothing, or a drafter cache beside the base model's (``new_cache``,
  written by ``prefill`` and by ``draft_tree``).

The runtime sits below this package and sees the heads only through ``runtime.drafting.StepDrafter``,
which ``Proposer`` extends. Heads are ``nn.Module``s, but only the members below are the decoder's
business: ``state_dict``, optimisers and the files belong to training and ``files.py``, which work
with the concrete classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from elesium.inference.runtime.drafting import StepDrafter

if TYPE_CHECKING:
    from elesium.inference.runtime.forward import ForwardRunner
    from elesium.inference.runtime.model import Transformer


@dataclass(frozen=True)
class DraftContext:
    """What a proposer reads at a step.

    ``rows`` ``[R, H]`` are the hidden states of the positions accepted since the last proposal,
    written from slot ``row_start``; ``row_tokens`` the token that followed each, the last being the
    pending token ``x_{t+1}`` (so ``rows[-1]`` is ``h_t``). ``fused``: the heads' top-k tokens and
    log-probabilities ``[heads, DRAFT_TOPK]`` at the kept node, on the CPU, when the verify forward
    computed them (``StepOutputs.draft_tokens``); None otherwise.
    """

    rows: torch.Tensor
    row_tokens: list[int]
    row_start: int
    fused: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class Proposal:
    """A step's draft candidates: rows of top-k ``tokens`` and their draft ``logprobs`` ``[rows, k]``.

    ``parents`` ``[rows]`` places each row in the tree: rows are concatenated over levels (level 0 is
    one row, the root's children; each later level ``min(width, rows * k)`` rows), and a row extends
    candidate ``parents[i] = row * k + rank`` of the level before (``HydraHeads.expand``'s layout).
    None: row d is depth d + 1's list under every parent (heads that read the hidden state alone),
    so every path of ranks < k exists. Tensors may be views into a runner's static buffers: read them
    before the next forward.
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    parents: torch.Tensor | None = None
    width: int = 0


class Proposer(StepDrafter, Protocol):
    """Draft heads as the decoder, the runner, the tuner and the engine see them."""

    source_sha256: str
    """sha256 of the files the heads were loaded from ("" when built in memory); profiles match on it."""

    @property
    def dtype(self) -> torch.dtype: ...

    def config(self) -> dict[str, int | str]:
        """The manifest's ``heads`` block: enough to rebuild heads of this shape."""
        ...

    def teacher_forced(self, model: Transformer, hidden: torch.Tensor,
                       next_tokens: torch.Tensor) -> torch.Tensor:
        """Every head's output ``[K, ..., H]`` along a known path (training, scoring, calibration)."""
        ...

    def prefill(self, runner: ForwardRunner, hidden: torch.Tensor, next_tokens: list[int],
                start: int = 0) -> None:
        """Take in prompt rows: ``hidden[i]`` (slot ``start + i``) paired with ``next_tokens[i]``, the
        token after it. A no-op for heads that keep no cache."""
        ...

    def propose(self, runner: ForwardRunner, context: DraftContext, topk: int, width: int,
                levels: int) -> Proposal:
        """This step's candidates: ``topk`` per drafted row, ``width`` paths kept per level by heads that
        expand a tree, at most ``levels`` deep where drafting level by level."""
        ...


DraftHeads = Proposer
"""The name the engine and the tests use for the heads a runner holds."""
