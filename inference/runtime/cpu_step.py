"""The CPU decode step as one pure function, compiled once by inductor.

Eager PyTorch spends more of a CPU decode step dispatching ~1,000 small ops (casts, RoPE, norms,
views) than the int4 matmuls take. ``torch.compile`` fuses them into a few C++ loops, but only
pays off when the compiled graph neither mutates the KV cache nor depends on the cache offset:

* **No cache writes inside the graph.** Writing a layer's new K/V into a view of the big
  ``[layers, ...]`` cache makes AOT functionalisation rebuild the whole cache buffer every layer
  (~23 ms a step measured on 2 cores, more than the model's matmuls). So ``step_forward`` returns
  the new keys and values and the caller writes them with one indexed copy after the graph.
* **Attention in logical order.** A tree node attends to the cached slots before ``offset`` and
  then to its root path, depth by depth: the very key sequence it would see if it were decoded
  alone, one token at a time, in the same columns of the same window. With every layer row-wise
  (the int4 matmuls are row-invariant, and so are inductor's loops over a row), a node's logits are
  bit for bit those of vanilla decoding, so greedy speculative output equals vanilla's. Keys come
  from the cache or the step's own new keys by a select, so nothing is written first.
* **A cache window, not the whole cache.** The caller passes the cache sliced to a window that
  grows in steps of ``WINDOW`` slots; its length is a dynamic dimension, so one compiled graph
  serves every context length while each step reads only live-ish slots.
* **The offset is a 0-d tensor**, so a new position is new data, not a recompile.

The eager call of ``step_forward`` is its own reference, and ``Transformer.forward`` is the
reference of both (tests compare all three). Numerics: the same maths as ``Transformer.forward`` in
a different summation order, so logits agree to float tolerance, not bit for bit; greedy output is
deterministic for a given engine (the fingerprint names this path), but it is not the float32
reference's token for token (BENCHMARKS.md section 10 measures how often they agree). What is bit
for bit is a row against itself: one node's outputs do not depend on the tree around it, which
``tests/test_cpu_step.py`` checks for the eager and the compiled function.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from elesium.inference.runtime.drafting import DRAFT_TOPK, StepDrafter, scored_topk
from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.runtime.model import KVCache, Transformer
from elesium.inference.runtime.precompiled import PrecompiledFunction, PrecompileStore
from elesium.inference.runtime.step_outputs import StepOutputs

WINDOW = 256
"""Granularity of the attention window (cache slots): a step reads the first multiple of this that
holds the context, so a 300-token context reads 512 slots, not the whole 8k cache."""

def step_forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, offset: torch.Tensor,
                 k_window: torch.Tensor, v_window: torch.Tensor, ancestors: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """N new tokens (a chain or a tree) through the model without touching the cache.

    Args:
        tokens: ``[B, N]``; ``positions``: ``[N]``, ``offset`` plus each node's depth in the tree;
            ``offset``: 0-d int64, the first slot the new tokens will occupy (every slot before it
            is context).
        k_window, v_window: ``[layers, B, kv_heads, W, head_dim]``, the cache's first ``W`` slots,
            ``W > max(positions)``; slots at or past ``offset`` are never read as context.
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
    dev = tokens.device
    width = k_window.shape[3]
    slots = torch.arange(width, device=dev)
    # Each node's keys in logical order: column j is cache slot j below ``offset``, and from there
    # the node's root path, depth by depth (``path[r, d]``: r's ancestor at depth d, r at its own).
    levels = torch.arange(n, device=dev)
    depth = positions - offset
    on_path = ancestors[:, :, None] & (depth[None, :, None] == levels[None, None, :])  # [r, node, d]
    path = (on_path.long() * levels[None, :, None]).sum(1)  # [N, N]
    node = path[:, (slots - offset).clamp(0, n - 1)]  # [N, W]
    cached = (slots < offset)[None, None, None, :, None]
    bias = torch.zeros(n, width, device=dev).masked_fill(slots[None, :] > positions[:, None], float("-inf"))
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    x = model.embed(tokens)
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        q, k, v = attn.project(layer.attn_norm(x), cos, sin)
        keys.append(k)
        values.append(v)
        # [B, kv, N, W, head_dim]: inductor fuses these selects into the loops that read them.
        k_rows = torch.where(cached, k_window[i][:, :, None], k[:, :, node])
        v_rows = torch.where(cached, v_window[i][:, :, None], v[:, :, node])
        qg = q.reshape(b, kv, group, n, 1, dim)
        # Products as broadcast multiply + sum, not matmuls: with a handful of query rows a BLAS call
        # costs more to dispatch than to run, while inductor fuses these into the softmax's loops.
        s = (qg * k_rows[:, :, None]).sum(-1) * scale + bias  # [B, kv, group, N, W]
        p = (s - s.amax(-1, keepdim=True)).exp()
        mixed = (p[..., None] * v_rows[:, :, None]).sum(-2)
        out = (mixed / p.sum(-1)[..., None]).view(b, c.num_heads, n, dim)
        x = x + attn.merge(out)
        x = x + layer.mlp(x)
    hidden = model.norm(x)
    logits = model.logits(hidden)
    return hidden, logits, logits.argmax(-1), torch.stack(keys), torch.stack(values)


