"""The k most likely draft tokens of each row of logits, with their log-probabilities.

Why a module of its own. Drafting asks this once per tree level, over the whole 49,152-token vocabulary,
for up to ``width`` rows at a time. Written as ``topk(log_softmax(logits))`` it costs, on the H200, a
softmax kernel that writes the full ``[rows, V]`` back, and a multi-block radix select (four passes:
digit counts, cumulative sums, within-k counts, gather) for every level: about 200 µs of a 1.7 ms tree
step (BENCHMARKS §6i's profile). Two cheaper forms give the same values:

* ``topk(logits) - logsumexp(logits)``: log-softmax is a per-row shift, so it does not change which
  tokens are on top; only the k chosen values need the shift, and ``logsumexp`` is one reduction that
  writes one float per row.
* chunked selection: a row's top k lie among the union of its chunks' top k. Selecting within
  ``chunk``-wide slices first (many small slices, which torch's single-block top-k handles in one
  pass) and then among the ``V / chunk * k`` survivors avoids the multi-block path.

On CUDA the chunked selection runs as two Triton kernels with the shift fused in
(``kernels/topk_logprobs.py``); the torch slice form measured slower than the reference on the H200
(BENCHMARKS §6j) and stays as the same selection on other devices.

Drafts only propose: verification is exact whatever is drafted, so these forms cannot change an
output, only which candidates a tree holds when two logits tie exactly at the k-th place (either form
picks one of them deterministically). ``top_logprobs_reference`` is the definition they are tested
against (tests/test_top_logprobs.py, tests/test_topk_kernel.py).
"""

from __future__ import annotations

import importlib.util

import torch

HAS_TOPK_KERNEL = importlib.util.find_spec("triton") is not None
"""Whether ``top_logprobs`` can run its chunked form as the Triton kernels (on CUDA tensors)."""


def top_logprobs_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, log-probabilities) of the ``k`` best tokens of each row, best first: the definition."""
    top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
    return top.indices, top.values


def top_logprobs(logits: torch.Tensor, k: int, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_logprobs_reference`'s result, computed as a shift of the top logits; with ``chunk``,
    selected in two stages (module docstring). Any leading shape; the last dimension is the vocabulary.

    Static shapes and no host syncs, so it can be captured in a CUDA graph. ``chunk`` must be at least
    ``k`` (and a power of two on CUDA, where the Triton kernels run); a vocabulary that is not a
    multiple of it is padded with ``-inf`` (never selected while a row has ``k`` finite logits).
    """
    v = logits.shape[-1]
    if chunk is not None and chunk < v and logits.is_cuda and HAS_TOPK_KERNEL:
        from elesium.kernels.topk_logprobs import topk_logprobs

        return topk_logprobs(logits, k, chunk)
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    if chunk is None or chunk >= v:
        top = torch.topk(x, k, dim=-1)
        return top.indices, top.values - lse
    if chunk < k:
        raise ValueError(f"chunk {chunk} is narrower than k = {k}")
    pad = -v % chunk
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    lead = x.shape[:-1]
    slices = x.reshape(*lead, -1, chunk)  # [..., V / chunk, chunk]
    first = torch.topk(slices, k, dim=-1, sorted=False)
    base = torch.arange(slices.shape[-2], device=x.device).unsqueeze(-1) * chunk
    cand_values = first.values.reshape(*lead, -1)
    cand_index = (first.indices + base).reshape(*lead, -1)
    second = torch.topk(cand_values, k, dim=-1)
    return cand_index.gather(-1, second.indices), second.values - lse


def level_candidates(logits: torch.Tensor, k: int, chunk: int | None,
                     logit_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft level's top-``k`` tokens and log-probabilities: the reference form, or ``top_logprobs``
    in slices of ``chunk`` (what the tree expansions of ``hydra.py`` and ``drafter_tree.py`` share).

    ``logit_scale`` s: the log-probabilities of ``softmax(s * logits)``, the draft distribution at
    temperature 1 / s. Unlike a scale of the log-probabilities afterwards (the tree policy's
    ``draft_temperature``, which ranks paths the same), it changes which paths win across parents,
    because each parent's distribution is renormalised; it never changes a parent's own top-k."""
    if logit_scale != 1.0:
        logits = logits.float() * logit_scale
    return top_logprobs_reference(logits, k) if chunk is None else top_logprobs(logits, k, chunk)


def best_paths(cum: torch.Tensor, logprobs: torch.Tensor, width: int,
               k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2's expansion rule: of every row's ``k`` candidates (``logprobs`` ``[rows, k]``, each row's
    path so far scoring ``cum`` ``[rows]``), keep the ``width`` paths of highest total log-probability.
    Returns their flat candidate indices ``row * k + rank``, their rows and their totals."""
    total = (cum[:, None] + logprobs).flatten()
    best = torch.topk(total, min(width, total.numel())).indices
    return best, torch.div(best, k, rounding_mode="floor"), total[best]
