"""The batched CUDA decode step (``inference/runtime/batched_cuda_step.py``) in Triton's interpreter.

On the CPU its Triton kernels run interpreted and its matmuls are torch's (the invariant matmul is
CUDA-only), so these tests check the indexing: each row reads and writes its own pool slot at its own
position, its result is its sequence's one-sequence forward (``fused_forward`` on a cache of its own),
and nothing else in the pool moves. The bitwise property in bf16 with compiled kernels, through the
batcher, is ``tests/test_gpu.py::test_batched_cuda_serving_gives_solo_tokens``.
TRITON_INTERPRET must be set before Triton is imported, hence the top of the file.
"""

from __future__ import annotations

import os
import sys

_TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from elesium.inference.runtime.config import ModelConfig  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _interpreted() -> None:
    if _TRITON_IMPORTED_TOO_EARLY:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_qkv_to_slots_writes_each_row_into_its_own_slot(dtype: torch.dtype) -> None:
    """Row b's key and value land in pool slot slots[b] at offsets[b] and nowhere else; its queries and
    cache entries are bitwise what rope_qkv_to_cache gives the row alone in a cache of its own."""
    from elesium.inference.runtime.model import rope_tables
    from elesium.kernels.fused_pointwise import (
        rope_qkv_to_cache,
        rope_qkv_to_slots,
        rope_qkv_to_slots_reference,
    )

    g = torch.Generator().manual_seed(11)
    b, hq, hkv, d, cap, pool_slots = 4, 3, 1, 64, 40, 6
    config = ModelConfig(vocab_size=8, hidden_size=hq * d, intermediate_size=8, num_layers=1, num_heads=hq,
                         num_kv_heads=hkv, head_dim=d, max_position_embeddings=64)
    cos_t, sin_t = rope_tables(config, 64)
    slots, offsets = torch.tensor([4, 0, 5, 2]), torch.tensor([0, 39, 17, 3])
    qkv = torch.randn(b, 1, (hq + 2 * hkv) * d, generator=g).to(dtype)
    cos, sin = cos_t[offsets][:, None], sin_t[offsets][:, None]
    pools = [torch.randn(pool_slots, hkv, cap, d, generator=g).to(dtype) for _ in range(2)]
    ours, ref = [p.clone() for p in pools], [p.clone() for p in pools]
    q = rope_qkv_to_slots(qkv, cos, sin, *ours, slots, offsets, hq, hkv)
    q_ref = rope_qkv_to_slots_reference(qkv, cos, sin, *ref, slots, offsets, hq, hkv)
    assert q.shape == (b, hq, 1, d) and rel_err(q, q_ref) < TOL[dtype]
    written = torch.zeros(pool_slots, cap, dtype=torch.bool)
    written[slots, offsets] = True
    for mine, theirs, before in zip(ours, ref, pools, strict=True):
        assert rel_err(mine[slots, :, offsets], theirs[slots, :, offsets]) < TOL[dtype]
        assert torch.equal(mine.transpose(1, 2)[~written], before.transpose(1, 2)[~written])
    for row in range(b):  # the same kernel arithmetic as one sequence's own cache write
        alone = [p[slots[row]:slots[row] + 1].clone() for p in pools]
        q_one = rope_qkv_to_cache(qkv[row:row + 1], cos[row:row + 1], sin[row:row + 1], *alone,
                                  int(offsets[row]), hq, hkv)
        assert torch.equal(q_one[0], q[row])
        assert torch.equal(alone[0][0, :, offsets[row]], ours[0][slots[row], :, offsets[row]])
    with pytest.raises(ValueError, match="must both be"):
        rope_qkv_to_slots(qkv, cos, sin, *ours, slots[:3], offsets, hq, hkv)


def _model(dtype: torch.dtype):
    from elesium.inference.runtime.invariant import apply_invariant_numerics
    from elesium.inference.runtime.model import Transformer

    torch.manual_seed(4)
    config = ModelConfig(vocab_size=50, hidden_size=128, intermediate_size=96, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=64, max_position_embeddings=256)
    model = apply_invariant_numerics(Transformer(config).eval().requires_grad_(False), True)
    for layer in model.layers:  # non-trivial norm weights, so a wrong norm cannot pass
        layer.attn_norm.weight.uniform_(0.5, 1.5)
        layer.mlp_norm.weight.uniform_(0.5, 1.5)
    model.norm.weight.uniform_(0.5, 1.5)
    return model.to(dtype)


