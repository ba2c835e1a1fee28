"""Running the model's forward for the decoders: eagerly, or replaying captured CUDA graphs.

On an H200 an eager forward of a 30-layer model is ~15 ms of kernel launches for ~1 ms of work, so
decode steps on CUDA replay graphs captured once per number of new tokens (a "bucket"). The graph
path keeps every input in a static buffer and passes the cache offset as a device tensor; the eager
path passes a Python int and attends over just the live cache slots. Both compute the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from elesium.inference.model import KVCache, Transformer

PREFILL_CHUNK = 512
DRAFT_TOPK = 10  # candidates per head computed in a fused step; trees use at most this many ranks


@dataclass
class StepOutputs:
    """What one verification forward yields, all still on the model's device.

    ``draft_tokens`` / ``draft_logprobs`` (``[N, heads, DRAFT_TOPK]``) are the heads' proposals at
    every node, present when the runner fuses drafting into the step (CUDA graphs): the next
    step's drafts are then a row lookup at the accepted node instead of another round of launches.
    """

    hidden: torch.Tensor
    logits: torch.Tensor
    greedy: torch.Tensor
    draft_tokens: torch.Tensor | None = None
    draft_logprobs: torch.Tensor | None = None


def draft_topk(model: Transformer, heads: nn.Module, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads' top-k tokens and log-probabilities, ``[..., heads, k]``, for hidden states ``[..., H]``."""
    logits = model.logits(heads(hidden)).movedim(0, -2)  # [..., heads, V]
    top = torch.topk(logits, k, dim=-1)
    return top.indices, top.values - torch.logsumexp(logits, dim=-1, keepdim=True)


class ForwardRunner:
    """Eager forwards over one KV cache (batch 1)."""

    fuses_drafts = False

    def __init__(self, model: Transformer, cache: KVCache, heads: nn.Module | None = None) -> None:
        self.model = model
        self.cache = cache
        self.heads = heads

    @property
    def device(self) -> torch.device:
        return self.model.device

    def set_heads(self, heads: nn.Module | None) -> None:
        self.heads = heads

    def prefill(self, prompt_ids: list[int], start: int = 0) -> torch.Tensor:
        """Write the prompt into the cache from slot ``start``; return hidden states ``[len, hidden]``.

        Long prompts go in chunks so the attention mask stays ``[chunk, prefix + chunk]``.
        """
        outs = []
        for lo in range(0, len(prompt_ids), PREFILL_CHUNK):
            chunk = prompt_ids[lo:lo + PREFILL_CHUNK]
            tokens = torch.tensor([chunk], device=self.device)
            positions = torch.arange(start + lo, start + lo + len(chunk), device=self.device)
            outs.append(self.model(tokens, positions, self.cache, start + lo)[0])
        return torch.cat(outs)

    def step_outputs(self, tokens: torch.Tensor, positions: torch.Tensor, offset: int | torch.Tensor,
                     ancestors: torch.Tensor | None, with_drafts: bool) -> StepOutputs:
        """The step's whole device computation; the graph runner captures exactly this."""
        hidden = self.model(tokens, positions, self.cache, offset, ancestors)[0]
        logits = self.model.logits(hidden)
        out = StepOutputs(hidden, logits, logits.argmax(-1))
        if with_drafts and self.heads is not None:
            out.draft_tokens, out.draft_logprobs = draft_topk(self.model, self.heads, hidden, DRAFT_TOPK)
        return out

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, offset: int,
               ancestors: torch.Tensor | None = None) -> StepOutputs:
        """One verification forward over ``tokens [1, N]`` at cache slots ``offset...``."""
        return self.step_outputs(tokens, positions, offset, ancestors, with_drafts=False)


class CudaGraphRunner(ForwardRunner):
    """Replays one captured CUDA graph per bucket of N; falls back to eager for larger N.

    A call with N new tokens runs the smallest bucket >= N; the extra rows are padding nodes that
    see only themselves, write their K/V past the real nodes (overwritten next step) and are sliced
    off the outputs.
    """

    def __init__(self, model: Transformer, cache: KVCache, heads: nn.Module | None = None,
                 buckets: tuple[int, ...] = (1,)) -> None:
        super().__init__(model, cache, heads)
        self.buckets = tuple(sorted(set(buckets)))
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], StepOutputs]] = {}
        self._pool = None

    @property
    def fuses_drafts(self) -> bool:  # type: ignore[override]
        return self.heads is not None

    def set_heads(self, heads: nn.Module | None) -> None:
        """New heads invalidate every captured graph (they baked in the old weights' addresses)."""
        self.heads = heads
        self._graphs.clear()

    def _capture(self, n: int) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], StepOutputs]:
        dev = self.device
        io = {
            "tokens": torch.zeros(1, n, dtype=torch.long, device=dev),
            "positions": torch.zeros(n, dtype=torch.long, device=dev),
            "offset": torch.zeros((), dtype=torch.long, device=dev),
            "ancestors": torch.eye(n, dtype=torch.bool, device=dev),
        }

        def body() -> StepOutputs:
            return self.step_outputs(io["tokens"], io["positions"], io["offset"], io["ancestors"],
                                     with_drafts=self.heads is not None)

        # Warm up on a side stream (allocator and kernel selection), as torch's docs prescribe.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = body()
        self._pool = graph.pool()
        return graph, io, out

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, offset: int,
               ancestors: torch.Tensor | None = None) -> StepOutputs:
        n = tokens.shape[1]
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None or offset + bucket > self.cache.max_len:
            return self.step_outputs(tokens, positions, offset, ancestors, with_drafts=self.fuses_drafts)
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        graph, io, out = self._graphs[bucket]
        io["tokens"][0, :n].copy_(tokens[0])
        io["positions"][:n].copy_(positions)
        io["positions"][n:].fill_(0)
        io["offset"].fill_(offset)
        anc = io["ancestors"]
        anc.copy_(torch.eye(bucket, dtype=torch.bool, device=anc.device))
        anc[:n, :n].copy_(ancestors if ancestors is not None else self.model.causal(n))
        graph.replay()
        # Views into static buffers: valid until the next replay of this bucket.
        return StepOutputs(out.hidden[:n], out.logits[:n], out.greedy[:n],
                           None if out.draft_tokens is None else out.draft_tokens[:n],
                           None if out.draft_logprobs is None else out.draft_logprobs[:n])
