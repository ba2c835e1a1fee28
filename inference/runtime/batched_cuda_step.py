"""One decode token for each of many sequences in one forward on CUDA, one captured graph per batch bucket.

Why: on a GPU the one-sequence decode step is launch-bound (a 135M model's step is ~270 kernel
launches, replayed from a CUDA graph), so B sequences in one forward cost little more than one, and
aggregate tokens/s grows almost in proportion to B until the matmuls start to matter.

The forward is ``fused_forward`` (``runtime/fused.py``) with the batch made of *different
sequences*: row ``b`` is sequence ``slots[b]`` of a :class:`~elesium.inference.runtime.slot_pool.SlotPool`
at its own position ``offsets[b]``. Only two of its kernels see the rows as different sequences:

* ``rope_qkv_to_slots`` writes row ``b``'s key and value into pool row ``slots[b]`` at ``offsets[b]``;
* ``ragged_tree_attention`` reads, for row ``b``, pool row ``slots[b]``'s first ``offsets[b]`` positions
  and then the row's own key.

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
from collections.abc import Callable
from typing import Any, cast

import torch

from elesium.inference.runtime.cpu_step import window_for
from elesium.inference.runtime.forward import record_graph
from elesium.inference.runtime.model import Block, Transformer
from elesium.inference.runtime.slot_pool import SlotPool
from elesium.inference.runtime.step_outputs import StepOutputs
from elesium.kernels.fused_pointwise import add_rms_norm, rope_qkv_to_slots, swiglu
from elesium.kernels.ragged_attention import ragged_tree_attention

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Rows a captured graph holds; a batch takes the smallest bucket that fits it."""
PREFILL_ROWS = (1, 2, 4, 8)
"""Prompt blocks (of different sequences) a prefill graph holds: newcomers' prompts are prefilled together."""


def pool_forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor,
                 slots: torch.Tensor, node_seq: torch.Tensor, ancestors: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor) -> torch.Tensor:
    """``fused_forward`` for ``B`` sequences of a slot pool, ``N`` new tokens each; writes their keys, values.

    Args:
        tokens, positions: ``[B, N]``; row ``b``'s node ``i`` goes to pool slot ``slots[b]`` at position
            ``offsets[b] + i`` (``offsets``, ``slots``: ``[B]``).
        node_seq: ``[B * N]``, each node's row (``arange(B).repeat_interleave(N)``); ``ancestors``:
            ``[B * N, N]``, the nodes of its own row each node sees, by index within the row, itself
            included (a causal block for a prompt chunk, a tree's ancestor rows, ones for one token).
            Passed in so that a captured graph allocates neither.
        k_pool, v_pool: the pool's ``[slots, layers, 1, kv_heads, capacity, head_dim]`` tensors.

    Returns the final normed hidden states ``[B, N, hidden]``.
    """
    c = model.config
    b, n = tokens.shape
    hq, hkv, dim = c.num_heads, c.num_kv_heads, c.head_dim
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]  # [B, N, D]
    scale = 1.0 / math.sqrt(dim)
    layers = model.layers
    x = model.embed(tokens)
    normed = cast(Block, layers[0]).attn_norm(x)
    for i, module in enumerate(layers):
        layer = cast(Block, module)
        attn = layer.attn
        k_layer, v_layer = k_pool[:, i, 0], v_pool[:, i, 0]  # [slots, kv_heads, capacity, head_dim]
        # Queries laid out [B, N, Hq, D], so that the attention's [Hq, B * N, D] is a view of them.
        q = torch.empty((b, n, hq, dim), dtype=x.dtype, device=x.device)
        rope_qkv_to_slots(attn.wqkv(normed), cos, sin, k_layer, v_layer, slots, offsets, hq, hkv,
                          q_out=q.permute(0, 2, 1, 3))
        heads_out = torch.empty((b * n, hq, dim), dtype=x.dtype, device=x.device)  # the layout wo reads
        ragged_tree_attention(q.view(b * n, hq, dim).transpose(0, 1), k_layer, v_layer, slots, offsets,
                              node_seq, ancestors, scale, out=heads_out.transpose(0, 1))
        x, normed = add_rms_norm(x, attn.wo(heads_out.view(b, n, hq * dim)), layer.mlp_norm.weight,
                                 layer.mlp_norm.eps)
        following = cast(Block, layers[i + 1]).attn_norm if i + 1 < len(layers) else model.norm
        x, normed = add_rms_norm(x, layer.w2(swiglu(layer.w13(normed))), following.weight, following.eps)
    return normed


