"""One decode token for each of many sequences in one forward on CUDA, one captured graph per batch bucket.

Why: on a GPU the one-sequence decode step is launch-bound (a 135M model's step is ~270 kernel
launches, replayed from a CUDA graph), so B sequences in one forward cost little more than one, and
aggregate tokens/s grows almost in proportion to B until the matmuls start to matter.

The forward is ``fused_forward`` (``runtime/fused.py``) with the batch made of *different
sequences*: row ``b`` is sequence ``slots[b]`` of a :class:`~elesium.inference.runtime.slot_pool.SlotPool`
at its own position ``offsets[b]``. Only two of its kernels see the rows as different sequences:

* ``rope_qkv_to_slots`` writes row ``b``'s key and value into pool row ``slots[b]`` at ``offsets[b]``;
* ``ragged_tree_attention`` reads, for row ``b``, pool row ``slots[b]``'s first ``offsets[b]`` positions
  and then the row's own key (prompt blocks: ``ragged_causal_attention``, the same bits with a block's
  nodes sharing programs).

Both are the one-sequence kernels with other addresses (``tests/test_ragged_attention.py`` and the GPU
tests hold them to it bitwise), and every other kernel of the forward is one of the invariant numerics'
row-wise kernels (matmul, RMSNorm, SwiGLU): a row's logits are the bits the sequence's one-sequence
step computes alone, whatever the other rows are. That needs the pool's capacity to equal the
one-sequence cache's (the attention's split count follows the capacity), which the batcher's pool has.

Graphs: one per bucket of rows (1, 2, 4, ... up to the batcher's slots), captured at warm-up, so a
step is one replay whatever the mix of positions and slots (they are device tensors the graph
reads). A batch of B rows replays the smallest bucket >= B; its padding rows decode token 0 at
position 0 of the pool's scratch slot, which no generation holds, and are sliced off.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from elesium.inference.runtime.cpu_step import window_for
from elesium.inference.runtime.forward import record_graph
from elesium.inference.runtime.model import Block, Transformer
from elesium.inference.runtime.slot_pool import SlotPool
from elesium.inference.runtime.step_outputs import StepOutputs
from elesium.kernels.fused_pointwise import add_rms_norm, rope_qkv_to_slots, swiglu
from elesium.kernels.ragged_attention import ragged_causal_attention, ragged_tree_attention

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Rows a captured graph holds; a batch takes the smallest bucket that fits it."""
PromptBlock = tuple[int, list[int], int]
"""A block of a prompt to prefill: (its pool slot, its tokens, the position of its first token)."""
PREFILL_ROWS = (1, 2, 4, 8)
"""Prompt blocks (of different sequences) a prefill graph holds: newcomers' prompts are prefilled together."""


class Group(NamedTuple):
    """Rows of one shape in a pool forward: ``tokens`` and ``positions`` ``[B, N]``; row ``b``'s node ``i``
    goes to pool slot ``slots[b]`` at position ``offsets[b] + i`` (``offsets``, ``slots``: ``[B]``).
    ``node_seq``: ``[B * N]``, each node's row (``arange(B).repeat_interleave(N)``); ``ancestors``:
    ``[B * N, N]``, the nodes of its own row each node sees, by index within the row, itself included (a
    causal block for a prompt chunk, a tree's ancestor rows, ones for one token). Passed in so that a
    captured graph allocates neither. ``causal``: every row is a causal block (prompt blocks), so the
    attention is ``ragged_causal_attention`` (the same bits in a fifth of the programs) and ``ancestors``
    is not read."""

    tokens: torch.Tensor
    positions: torch.Tensor
    offsets: torch.Tensor
    slots: torch.Tensor
    node_seq: torch.Tensor
    ancestors: torch.Tensor
    causal: bool = False


