"""One decode token for each of many sequences in one forward: the CPU step of batched serving.

On this CPU a forward's cost is almost all int4 matmuls, whose cost grows slowly with the rows they
carry (one row 10.8 ms, eight rows 26 ms: ``docs/design/batched-serving.md`` §6.1), so eight
sequences decoding one token each in one forward produce about three times the tokens per second of
eight forwards of one row.

The forward is ``step_forward``'s one-token case with the batch made of *different sequences*: row
``b`` is sequence ``slots[b]`` of a :class:`~elesium.inference.runtime.slot_pool.SlotPool`, with its
own context length ``offsets[b]``. Its attention reads, in logical order, its own cached slots below
its offset, then its own new key, and nothing after (bias −inf). That is column for column what the
one-sequence step computes, and every other layer is row-wise (row-invariant int4 matmuls, per-row
norms), so a sequence's logits do not depend on the other rows, their number, or their contexts:
batched tokens are the tokens the sequence gets alone. ``tests/test_batched_step.py`` holds the
compiled graph to that, bit for bit, against the one-sequence graph.

The new keys and values are returned, not written (for the reason ``cpu_step.py`` gives), and
:meth:`BatchedCpuStep.decode` scatters them into the pool after the graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch

from elesium.inference.runtime.cpu_step import window_for
from elesium.inference.runtime.model import Block, Transformer
from elesium.inference.runtime.precompiled import PrecompiledFunction, PrecompileStore
from elesium.inference.runtime.slot_pool import SlotPool

BatchOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def batched_decode_forward(model: Transformer, tokens: torch.Tensor, offsets: torch.Tensor,
                           slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> BatchOut:
    """One new token per row, each row a different sequence of the pool, without touching the pool.

    Args:
        tokens: ``[B, 1]``; ``offsets``: ``[B]`` int64, each row's context length (its token's position
            and the slot it will occupy); ``slots``: ``[B]`` int64, each row's sequence in the pool.
        k_pool, v_pool: ``[slots, layers, kv_heads, W, head_dim]``: the pool's first ``W`` positions,
            ``W > max(offsets)``.

    Returns float32 logits ``[B, vocab]``, their argmax ``[B]``, and the new keys and values
    ``[layers, B, kv_heads, 1, head_dim]``.
    """
    c = model.config
    b = tokens.shape[0]
    kv, group, dim = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
    scale = 1.0 / math.sqrt(dim)
    cos, sin = model.rope_cos[offsets][:, None, None], model.rope_sin[offsets][:, None, None]
    width = k_pool.shape[3]
    columns = torch.arange(width, device=tokens.device)
    # Mirrors step_forward at N = 1: [B, 1, 1, W, 1] "from the cache", and a bias that hides every
    # column past the row's own position (which holds its new key).
    cached = (columns[None, :] < offsets[:, None])[:, None, None, :, None]
    bias = torch.zeros(b, 1, 1, 1, width, device=tokens.device).masked_fill(
        (columns[None, :] > offsets[:, None])[:, None, None, None, :], float("-inf"))
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    x = model.embed(tokens)
    for i, module in enumerate(model.layers):
        layer = cast(Block, module)
        attn = layer.attn
        q, k, v = attn.project(layer.attn_norm(x), cos, sin)  # [B, heads or kv, 1, head_dim]
        keys.append(k)
        values.append(v)
        k_rows = torch.where(cached, k_pool[slots, i][:, :, None], k[:, :, :, None])  # [B, kv, 1, W, D]
        v_rows = torch.where(cached, v_pool[slots, i][:, :, None], v[:, :, :, None])
        qg = q.reshape(b, kv, group, 1, 1, dim)
        s = (qg * k_rows[:, :, None]).sum(-1) * scale + bias  # [B, kv, group, 1, W]
        p = (s - s.amax(-1, keepdim=True)).exp()
        mixed = (p[..., None] * v_rows[:, :, None]).sum(-2)
        out = (mixed / p.sum(-1)[..., None]).view(b, c.num_heads, 1, dim)
        x = x + attn.merge(out)
        x = x + layer.mlp(x)
    logits = model.logits(model.norm(x))[:, 0]
    return logits, logits.argmax(-1), torch.stack(keys), torch.stack(values)


class BatchedCpuStep:
    """``batched_decode_forward`` compiled once for every batch size from 2 and every window.

    One sequence alone never comes here: it takes the engine's one-sequence step (the same graph a
    generation has always used), and the tests prove the two agree bit for bit. ``compiled=False``
    runs the function eagerly (the reference in tests).
    """

    def __init__(self, model: Transformer, pool: SlotPool, compiled: bool = True,
                 precompile: PrecompileStore | None = None) -> None:
        self.model = model
        self.pool = pool
        self.compiled = compiled
        self._step: Callable[..., Any] = batched_decode_forward
        if compiled:  # saved on first use and loaded by later processes where there is a store
            # The pool's length names the graph: the pool's strides are compiled in as constants.
            self._step = PrecompiledFunction(batched_decode_forward, f"cpu-batched-step-{pool.max_len}",
                                             precompile)
        # Called as a step's forward starts (the batcher's ``defer_wakes``; see ``BatchedCudaStep``).
        self.on_launch: Callable[[], None] | None = None

    @torch.inference_mode()
    def decode(self, tokens: list[int], offsets: list[int],
               slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[B, vocab]`` and greedy tokens ``[B]`` of one token per sequence; writes their K/V."""
        b = len(tokens)
        if not b == len(offsets) == len(slots) or b < 2:
            raise ValueError(f"a batched step takes 2 or more rows of equal length, got {b}")
        pool = self.pool
        width = window_for(max(offsets) + 1, pool.max_len)
        for slot in slots:
            pool.reserve(slot, width)
        k_pool, v_pool = pool.k[:, :, 0, :, :width], pool.v[:, :, 0, :, :width]
        ids = torch.tensor(tokens)[:, None]
        at, rows = torch.tensor(offsets), torch.tensor(slots)
        if self.compiled:
            # Rows, window and pool size all dynamic: one graph for every batch, context and --max-batch.
            for tensor, dims in ((ids, (0,)), (at, (0,)), (rows, (0,)), (k_pool, (0, 3)), (v_pool, (0, 3))):
                for dim in dims:
                    torch._dynamo.mark_dynamic(tensor, dim)
        if self.on_launch is not None:
            self.on_launch()
        logits, greedy, keys, values = self._step(self.model, ids, at, rows, k_pool, v_pool)
        # pool[slot_b, :, 0, :, offset_b] for each row b: [B, layers, kv_heads, head_dim].
        pool.k[rows, :, 0, :, at] = keys[:, :, :, 0].transpose(0, 1)
        pool.v[rows, :, 0, :, at] = values[:, :, :, 0].transpose(0, 1)
        return logits, greedy

    def decode_greedy(self, tokens: list[int], offsets: list[int], slots: list[int],
                      steps: int) -> list[list[int]]:
        """``steps`` greedy tokens per row, each fed back as the row's next input: ``decode`` ``steps`` times.

        The CUDA step runs such a chain in one replay (``BatchedCudaStep.decode_greedy``); here a step costs
        tens of milliseconds of compute and chaining saves nothing, but the loop's chained path (and its
        tests) run on the CPU the same way."""
        picks: list[list[int]] = [[] for _ in tokens]
        tokens, offsets = list(tokens), list(offsets)
        for _ in range(steps):
            _, greedy = self.decode(tokens, offsets, slots)
            tokens, offsets = greedy.tolist(), [o + 1 for o in offsets]
            for row, token in zip(picks, tokens, strict=True):
                row.append(token)
        return picks

    def launch_greedy(self, tokens: list[int], offsets: list[int], slots: list[int],
                      steps: int) -> Callable[[], list[list[int]]]:
        """``decode_greedy`` behind the CUDA step's launch-then-read interface
        (``BatchedCudaStep.launch_greedy``): here the chain runs now and the function returns its tokens, so
        the loop's overlapped path (and its tests) run on the CPU the same way."""
        picks = self.decode_greedy(tokens, offsets, slots, steps)
        return lambda: picks
