"""Running the model's forward for the decoders: eagerly, or replaying captured CUDA graphs.

On an H200 an eager forward of a 30-layer model is ~15 ms of kernel launches for ~1 ms of work, so
decode steps on CUDA replay graphs captured once per number of new tokens (a "bucket"). The graph
path keeps every input in a static buffer and passes the cache offset as a device tensor; the eager
path passes a Python int and attends over just the live cache slots. Both compute the same function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from elesium.inference.drafters.drafter_tree import DrafterTree
from elesium.inference.drafters.protocol import DraftHeads, ExpandingHeads, FactoredHeads, expands
from elesium.inference.drafters.top_logprobs import HAS_TOPK_KERNEL
from elesium.inference.runtime.model import KVCache, Transformer

if TYPE_CHECKING:
    from elesium.inference.runtime.decode_chain import DecodeChain
    from elesium.inference.runtime.tree_chain import ChainGraphs, TreeChain, TreeShape
    from elesium.inference.sampling import SamplingParams

PREFILL_CHUNK = 512
T = TypeVar("T")
DRAFT_TOPK_CHUNK = 1024  # the slice width of the chains' drafting top-k on CUDA (CudaGraphRunner)
DRAFT_TOPK = 10  # candidates per head computed in a fused step; trees use at most this many ranks
MAX_CHAIN_GRAPHS = 8  # sampling settings that get their own self-feeding vanilla graph per runner
TREE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
"""Tree sizes (nodes, root included) that get their own CUDA graph: a tree runs in the smallest bucket
that holds it. The tuner measures the forward's cost at the same sizes, so its curve covers exactly
the shapes the graphs replay."""


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


def draft_topk(model: Transformer, heads: FactoredHeads, hidden: torch.Tensor,
               k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads' top-k tokens and log-probabilities, ``[..., heads, k]``, for hidden states ``[..., H]``."""
    logits = model.logits(heads(hidden)).movedim(0, -2)  # [..., heads, V]
    top = torch.topk(logits, k, dim=-1)
    return top.indices, top.values - torch.logsumexp(logits, dim=-1, keepdim=True)