def pool_forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor,
                 slots: torch.Tensor, node_seq: torch.Tensor, ancestors: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor) -> torch.Tensor:
    """``fused_forward`` for ``B`` sequences of a slot pool, ``N`` new tokens each (one :class:`Group`);
    writes their keys and values into ``k_pool``, ``v_pool`` (``[slots, layers, 1, kv_heads, capacity,
    head_dim]``). Returns the final normed hidden states ``[B, N, hidden]``."""
    group = Group(tokens, positions, offsets, slots, node_seq, ancestors)
    return pool_forward_groups(model, [group], k_pool, v_pool)[0]


def pool_forward_groups(model: Transformer, groups: list[Group], k_pool: torch.Tensor,
                        v_pool: torch.Tensor) -> list[torch.Tensor]:
    """One forward over several :class:`Group` s of rows (decode rows of one token and prompt blocks of a
    chunk, say): every matmul, norm and SwiGLU runs once over all their tokens, and only the two kernels that
    see rows as sequences (the RoPE + cache write, the attention) run once per group.

    Why: on a GPU a forward costs its ~270 launches more than its arithmetic, so prompt blocks riding on a
    decode step cost little more than the step, where a prefill forward of their own costs a whole one.
    Exact: those kernels are row-wise (the matmul is M-invariant), so a row's bits do not depend on what
    else is in the forward; and each layer writes every group's keys before any group attends, so a later
    block of a prompt sees an earlier block of the same forward (as in one group).

    Returns each group's final normed hidden states ``[B, N, hidden]``.
    """
    c = model.config
    hq, hkv, dim = c.num_heads, c.num_kv_heads, c.head_dim
    scale = 1.0 / math.sqrt(dim)
    spans: list[tuple[int, int, int, int]] = []  # each group's (first token, tokens, B, N)
    total = 0
    for g in groups:
        b, n = g.tokens.shape
        spans.append((total, b * n, b, n))
        total += b * n
    tables = [(model.rope_cos[g.positions], model.rope_sin[g.positions]) for g in groups]  # [B, N, D] each
    embedded = [model.embed(g.tokens).view(g.tokens.numel(), c.hidden_size) for g in groups]
    x = embedded[0] if len(embedded) == 1 else torch.cat(embedded)
    layers = model.layers
    normed = cast(Block, layers[0]).attn_norm(x)
    for i, module in enumerate(layers):
        layer = cast(Block, module)
        attn = layer.attn
        k_layer, v_layer = k_pool[:, i, 0], v_pool[:, i, 0]  # [slots, kv_heads, capacity, head_dim]
        qkv = attn.wqkv(normed)
        # Queries laid out [T, Hq, D], so that a group's [Hq, B * N, D] for the attention is a view of them.
        q = torch.empty((total, hq, dim), dtype=x.dtype, device=x.device)
        heads_out = torch.empty((total, hq, dim), dtype=x.dtype, device=x.device)  # the layout wo reads
        for g, (first, size, b, n), (cos, sin) in zip(groups, spans, tables, strict=True):
            rows = slice(first, first + size)
            rope_qkv_to_slots(qkv[rows].view(b, n, -1), cos, sin, k_layer, v_layer, g.slots, g.offsets, hq,
                              hkv, q_out=q[rows].view(b, n, hq, dim).permute(0, 2, 1, 3))
        for g, (first, size, _, _) in zip(groups, spans, strict=True):
            rows = slice(first, first + size)
            if g.causal:
                ragged_causal_attention(q[rows].transpose(0, 1), k_layer, v_layer, g.slots, g.offsets, scale,
                                        out=heads_out[rows].transpose(0, 1))
            else:
                ragged_tree_attention(q[rows].transpose(0, 1), k_layer, v_layer, g.slots, g.offsets,
                                      g.node_seq, g.ancestors, scale, out=heads_out[rows].transpose(0, 1))
        x, normed = add_rms_norm(x, attn.wo(heads_out.view(total, hq * dim)), layer.mlp_norm.weight,
                                 layer.mlp_norm.eps)
        following = cast(Block, layers[i + 1]).attn_norm if i + 1 < len(layers) else model.norm
        x, normed = add_rms_norm(x, layer.w2(swiglu(layer.w13(normed))), following.weight, following.eps)
    return [normed[first:first + size].view(b, n, -1) for first, size, b, n in spans]


