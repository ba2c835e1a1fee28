"""Running the model's forward for the decoders: eagerly, or replaying captured CUDA graphs.

On an H200 an eager forward of a 30-layer model is ~15 ms of kernel launches for ~1 ms of work, so
decode steps on CUDA replay graphs captured once per number of new tokens (a "bucket"). The graph
path keeps every input in a static buffer and passes the cache offset as a device tensor; the eager
path passes a Python int and attends over just the live cache slots. Both compute the same function.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from elesium.inference.runtime.decode_chain import STATE, DecodeChain, chain_body
from elesium.inference.runtime.drafting import DRAFT_TOPK, Drafted, DrafterCache, StepDrafter
from elesium.inference.runtime.model import KVCache, Transformer
from elesium.inference.runtime.prefix_cache import PrefixCache
from elesium.inference.runtime.step_outputs import StepOutputs
from elesium.inference.sampling import SamplingParams

if TYPE_CHECKING:
    from elesium.inference.runtime.batched_cuda_step import BatchedCudaStep

PREFILL_CHUNK = 64
"""Eager prefill block (tokens): blocks are counted from position 0, so a block's keys depend only on
the tokens up to its end and a prefix cache (``prefix_cache.py``) can serve them exactly. 64 costs
~6 % over one 512-token forward on the 2-core CPU (1.72 against 1.62 ms a token); 32 cost 19 %."""
T = TypeVar("T")
DRAFT_TOPK_CHUNK = 1024  # the slice width of the chains' drafting top-k on CUDA (CudaGraphRunner)
MAX_CHAIN_GRAPHS = 8  # sampling settings that get their own self-feeding graph per runner
TREE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
"""Tree sizes (nodes, root included) that get their own CUDA graph: a tree runs in the smallest bucket
that holds it. The tuner measures the forward's cost at the same sizes, so its curve covers exactly
the shapes the graphs replay."""
HAS_TOPK_KERNEL = importlib.util.find_spec("triton") is not None
"""Whether drafting's sliced top-k can run as the Triton kernels (``top_logprobs.py``)."""

Capture = Callable[[Callable[[], Any]], tuple[Any, Any]]
"""Warm a step body up and capture it: ``CudaGraphRunner._record`` (two real runs, then a graph); tests
pass an eager stand-in whose ``replay()`` runs the body."""

__all__ = ["DRAFT_TOPK", "Capture", "CudaGraphRunner", "ForwardRunner", "StepOutputs"]


@dataclass
class PartialPrefill:
    """A prompt prefilled part of the way from slot 0: the step loop spreads a long prompt's blocks over
    several iterations, between the running generations' steps (``Batcher``), and the decoder's own
    ``prefill`` then finishes it (``ForwardRunner.partial``)."""

    ids: list[int]
    done: int = 0  # positions written
    parts: list[torch.Tensor] = field(default_factory=list)  # their hidden states, block by block
    hit_blocks: int = -1  # blocks served by the prefix cache; -1: not looked up yet

    @property
    def left(self) -> int:
        return len(self.ids) - self.done