def test_batched_forward_rows_are_their_sequences_alone() -> None:
    """Four sequences with contexts of 0 to 130 tokens in pool slots 3, 0, 4, 1 (slot 2 idle): each row's
    logits are its sequence's one-sequence forward, each row's key and value land at its own slot and
    position (as the one-sequence forward writes them), and the idle slot and every earlier position
    are untouched."""
    from elesium.inference.runtime.batched_cuda_step import BatchedCudaStep, pool_forward
    from elesium.inference.runtime.fused import fused_forward
    from elesium.inference.runtime.model import KVCache
    from elesium.inference.runtime.slot_pool import SlotPool

    model = _model(torch.float32)
    c = model.config
    g = torch.Generator().manual_seed(2)
    lengths, slots = [0, 1, 64, 130], [3, 0, 4, 1]
    pool = SlotPool(c, 5, 192, torch.device("cpu"), torch.float32)
    solo_logits, solo_caches = [], []
    tokens = torch.randint(0, c.vocab_size, (4,), generator=g)
    for n, slot in zip(lengths, slots, strict=True):
        pool.reserve(slot, pool.max_len)
        cache = pool.cache(slot)
        if n:  # the context, written by the eager forward
            model(torch.randint(0, c.vocab_size, (1, n), generator=g), torch.arange(n), cache, 0)
    pool.reserve(2, pool.max_len)
    for n, slot, token in zip(lengths, slots, tokens.tolist(), strict=True):
        own = KVCache.of(pool.k[slot].clone(), pool.v[slot].clone())  # the sequence alone, its own cache
        hidden = fused_forward(model, torch.tensor([[token]]), torch.tensor([n]), own, n, model.causal(1))
        solo_logits.append(model.logits(hidden[0, 0]))
        solo_caches.append(own)
    before_k, before_v = pool.k.clone(), pool.v.clone()
    at, rows = torch.tensor(lengths), torch.tensor(slots)
    normed = pool_forward(model, tokens[:, None], at[:, None], at, rows, torch.arange(4),
                          torch.ones(4, 1, dtype=torch.bool), pool.k, pool.v)
    logits = model.logits(normed[:, 0])
    greedy = logits.argmax(-1)
    assert logits.shape == (4, c.vocab_size) and logits.dtype == torch.float32
    for row, (n, slot) in enumerate(zip(lengths, slots, strict=True)):
        assert rel_err(logits[row], solo_logits[row]) < TOL[torch.float32], row
        assert int(greedy[row]) == int(logits[row].argmax())
        assert rel_err(pool.k[slot, :, 0, :, n], solo_caches[row].k[:, 0, :, n]) < TOL[torch.float32]
        assert rel_err(pool.v[slot, :, 0, :, n], solo_caches[row].v[:, 0, :, n]) < TOL[torch.float32]
        assert torch.equal(pool.k[slot, :, :, :, :n], before_k[slot, :, :, :, :n])
        assert torch.equal(pool.k[slot, :, :, :, n + 1:], before_k[slot, :, :, :, n + 1:])
    assert torch.equal(pool.k[2], before_k[2]) and torch.equal(pool.v[2], before_v[2])
    # The step object (eager on the CPU: graphs are CUDA's) gives the same rows and greedy tokens, and
    # refuses an empty or ragged batch.
    pool.k.copy_(before_k)
    pool.v.copy_(before_v)
    step = BatchedCudaStep(model, pool, rows=4, graphs=False)
    assert step.buckets == (1, 2, 4)
    again, picks = step.decode(tokens.tolist(), lengths, slots)
    assert torch.equal(again, logits) and picks == greedy.tolist()
    with pytest.raises(ValueError, match="1 or more rows"):
        step.decode([], [], [])
    with pytest.raises(ValueError, match="1 or more rows"):
        step.decode([1, 2], [3], [0, 1])