def use_inductor_cache(directory: Path) -> None:
    """Keep inductor's compiled artefacts in ``directory`` unless the user chose a place.

    Importing ``torch._dynamo`` already sets ``TORCHINDUCTOR_CACHE_DIR`` to inductor's default under
    ``/tmp`` (lost on reboot), so a plain ``setdefault`` never takes effect; the default is replaced
    here, a value the user set is kept. Inductor reads the variable at each compile.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)


def window_for(end: int, capacity: int) -> int:
    """Slots a step reads when its context ends at ``end``: ``end`` rounded up to ``WINDOW``."""
    return min(capacity, max(WINDOW, -(-end // WINDOW) * WINDOW))


class CompiledCpuRunner(ForwardRunner):
    """Every decode step, chain or tree, through ``step_forward``: one compiled graph for one-token
    steps and one more, with the node count dynamic, for trees.

    All steps share the function so that a tree node computes exactly what vanilla decoding computes
    for it; an eager fallback for some sizes would break that. The tree graph compiles on the first
    tree (minutes on 2 cores, like the first; inductor's cache makes later starts fast), so engines that
    never speculate never pay for it. Prefill and drafting run ``ForwardRunner``'s plain eager forward:
    prompts are one call per chunk, where dispatch overhead does not dominate, and they are the same
    for both modes. Medusa heads' drafts are computed from the step's hidden states after the graph.
    ``compiled=False`` runs ``step_forward`` eagerly: the reference the tests hold the graphs to.
    """

    def __init__(self, model: Transformer, cache: KVCache, heads: StepDrafter | None = None,
                 compiled: bool = True, precompile: PrecompileStore | None = None) -> None:
        super().__init__(model, cache, heads)
        self.compiled = compiled
        # Two graphs of one function: one-token steps (specialised) and trees (node count dynamic).
        # With a store, each is saved on first use and later processes load it (precompiled.py). The
        # cache's length is in the name: the window is a view of the cache, and its strides, which
        # inductor compiles in as constants, follow from it.
        self.graphs: dict[str, PrecompiledFunction] = {
            kind: PrecompiledFunction(step_forward, f"cpu-step-{kind}-{cache.max_len}", precompile)
            for kind in ("one", "tree")}

    def preload(self, trees: bool) -> list[str]:
        """Load the saved one-token graph (and the tree graph where ``trees``) now; the names loaded."""
        if not self.compiled:
            return []
        names = ("one", "tree") if trees else ("one",)
        return [name for name in names if self.graphs[name].preload()]

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], offset: int,
               ancestors: torch.Tensor | None = None, *, drafts: bool = False) -> StepOutputs:
        n = len(tokens)
        if offset + n > self.cache.max_len:
            raise ValueError(f"{offset + n} tokens do not fit the KV cache of {self.cache.max_len}")
        # The window must hold every node's logical positions: up to offset + depth <= offset + n - 1.
        width = window_for(offset + n, self.cache.max_len)
        k_window, v_window = self.cache.k[:, :, :, :width], self.cache.v[:, :, :, :width]
        inputs = (torch.tensor([tokens]), torch.tensor(positions), torch.tensor(offset), k_window, v_window,
                  self.model.causal(n) if ancestors is None else ancestors.to(torch.bool))
        if self.compiled:
            torch._dynamo.mark_dynamic(k_window, 3)
            torch._dynamo.mark_dynamic(v_window, 3)
            if n > 1:  # one graph for every tree size (a size of 1 is always specialised)
                for tensor, dims in zip(inputs, ((1,), (0,), (), (), (), (0, 1)), strict=True):
                    for dim in dims:
                        torch._dynamo.mark_dynamic(tensor, dim)
        step = self.graphs["one" if n == 1 else "tree"] if self.compiled else step_forward
        hidden, logits, greedy, keys, values = step(self.model, *inputs)
        self.cache.k[:, :, :, offset:offset + n] = keys
        self.cache.v[:, :, :, offset:offset + n] = values
        if not (drafts and self.fuses_drafts):
            return StepOutputs(hidden[0], logits[0], greedy[0])
        assert self.heads is not None
        top_tokens, top_logprobs = scored_topk(self.model, self.heads.fused_states(hidden[0]), DRAFT_TOPK)
        return StepOutputs(hidden[0], logits[0], greedy[0], top_tokens, top_logprobs)