def slot_forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, offset: torch.Tensor,
                 slot: torch.Tensor, node_seq: torch.Tensor, ancestors: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor) -> StepOutputs:
    """One sequence's step of ``N`` nodes (a prompt chunk or a tree: ``tokens``, ``positions`` ``[N]``,
    ``ancestors`` ``[N, N]``) in pool slot ``slot`` from position ``offset`` (both ``[1]``): the one-sequence
    step (``ForwardRunner.step_outputs`` without drafts) on a pool slot."""
    hidden = pool_forward(model, tokens[None], positions[None], offset, slot, node_seq, ancestors, k_pool,
                          v_pool)[0]
    logits = model.logits(hidden)
    return StepOutputs(hidden, logits, logits.argmax(-1))


class Decoded(NamedTuple):
    """What ``BatchedCudaStep.decode_rows`` returns."""

    logits: torch.Tensor | None
    """A single step's float32 logits ``[B, vocab]`` (a view of the graph's output); None for a chain."""
    picks: list[list[int]]
    """Each row's greedy tokens, one per step."""
    hidden: list[torch.Tensor]
    """Each prompt block's hidden states ``[n, hidden]``, in the order given."""


_Outputs = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]
"""A decode forward's float32 logits (one step; None for a chain), greedy tokens, and prompt blocks' hidden
states (None without blocks)."""


