"""Turning logits into a token: the single definition of the target distribution.

Vanilla sampling and speculative verification both call ``target_probs`` so that "exactly the base
model's distribution" has one meaning: the grammar mask (when the output is constrained, forbidden
tokens' logits become -inf, so the rest renormalise), then temperature, then top-k, then top-p
(nucleus), in float32. Greedy decoding is the argmax of the same masked logits.
Random draws come from a seeded CPU ``torch.Generator`` as uniforms and tokens are picked by inverse
CDF, so a run replays bit for bit from its seed whatever device did the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy. ``seed`` None draws a fresh seed (recorded in the result, so
    the run can still be replayed). ``deadline_s``: seconds from the request's arrival after which the
    generation ends at its next step boundary with the tokens it has (``finish_reason`` "deadline"), or
    with none if it was still queued. It picks no token, only where the output is cut; a run's record
    keeps that place, so a replay cuts at the same token whatever its own speed.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.deadline_s is not None and not (0.0 < self.deadline_s < float("inf")):
            raise ValueError(f"deadline_s must be a positive number of seconds, got {self.deadline_s}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def masked(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Logits with the tokens ``allowed`` (bool, broadcastable) forbids set to -inf; unchanged if None."""
    return logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))


def greedy_token(logits: torch.Tensor, allowed: torch.Tensor | None = None) -> int:
    """The argmax token of a 1-D logit row, among the allowed ones."""
    return int(masked(logits, allowed).argmax(-1).item())


def target_probs(logits: torch.Tensor, params: SamplingParams,
                 allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities ``[..., V]`` after the grammar mask, temperature, top-k and top-p. Not for greedy.

    The mask comes first, so top-k and top-p choose among the allowed tokens: the constrained
    target is the base distribution restricted to the grammar and renormalised.
    """
    x = masked(logits.float(), allowed) / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep a token while the mass strictly before it is below top_p: the smallest set reaching it.
        before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from a 1-D probability vector (need not be normalised) with uniform ``u``."""
    cdf = probs.double().cumsum(0)
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device),
                                 right=True).item())
    idx = min(idx, probs.shape[0] - 1)
    # Never return a zero-probability token because of rounding at the top of the CDF.
    while probs[idx] <= 0 and idx > 0:
        idx -= 1
    return idx


def sample_on_device(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``sample_from`` without reading anything back: the same token, as a 0-d tensor on ``probs``'s
    device, so that a captured CUDA graph can pick it (``runtime/decode_chain.py``).

    ``u`` is the float64 uniform as a 1-element tensor. The scaled target is the same IEEE product as
    the host's ``u * float(cdf[-1])``, and the walk down over zero-probability tokens becomes "the
    last token at or before the draw whose probability is positive, else 0", which is where that
    loop stops.
    """
    cdf = probs.double().cumsum(0)
    idx = torch.searchsorted(cdf, u.double() * cdf[-1:], right=True).clamp(max=probs.shape[0] - 1)
    pos = torch.arange(probs.shape[0], device=probs.device)
    return torch.where((probs > 0) & (pos <= idx), pos, 0).amax()


class Sampler:
    """Seeded source of uniforms; one per generation, consumed in a fixed order."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._gen = torch.Generator(device="cpu").manual_seed(seed)

    def uniform(self) -> float:
        return float(torch.rand((), generator=self._gen, dtype=torch.float64))

    def uniforms(self, n: int) -> torch.Tensor:
        """The next ``n`` uniforms at once, float64: the values ``n`` calls of ``uniform`` would return
        (tests/test_sampling_device.py holds torch to that)."""
        return torch.rand(n, generator=self._gen, dtype=torch.float64)

    def pick(self, logits: torch.Tensor, params: SamplingParams, allowed: torch.Tensor | None = None) -> int:
        """Greedy argmax, or a draw from the target distribution (both within ``allowed``, if given)."""
        if params.greedy:
            return greedy_token(logits, allowed)
        return sample_from(target_probs(logits, params, allowed), self.uniform())