def test_slot_steps_are_the_one_sequence_steps() -> None:
    """``BatchedCudaStep.nodes`` (eager on the CPU): a 21-token prompt chunk and then a 9-node tree of one
    sequence in pool slot 2 give the hidden states, logits and cache entries of the one-sequence forward on a
    cache of its own, and no other slot changes."""
    from elesium.inference.runtime.batched_cuda_step import BatchedCudaStep
    from elesium.inference.runtime.fused import fused_forward
    from elesium.inference.runtime.slot_pool import SlotPool
    from helpers import ancestors_from_parents

    model = _model(torch.float32)
    c = model.config
    g = torch.Generator().manual_seed(6)
    pool = SlotPool(c, 4, 128, torch.device("cpu"), torch.float32)
    for slot in range(4):
        pool.reserve(slot, pool.max_len)
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    own = model.new_cache(128)
    own.k.copy_(pool.k[2])
    own.v.copy_(pool.v[2])
    before_k = pool.k.clone()
    step = BatchedCudaStep(model, pool, rows=2, graphs=False, node_buckets=(4, 16, 32))
    prompt = torch.randint(0, c.vocab_size, (21,), generator=g).tolist()
    out = step.nodes(prompt, list(range(21)), 0, None, 2)
    ref = fused_forward(model, torch.tensor([prompt]), torch.arange(21), own, 0, model.causal(21))[0]
    assert rel_err(out.hidden, ref) < TOL[torch.float32]
    assert torch.equal(out.logits, model.logits(out.hidden))
    assert torch.equal(out.greedy, out.logits.argmax(-1))
    anc = ancestors_from_parents([-1, 0, 0, 1, 1, 2, 3, 3, 5])
    depth = anc.sum(1) - 1
    tree = torch.randint(0, c.vocab_size, (9,), generator=g).tolist()
    out = step.nodes(tree, (21 + depth).tolist(), 21, anc, 2)
    ref = fused_forward(model, torch.tensor([tree]), 21 + depth, own, 21, anc)[0]
    assert rel_err(out.hidden, ref) < TOL[torch.float32]
    assert rel_err(pool.k[2, :, 0, :, :30], own.k[:, 0, :, :30]) < TOL[torch.float32]
    assert rel_err(pool.v[2, :, 0, :, :30], own.v[:, 0, :, :30]) < TOL[torch.float32]
    assert torch.equal(pool.k[2, :, :, :, 30:], before_k[2, :, :, :, 30:])
    for other in (0, 1, 3):
        assert torch.equal(pool.k[other], before_k[other])


def test_prefill_rows_are_each_prompts_own_blocks() -> None:
    """``BatchedCudaStep.prefill`` (eager on the CPU): three prompts' blocks in one forward (a full block
    from 0, a short first block, and a second block after 64 positions) give each prompt's one-sequence
    prefill hidden states and cache entries; bad blocks are refused."""
    from elesium.inference.runtime.batched_cuda_step import BatchedCudaStep
    from elesium.inference.runtime.fused import fused_forward
    from elesium.inference.runtime.slot_pool import SlotPool

    model = _model(torch.float32)
    c = model.config
    g = torch.Generator().manual_seed(9)
    pool = SlotPool(c, 4, 192, torch.device("cpu"), torch.float32)
    step = BatchedCudaStep(model, pool, rows=2, graphs=False, block=64)
    prompts = [torch.randint(0, c.vocab_size, (n,), generator=g).tolist() for n in (64, 23, 100)]
    slots = [2, 0, 1]
    # The third prompt's first block, alone, so that its second block has a context.
    (first,) = step.prefill([(1, prompts[2][:64], 0)])
    hidden = step.prefill([(2, prompts[0], 0), (0, prompts[1], 0), (1, prompts[2][64:], 64)])
    for ids, slot, got, start in zip(prompts, slots, hidden, (0, 0, 64), strict=True):
        own = model.new_cache(192)
        ref = fused_forward(model, torch.tensor([ids]), torch.arange(len(ids)), own, 0,
                            model.causal(len(ids)))[0]
        assert got.shape == (len(ids) - start, c.hidden_size)
        assert rel_err(got, ref[start:]) < TOL[torch.float32]
        n = len(ids)
        assert rel_err(pool.k[slot, :, 0, :, :n], own.k[:, 0, :, :n]) < TOL[torch.float32]
    assert rel_err(first, fused_forward(model, torch.tensor([prompts[2][:64]]), torch.arange(64),
                                        model.new_cache(192), 0, model.causal(64))[0]) < TOL[torch.float32]
    with pytest.raises(ValueError, match="1 to 64 tokens"):
        step.prefill([(0, prompts[0] + [1], 0)])
    with pytest.raises(ValueError, match="1 to 64 tokens"):
        step.prefill([(0, [1, 2], 150)])  # its block would write past the slot
    with pytest.raises(ValueError, match="1 to 8 blocks"):
        step.prefill([])