def batched_cuda_forward(model: Transformer, tokens: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor,
                         node_seq: torch.Tensor, ancestors: torch.Tensor, k_pool: torch.Tensor,
                         v_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per row (``tokens`` ``[B, 1]`` at positions ``offsets``), each row a different sequence
    of the pool (``pool_forward`` with ``N`` = 1, ``node_seq`` = ``arange(B)``, ``ancestors`` all True).

    Returns float32 logits ``[B, vocab]`` and their argmax ``[B]``.
    """
    normed = pool_forward(model, tokens, offsets[:, None], offsets, slots, node_seq, ancestors, k_pool,
                          v_pool)
    logits = model.logits(normed[:, 0])
    return logits, logits.argmax(-1)


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
      tokens fed back on the device (one graph per bucket of rows and number of steps).

    Unlike the CPU step it takes a batch of one as well. ``graphs=False`` runs the forwards eagerly (the
    reference in tests); so do batches past the largest bucket and node blocks that would write past
    the slot's end. Results are views of a graph's static outputs, valid until the next call.
    """

    def __init__(self, model: Transformer, pool: SlotPool, rows: int, graphs: bool = True,
                 node_buckets: tuple[int, ...] = (), block: int = 64, chain: int = 1) -> None:
        self.model = model
        self.pool = pool
        self.scratch = pool.slots - 1  # the batcher's slot that no generation holds
        self.graphs = graphs
        fits = next((b for b in BUCKETS if b >= rows), BUCKETS[-1])  # the smallest bucket for a full batch
        self.buckets = tuple(b for b in BUCKETS if b <= fits)
        self.node_buckets = tuple(sorted(set(node_buckets)))
        self.block = block  # the prefill's block (PREFILL_CHUNK): a block's bits do not depend on it
        self.max_prefill_blocks = PREFILL_ROWS[-1]
        self._rows: dict[int, _Captured] = {}
        self._nodes: dict[int, _Captured] = {}
        self._prefills: dict[int, _Captured] = {}
        self.chain = chain  # the steps of the greedy chains captured at warm-up (1: none)
        self._chains: dict[tuple[int, int], _Captured] = {}
        self._mempool: Any = None  # the graphs share one memory pool (torch.cuda.graph_pool_handle)
        dev = model.device
        self._node_seq = torch.arange(self.buckets[-1], device=dev)
        self._ones = torch.ones(self.buckets[-1], 1, dtype=torch.bool, device=dev)
        self._zeros = torch.zeros(max(self.node_buckets, default=1), dtype=torch.long, device=dev)

    def warm_up(self) -> None:
        """Capture every graph now (a generation's first step must not pay for it)."""
        self.pool.reserve(self.scratch, self.pool.max_len)
        for bucket in self.buckets:
            self._row_graph(bucket)
        for bucket in self.node_buckets:
            self._node_graph(bucket)
        for bucket in PREFILL_ROWS:
            self._prefill_graph(bucket)
        if self.chain > 1:
            for bucket in self.buckets:
                self._chain_graph(bucket, self.chain)

    @torch.inference_mode()
    def decode(self, tokens: list[int], offsets: list[int],
               slots: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Logits ``[B, vocab]`` and greedy tokens of one token per row (row ``b``: sequence ``slots[b]``
        at position ``offsets[b]``)."""
        b = len(tokens)
        if not b == len(offsets) == len(slots) or b < 1:
            raise ValueError(f"a batched step takes 1 or more rows of equal length, got {b}")
        pool = self.pool
        for slot, offset in zip(slots, offsets, strict=True):
            pool.reserve(slot, window_for(offset + 1, pool.max_len))  # finite values in every block read
        bucket = next((n for n in self.buckets if n >= b), None)
        if bucket is None or not self.graphs:
            dev = self.model.device
            ids = torch.tensor(tokens, device=dev)[:, None]
            at, rows = torch.tensor(offsets, device=dev), torch.tensor(slots, device=dev)
            one_node = torch.ones(b, 1, dtype=torch.bool, device=dev)
            logits, greedy = batched_cuda_forward(self.model, ids, at, rows, torch.arange(b, device=dev),
                                                  one_node, pool.k, pool.v)
            return logits, greedy.tolist()
        captured = self._row_graph(bucket)
        self._replay_rows(captured, tokens, offsets, slots)
        logits, greedy = captured.out
        return logits[:b], greedy[:b].tolist()

    def _replay_rows(self, captured: _Captured, tokens: list[int], offsets: list[int],
                     slots: list[int]) -> None:
        """Stage one row per sequence into a row or chain graph, replay it, and wait for it (with the GIL
        released: the consumers' threads run while the GPU works). Padding rows decode token 0 at position 0
        of the scratch slot."""
        b = len(tokens)
        staging = captured.free_staging()
        staging[0, :b] = torch.tensor(tokens)
        staging[1, :b] = torch.tensor(offsets)
        staging[2, :b] = torch.tensor(slots)
        staging[:, b:] = torch.tensor([[0], [0], [self.scratch]])
        captured.replay()
        torch.cuda.current_stream().synchronize()

    @torch.inference_mode()
    def decode_greedy(self, tokens: list[int], offsets: list[int], slots: list[int],
                      steps: int) -> list[list[int]]:
        """``steps`` greedy tokens for each row (row ``b``: sequence ``slots[b]``, its next input
        ``tokens[b]`` at position ``offsets[b]``), each step's argmax fed back on the device as the next
        step's input.

        Why: at 32 rows a step's GPU work (~1.37 ms) is less than the loop's host work around it: staging,
        the read-back, handing the rows their tokens, and the GIL taken back from 32 consumer threads
        (~2.0 ms a step in serving, BENCHMARKS §21c). Chained, the host does that once per ``steps``
        tokens. Exact: step ``j`` is ``decode``'s forward of the row's previous greedy token at
        ``offsets[b] + j``, and a row's result does not depend on the other rows, so the tokens are the
        ones ``steps`` calls of ``decode`` give. Every row needs room for ``steps`` positions.
        """
        b = len(tokens)
        if not b == len(offsets) == len(slots) or b < 1 or steps < 1:
            raise ValueError(f"a greedy chain takes 1 or more rows of equal length and 1 or more steps, got "
                             f"{b} rows and {steps} steps")
        pool = self.pool
        if max(offsets) + steps > pool.max_len:
            raise ValueError(f"a chain of {steps} steps from position {max(offsets)} ends past the slot's "
                             f"{pool.max_len} positions")
        for slot, offset in zip(slots, offsets, strict=True):
            pool.reserve(slot, window_for(offset + steps, pool.max_len))
        bucket = next((n for n in self.buckets if n >= b), None)
        if bucket is None or not self.graphs:
            inputs = torch.tensor([tokens, offsets, slots], device=self.model.device)
            return self._chain_body(inputs, b, steps)().tolist()  # type: ignore[no-any-return]
        captured = self._chain_graph(bucket, steps)
        self._replay_rows(captured, tokens, offsets, slots)
        picks: torch.Tensor = captured.out
        return picks[:b].tolist()  # type: ignore[no-any-return]

    def _chain_body(self, inputs: torch.Tensor, bucket: int, steps: int) -> Callable[[], torch.Tensor]:
        """``steps`` batched forwards, each fed the last one's argmax: greedy tokens ``[bucket, steps]``."""
        pool, model, dev = self.pool, self.model, self.model.device
        # Its own: the eager path may hold more rows than the largest bucket (a graph keeps them with body).
        node_seq, ones = torch.arange(bucket, device=dev), torch.ones(bucket, 1, dtype=torch.bool, device=dev)

        def body() -> torch.Tensor:
            tokens, at, slots = inputs[0][:, None], inputs[1], inputs[2]
            picks = []
            for _ in range(steps):
                _, greedy = batched_cuda_forward(model, tokens, at, slots, node_seq, ones, pool.k, pool.v)
                picks.append(greedy)
                tokens, at = greedy[:, None], at + 1
            return torch.stack(picks, 1)

        return body

    def _chain_graph(self, bucket: int, steps: int) -> _Captured:
        captured = self._chains.get((bucket, steps))
        if captured is None:
            staging = torch.zeros(3, bucket, dtype=torch.long).pin_memory()
            staging[2] = self.scratch
            inputs = staging.to(self.model.device)
            captured = self._chains[bucket, steps] = self._capture(staging, inputs,
                                                                   self._chain_body(inputs, bucket, steps))
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
    def prefill(self, blocks: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """Hidden states ``[n, hidden]`` of one prompt block per sequence, all in one forward: ``blocks``
        holds ``(slot, tokens, offset)``, at most ``block`` tokens each and ``fits_prefill(offset)``.

        Each row is a causal block of its own sequence after its first ``offset`` positions, exactly what
        the one-sequence prefill computes for that block (the same kernels, rows independent of each other
        and of the block's length). A short block's padding nodes come after its real ones, so no real
        node sees them; their keys land past the prompt and are overwritten by its later tokens.
        """
        if not 1 <= len(blocks) <= PREFILL_ROWS[-1]:
            raise ValueError(f"a batched prefill takes 1 to {PREFILL_ROWS[-1]} blocks, got {len(blocks)}")
        chunk, pool = self.block, self.pool
        for slot, tokens, offset in blocks:
            if not 1 <= len(tokens) <= chunk or not self.fits_prefill(offset):
                raise ValueError(f"a prefill block holds 1 to {chunk} tokens ending within the slot, got "
                                 f"{len(tokens)} from {offset}")
            pool.reserve(slot, window_for(offset + chunk, pool.max_len))
        b = len(blocks)
        bucket = next(m for m in PREFILL_ROWS if m >= b)
        if not self.graphs:
            dev = self.model.device
            staging = self._prefill_staging(blocks, b)
            inputs = staging.to(dev)
            hidden = self._prefill_body(inputs, b)()
        else:
            captured = self._prefill_graph(bucket)
            self._prefill_staging(blocks, bucket, captured.free_staging())
            captured.replay()
            hidden = captured.out
        return [hidden[i, :len(tokens)].clone() for i, (_, tokens, _) in enumerate(blocks)]

    def _prefill_staging(self, blocks: list[tuple[int, list[int], int]], bucket: int,
                         staging: torch.Tensor | None = None) -> torch.Tensor:
        """tokens ``[bucket, block]`` | positions ``[bucket, block]`` | offsets | slots, as one int tensor."""
        chunk = self.block
        if staging is None:
            staging = torch.zeros(2 * bucket * chunk + 2 * bucket, dtype=torch.long)
        tokens = staging[:bucket * chunk].view(bucket, chunk)
        positions = staging[bucket * chunk:2 * bucket * chunk].view(bucket, chunk)
        offsets, slots = staging[2 * bucket * chunk:].view(2, bucket)
        tokens.zero_()
        positions.copy_(torch.arange(chunk))  # padding rows: positions 0.. of the scratch slot
        offsets.zero_()
        slots.fill_(self.scratch)
        for i, (slot, ids, offset) in enumerate(blocks):
            tokens[i, :len(ids)] = torch.tensor(ids)
            positions[i] += offset
            offsets[i], slots[i] = offset, slot
        return staging

    def _prefill_body(self, inputs: torch.Tensor, bucket: int) -> Callable[[], torch.Tensor]:
        chunk, dev = self.block, self.model.device
        node_seq = torch.arange(bucket, device=dev).repeat_interleave(chunk)
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).tril().repeat(bucket, 1)
        tokens = inputs[:bucket * chunk].view(bucket, chunk)
        positions = inputs[bucket * chunk:2 * bucket * chunk].view(bucket, chunk)
        offsets, slots = inputs[2 * bucket * chunk:].view(2, bucket)
        pool = self.pool
        return lambda: pool_forward(self.model, tokens, positions, offsets, slots, node_seq, causal, pool.k,
                                    pool.v)

    def _prefill_graph(self, bucket: int) -> _Captured:
        captured = self._prefills.get(bucket)
        if captured is None:
            staging = self._prefill_staging([], bucket, torch.zeros(
                2 * bucket * self.block + 2 * bucket, dtype=torch.long).pin_memory())
            inputs = staging.to(self.model.device)
            body = self._prefill_body(inputs, bucket)
            captured = self._prefills[bucket] = self._capture(staging, inputs, body)
        return captured

    def _row_graph(self, bucket: int) -> _Captured:
        captured = self._rows.get(bucket)
        if captured is None:
            staging = torch.zeros(3, bucket, dtype=torch.long).pin_memory()
            staging[2] = self.scratch
            inputs = staging.to(self.model.device)
            node_seq, ones, pool = self._node_seq[:bucket], self._ones[:bucket], self.pool
            captured = self._rows[bucket] = self._capture(staging, inputs, lambda: batched_cuda_forward(
                self.model, inputs[0][:, None], inputs[1], inputs[2], node_seq, ones, pool.k, pool.v))
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
