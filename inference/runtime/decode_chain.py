"""Vanilla decoding on CUDA without a host round trip between tokens.

A captured 1-token step that reads its input token and cache offset from a device buffer, picks the
next token on the device, and writes it and the next offset back into that same buffer, can be
replayed back to back: step k + 1 needs nothing from the host. The host only has to *read* the
tokens, so it keeps a few replays in flight and reads each token through a pinned buffer and an
event. Its own per-token work (detokenising, stop strings, records, the caller's code) then overlaps
the GPU's next forwards instead of adding to them, and the GPU no longer idles for a launch and a
sync each token.

The pick is the host path's, on the device: the argmax, or ``sampling.sample_on_device`` over
``sampling.target_probs`` with the generation's own uniforms, drawn up front from its seeded
``Sampler`` in the order the host path would consume them (one per token). So a seeded sampled run
yields the same tokens chained or not, and replays to them.

Stop conditions stay exact: tokens are handed out one at a time in order, and a replay in flight when
the generation stops only wrote its K/V past the end of the kept context, in slots that the next
prefill or step overwrites before anything reads them (the same argument as the tree graphs' padding
rows). The arithmetic is the 1-token step graph's, so the tokens equal the synchronous path's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from elesium.inference.runtime.step_outputs import StepOutputs
from elesium.inference.sampling import SamplingParams, sample_on_device, target_probs

LOOKAHEAD = 3
"""Replays kept in flight ahead of the token being read. Two already hide a host turn shorter than a
forward; a third absorbs an occasional slow turn (a stop-string check over a long tail, the GIL held
by another thread) at the cost of at most that many wasted forwards when a generation stops."""

STATE = 3
"""The chain's device state: ``[token, offset, step]`` (int64); ``step`` indexes the uniforms."""


class DecodeChain:
    """One generation's tokens, produced by self-feeding replays of a captured 1-token step.

    ``state`` is the graph's device buffer; ``graph`` replays one step that reads it and writes the
    step's token, ``offset + 1`` and ``step + 1`` back. ``limit`` is the first cache slot the chain
    must not write (the cache's length).
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, state: torch.Tensor, token: int, offset: int,
                 limit: int, lookahead: int = LOOKAHEAD) -> None:
        if offset >= limit:
            raise ValueError(f"no room for a step: offset {offset} >= cache length {limit}")
        self._graph = graph
        self._state = state
        self._limit = limit
        # A blocking copy: the previous generation's replays (if any are still queued) run first on
        # this stream, and the host may reuse the source at once.
        state.copy_(torch.tensor([token, offset, 0], dtype=state.dtype))
        self._next_offset = offset  # the slot the next replay writes
        self._slots = [torch.zeros(1, dtype=state.dtype).pin_memory() for _ in range(lookahead + 1)]
        self._events = [torch.cuda.Event() for _ in range(lookahead + 1)]
        self._free = deque(range(lookahead + 1))
        self._inflight: deque[int] = deque()
        self._lookahead = lookahead

    def next_token(self, wanted: int) -> int:
        """The next token; ``wanted`` (>= 1) is how many more tokens the caller may still take, so the
        chain never runs more than that many steps ahead (nor past the cache)."""
        while (len(self._inflight) < min(wanted, self._lookahead + 1)
               and self._next_offset < self._limit):
            self._launch()
        if not self._inflight:
            raise RuntimeError("the cache is full: no slot left for another step")
        slot = self._inflight.popleft()
        self._events[slot].synchronize()
        token = int(self._slots[slot].item())
        self._free.append(slot)
        return token

    def _launch(self) -> None:
        slot = self._free.popleft()
        self._graph.replay()
        self._slots[slot].copy_(self._state[:1], non_blocking=True)
        self._events[slot].record()
        self._inflight.append(slot)
        self._next_offset += 1


def chain_body(step: Callable[..., StepOutputs], state: torch.Tensor, self_row: torch.Tensor,
               uniforms: torch.Tensor, params: SamplingParams) -> Callable[[], StepOutputs]:
    """The captured step: one token at slot ``state[1]``, its pick, then ``state`` advanced.

    ``params`` are baked in (temperature, top-k and top-p shape the graph), so each distinct
    setting gets its own graph; ``uniforms[state[2]]`` is the step's draw when sampling.
    """

    def body() -> StepOutputs:
        out = step(state[:1].view(1, 1), state[1:2], self_row, state[1], with_drafts=False)
        if params.greedy:
            token = out.greedy[0]
        else:
            token = sample_on_device(target_probs(out.logits[0], params), uniforms.index_select(0, state[2:]))
        state[0].copy_(token)
        state[1:].add_(1)
        return out

    return body