def test_a_prompts_consecutive_blocks_share_one_prefill_forward() -> None:
    """A 150-token prompt's three blocks and another prompt's only block in one ``prefill`` call: each layer
    writes every row's keys before any row attends, so a later block of the same prompt sees the earlier
    blocks' keys of that very forward, and the result is the prompt's one-sequence prefill (hidden states
    and cache) as if its blocks had been prefilled one call after another."""
    from elesium.inference.runtime.batched_cuda_step import BatchedCudaStep
    from elesium.inference.runtime.fused import fused_forward
    from elesium.inference.runtime.slot_pool import SlotPool

    model = _model(torch.float32)
    c = model.config
    g = torch.Generator().manual_seed(12)
    pool = SlotPool(c, 4, 224, torch.device("cpu"), torch.float32)
    step = BatchedCudaStep(model, pool, rows=2, graphs=False, block=64)
    ids = torch.randint(0, c.vocab_size, (150,), generator=g).tolist()
    other = torch.randint(0, c.vocab_size, (40,), generator=g).tolist()
    hidden = step.prefill([(1, ids[:64], 0), (3, other, 0), (1, ids[64:128], 64), (1, ids[128:], 128)])
    for prompt, slot, got in ((ids, 1, torch.cat([hidden[0], hidden[2], hidden[3]])), (other, 3, hidden[1])):
        own = model.new_cache(224)
        ref = fused_forward(model, torch.tensor([prompt]), torch.arange(len(prompt)), own, 0,
                            model.causal(len(prompt)))[0]
        n = len(prompt)
        assert got.shape == (n, c.hidden_size) and rel_err(got, ref) < TOL[torch.float32]
        assert rel_err(pool.k[slot, :, 0, :, :n], own.k[:, 0, :, :n]) < TOL[torch.float32]
        assert rel_err(pool.v[slot, :, 0, :, :n], own.v[:, 0, :, :n]) < TOL[torch.float32]

def test_greedy_chain_is_its_steps_one_after_another() -> None:
    """``decode_greedy`` (eager on the CPU, one graph replay on CUDA): three sequences at positions 0, 5 and
    70 of pool slots 2, 0, 3, chained for 5 steps, get the greedy tokens and the keys and values of five
    ``decode`` calls, each fed the last call's picks; a batch past the largest bucket chains eagerly with the
    same result, and a chain that would run past the slot is refused before anything is written."""
    from elesium.inference.runtime.batched_cuda_step import BatchedCudaStep
    from elesium.inference.runtime.slot_pool import SlotPool

    model = _model(torch.float32)
    c = model.config
    g = torch.Generator().manual_seed(8)
    # Untied: with the embeddings as its output a random model's greedy pick is its input token, and a chain
    # that fed the first tokens back again would pass.
    model.lm_head.weight = torch.nn.Parameter(torch.randn(c.vocab_size, c.hidden_size, generator=g),
                                              requires_grad=False)
    lengths, slots = [0, 5, 70], [2, 0, 3]
    pool = SlotPool(c, 5, 96, torch.device("cpu"), torch.float32)
    for n, slot in zip(lengths, slots, strict=True):
        pool.reserve(slot, pool.max_len)
        if n:
            model(torch.randint(0, c.vocab_size, (1, n), generator=g), torch.arange(n), pool.cache(slot), 0)
    first = torch.randint(0, c.vocab_size, (3,), generator=g).tolist()
    before_k, before_v = pool.k.clone(), pool.v.clone()
    step = BatchedCudaStep(model, pool, rows=2, graphs=False)  # buckets (1, 2): three rows chain eagerly
    tokens, offsets, picks = list(first), list(lengths), [[] for _ in slots]
    for _ in range(5):
        _, greedy = step.decode(tokens, offsets, slots)
        for row, token in zip(picks, greedy, strict=True):
            row.append(token)
        tokens, offsets = greedy, [o + 1 for o in offsets]
    stepped_k, stepped_v = pool.k.clone(), pool.v.clone()
    pool.k.copy_(before_k)
    pool.v.copy_(before_v)
    chained = step.decode_greedy(first, lengths, slots, 5)
    assert chained == picks
    assert sum(len(set(row)) > 2 for row in picks) >= 2, f"rows repeat their tokens: too weak a test {picks}"
    assert torch.equal(pool.k[slots], stepped_k[slots]) and torch.equal(pool.v[slots], stepped_v[slots])
    two = step.decode_greedy(first[:2], lengths[:2], slots[:2], 5)  # within a bucket: the same body
    assert two == picks[:2]
    pool.k.copy_(before_k)
    pool.v.copy_(before_v)
    collect = step.launch_greedy(first, lengths, slots, 5)  # the batcher's overlapped chains
    with pytest.raises(RuntimeError, match="not read back"):  # its outputs would be overwritten
        step.decode_greedy(first, lengths, slots, 5)
    assert collect() == picks
    assert torch.equal(pool.k[slots], stepped_k[slots]) and torch.equal(pool.v[slots], stepped_v[slots])
    with pytest.raises(ValueError, match="past the slot"):
        step.decode_greedy([1], [92], [1], 5)
    with pytest.raises(ValueError, match="1 or more steps"):
        step.decode_greedy([1], [0], [1], 0)


