"""What the tree decoder, the forward runner and the tuner may call on draft heads.

Two kinds of heads draft differently, and the decoder takes a different path for each:

* ``FactoredHeads`` (Medusa, ``medusa.py``) read only the hidden state: one call gives every head's
  output, head d's top-k list is the same under every parent, and the runner can fuse the next
  step's drafting into the verification forward.
* ``ExpandingHeads`` (Hydra, ``hydra.py``) read the tokens drafted before them, so the tree is
  expanded level by level after the step chose its bonus token (``expand``), optionally with an
  attention drafter (``attention_drafter.py``) proposing level 1.

``DraftHeads`` is either; ``expands`` tells them apart for the type checker and at run time. Both
kinds are ``nn.Module``s, but only the members below are the decoder's business: anything else
(``state_dict``, optimisers) belongs to the file format and the training loops, which work with
the concrete classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

import torch
from typing_extensions import TypeIs

from elesium.inference.drafters.drafter_tree import DrafterTree

if TYPE_CHECKING:
    from elesium.inference.drafters.attention_drafter import FeatureDrafter
    from elesium.inference.runtime.model import Transformer


class _HeadsBase(Protocol):
    num_heads: int
    """Draft depth: head k (1-based) guesses the token k places after the base model's next one."""
    drafter: FeatureDrafter | None
    """An attention drafter for level 1 (Hydra heads only; always None on Medusa heads)."""
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


class FactoredHeads(_HeadsBase, Protocol):
    """Heads that read the hidden state alone (Medusa)."""

    conditioned: Literal[False]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every head's transformed state ``[K, ..., H]`` for hidden states ``[..., H]``."""
        ...


class ExpandingHeads(_HeadsBase, Protocol):
    """Heads whose drafts depend on the path drafted so far (Hydra)."""

    conditioned: Literal[True]

    def expand(self, model: Transformer, hidden: torch.Tensor, token: torch.Tensor, width: int, topk: int,
               first: torch.Tensor | None = None, topk_chunk: int | None = None,
               levels: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A candidate tree as (tokens, logprobs, parents) over levels; ``HydraHeads.expand`` has the
        layout."""
        ...


DraftHeads = FactoredHeads | ExpandingHeads | DrafterTree
"""``DrafterTree`` (``drafter_tree.py``) drafts path by path too (``expands`` is true for it) but expands
through the drafter's cache; ``forward.draft_tree`` tells it apart."""


def expands(heads: DraftHeads) -> TypeIs[ExpandingHeads]:
    """Whether ``heads`` draft path by path (Hydra) rather than one list per depth (Medusa)."""
    return heads.conditioned