def draft_tree(model: Transformer, heads: ExpandingHeads, rows: torch.Tensor, tokens: torch.Tensor,
               start: int | torch.Tensor,
               last: torch.Tensor, width: int, topk: int,
               drafter_cache: tuple[torch.Tensor, torch.Tensor] | None, topk_chunk: int | None = None,
               levels: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's drafting for path-conditioned heads: advance the drafter, then expand the tree.

    ``rows`` ``[R, H]`` are the hidden states of the positions written since the drafter last ran
    (the accepted nodes, at slots ``start...``), ``tokens`` ``[R]`` the token that followed each; row
    ``last`` (a ``[1]`` index tensor) is ``h_t`` and its token the chosen ``x_{t+1}``. Rows past
    ``last`` are padding (the CUDA graph runs a fixed R): they write drafter slots that the next
    call overwrites, and causal attention keeps them out of the real rows. With an ``int`` start
    this runs eagerly over the live slots; with a 0-d tensor it is static for capture.
    """
    drafter = heads.drafter
    first = None
    if drafter is not None:
        if drafter_cache is None:
            raise ValueError("these heads carry a drafter, but no drafter cache was given")
        r = rows.shape[0]
        # Clamp only matters for padding rows at the very end of the context.
        positions = (start + torch.arange(r, device=rows.device)).clamp(max=model.rope_cos.shape[0] - 1)
        feats = drafter(model, rows[None], tokens[None], positions, *drafter_cache, start, model.causal(r))[0]
        first = feats.index_select(0, last)
    hidden, token = rows.index_select(0, last)[0], tokens.index_select(0, last)
    if isinstance(heads, DrafterTree):  # the drafter drafts every level, through its own cache
        assert first is not None and drafter_cache is not None
        # Eager callers pass no padding rows: the host knows the root slot, and attention spans the live
        # slots only. The graphs' root stays on the device.
        root = start + int(last) if isinstance(start, int) else (start + last).reshape(())
        return heads.expand(model, first, token, width, topk, drafter_cache, root, topk_chunk, levels)
    return heads.expand(model, hidden, token, width, topk, first, topk_chunk, levels)


class ForwardRunner:
    """Eager forwards over one KV cache (batch 1), plus the heads' drafter cache when they carry one."""

    def __init__(self, model: Transformer, cache: KVCache, heads: DraftHeads | None = None) -> None:
        self.model = model
        self.cache = cache
        self.heads: DraftHeads | None = None
        self.drafter_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        ForwardRunner.set_heads(self, heads)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def draft_rows(self) -> int:
        """Most rows one drafting call takes: a step accepts at most one node per level plus the root."""
        return 1 if self.heads is None else self.heads.num_heads + 1

    def set_heads(self, heads: DraftHeads | None) -> None:
        self.heads = heads
        drafter = None if heads is None else heads.drafter
        # Slack past the context for the graph runner's padding rows.
        # A drafter tree writes its level rows past the last slot a real or padding row writes.
        scratch = heads.scratch_slots if isinstance(heads, DrafterTree) else 0
        self.drafter_cache = None if drafter is None else drafter.new_cache(
            self.cache.max_len + self.draft_rows + scratch, self.device, drafter.dtype)

    def prefill_drafter(self, heads: DraftHeads, hidden: torch.Tensor, next_tokens: list[int],
                        start: int = 0) -> None:
        """Write prompt rows into the drafter cache: ``hidden[i]`` (slot ``start + i``) paired with
        ``next_tokens[i]``, the token after it. A no-op for heads without a drafter."""
        drafter = heads.drafter
        if drafter is None or not next_tokens:
            return
        if heads is not self.heads or self.drafter_cache is None:
            raise ValueError("the drafter's cache belongs to the runner's own heads")
        tokens = torch.tensor(next_tokens, device=self.device)
        for lo in range(0, len(next_tokens), PREFILL_CHUNK):
            hi = min(lo + PREFILL_CHUNK, len(next_tokens))
            positions = torch.arange(start + lo, start + hi, device=self.device)
            drafter(self.model, hidden[None, lo:hi], tokens[None, lo:hi], positions, *self.drafter_cache,
                    start + lo, self.model.causal(hi - lo))

    def decode_chain(self, token: int, offset: int, params: SamplingParams,
                     draw: Callable[[], torch.Tensor] | None) -> DecodeChain | None:
        """Self-feeding vanilla steps from ``token`` at slot ``offset``, where the runner has them
        (CUDA graphs); None here: eager steps are synchronous anyway."""
        return None

    def tree_chain(self, shape: TreeShape, pending: int, offset: int, rows: torch.Tensor,
                   row_tokens: list[int], row_start: int, draft_temperature: float, limit: int,
                   params: SamplingParams, draw: Callable[[int], torch.Tensor] | None,
                   max_tokens: int | None) -> TreeChain | None:
        """Self-feeding tree steps (``runtime.tree_chain``) where the runner has them (CUDA graphs);
        None here."""
        return None

    @property
    def fuses_drafts(self) -> bool:
        """Whether verification steps also compute the next step's drafts (Medusa heads only: Hydra
        heads need the bonus token, which is chosen after the step)."""
        return self.heads is not None and not expands(self.heads)

    def expand(self, heads: ExpandingHeads, rows: torch.Tensor, tokens: list[int], start: int, width: int,
               topk: int, levels: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hydra heads' candidate tree (``draft_tree``): ``rows`` ``[R, H]`` are the positions written
        since the last call, from slot ``start``; ``tokens`` the token after each, the last being the
        chosen ``x_{t+1}``; ``levels``: how deep to draft (``HydraHeads.expand``)."""
        if heads.drafter is not None and heads is not self.heads:
            raise ValueError("the drafter's cache belongs to the runner's own heads")
        dev = self.device
        return draft_tree(self.model, heads, rows, torch.tensor(tokens, device=dev), start,
                          torch.tensor([len(tokens) - 1], device=dev), width, topk, self.drafter_cache,
                          levels=levels)

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

    def step_outputs(self, tokens: torch.Tensor, positions: torch.Tensor, ancestors: torch.Tensor | None,
                     offset: int | torch.Tensor, with_drafts: bool) -> StepOutputs:
        """The step's whole device computation; the graph runner captures exactly this."""
        hidden = self.model(tokens, positions, self.cache, offset, ancestors)[0]
        if not with_drafts or self.heads is None or expands(self.heads):
            logits = self.model.logits(hidden)
            return StepOutputs(hidden, logits, logits.argmax(-1))
        # One lm_head product for the nodes and every head at every node: the 49k x H weight is
        # read once, which is most of its cost on a CPU and one launch fewer on a GPU.
        n = hidden.shape[0]
        drafted = self.heads(hidden)  # [K, N, H]
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


class CudaGraphRunner(ForwardRunner):
    """Replays one captured CUDA graph per bucket of N; falls back to eager for larger N.

    A call with N new tokens runs the smallest bucket >= N; the extra rows are padding nodes that
    see only themselves, write their K/V past the real nodes (overwritten next step) and are sliced
    off the outputs.
    """

    def __init__(self, model: Transformer, cache: KVCache, heads: DraftHeads | None = None,
                 buckets: tuple[int, ...] = TREE_BUCKETS) -> None:
        super().__init__(model, cache, heads)
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
        # The self-feeding tree steps (tree_chain), one graph per tree shape and sampling setting,
        # with their buffers.
        self._tree_chains: ChainGraphs = {}
        self.tree_chains = True  # off: tree steps go through the host (A/B runs)
        self.compile_tree_logic = True  # off: the chain's tree logic runs as eager kernels (A/B runs)
        # The chain's drafting top-k in slices of this width (``HydraHeads.expand``), which on CUDA is
        # the two-stage Triton kernel (kernels/topk_logprobs.py): 0.67 against 0.74 ms/token for the
        # reference form at T = 0 on the H200 (BENCHMARKS §6j). None: the reference form (A/B runs).
        self.draft_topk_chunk: int | None = DRAFT_TOPK_CHUNK if HAS_TOPK_KERNEL else None

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
        from elesium.inference.runtime.decode_chain import STATE, DecodeChain, chain_body

        limit = self.cache.max_len
        key = (0.0, 0, 1.0) if params.greedy else (params.temperature, params.top_k, params.top_p)
        if not self.chains or offset + 2 > limit or (
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

    def tree_chain(self, shape: TreeShape, pending: int, offset: int, rows: torch.Tensor,
                   row_tokens: list[int], row_start: int, draft_temperature: float, limit: int,
                   params: SamplingParams, draw: Callable[[int], torch.Tensor] | None,
                   max_tokens: int | None) -> TreeChain | None:
        """Tree steps that feed themselves on the device (``tree_chain.start_tree_chain``), one graph
        per tree shape and sampling setting (at most ``MAX_CHAIN_GRAPHS`` settings' worth), captured
        on first use; None without expanding heads of the runner's own."""
        from elesium.inference.runtime.tree_chain import start_tree_chain

        if not self.tree_chains:
            return None
        return start_tree_chain(self, self._tree_chains, self._record, shape, pending, offset, rows,
                                row_tokens, row_start, draft_temperature, limit, params, draw, max_tokens,
                                MAX_CHAIN_GRAPHS)

    def set_heads(self, heads: DraftHeads | None) -> None:
        """New heads invalidate every captured graph (they baked in the old weights' addresses)."""
        super().set_heads(heads)
        self._graphs.clear()
        self._expanders.clear()
        self._tree_chains.clear()

    @torch.inference_mode()
    def expand(self, heads: ExpandingHeads, rows: torch.Tensor, tokens: list[int], start: int, width: int,
               topk: int, levels: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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

            def body() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                return draft_tree(self.model, heads, io["rows"], ints[:r_max], ints[r_max],
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
        """Warm ``body`` up on a side stream (allocator, kernel selection; as torch's docs prescribe),
        then capture it into a graph sharing the runner's memory pool."""
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
        return graph, out

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], start: int = 0) -> torch.Tensor:
        """The prompt in chunks of the largest bucket, each replaying that bucket's step graph with a
        causal ancestor block: an eager prefill launches ~300 kernels a layer's worth at a time, which
        on an H200 costs more than the work (and every generation pays it before its first token).

        Same function as the eager prefill, and under invariant numerics the same bits: a row's result
        depends neither on how many rows the forward holds nor on the offset being a tensor.
        """
        chunk = self.buckets[-1]
        outs = []
        for lo in range(0, len(prompt_ids), chunk):
            part = prompt_ids[lo:lo + chunk]
            at = start + lo
            out = self.decode(part, list(range(at, at + len(part))), at)
            outs.append(out.hidden.clone())  # a view into the bucket's static output until cloned
        return torch.cat(outs)

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], offset: int,
               ancestors: torch.Tensor | None = None, *, drafts: bool = False) -> StepOutputs:
        n = len(tokens)
        drafts = drafts and self.fuses_drafts
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None or offset + bucket > self.cache.max_len:
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