class ForwardRunner:
    """Eager forwards over one KV cache (batch 1), plus the heads' own cache when they keep one.

    The heads are held as ``StepDrafter``s: the runner runs their drafting where a step needs it
    (fused into the verify forward, or ``expand``) and never asks which kind they are.
    """

    tree_chains = False  # whether self-feeding tree steps may be captured (``capture``); CUDA graphs only
    compile_tree_logic = False  # the chain's tree logic through torch.compile (CudaGraphRunner)
    # The chain's drafting top-k in slices of this width (``HydraHeads.expand``); None: the reference form.
    draft_topk_chunk: int | None = None

    def __init__(self, model: Transformer, cache: KVCache, heads: StepDrafter | None = None) -> None:
        self.model = model
        self.cache = cache
        self.heads: StepDrafter | None = None
        self.drafter_cache: DrafterCache | None = None
        # Captured self-feeding tree steps (``decoding/tree_chain.py``) with the buffers they read, kept
        # here because they bake in this runner's cache and heads: dropped with the heads.
        self.chain_graphs: dict[Any, tuple[Any, tuple[Any, ...]]] = {}
        self.tree_chains_started = 0  # generations whose tree steps ran on a chain (tests, benchmarks)
        # Prompt prefixes already prefilled (``prefix_cache.py``); the engine attaches one where the
        # prefill's blocks are exact to reuse (the eager CPU prefill).
        self.prefix_cache: PrefixCache | None = None
        # A prompt the step loop already prefilled part of, into ``cache``: the next ``prefill`` of the
        # same prompt from slot 0 goes on from it (the loop sets it around a generation's prefill).
        self.partial: PartialPrefill | None = None
        ForwardRunner.set_heads(self, heads)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def draft_rows(self) -> int:
        """Most rows one drafting call takes: a step accepts at most one node per level plus the root."""
        return 1 if self.heads is None else self.heads.num_heads + 1

    @property
    def capture(self) -> Capture | None:
        """How callers above the runtime capture a step of their own (the tree chain); None: eagerly only."""
        return None

    def set_heads(self, heads: StepDrafter | None) -> None:
        self.heads = heads
        self.chain_graphs.clear()
        # Slack past the context for the graph runner's padding rows; the heads add their own.
        self.drafter_cache = None if heads is None else heads.new_cache(
            self.cache.max_len + self.draft_rows, self.device)

    def decode_chain(self, token: int, offset: int, params: SamplingParams,
                     draw: Callable[[], torch.Tensor] | None) -> DecodeChain | None:
        """Self-feeding vanilla steps from ``token`` at slot ``offset``, where the runner has them
        (CUDA graphs); None here: eager steps are synchronous anyway."""
        return None

    @property
    def fuses_drafts(self) -> bool:
        """Whether verification steps also compute the next step's drafts (heads that read the hidden
        state alone; path-conditioned heads need the bonus token, which is chosen after the step)."""
        return self.heads is not None and self.heads.fuses_drafts

    def expand(self, heads: StepDrafter, rows: torch.Tensor, tokens: list[int], start: int, width: int,
               topk: int, levels: int | None = None) -> Drafted:
        """Path-conditioned heads' candidate tree (``StepDrafter.draft_tree``): ``rows`` ``[R, H]`` are the
        positions written since the last call, from slot ``start``; ``tokens`` the token after each, the
        last being the chosen ``x_{t+1}``; ``levels``: how deep to draft (``HydraHeads.expand``). Only
        the runner's own heads get its drafter cache."""
        dev = self.device
        cache = self.drafter_cache if heads is self.heads else None
        last = torch.tensor([len(tokens) - 1], device=dev)
        return heads.draft_tree(self.model, rows, torch.tensor(tokens, device=dev), start, last, width, topk,
                                cache, levels=levels)

    def prefill(self, prompt_ids: list[int], start: int = 0) -> torch.Tensor:
        """Write the prompt into the cache from slot ``start``; return hidden states ``[len, hidden]``.

        The prompt goes in blocks of ``PREFILL_CHUNK`` counted from its first token, so the attention
        mask stays ``[chunk, prefix + chunk]``, a whole prompt prefilled from slot 0 can take its first
        blocks from the prefix cache (the same bits the forward would compute again), and the step
        loop can run some blocks early (``partial``) without changing a bit.
        """
        if start != 0:
            outs = []
            for lo in range(0, len(prompt_ids), PREFILL_CHUNK):
                outs.append(self._prefill_block(prompt_ids[lo:lo + PREFILL_CHUNK], start + lo))
            return torch.cat(outs)
        partial = self.partial
        if partial is None or partial.ids != prompt_ids:
            partial = PartialPrefill(list(prompt_ids))
        self.prefill_blocks(partial, None)
        hidden = torch.cat(partial.parts)
        cache = self._prefix_cache()
        if cache is not None:
            cache.store(prompt_ids, self.cache, hidden, partial.hit_blocks)
        return hidden

    def prefill_blocks(self, partial: PartialPrefill, blocks: int | None) -> None:
        """Prefill up to ``blocks`` more blocks of ``partial`` (None: all), prefix-cache hits first."""
        chunk = PREFILL_CHUNK
        if partial.hit_blocks < 0:
            partial.hit_blocks = 0
            cache = self._prefix_cache()
            if cache is not None:
                for block in cache.match(partial.ids):
                    self.cache.k[:, 0, :, partial.done:partial.done + chunk] = block.k
                    self.cache.v[:, 0, :, partial.done:partial.done + chunk] = block.v
                    partial.parts.append(block.hidden)
                    partial.done += chunk
                    partial.hit_blocks += 1
        while partial.left > 0 and (blocks is None or blocks > 0):
            lo = partial.done
            partial.parts.append(self._prefill_block(partial.ids[lo:lo + chunk], lo))
            partial.done += min(chunk, partial.left)
            blocks = None if blocks is None else blocks - 1

    def _prefix_cache(self) -> PrefixCache | None:
        cache = self.prefix_cache
        return cache if cache is not None and cache.block == PREFILL_CHUNK else None

    def _prefill_block(self, tokens: list[int], at: int) -> torch.Tensor:
        ids = torch.tensor([tokens], device=self.device)
        positions = torch.arange(at, at + len(tokens), device=self.device)
        return self.model(ids, positions, self.cache, at)[0]

    def step_outputs(self, tokens: torch.Tensor, positions: torch.Tensor, ancestors: torch.Tensor | None,
                     offset: int | torch.Tensor, with_drafts: bool) -> StepOutputs:
        """The step's whole device computation; the graph runner captures exactly this."""
        hidden = self.model(tokens, positions, self.cache, offset, ancestors)[0]
        if not with_drafts or self.heads is None or not self.heads.fuses_drafts:
            logits = self.model.logits(hidden)
            return StepOutputs(hidden, logits, logits.argmax(-1))
        # One lm_head product for the nodes and every head at every node: the 49k x H weight is
        # read once, which is most of its cost on a CPU and one launch fewer on a GPU.
        n = hidden.shape[0]
        drafted = self.heads.fused_states(hidden)  # [K, N, H]
        every = self.model.logits(torch.cat([hidden, drafted.flatten(0, 1)]))
        logits = every[:n]
        head_logits = every[n:].view(drafted.shape[0], n, -1).movedim(0, 1)  # [N, K, V]
        top = torch.topk(head_logits, DRAFT_TOPK, dim=-1)
        return StepOutputs(hidden, logits, logits.argmax(-1), top.indices,
                           top.values - torch.logsumexp(head_logits, dim=-1, keepdim=True))

    def decode(self, tokens: list[int], positions: list[int], offset: int,
               ancestors: torch.Tensor | None = None, *, drafts: bool = False) -> StepOutputs:
        """One verification forward of N tokens at cache slots ``offset...``.

        Inputs arrive as host values (the decoders build trees on the CPU); each runner moves them to
        the device its own way. ``drafts`` also returns every node's head proposals (when heads are
        attached); vanilla decoding leaves it off and pays nothing for the heads.
        """
        return self.step_outputs(*self._device_inputs(tokens, positions, ancestors), offset,
                                 with_drafts=drafts and self.fuses_drafts)

    def _device_inputs(self, tokens: list[int], positions: list[int],
                       ancestors: torch.Tensor | None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        dev = self.device
        return (torch.tensor([tokens], device=dev), torch.tensor(positions, device=dev),
                None if ancestors is None else ancestors.to(dev))


def record_graph(body: Callable[[], T], pool: Any = None) -> tuple[torch.cuda.CUDAGraph, T, Any]:
    """Warm ``body`` up on a side stream (allocator, kernel selection; as torch's docs prescribe), then
    capture it into a graph in memory pool ``pool`` (None: a new one). Returns the graph, what the capture
    returned (static tensors every replay rewrites) and the pool, for the next capture to share."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    return graph, out, graph.pool()


class CudaGraphRunner(ForwardRunner):
    """Replays one captured CUDA graph per bucket of N; falls back to eager for larger N.

    A call with N new tokens runs the smallest bucket >= N; the extra rows are padding nodes that
    see only themselves, write their K/V past the real nodes (overwritten next step) and are sliced
    off the outputs.
    """

    def __init__(self, model: Transformer, cache: KVCache, heads: StepDrafter | None = None,
                 buckets: tuple[int, ...] = TREE_BUCKETS) -> None:
        super().__init__(model, cache, heads)
        # The cache every graph is captured on. The batcher points ``cache`` at a pool slot for a
        # generation's solo work; the graphs would still write the captured cache, so such work runs on
        # the pool's graphs (``slot_step``) or eagerly (``_on_own_cache``), the same bits either way under
        # invariant numerics.
        self._graph_cache = cache
        # Set by the batcher with the cache: the pool's graphs and the slot, which then run this
        # runner's steps on that slot (``BatchedCudaStep.nodes``) instead of eager launches.
        self.slot_step: tuple[BatchedCudaStep, int] | None = None
        self.buckets = tuple(sorted(set(buckets)))
        # One graph per (bucket, with drafts): vanilla steps must not pay for the heads.
        self._graphs: dict[tuple[int, bool],
                           tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], StepOutputs]] = {}
        # Drafting graphs by (width, top-k, levels).
        self._expanders: dict[tuple[int, int, int | None],
                              tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], tuple[torch.Tensor, ...]],
                              ] = {}
        self._pool = None
        # The self-feeding 1-token graphs (decode_chain), one per sampling setting, and the buffers they
        # read (state, the constant ancestor row, the uniforms): all kept alive, so that neither the
        # allocator nor later captures reuse their memory while a graph still reads or writes it.
        self._chains: dict[tuple[float, int, float], tuple[torch.cuda.CUDAGraph, StepOutputs]] = {}
        self._chain_io: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.chains = True  # off: vanilla steps take the synchronous bucket-1 graph (A/B runs)
        # The self-feeding tree steps (``decoding/tree_chain.py``) are captured through ``capture`` into
        # ``chain_graphs``, one graph per tree shape and sampling setting.
        self.tree_chains = True  # off: tree steps go through the host (A/B runs)
        self.compile_tree_logic = True  # off: the chain's tree logic runs as eager kernels (A/B runs)
        # The chain's drafting top-k in slices of this width (``HydraHeads.expand``), which on CUDA is
        # the two-stage Triton kernel (kernels/topk_logprobs.py): 0.67 against 0.74 ms/token for the
        # reference form at T = 0 on the H200 (BENCHMARKS §6j). None: the reference form (A/B runs).
        self.draft_topk_chunk = DRAFT_TOPK_CHUNK if HAS_TOPK_KERNEL else None

    @property
    def _on_own_cache(self) -> bool:
        return self.cache is self._graph_cache

    @property
    def capture(self) -> Capture | None:
        return self._record if self._on_own_cache else None

    def decode_chain(self, token: int, offset: int, params: SamplingParams,
                     draw: Callable[[], torch.Tensor] | None) -> DecodeChain | None:
        """Vanilla steps that feed themselves on the device (``decode_chain.DecodeChain``).

        One graph per sampling setting, captured on first use with the call's real inputs like the
        step graphs: warm-up runs two real steps (slots ``offset`` and ``offset + 1``), whose writes the
        chain's first replays make again or overwrite. So it needs two free slots; otherwise, or past
        ``MAX_CHAIN_GRAPHS`` settings, the caller decodes synchronously. ``draw`` returns the
        generation's uniforms when sampling (float64, one per token the chain may take); it is called
        only once the chain is sure to start, so a caller that falls back still has them.
        """
        limit = self.cache.max_len
        key = (0.0, 0, 1.0) if params.greedy else (params.temperature, params.top_k, params.top_p)
        if not self.chains or not self._on_own_cache or offset + 2 > limit or (
                key not in self._chains and len(self._chains) >= MAX_CHAIN_GRAPHS):
            return None
        if self._chain_io is None:
            self._chain_io = (torch.zeros(STATE, dtype=torch.long, device=self.device),
                              torch.ones(1, 1, dtype=torch.bool, device=self.device),
                              torch.zeros(limit, dtype=torch.float64, device=self.device))
        state, self_row, draws = self._chain_io
        if draw is not None:
            uniforms = draw()
            draws[:len(uniforms)].copy_(uniforms)
        if key not in self._chains:
            state.copy_(torch.tensor([token, offset, 0]))
            self._chains[key] = self._record(chain_body(self.step_outputs, state, self_row, draws, params))
        return DecodeChain(self._chains[key][0], state, token, offset, limit)

    def set_heads(self, heads: StepDrafter | None) -> None:
        """New heads invalidate every captured graph (they baked in the old weights' addresses)."""
        super().set_heads(heads)
        self._graphs.clear()
        self._expanders.clear()

    @torch.inference_mode()
    def expand(self, heads: StepDrafter, rows: torch.Tensor, tokens: list[int], start: int, width: int,
               topk: int, levels: int | None = None) -> Drafted:
        """Replay the drafting graph for (width, topk, levels): the drafter and the levels become one
        replay.

        The graph runs ``draft_rows`` rows, the real ones first. Like the step graphs it is captured
        on the call's real inputs, because warm-up really writes the drafter's cache. Heads other
        than the runner's own run eagerly.
        """
        r_max, n = self.draft_rows, len(tokens)
        if heads is not self.heads or n > r_max:
            return super().expand(heads, rows, tokens, start, width, topk, levels)
        key = (width, topk, levels)
        captured = self._expanders.get(key)
        io = captured[1] if captured else {
            "rows": torch.zeros(r_max, rows.shape[-1], dtype=rows.dtype, device=self.device),
            "staging": torch.zeros(r_max + 2, dtype=torch.long).pin_memory(),
            "ints": torch.zeros(r_max + 2, dtype=torch.long, device=self.device)}
        io["rows"][:n].copy_(rows)
        staging = io["staging"]  # tokens | start | last; safe to reuse: the last results were read back
        staging.zero_()
        staging[:n] = torch.tensor(tokens)
        staging[r_max], staging[r_max + 1] = start, n - 1
        io["ints"].copy_(staging, non_blocking=True)
        if captured is None:
            ints = io["ints"]

            def body() -> Drafted:
                return heads.draft_tree(self.model, io["rows"], ints[:r_max], ints[r_max],
                                        ints[r_max + 1:], width, topk, self.drafter_cache, levels=levels)

            graph, outs = self._record(body)
            captured = self._expanders[key] = (graph, io, outs)
        graph, _, outs = captured
        graph.replay()
        return outs

    def _capture(self, n: int, first: torch.Tensor,
                 drafts: bool) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], StepOutputs]:
        """Capture bucket ``n``, with ``first`` (the staging layout) holding the call's real inputs.

        Warm-up and capture really execute the step, cache writes included. With placeholder inputs
        they would write junk K/V over live slots (slot 0 onwards), so they run on the step that
        is about to run anyway: its writes are exactly the ones the replay makes again.
        """
        dev = self.device
        # Every per-step input lives in one int64 buffer (tokens | positions | offset | ancestor rows),
        # filled by a single asynchronous copy from pinned host memory.
        io = {"staging": first.pin_memory(), "device": first.to(dev)}
        buf = io["device"]

        def body() -> StepOutputs:
            tokens = buf[:n].view(1, n)
            positions = buf[n:2 * n]
            offset = buf[2 * n]
            ancestors = buf[2 * n + 1:].view(n, n).bool()
            return self.step_outputs(tokens, positions, ancestors, offset, with_drafts=drafts)

        graph, out = self._record(body)
        return graph, io, out

    def _record(self, body: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
        """``record_graph`` into the runner's memory pool."""
        graph, out, self._pool = record_graph(body, self._pool)
        return graph, out

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], start: int = 0) -> torch.Tensor:
        """The prompt in chunks of the largest bucket, each replaying that bucket's step graph with a
        causal ancestor block: an eager prefill launches ~300 kernels a layer's worth at a time, which
        on an H200 costs more than the work (and every generation pays it before its first token).

        Same function as the eager prefill, and under invariant numerics the same bits: a row's result
        depends neither on how many rows the forward holds nor on the offset being a tensor. A prompt
        the batcher has prefilled part of the way (``partial``) is finished in its blocks instead.
        """
        if start == 0 and self.partial is not None and self.partial.ids == prompt_ids:
            return super().prefill(prompt_ids)
        chunk = self.buckets[-1]
        outs = []
        for lo in range(0, len(prompt_ids), chunk):
            part = prompt_ids[lo:lo + chunk]
            at = start + lo
            out = self.decode(part, list(range(at, at + len(part))), at)
            outs.append(out.hidden.clone())  # a view into the bucket's static output until cloned
        return torch.cat(outs)

    def _prefill_block(self, tokens: list[int], at: int) -> torch.Tensor:
        """A block of the batcher's spread prefill (``prefill_blocks``): a graph replay, as ``prefill``'s."""
        return self.decode(tokens, list(range(at, at + len(tokens))), at).hidden.clone()

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], offset: int,
               ancestors: torch.Tensor | None = None, *, drafts: bool = False) -> StepOutputs:
        n = len(tokens)
        drafts = drafts and self.fuses_drafts
        if not self._on_own_cache and self.slot_step is not None and not drafts:
            step, slot = self.slot_step
            return step.nodes(tokens, positions, offset, ancestors, slot)
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None or offset + bucket > self.cache.max_len or not self._on_own_cache:
            return self.step_outputs(*self._device_inputs(tokens, positions, ancestors), offset,
                                     with_drafts=drafts)
        key = (bucket, drafts)
        captured = self._graphs.get(key)
        staging = (captured[1]["staging"] if captured
                   else torch.zeros(2 * bucket + 1 + bucket * bucket, dtype=torch.long))
        # Safe to overwrite: the previous step's results were read back (a sync) before this call.
        staging[:n] = torch.tensor(tokens)
        staging[bucket:bucket + n] = torch.tensor(positions)
        staging[2 * bucket] = offset
        rows = staging[2 * bucket + 1:].view(bucket, bucket)
        rows.zero_()
        rows.diagonal().fill_(1)  # padding nodes see only themselves
        rows[:n, :n] = ancestors if ancestors is not None else self.model.causal(n).cpu()
        if captured is None:
            captured = self._graphs[key] = self._capture(bucket, staging, drafts)
        graph, io, out = captured
        io["device"].copy_(io["staging"], non_blocking=True)
        graph.replay()
        # Views into static buffers: valid until the next replay of this bucket.
        return StepOutputs(out.hidden[:n], out.logits[:n], out.greedy[:n],
                           None if out.draft_tokens is None else out.draft_tokens[:n],
                           None if out.draft_logprobs is None else out.draft_logprobs[:n])
