"""The CPU decode step as one pure function, compiled once by inductor.

Eager PyTorch spends more of a CPU decode step dispatching ~1,000 small ops (casts, RoPE, norms,
views) than the int4 matmuls take. ``torch.compile`` fuses them into a few C++ loops, but only
pays off when the compiled graph neither mutates the KV cache nor depends on the cache offset:

* **No cache writes inside the graph.** Writing a layer's new K/V into a view of the big
  ``[layers, ...]`` cache makes AOT functionalisation rebuild the whole cache buffer every layer
  (~23 ms a step measured on 2 cores, more than the model's matmuls). So ``step_forward`` returns
  the new keys and values and the caller writes them with one indexed copy after the graph.
* **Attention in two parts.** Each query attends to the cached slots before ``offset`` (one mask
  row, the same for every node) and to the step's own nodes (the ``ancestors`` mask), with one
  softmax over both. That needs neither the new K/V in the cache nor a concatenation.
* **A cache window, not the whole cache.** The caller passes the cache sliced to a window that
  grows in steps of ``WINDOW`` slots; its length is a dynamic dimension, so one compiled graph
  serves every context length while each step reads only live-ish slots.
* **The offset is a 0-d tensor**, so a new position is new data, not a recompile.

The eager call of ``step_forward`` is its own reference, and ``Transformer.forward`` is the
reference of both (tests compare all three). Numerics: the same maths as ``Transformer.forward`` in
a different summation order, so logits agree to float tolerance, not bit for bit; greedy output is
deterministic for a given engine (the fingerprint names this path), but it is not the float32
reference's token for token (BENCHMARKS.md section 10 measures how often they agree).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from elesium.inference.drafters.protocol import DraftHeads
from elesium.inference.runtime.forward import ForwardRunner, StepOutputs
from elesium.inference.runtime.model import KVCache, Transformer

WINDOW = 256
"""Granularity of the attention window (cache slots): a step reads the first multiple of this that
holds the context, so a 300-token context reads 512 slots, not the whole 8k cache."""

COMPILE_SIZES = (1,)
"""Numbers of new tokens that get a compiled graph (a first compile costs ~1 minute on 2 cores;
later starts load inductor's cache in seconds). Other sizes (tree verification, which the CPU does
not run by default) take the plain eager forward."""


def step_forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, offset: torch.Tensor,
                 k_window: torch.Tensor, v_window: torch.Tensor, ancestors: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """N new tokens through the model without touching the cache.

    Args:
        tokens: ``[B, N]``; ``positions``: ``[N]`` RoPE positions; ``offset``: 0-d int64, the
            first slot the new tokens will occupy (every slot before it is context).
        k_window, v_window: ``[layers, B, kv_heads, W, head_dim]``, the cache's first ``W >= offset``
            slots; slots at or past ``offset`` are masked out whatever they hold.
        ancestors: ``[N, N]`` bool, which new tokens each new token sees (itself included).

    Returns final-norm hidden states ``[B, N, hidden]``, float32 logits ``[B, N, vocab]``, their
    argmax ``[B, N]``, and the new keys and values ``[layers, B, kv_heads, N, head_dim]`` for the
    caller to write at ``offset``.
    """
    c = model.config
    b, n = tokens.shape
    kv, group, dim = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
    scale = 1.0 / math.sqrt(dim)
    cos, sin = model.rope_cos[positions][None, None], model.rope_sin[positions][None, None]
    width = k_window.shape[3]
    context = torch.arange(width, device=tokens.device) < offset
    old_bias = torch.zeros(width, device=tokens.device).masked_fill(~context, float("-inf"))
    # Query rows are grouped per KV head: row g * N + t is query head (h * group + g), token t.
    new_bias = torch.zeros(n, n, device=tokens.device).masked_fill(~ancestors, float("-inf")).repeat(group, 1)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    x = model.embed(tokens)
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        q, k, v = attn.project(layer.attn_norm(x), cos, sin)
        keys.append(k)
        values.append(v)
        qg = q.reshape(b, kv, group * n, 1, dim)
        # Products as broadcast multiply + sum, not matmuls: with a handful of query rows a BLAS call
        # costs more to dispatch than to run, while inductor fuses these into the softmax's loops.
        old = (qg * k_window[i][:, :, None]).sum(-1) * scale + old_bias
        new = (qg * k[:, :, None]).sum(-1) * scale + new_bias
        top = torch.maximum(old.amax(-1, keepdim=True), new.amax(-1, keepdim=True))
        p_old, p_new = (old - top).exp(), (new - top).exp()
        total = p_old.sum(-1, keepdim=True) + p_new.sum(-1, keepdim=True)
        mixed = ((p_old[..., None] * v_window[i][:, :, None]).sum(-2)
                 + (p_new[..., None] * v[:, :, None]).sum(-2))
        out = (mixed / total).view(b, c.num_heads, n, dim)
        x = x + attn.merge(out)
        x = x + layer.mlp(x)
    hidden = model.norm(x)
    logits = model.logits(hidden)
    return hidden, logits, logits.argmax(-1), torch.stack(keys), torch.stack(values)


def window_for(end: int, capacity: int) -> int:
    """Slots a step reads when its context ends at ``end``: ``end`` rounded up to ``WINDOW``."""
    return min(capacity, max(WINDOW, -(-end // WINDOW) * WINDOW))


class CompiledCpuRunner(ForwardRunner):
    """Decode steps through ``step_forward``, compiled for the sizes in ``compile_sizes``.

    Prefill, drafting, fused Medusa drafts and steps of other sizes run ``ForwardRunner``'s plain
    eager forward: prompts are one call per chunk, where dispatch overhead does not dominate.
    ``compiled=False`` runs ``step_forward`` eagerly for every size: the reference the tests hold
    the compiled graph to.
    """

    def __init__(self, model: Transformer, cache: KVCache, heads: DraftHeads | None = None,
                 compile_sizes: tuple[int, ...] = COMPILE_SIZES, compiled: bool = True) -> None:
        super().__init__(model, cache, heads)
        self.compile_sizes = compile_sizes
        self._step: Callable[..., Any] = self._bound_step
        if compiled:
            self._step = torch.compile(self._bound_step, fullgraph=True, dynamic=False)

    def _bound_step(self, tokens: torch.Tensor, positions: torch.Tensor, offset: torch.Tensor,
                    k_window: torch.Tensor, v_window: torch.Tensor, ancestors: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return step_forward(self.model, tokens, positions, offset, k_window, v_window, ancestors)

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], offset: int,
               ancestors: torch.Tensor | None = None, *, drafts: bool = False) -> StepOutputs:
        n = len(tokens)
        compiled = self._step is not self._bound_step
        if (drafts and self.fuses_drafts) or (compiled and n not in self.compile_sizes):
            # Eagerly, the plain forward is the faster form of the same function (it writes the cache
            # in place and calls one attention kernel instead of materialising the products).
            return super().decode(tokens, positions, offset, ancestors, drafts=drafts)
        if offset + n > self.cache.max_len:
            raise ValueError(f"{offset + n} tokens do not fit the KV cache of {self.cache.max_len}")
        width = window_for(offset, self.cache.max_len)
        k_window, v_window = self.cache.k[:, :, :, :width], self.cache.v[:, :, :, :width]
        if compiled:
            torch._dynamo.mark_dynamic(k_window, 3)
            torch._dynamo.mark_dynamic(v_window, 3)
        anc = self.model.causal(n) if ancestors is None else ancestors.to(torch.bool)
        hidden, logits, greedy, keys, values = self._step(torch.tensor([tokens]), torch.tensor(positions),
                                                          torch.tensor(offset), k_window, v_window, anc)
        self.cache.k[:, :, :, offset:offset + n] = keys
        self.cache.v[:, :, :, offset:offset + n] = values
        return StepOutputs(hidden[0], logits[0], greedy[0])
