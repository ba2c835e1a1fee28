"""Tree speculative decoding on CUDA as one self-feeding graph per step, greedy or sampled.

The host tree step (``decoding/speculative.py``) synchronises twice: it reads the drafts back to
choose the tree, and the verify forward's argmax back to walk it, with the GPU idle while Python
works (BENCHMARKS.md §6e: a 2.7 ms step holding 1.7 ms of GPU work). Here one captured graph goes
from one step's accepted tokens to the next step's: the heads' drafting (``StepDrafter.draft_tree``), the
tree chosen on the device (``device_tree.py``), the verify forward, acceptance (greedy, or exact
rejection sampling), the move of the accepted path's K/V to contiguous slots, and the state the next
step starts from. Like the vanilla
chain (``decode_chain.py``) it reads and writes only device buffers, so the host keeps a few replays
in flight and reads each step's small record (tokens committed, the path) through a pinned buffer
and an event, while detokenising and stop strings overlap the next steps.

Device state (int64 ``ints``): ``[pending, offset, start, last, step, row_tokens...]`` plus the
drafter's rows ``[R, H]``: the hidden states of the positions the last step accepted, written from
slot ``start``, each paired with the token after it; ``last`` is the index of the newest; ``step``
counts the chain's steps.

Sampling: the sampling parameters are baked into the graph (one graph per tree shape and setting, as
the vanilla chain has one per setting), and the uniforms are the generation's own, drawn up front
from its seeded ``Sampler``: step s of the chain reads ``draws[s * N : (s + 1) * N]``, one per tree
node (``device_tree.accept_sampled``). So a seeded run replays to the same tokens, and the host path
that may finish the generation after ``hand_back`` continues from the Sampler after those draws.
That is exactly what ``TreeDecoder`` keeps on the host between steps, so a chain can start from a
host state and hand its state back (``hand_back``) when the cache is too full for another
fixed-size step.

Stops stay exact: a step commits between 1 and ``depth + 1`` tokens; the host hands them out in order,
and a step in flight when the generation stops wrote only past the kept context (its tree's K/V, the
compacted path, the drafter's rows from the last kept step's first slot: rows the next generation's
prefill or steps overwrite before reading). The tree has a fixed size and its draft temperature is
the policy's at the chain's start (the adaptive policy needs the host between steps); neither changes
what greedy decoding outputs, only how many tokens a step keeps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from elesium.inference.decoding.device_tree import (
    DeviceTree,
    ExpansionLayout,
    accept_greedy,
    accept_sampled,
    best_first,
    candidate_scores,
    device_tree,
)
from elesium.inference.runtime.drafting import DrafterCache, StepDrafter
from elesium.inference.runtime.forward import MAX_CHAIN_GRAPHS, ForwardRunner
from elesium.inference.runtime.model import KVCache, Transformer
from elesium.inference.runtime.step_outputs import StepOutputs
from elesium.inference.sampling import SamplingParams, target_probs

LOOKAHEAD = 2
"""Steps in flight ahead of the one being read. A step is ~2 vanilla forwards long, so two already
cover any host turn; each wasted step at a stop costs one step of GPU time."""

INTS = 5
"""``ints`` before the row tokens: pending, offset, start, last, step."""

SamplingKey = tuple[float, int, float]
"""(temperature, top-k, top-p); greedy is (0, 0, 1)."""


def sampling_key(params: SamplingParams) -> SamplingKey:
    return (0.0, 0, 1.0) if params.greedy else (params.temperature, params.top_k, params.top_p)


@dataclass(frozen=True)
class TreeShape:
    """What one captured step bakes in: tree nodes and the drafting's shape (the draft temperature
    is a device input, so the policy's adapted value needs no new graph)."""

    nodes: int
    width: int
    topk: int


PROB_SCALE = 10_000
"""A recorded node's draft probability travels in the int64 record as ``round(p * PROB_SCALE)``: the
4 decimals the host path records."""


@dataclass(frozen=True)
class ChainStep:
    """One step read back: the tokens it committed, its accepted nodes (in the device tree's
    best-first numbering) and the depth of its tree; with tree recording, every node's token, parent
    (-1 for the root) and draft probability."""

    tokens: list[int]
    path: list[int]
    tree_depth: int
    tree: tuple[list[int], list[int], list[float]] | None = None


TreeLogic = tuple[Callable[..., tuple[torch.Tensor, ...]], Callable[..., tuple[torch.Tensor, ...]]]