def test_prompt_blocks_riding_on_decode_steps_are_their_own_prefill() -> None:
    """``decode_rows`` with prompt blocks in its first forward (eager on the CPU, one graph replay on CUDA):
    a chain of three steps of three decoding sequences, with two newcomers' prompts riding on it (a
    100-token prompt's two blocks, which must see each other's keys within the forward, and a 30-token
    one), gives the rows the greedy tokens of the same chain without the blocks, the blocks the hidden
    states of ``prefill``, and every slot the same keys and values; a block on a decoding row's slot is
    refused."""
    from elesium.inference.runtime.batched_cuda_step import BatchedCudaStep
    from elesium.inference.runtime.slot_pool import SlotPool

    model = _model(torch.float32)
    c = model.config
    g = torch.Generator().manual_seed(14)
    model.lm_head.weight = torch.nn.Parameter(torch.randn(c.vocab_size, c.hidden_size, generator=g),
                                              requires_grad=False)  # untied: see the chain test
    lengths, slots = [3, 40, 90], [4, 0, 2]
    pool = SlotPool(c, 6, 160, torch.device("cpu"), torch.float32)
    for n, slot in zip(lengths, slots, strict=True):
        pool.reserve(slot, pool.max_len)
        model(torch.randint(0, c.vocab_size, (1, n), generator=g), torch.arange(n), pool.cache(slot), 0)
    long, short = (torch.randint(0, c.vocab_size, (n,), generator=g).tolist() for n in (100, 30))
    blocks = [(1, long[:64], 0), (3, short, 0), (1, long[64:], 64)]
    first = torch.randint(0, c.vocab_size, (3,), generator=g).tolist()
    before_k, before_v = pool.k.clone(), pool.v.clone()
    step, steps = BatchedCudaStep(model, pool, rows=4, graphs=False), 3
    alone_hidden = step.prefill(blocks)
    alone = step.decode_rows(first, lengths, slots, steps)
    alone_k, alone_v = pool.k.clone(), pool.v.clone()
    pool.k.copy_(before_k)
    pool.v.copy_(before_v)
    together = step.decode_rows(first, lengths, slots, steps, blocks)
    assert together.picks == alone.picks and together.logits is None
    assert sum(len(set(row)) > 1 for row in alone.picks) >= 2, alone.picks
    assert [h.shape[0] for h in together.hidden] == [64, 30, 36]
    for got, want in zip(together.hidden, alone_hidden, strict=True):
        assert rel_err(got, want) < TOL[torch.float32]
    written = {**{s: n + steps for s, n in zip(slots, lengths, strict=True)}, 1: 100, 3: 30}
    for slot, n in written.items():
        assert rel_err(pool.k[slot, ..., :n, :], alone_k[slot, ..., :n, :]) < TOL[torch.float32], slot
        assert rel_err(pool.v[slot, ..., :n, :], alone_v[slot, ..., :n, :]) < TOL[torch.float32], slot
    with pytest.raises(ValueError, match="decoding row's"):
        step.decode_rows(first, lengths, slots, 1, [(0, [1, 2], 40)])


def test_one_sequence_prompt_blocks_through_the_causal_kernel_are_bitwise_the_same() -> None:
    """``fused_forward`` with ``causal`` (what ``Transformer.forward`` passes for a prompt block) attends
    through the ragged causal kernel; hidden states and cache entries are bitwise those of the per-node
    kernel, for a full block from 0 and a short one after it, with an int and with a device offset."""
    from elesium.inference.runtime.fused import fused_forward

    model = _model(torch.float32)
    c = model.config
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, c.vocab_size, (1, 94), generator=g)
    caches = {causal: model.new_cache(192) for causal in (False, True)}
    for lo, hi, offset in ((0, 64, 0), (64, 94, torch.tensor(64))):
        outs = [fused_forward(model, ids[:, lo:hi], torch.arange(lo, hi), caches[causal], offset,
                              model.causal(hi - lo), causal=causal) for causal in (False, True)]
        assert torch.equal(outs[0], outs[1]), (lo, hi)
    assert torch.equal(caches[False].k, caches[True].k) and torch.equal(caches[False].v, caches[True].v)
