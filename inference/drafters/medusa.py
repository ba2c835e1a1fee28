"""Medusa heads: K small residual MLPs that guess the tokens after the base model's next one.

Design (Cai et al. 2024, "Medusa-1" heads; HEADS.md has the longer notes and the results):

* **Which hidden state.** Every head reads the base model's *final-norm* hidden state ``h_t`` at the
  current position, i.e. exactly what ``Transformer.forward`` returns and what ``lm_head`` consumes.
  ``lm_head(h_t)`` gives the base model's next token ``x_{t+1}``; head ``k`` (1-based) guesses
  ``x_{t+1+k}``. Reading the post-norm state means the speculative engine reuses the hidden states it
  already computed for verification: no extra base-model work per step.
* **Residual blocks, zero-initialised.** A head is one or more blocks ``x + SiLU(W x + b)`` with
  ``W, b = 0`` at init, so an untrained head computes ``lm_head(h_t)``: it starts as "the next token
  repeats" rather than noise, which is the Medusa recipe and makes training converge fast. Every
  block owns its weights (Medusa's reference code repeats one block object ``num_layers`` times,
  which silently shares weights between layers; we don't).
* **No per-head output layer.** Each head's transformed state goes through the base model's own
  frozen ``lm_head`` (tied to the embeddings for SmolLM2). A per-head ``[hidden, vocab]`` layer would
  be 576 x 49152 = 28M parameters per head (57 MB in fp16 for one head) for a 135M base model, would
  have to be learned from scratch, and would break the zero-init identity. Sharing it keeps the
  shipped file ~2.7 MB and puts all capacity where it is cheap (576 x 576 per block).

API used by the speculative engine (keep it stable): ``MedusaHeads.forward(hidden) -> [K, ..., H]``
(the caller applies ``model.logits``), ``head_logits``, ``teacher_forced`` (shared with
``HydraHeads``, the sequentially dependent variant in ``hydra.py``), and the
file functions in ``files.py`` (which build either kind from the manifest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from elesium.inference.drafters.protocol import DraftContext, Proposal
from elesium.inference.runtime.drafting import Drafted, DrafterCache, scored_topk

if TYPE_CHECKING:
    from elesium.inference.drafters.attention_drafter import FeatureDrafter
    from elesium.inference.runtime.forward import ForwardRunner
    from elesium.inference.runtime.model import Transformer


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` with ``W, b`` zero-initialised: the identity until trained."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``num_heads`` independent stacks of ``num_layers`` residual blocks over the final-norm hidden state.

    Example::

        heads = load_heads(None, base_sha256=engine.weights_info.sha256, device="cpu", dtype=torch.float32)
        hidden = engine.model(tokens, positions, cache, offset)[:, -1]      # [B, H]
        logits = heads.head_logits(engine.model, hidden)                    # [K, B, V] float32
    """

    # The ``drafters.protocol.Proposer`` members that are not modules or methods.
    # Drafts read the hidden state alone (one top-k list per depth), so the verify forward scores them.
    fuses_drafts = True
    drafter: FeatureDrafter | None = None  # never set: the attention drafter pairs with Hydra heads
    source_sha256: str = ""  # set by load_heads to the files' sha256

    def __init__(self, hidden_size: int, num_heads: int = 4, num_layers: int = 1) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 1, got {num_heads} and {num_layers}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        # Fresh ResBlock objects for every (head, layer): no accidental weight sharing.
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(num_heads))

    @property
    def dtype(self) -> torch.dtype:
        return self.heads[0][0].linear.weight.dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Transformed hidden states ``[num_heads, ..., H]`` in ``hidden``'s dtype.

        Runs in the heads' own dtype (fp16 heads on a float32 model work) and casts back, so the
        result can go straight into ``model.logits``.
        """
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden size {hidden.shape[-1]} does not match the heads' {self.hidden_size}")
        x = hidden.to(self.dtype)
        return torch.stack([head(x) for head in self.heads]).to(hidden.dtype)

    def head_logits(self, model: Transformer, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[num_heads, ..., V]`` through the base model's shared ``lm_head``."""
        return model.logits(self(hidden))

    def teacher_forced(self, model: Transformer, hidden: torch.Tensor,
                       next_tokens: torch.Tensor) -> torch.Tensor:
        """Same signature as ``HydraHeads.teacher_forced``; Medusa heads ignore the tokens."""
        return self(hidden)

    # -- drafters.protocol.Proposer ---------------------------------------------------------------
    def new_cache(self, max_len: int, device: torch.device) -> DrafterCache | None:
        return None

    def fused_states(self, hidden: torch.Tensor) -> torch.Tensor:
        return self(hidden)

    def draft_tree(self, model: Transformer, rows: torch.Tensor, tokens: torch.Tensor,
                   start: int | torch.Tensor, last: torch.Tensor, width: int, topk: int,
                   cache: DrafterCache | None, topk_chunk: int | None = None,
                   levels: int | None = None) -> Drafted:
        raise TypeError("Medusa heads read the hidden state alone: they draft inside the verify forward "
                        "(fused_states), never after it")

    def prefill(self, runner: ForwardRunner, hidden: torch.Tensor, next_tokens: list[int],
                start: int = 0) -> None:
        return None  # nothing kept between steps

    def propose(self, runner: ForwardRunner, context: DraftContext, topk: int, width: int,
                levels: int) -> Proposal:
        """Every head's top-k at ``h_t``: the verify forward's (``context.fused``) where it scored them,
        else computed now (the first step after a prefill)."""
        if context.fused is not None:
            tokens, logprobs = context.fused
        else:
            tokens, logprobs = scored_topk(runner.model, self(context.rows[-1]), topk)
            tokens, logprobs = tokens.cpu(), logprobs.float().cpu()
        return Proposal(tokens[:, :topk], logprobs[:, :topk])

    def config(self) -> dict[str, int | str]:
        return {"kind": "medusa", "num_heads": self.num_heads, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size}