def tree_logic(layout: ExpansionLayout, count: int, depth: int, greedy: bool, compiled: bool,
               with_probs: bool = False) -> TreeLogic:
    """The step's tree choice and acceptance, as two functions of tensors (tuples in and out).

    ``compiled``: through ``torch.compile`` (inductor), which fuses their ~150 small pointwise,
    indexing and reduction kernels into a few; inside a CUDA graph each kernel costs its launch gap
    as well as its work. Only the bookkeeping is compiled: the target probabilities stay eager
    (``target_probs``, the one definition vanilla sampling uses). The chosen set and the greedy path
    are the same from either (tests/test_gpu.py compares them); the sampled walk's float64 masses may
    round differently in the last bit, which could move a decision only for a uniform within ~1e-16
    of its threshold. Compilation happens at the first (warm-up) call, per captured step.
    ``with_probs`` (tree recording): ``choose`` also returns each drafted node's own log-probability.
    """

    def choose(pending: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, parents: torch.Tensor,
               temperature: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cand = candidate_scores(logprobs, parents, layout, temperature)
        chosen = best_first(cand, count)
        t = device_tree(pending, tokens, cand, chosen, depth)
        if with_probs:  # nodes are numbered best first: node i + 1 is chosen[i]
            return t.tokens, t.parent, t.depth, t.ancestors, logprobs.reshape(-1)[chosen]
        return t.tokens, t.parent, t.depth, t.ancestors

    def accept(tree: tuple[torch.Tensor, ...], scores: torch.Tensor,
               uniforms: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        t = DeviceTree(*tree)
        a = accept_greedy(t, scores, depth) if greedy else accept_sampled(t, scores, uniforms, depth)
        return a.path, a.length, a.committed, a.bonus

    if not compiled:
        return choose, accept
    return (torch.compile(choose, fullgraph=True, dynamic=False),
            torch.compile(accept, fullgraph=True, dynamic=False))


def tree_step_body(model: Transformer, heads: StepDrafter, cache: KVCache,
                   drafter_cache: DrafterCache | None,
                   step: Callable[..., StepOutputs], ints: torch.Tensor, rows: torch.Tensor,
                   temperature: torch.Tensor, record: torch.Tensor, shape: TreeShape,
                   params: SamplingParams, draws: torch.Tensor, compiled: bool = False,
                   topk_chunk: int | None = None, record_trees: bool = False) -> Callable[[], torch.Tensor]:
    """The captured step. ``temperature`` (the drafts') is a float64 ``[1]``; ``record`` receives
    ``[length, tree depth, committed (D + 1), path (D + 1)]``, then with ``record_trees`` every node's
    token, parent and draft probability (``[N]`` each, the probability as ``round(p * PROB_SCALE)``);
    ``draws`` holds the uniforms when ``params`` sample, ``N`` per step; ``compiled``: ``tree_logic``'s;
    ``topk_chunk``: the drafting's top-k form (``HydraHeads.expand``)."""
    depth = heads.num_heads
    r = depth + 1
    layout = ExpansionLayout.of(depth, shape.width, shape.topk)
    count = min(shape.nodes - 1, layout.candidates)
    n = count + 1
    choose, accept = tree_logic(layout, count, depth, params.greedy, compiled, record_trees)

    def body() -> torch.Tensor:
        # Every constant is made inside the body, so that it lives in the graph's own memory: a
        # tensor made outside would be freed with the closure and its memory reused while the graph
        # still reads it.
        lanes = torch.arange(r, device=ints.device)
        pending, offset, start = ints[0], ints[1], ints[2]
        tokens, logprobs, parents = heads.draft_tree(model, rows, ints[INTS:INTS + r], start, ints[3:4],
                                                     shape.width, shape.topk, drafter_cache, topk_chunk)
        chosen_tree = choose(pending, tokens, logprobs, parents, temperature)
        tree = chosen_tree[:4]
        node_tokens, node_parent, node_depth, ancestors = tree
        out = step(node_tokens.view(1, -1), offset + node_depth, ancestors, offset, with_drafts=False)
        steps = ints[4:5]
        if params.greedy:
            path, length, committed, bonus = accept(tree, out.greedy, None)
        else:
            uniforms = draws.index_select(0, steps * n + torch.arange(n, device=ints.device))
            path, length, committed, bonus = accept(tree, target_probs(out.logits, params), uniforms)
        cache.move(offset + path, offset + lanes)
        rows.copy_(out.hidden.index_select(0, path))
        at = offset.reshape(1)
        ints.copy_(torch.cat([bonus, at + length, at, length - 1, steps + 1, committed]))
        parts = [length, node_depth.max().reshape(1), committed, path]
        if record_trees:
            root = torch.full((1,), PROB_SCALE, dtype=torch.long, device=ints.device)
            probs = (chosen_tree[4].double().exp() * PROB_SCALE).round().long()
            parts += [node_tokens, node_parent, torch.cat([root, probs])]
        record.copy_(torch.cat(parts))
        return record

    return body


class TreeChain:
    """One generation's tree steps, produced by self-feeding replays of a captured step.

    ``limit`` is the first cache slot no step may write. A step at offset o writes slots
    ``o .. o + nodes - 1`` and advances by at most ``depth + 1``, so a launch needs room for the
    worst case of every step still in flight. ``max_steps`` caps the launches (a sampled chain has
    uniforms for that many steps).
    """

    def __init__(self, graph: Any, ints: torch.Tensor, rows: torch.Tensor, record: torch.Tensor, *,
                 nodes: int, depth: int, offset: int, limit: int, max_steps: int | None = None,
                 lookahead: int = LOOKAHEAD, record_trees: bool = False) -> None:
        self._graph = graph
        self._ints = ints
        self._rows = rows
        self._record = record
        self.nodes = nodes  # the tree's size, root included
        self._depth = depth
        self._limit = limit
        self._offset = offset  # after the last step read
        self._record_trees = record_trees  # the record also holds the step's tree
        self._launches_left = max_steps
        cuda = record.device.type == "cuda"  # on the CPU (tests) each replay has finished when it returns
        self._slots = [torch.zeros_like(record, device="cpu") for _ in range(lookahead + 1)]
        if cuda:
            self._slots = [slot.pin_memory() for slot in self._slots]
        self._events = [torch.cuda.Event() if cuda else None for _ in range(lookahead + 1)]
        self._free = deque(range(lookahead + 1))
        self._inflight: deque[int] = deque()
        self._lookahead = lookahead

    def _fits(self, ahead: int) -> bool:
        if self._launches_left is not None and self._launches_left <= 0:
            return False
        return self._offset + ahead * (self._depth + 1) + self.nodes <= self._limit

    def next_step(self, wanted: int) -> ChainStep | None:
        """The next step's tokens, or None when no step fits the cache any more (then ``hand_back``).
        ``wanted`` (>= 1): tokens the caller may still take; every step yields at least one."""
        while (len(self._inflight) < min(wanted, self._lookahead + 1) and self._fits(len(self._inflight))):
            self._launch()
        if not self._inflight:
            return None
        slot = self._inflight.popleft()
        event = self._events[slot]
        if event is not None:
            event.synchronize()
        values = self._slots[slot].tolist()
        self._free.append(slot)
        d = self._depth + 1
        length = values[0]
        self._offset += length
        tree = None
        if self._record_trees:
            at, n = 2 + 2 * d, self.nodes
            parents = [-1] + values[at + n + 1:at + 2 * n]  # the device tree's root is its own parent
            tree = (values[at:at + n], parents, [p / PROB_SCALE for p in values[at + 2 * n:at + 3 * n]])
        return ChainStep(values[2:2 + length], values[2 + d:2 + d + length], values[1], tree)

    def hand_back(self) -> tuple[int, int, int, list[int], torch.Tensor]:
        """The host decoder's state after the last step read (no step may be in flight):
        pending token, offset, drafter rows' start, their tokens and their hidden states."""
        if self._inflight:
            raise RuntimeError("steps are still in flight")
        ints = self._ints.tolist()
        pending, offset, start, last = ints[:4]
        n = last + 1
        return pending, offset, start, ints[INTS:INTS + n], self._rows[:n].clone()

    def _launch(self) -> None:
        slot = self._free.popleft()
        if self._launches_left is not None:
            self._launches_left -= 1
        self._graph.replay()
        self._slots[slot].copy_(self._record, non_blocking=self._events[slot] is not None)
        event = self._events[slot]
        if event is not None:
            event.record()
        self._inflight.append(slot)


ChainGraphs = dict[tuple[TreeShape, SamplingKey, bool, int | None, bool], tuple[Any, tuple[Any, ...]]]
"""Captured steps by (tree shape, sampling setting, compiled tree logic, drafting's top-k chunk, tree
recording)."""


def start_tree_chain(runner: ForwardRunner, shape: TreeShape, pending: int, offset: int, rows: torch.Tensor,
                     row_tokens: list[int], row_start: int, draft_temperature: float, limit: int,
                     params: SamplingParams, draw: Callable[[int], torch.Tensor] | None = None,
                     max_tokens: int | None = None, max_graphs: int | None = MAX_CHAIN_GRAPHS,
                     record_trees: bool = False) -> TreeChain | None:
    """A chain from the host decoder's state: ``rows`` ``[n, H]`` (n <= heads + 1) written from slot
    ``row_start``, each paired with its entry of ``row_tokens``, the last one with ``pending``.

    ``runner.chain_graphs`` keeps one captured step (through ``runner.capture``) per (shape, sampling
    setting) with the buffers it reads (kept alive, so neither the allocator nor later captures reuse
    them); past ``max_graphs`` of them a new setting gets no chain. Capture happens on first use with
    the call's real state: warm-up runs two real steps, whose writes lie at or past ``offset`` except
    the drafter row at ``row_start``, which gets the value the first replay writes again; then the
    state is set back. ``draw(n)`` gives the
    generation's next ``n`` uniforms (float64) when sampling; it is called only once the chain is
    sure to start, for ``nodes`` uniforms a step and as many steps as tokens may still be taken
    (``max_tokens``, at most the cache's free slots): each step commits at least one. None where the
    runner captures no steps (or has them off), its heads draft inside the verify forward (there is no
    drafting after the bonus token to capture), or the cache cannot hold the first steps.
    ``record_trees``: the step also reads back its whole tree (a step captured of its own, so that a
    generation that does not record reads back nothing more).
    """
    heads, capture = runner.heads, runner.capture
    if heads is None or heads.fuses_drafts or capture is None or not runner.tree_chains:
        return None
    graphs: ChainGraphs = runner.chain_graphs
    depth = heads.num_heads
    r = depth + 1
    nodes = min(shape.nodes, ExpansionLayout.of(depth, shape.width, shape.topk).candidates + 1)
    # Warm-up and the first replays may advance up to three steps before the host reads one.
    limit = min(limit, runner.cache.max_len)
    if len(row_tokens) > r or offset + 3 * r + nodes > limit:
        return None
    compiled, chunk = runner.compile_tree_logic, runner.draft_topk_chunk
    key = (shape, sampling_key(params), compiled, chunk, record_trees)
    captured = graphs.get(key)
    if captured is None and max_graphs is not None and len(graphs) >= max_graphs:
        return None
    if not params.greedy and draw is None:
        raise ValueError("a sampled chain needs the generation's uniforms (draw)")
    dev = runner.device
    io = captured[1] if captured else (
        torch.zeros(INTS + r, dtype=torch.long, device=dev),
        torch.zeros(r, rows.shape[-1], dtype=rows.dtype, device=dev),
        torch.zeros(1, dtype=torch.float64, device=dev),
        torch.zeros(2 + 2 * r + (3 * nodes if record_trees else 0), dtype=torch.long, device=dev),
        # Every step commits a token, so no chain takes more steps than the cache has slots.
        torch.zeros(0 if params.greedy else runner.cache.max_len * nodes, dtype=torch.float64, device=dev))
    ints, buf, temperature, record, draws = io[:5]
    max_steps = None
    if not params.greedy:
        assert draw is not None
        max_steps = limit - offset if max_tokens is None else max(1, min(max_tokens, limit - offset))
        uniforms = draw(max_steps * nodes)
        draws[:uniforms.numel()].copy_(uniforms)
    n = len(row_tokens)
    state = torch.zeros(INTS + r, dtype=torch.long)
    state[:INTS] = torch.tensor([pending, offset, row_start, n - 1, 0])
    state[INTS:INTS + n] = torch.tensor(row_tokens)

    def reset() -> None:
        ints.copy_(state)
        buf.zero_()
        buf[:n].copy_(rows)
        temperature.fill_(draft_temperature)

    reset()
    if captured is None:
        body = tree_step_body(runner.model, heads, runner.cache, runner.drafter_cache, runner.step_outputs,
                              ints, buf, temperature, record, shape, params, draws, compiled, chunk,
                              record_trees)
        graph, _ = capture(body)
        captured = graphs[key] = (graph, io + (body,))  # the body too: whatever it holds stays alive
        reset()
    runner.tree_chains_started += 1
    return TreeChain(captured[0], ints, buf, record, nodes=nodes, depth=depth, offset=offset, limit=limit,
                     max_steps=max_steps, record_trees=record_trees)