class _Captured:
    """One graph and the static tensors it reads (``inputs``, filled from ``staging`` before each replay)
    and writes (``out``)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, staging: torch.Tensor, inputs: torch.Tensor,
                 out: Any, body: Callable[[], Any]) -> None:
        self.graph = graph
        self.staging = staging  # pinned host memory, so the copy to ``inputs`` is asynchronous
        self.inputs = inputs
        self.out = out
        # The captured function, kept with the graph: the constant tensors it closes over (a prefill's
        # causal block, its node-to-row map) are read by every replay and must never be freed.
        self.body = body
        self._copied: torch.cuda.Event | None = None  # the last replay's copy of ``staging``

    def free_staging(self) -> torch.Tensor:
        """``staging``, once the last replay's copy has read it: the copy runs asynchronously, in stream
        order, so two calls with no read-back between them (a long prompt's blocks, one after another)
        would otherwise overwrite inputs the first replay had not copied yet."""
        if self._copied is not None:
            self._copied.synchronize()
        return self.staging

    def replay(self) -> None:
        self.inputs.copy_(self.staging, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
        self.graph.replay()


class BatchedCudaStep:
    """The pool's forwards on CUDA, replayed from captured graphs.

    * ``decode``: one token for each of ``B`` sequences, one graph per bucket of rows (``BUCKETS``);
    * ``nodes``: ``N`` nodes of one sequence (a prompt chunk, a tree), one graph per bucket of nodes
      (``node_buckets``, the engine's tree buckets): the one-sequence step's graphs are bound to the
      engine's own cache, so a generation's prefill and tree steps on its pool slot come here;
    * ``prefill``: one prompt block each of up to 8 sequences (``PREFILL_ROWS``), so that newcomers
      arriving together are prefilled in one forward rather than one after another;
    * ``decode_greedy``: ``steps`` greedy tokens for each of ``B`` sequences in one replay, each step's
      tokens fed back on the device;
    * ``decode_rows``: either of the two, with up to 8 prompt blocks riding in its (first) forward. Its
      graphs are keyed by bucket of rows, steps (1 and ``chain``) and bucket of blocks (none and
      ``PREFILL_ROWS``; warm-up captures the ones with blocks only with ``fold``, off as the batcher's
      ``fold_prefill`` is: the others are captured at their first use).

    Unlike the CPU step it takes a batch of one as well. ``graphs=False`` runs the forwards eagerly (the
    reference in tests); so do batches past the largest bucket and node blocks that would write past
    the slot's end. Results are views of a graph's static outputs, valid until the next call.
    """

    def __init__(self, model: Transformer, pool: SlotPool, rows: int, graphs: bool = True,
                 node_buckets: tuple[int, ...] = (), block: int = 64, chain: int = 1,
                 fold: bool = False) -> None:
        self.model = model
        self.pool = pool
        self.scratch = pool.slots - 1  # the batcher's slot that no generation holds
        self.graphs = graphs
        fits = next((b for b in BUCKETS if b >= rows), BUCKETS[-1])  # the smallest bucket for a full batch
        self.buckets = tuple(b for b in BUCKETS if b <= fits)
        self.node_buckets = tuple(sorted(set(node_buckets)))
        self.block = block  # the prefill's block (PREFILL_CHUNK): a block's bits do not depend on it
        self.max_prefill_blocks = PREFILL_ROWS[-1]
        self._nodes: dict[int, _Captured] = {}
        self._prefills: dict[int, _Captured] = {}
        self.chain = chain  # the steps of the greedy chains captured at warm-up (1: none)
        self.fold = fold  # whether warm-up captures the decode graphs that carry prompt blocks
        self._decodes: dict[tuple[int, int, int], _Captured] = {}  # (rows, steps, blocks)
        self._mempool: Any = None  # the graphs share one memory pool (torch.cuda.graph_pool_handle)
        self._zeros = torch.zeros(max(self.node_buckets, default=1), dtype=torch.long, device=model.device)
        # Host seconds inside ``prefill`` (benchmarks: the serving loop spends ~3 ms of host time per newcomer
        # in its prefill forwards, BENCHMARKS §27): waiting for the staging buffer, filling it, replaying.
        self.prefill_host_s: dict[str, float] = dict.fromkeys(("wait", "stage", "replay", "outputs"), 0.0)
        self.prefill_forwards = 0
        # Called once a decode step is running on the device, before the read-back waits for it: the
        # batcher wakes its consumers there, so their Python runs while the GPU works (``defer_wakes``).
        self.on_launch: Callable[[], None] | None = None
        self._unread = False  # a chain launched by ``launch_greedy`` whose tokens were not read back yet

    def warm_up(self) -> None:
        """Capture every graph now (a generation's first step must not pay for it)."""
        self.pool.reserve(self.scratch, self.pool.max_len)
        for bucket in self.node_buckets:
            self._node_graph(bucket)
        for bucket in PREFILL_ROWS:
            self._prefill_graph(bucket)
        for held in (0, *PREFILL_ROWS) if self.fold else (0,):
            for steps in sorted({1, self.chain}):
                for bucket in self.buckets:
                    self._decode_graph(bucket, steps, held)

    @torch.inference_mode()
    def decode(self, tokens: list[int], offsets: list[int],
               slots: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Logits ``[B, vocab]`` and greedy tokens of one token per row (row ``b``: sequence ``slots[b]``
        at position ``offsets[b]``)."""
        out = self.decode_rows(tokens, offsets, slots)
        assert out.logits is not None
        return out.logits, [picks[0] for picks in out.picks]

    def decode_greedy(self, tokens: list[int], offsets: list[int], slots: list[int],
                      steps: int) -> list[list[int]]:
        """``steps`` greedy tokens for each row (``decode_rows`` with no prompt blocks)."""
        return self.decode_rows(tokens, offsets, slots, steps).picks

    @torch.inference_mode()
    def decode_rows(self, tokens: list[int], offsets: list[int], slots: list[int], steps: int = 1,
                    blocks: Sequence[PromptBlock] = ()) -> Decoded:
        """``steps`` decode steps of one token per row (row ``b``: sequence ``slots[b]``, its next input
        ``tokens[b]`` at position ``offsets[b]``) in one replay, each step's argmax fed back on the device as
        the next step's input; ``blocks`` (``(slot, tokens, offset)``, as ``prefill`` takes them) ride in the
        first step's forward (``pool_forward_groups``).

        Why chains: at 32 rows a step's GPU work (~1.37 ms) is less than the loop's host work around it:
        staging, the read-back, handing the rows their tokens, and the GIL taken back from 32 consumer
        threads (~2.0 ms a step in serving, BENCHMARKS §21c). Chained, the host does that once per ``steps``
        tokens. Why blocks: a prefill forward of its own costs about a decode step's launches (BENCHMARKS
        §23: prefill was 37 % of the wall at 32 concurrent), so riding on a step a block was to cost its
        arithmetic only. Measured (§25), it costs as much either way; the batcher's fold is off by default.

        Exact: step ``j`` is ``decode``'s forward of the row's previous greedy token at ``offsets[b] + j``,
        a block is ``prefill``'s block, and a row's result depends neither on the other rows nor on the
        blocks beside it, so the tokens and hidden states are those of ``steps`` calls of ``decode`` and one
        of ``prefill``. Every row needs room for ``steps`` positions.
        """
        b = len(tokens)
        logits, picks, hidden = self._launch(tokens, offsets, slots, steps, blocks)
        self._wait()  # the GIL released while it waits: consumers run
        picked: list[list[int]] = picks[:b].tolist()  # one read-back for every row and step
        prompts = [] if hidden is None else [hidden[i, :len(blk[1])].clone() for i, blk in enumerate(blocks)]
        return Decoded(None if logits is None else logits[:b], picked, prompts)

    @torch.inference_mode()
    def launch_greedy(self, tokens: list[int], offsets: list[int], slots: list[int],
                      steps: int) -> Callable[[], list[list[int]]]:
        """``decode_greedy`` without waiting for it: the chain is launched, and the returned function waits
        for it and reads its tokens back (call it once, before this step launches anything else).

        Why: the loop hands the last chain's tokens to their rows (~1 ms of host work at 32 rows) while
        this one runs on the GPU, instead of with the GPU idle between two chains (``Batcher.overlap``)."""
        b = len(tokens)
        _, picks, _ = self._launch(tokens, offsets, slots, steps, ())
        self._unread = True

        def collect() -> list[list[int]]:
            self._wait()  # the GIL released while it waits
            self._unread = False
            return cast("list[list[int]]", picks[:b].tolist())

        return collect

    def _wait(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def _launch(self, tokens: list[int], offsets: list[int], slots: list[int], steps: int,
                blocks: Sequence[PromptBlock]) -> _Outputs:
        """Stage and launch ``decode_rows``' forwards; return their outputs, not yet computed (a graph's are
        its static tensors, valid until its next replay)."""
        b = len(tokens)
        if not b == len(offsets) == len(slots) or b < 1 or steps < 1:
            raise ValueError(f"a batched step takes 1 or more rows of equal length and 1 or more steps, got "
                             f"{b} rows and {steps} steps")
        if self._unread:
            raise RuntimeError("a chain launched by launch_greedy was not read back before the next launch")
        pool = self.pool
        if max(offsets) + steps > pool.max_len:
            raise ValueError(f"a chain of {steps} steps from position {max(offsets)} ends past the slot's "
                             f"{pool.max_len} positions")
        self._reserve_blocks(blocks, allow_none=True)
        if set(slots) & {slot for slot, _, _ in blocks}:
            raise ValueError("a prompt block's slot is also a decoding row's")
        for slot, offset in zip(slots, offsets, strict=True):
            pool.reserve(slot, window_for(offset + steps, pool.max_len))  # finite values in every block read
        bucket = next((n for n in self.buckets if n >= b), None)
        held = next(m for m in (0, *PREFILL_ROWS) if m >= len(blocks))
        if bucket is None or not self.graphs:
            staging = torch.zeros(3 * b + self._prefill_size(len(blocks)), dtype=torch.long)
            self._stage_rows(staging, b, len(blocks), tokens, offsets, slots, blocks)
            outputs = self._rows_body(staging.to(self.model.device), b, steps, len(blocks))()
            self._launched()
            return outputs
        captured = self._decode_graph(bucket, steps, held)
        self._stage_rows(captured.free_staging(), bucket, held, tokens, offsets, slots, blocks)
        captured.replay()
        self._launched()
        return cast("_Outputs", captured.out)

    def _launched(self) -> None:
        if self.on_launch is not None:
            self.on_launch()

    def _stage_rows(self, staging: torch.Tensor, bucket: int, held: int, tokens: list[int],
                    offsets: list[int], slots: list[int], blocks: Sequence[PromptBlock]) -> None:
        """Fill a decode graph's inputs: tokens | offsets | slots ``[3, bucket]``, then ``held`` prompt
        blocks' (``_prefill_staging``). Padding rows decode token 0 at position 0 of the scratch slot."""
        b = len(tokens)
        rows = staging.numpy()[:3 * bucket].reshape(3, bucket)  # numpy: see _prefill_staging
        rows[0, :b], rows[1, :b], rows[2, :b] = tokens, offsets, slots
        rows[0, b:], rows[1, b:], rows[2, b:] = 0, 0, self.scratch
        if held:
            self._prefill_staging(blocks, held, staging[3 * bucket:])

    def _rows_body(self, inputs: torch.Tensor, bucket: int, steps: int,
                   held: int) -> Callable[[], tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]]:
        """``steps`` batched forwards, each fed the last one's argmax, the first carrying ``held`` prompt
        blocks: (the single step's float32 logits ``[bucket, vocab]`` or None for a chain, greedy tokens
        ``[bucket, steps]``, the blocks' hidden states ``[held, block, hidden]`` or None)."""
        pool, model, dev = self.pool, self.model, self.model.device
        rows = inputs[:3 * bucket].view(3, bucket)
        # Its own: the eager path may hold more rows than the largest bucket (a graph keeps them with body).
        node_seq, ones = torch.arange(bucket, device=dev), torch.ones(bucket, 1, dtype=torch.bool, device=dev)
        prompt = self._prefill_group(inputs[3 * bucket:], held) if held else None

        def body() -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
            tokens, at, slots = rows[0][:, None], rows[1], rows[2]
            picks, hidden = [], None
            for step in range(steps):
                groups = [Group(tokens, at[:, None], at, slots, node_seq, ones)]
                if step == 0 and prompt is not None:
                    groups.append(prompt)
                normed = pool_forward_groups(model, groups, pool.k, pool.v)
                logits = model.logits(normed[0][:, 0])
                greedy = logits.argmax(-1)
                if len(normed) > 1:
                    hidden = normed[1]
                picks.append(greedy)
                tokens, at = greedy[:, None], at + 1
            return (logits if steps == 1 else None), torch.stack(picks, 1), hidden

        return body

    def _decode_graph(self, bucket: int, steps: int, held: int) -> _Captured:
        captured = self._decodes.get((bucket, steps, held))
        if captured is None:
            staging = torch.zeros(3 * bucket + self._prefill_size(held), dtype=torch.long).pin_memory()
            self._stage_rows(staging, bucket, held, [], [], [], ())
            inputs = staging.to(self.model.device)
            captured = self._decodes[bucket, steps, held] = self._capture(
                staging, inputs, self._rows_body(inputs, bucket, steps, held))
        return captured

    @torch.inference_mode()
    def nodes(self, tokens: list[int], positions: list[int], offset: int, ancestors: torch.Tensor | None,
              slot: int) -> StepOutputs:
        """``ForwardRunner.decode``'s step (no drafts) for the sequence in pool slot ``slot``: nodes
        ``tokens`` at ``positions``, written from position ``offset``, each seeing its ``ancestors``
        (``[N, N]`` bool; None: causal)."""
        n = len(tokens)
        pool = self.pool
        rows = ancestors.cpu() if ancestors is not None else torch.ones(n, n, dtype=torch.bool).tril()
        bucket = next((m for m in self.node_buckets if m >= n), None)
        if bucket is None or offset + bucket > pool.max_len or not self.graphs:
            pool.reserve(slot, window_for(offset + n, pool.max_len))
            dev = self.model.device
            return slot_forward(self.model, torch.tensor(tokens, device=dev),
                                torch.tensor(positions, device=dev), torch.tensor([offset], device=dev),
                                torch.tensor([slot], device=dev),
                                torch.zeros(n, dtype=torch.long, device=dev), rows.to(dev), pool.k, pool.v)
        pool.reserve(slot, window_for(offset + bucket, pool.max_len))  # padding nodes write up to here
        captured = self._node_graph(bucket)
        staging = captured.free_staging()
        staging.zero_()
        staging[:n] = torch.tensor(tokens)
        staging[bucket:bucket + n] = torch.tensor(positions)
        staging[2 * bucket], staging[2 * bucket + 1] = offset, slot
        grid = staging[2 * bucket + 2:].view(bucket, bucket)
        grid.diagonal().fill_(1)  # padding nodes see only themselves, and write past the real ones
        grid[:n, :n] = rows
        captured.replay()
        out: StepOutputs = captured.out
        return StepOutputs(out.hidden[:n], out.logits[:n], out.greedy[:n])

    def fits_prefill(self, offset: int) -> bool:
        """Whether a block from ``offset`` can take ``prefill`` (its padding nodes write a whole block)."""
        return offset + self.block <= self.pool.max_len

    @torch.inference_mode()
    def prefill(self, blocks: list[PromptBlock]) -> list[torch.Tensor]:
        """Hidden states ``[n, hidden]`` of one prompt block per sequence, all in one forward: ``blocks``
        holds ``(slot, tokens, offset)``, at most ``block`` tokens each and ``fits_prefill(offset)``.

        Each row is a causal block of its own sequence after its first ``offset`` positions, exactly what
        the one-sequence prefill computes for that block (the same kernels, rows independent of each other
        and of the block's length). A short block's padding nodes come after its real ones, so no real
        node sees them; their keys land past the prompt and are overwritten by its later tokens.
        """
        self._reserve_blocks(blocks)
        b = len(blocks)
        bucket = next(m for m in PREFILL_ROWS if m >= b)
        if not self.graphs:
            staging = torch.zeros(self._prefill_size(b), dtype=torch.long)
            self._prefill_staging(blocks, b, staging)
            hidden = self._prefill_body(staging.to(self.model.device), b)()
        else:
            times = self.prefill_host_s
            t0 = time.perf_counter()
            captured = self._prefill_graph(bucket)
            staging = captured.free_staging()
            t1 = time.perf_counter()
            self._prefill_staging(blocks, bucket, staging)
            t2 = time.perf_counter()
            captured.replay()
            t3 = time.perf_counter()
            hidden = captured.out
            times["wait"] += t1 - t0
            times["stage"] += t2 - t1
            times["replay"] += t3 - t2
        self.prefill_forwards += 1
        t4 = time.perf_counter()
        out = [hidden[i, :len(tokens)].clone() for i, (_, tokens, _) in enumerate(blocks)]
        self.prefill_host_s["outputs"] += time.perf_counter() - t4
        return out

    def _reserve_blocks(self, blocks: Sequence[PromptBlock], allow_none: bool = False) -> None:
        """Refuse blocks ``prefill`` cannot take; reserve the positions their padding writes."""
        if not (0 if allow_none else 1) <= len(blocks) <= PREFILL_ROWS[-1]:
            raise ValueError(f"a batched prefill takes 1 to {PREFILL_ROWS[-1]} blocks, got {len(blocks)}")
        chunk, pool = self.block, self.pool
        for slot, tokens, offset in blocks:
            if not 1 <= len(tokens) <= chunk or not self.fits_prefill(offset):
                raise ValueError(f"a prefill block holds 1 to {chunk} tokens ending within the slot, got "
                                 f"{len(tokens)} from {offset}")
            pool.reserve(slot, window_for(offset + chunk, pool.max_len))

    def _prefill_size(self, bucket: int) -> int:
        return 2 * bucket * self.block + 2 * bucket

    def _prefill_staging(self, blocks: Sequence[PromptBlock], bucket: int,
                         staging: torch.Tensor) -> None:
        """tokens ``[bucket, block]`` | positions ``[bucket, block]`` | offsets | slots, as one int tensor;
        padding rows are positions 0.. of the scratch slot.

        Written through a numpy view of the host buffer, not with torch ops: each torch op releases the GIL
        and must take it back from the consumer threads, which at 32 concurrent cost ~4 ms per staging of
        ~20 small ops (BENCHMARKS §28c); numpy's small writes keep it."""
        chunk = self.block
        host = staging.numpy()
        tokens = host[:bucket * chunk].reshape(bucket, chunk)
        positions = host[bucket * chunk:2 * bucket * chunk].reshape(bucket, chunk)
        offsets, slots = host[2 * bucket * chunk:].reshape(2, bucket)
        tokens[:] = 0
        positions[:] = np.arange(chunk)
        offsets[:] = 0
        slots[:] = self.scratch
        for i, (slot, ids, offset) in enumerate(blocks):
            tokens[i, :len(ids)] = ids
            positions[i] += offset
            offsets[i], slots[i] = offset, slot

    def _prefill_group(self, inputs: torch.Tensor, bucket: int) -> Group:
        """The :class:`Group` of ``bucket`` prompt blocks staged in ``inputs`` (``_prefill_staging``)."""
        chunk, dev = self.block, self.model.device
        tokens = inputs[:bucket * chunk].view(bucket, chunk)
        positions = inputs[bucket * chunk:2 * bucket * chunk].view(bucket, chunk)
        offsets, slots = inputs[2 * bucket * chunk:].view(2, bucket)
        node_seq = torch.arange(bucket, device=dev).repeat_interleave(chunk)
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).tril().repeat(bucket, 1)
        return Group(tokens, positions, offsets, slots, node_seq, causal, causal=True)

    def _prefill_body(self, inputs: torch.Tensor, bucket: int) -> Callable[[], torch.Tensor]:
        group, pool = self._prefill_group(inputs, bucket), self.pool
        return lambda: pool_forward_groups(self.model, [group], pool.k, pool.v)[0]

    def _prefill_graph(self, bucket: int) -> _Captured:
        captured = self._prefills.get(bucket)
        if captured is None:
            staging = torch.zeros(self._prefill_size(bucket), dtype=torch.long).pin_memory()
            self._prefill_staging([], bucket, staging)
            inputs = staging.to(self.model.device)
            body = self._prefill_body(inputs, bucket)
            captured = self._prefills[bucket] = self._capture(staging, inputs, body)
        return captured

    def _node_graph(self, bucket: int) -> _Captured:
        captured = self._nodes.get(bucket)
        if captured is None:
            # tokens | positions | offset | slot | the [bucket, bucket] ancestor grid, as integers
            staging = torch.zeros(2 * bucket + 2 + bucket * bucket, dtype=torch.long).pin_memory()
            staging[2 * bucket + 1] = self.scratch
            staging[2 * bucket + 2:].view(bucket, bucket).diagonal().fill_(1)
            inputs = staging.to(self.model.device)
            node_seq, pool = self._zeros[:bucket], self.pool
            grid = inputs[2 * bucket + 2:].view(bucket, bucket)
            captured = self._nodes[bucket] = self._capture(staging, inputs, lambda: slot_forward(
                self.model, inputs[:bucket], inputs[bucket:2 * bucket], inputs[2 * bucket:2 * bucket + 1],
                inputs[2 * bucket + 1:2 * bucket + 2], node_seq, grid.bool(), pool.k, pool.v))
        return captured

    @torch.inference_mode()
    def _capture(self, staging: torch.Tensor, inputs: torch.Tensor, body: Callable[[], Any]) -> _Captured:
        graph, out, self._mempool = record_graph(body, self._mempool)
        return _Captured(graph, staging, inputs, out, body)
