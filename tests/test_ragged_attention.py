"""Ragged (multi-sequence) invariant tree attention, kernels/ragged_attention.py, in Triton's interpreter.

The property that matters: every node of a batched launch gets bit for bit what
``invariant_tree_attention`` gives its sequence alone (and so the 1-token decode of that node), whatever
the other sequences, their slots, prefixes and trees are; and the kernel computes the torch reference.
The interpreter has no bf16, so fp32 and fp16 stand in; the GPU test at the end checks bf16 and fp16 with
compiled kernels in a child process (this file sets TRITON_INTERPRET=1 for the whole session, as
tests/test_invariant_kernels.py does, hence the top of the file).
"""

from __future__ import annotations

import os
import sys

_TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import ancestors_from_parents  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
MAX_NODES = 128
GQA = [(9, 3), (4, 2)]  # SmolLM2-135M's heads, and an even group

# The batch of test 1: (prefix, parents of the tree); a pool of 7 slots, capacity 256, block_n 64.
BATCH = [(0, [-1]), (1, [-1]), (63, [-1, 0, 1]), (64, [-1, 0, 0, 1]), (130, [-1])]
SLOTS = [4, 0, 6, 2, 5]


@pytest.fixture(autouse=True)
def _interpreted() -> None:
    if _TRITON_IMPORTED_TOO_EARLY:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def make_batch(batch: list[tuple[int, list[int]]], slots: list[int], hq: int, hkv: int, pool_slots: int,
               capacity: int, dtype: torch.dtype, seed: int, d: int = 64, device: str = "cpu") -> dict:
    """Random q and pools, and the ragged index tensors of ``batch`` (prefix, parents) in ``slots``."""
    g = torch.Generator().manual_seed(seed)
    sizes = [len(parents) for _, parents in batch]
    total = sum(sizes)
    anc = torch.zeros(total, MAX_NODES, dtype=torch.bool)
    node_seq, start = [], 0
    for s, ((_, parents), n) in enumerate(zip(batch, sizes, strict=True)):
        anc[start:start + n, :n] = ancestors_from_parents(parents)
        node_seq += [s] * n
        start += n
    return dict(
        q=torch.randn(hq, total, d, generator=g).to(dtype).to(device),
        k_pool=torch.randn(pool_slots, hkv, capacity, d, generator=g).to(dtype).to(device),
        v_pool=torch.randn(pool_slots, hkv, capacity, d, generator=g).to(dtype).to(device),
        seq_slots=torch.tensor(slots, dtype=torch.int32, device=device),
        seq_prefix=torch.tensor([p for p, _ in batch], dtype=torch.int32, device=device),
        node_seq=torch.tensor(node_seq, dtype=torch.int32, device=device),
        ancestors=anc.to(device),
    )


def alone(args: dict, batch: list[tuple[int, list[int]]], **kw: int) -> list[torch.Tensor]:
    """Each sequence through the single-sequence kernel: ``[Hq, n_s, D]`` per sequence."""
    from elesium.kernels.invariant_attention import invariant_tree_attention

    res, start = [], 0
    for s, (prefix, parents) in enumerate(batch):
        n, slot = len(parents), int(args["seq_slots"][s])
        q_s = args["q"][:, start:start + n][None]
        anc_s = args["ancestors"][start:start + n, :n]
        res.append(invariant_tree_attention(q_s, args["k_pool"][slot][None], args["v_pool"][slot][None],
                                            prefix, anc_s, **kw)[0])
        start += n
    return res


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize(("hq", "hkv"), GQA)
def test_rows_equal_each_sequence_alone(dtype: torch.dtype, hq: int, hkv: int, splits: int) -> None:
    """Five sequences (prefixes 0, 1, 63, 64, 130 -- block boundaries on both sides; trees of 1, 1, a
    3-chain, a 4-node tree, 1) in slots of a 7-slot pool: each sequence's rows equal bitwise its
    ``invariant_tree_attention`` alone, and a ragged call holding only that sequence (in the same slot)
    gives the same bits, so a row does not depend on its batch."""
    from elesium.kernels.ragged_attention import ragged_tree_attention

    args = make_batch(BATCH, SLOTS, hq, hkv, 7, 256, dtype, seed=hq * 10 + splits)
    out = ragged_tree_attention(**args, num_splits=splits)
    assert out.shape == args["q"].shape and out.dtype == dtype
    start = 0
    for s, expect in enumerate(alone(args, BATCH, num_splits=splits)):
        n = expect.shape[1]
        assert torch.equal(out[:, start:start + n], expect), f"sequence {s}"
        single = dict(args, q=args["q"][:, start:start + n], seq_slots=args["seq_slots"][s:s + 1],
                      seq_prefix=args["seq_prefix"][s:s + 1], node_seq=torch.zeros(n, dtype=torch.int64),
                      ancestors=args["ancestors"][start:start + n])
        assert torch.equal(ragged_tree_attention(**single, num_splits=splits), expect), f"sequence {s} alone"
        start += n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(dtype: torch.dtype) -> None:
    """The kernel computes the torch reference (1 and 2 splits, the default split count, ``out`` given as a
    transposed view of a ``[T, Hq, D]`` buffer); the reference is tree attention's own contract."""
    from elesium.kernels.ragged_attention import ragged_tree_attention, ragged_tree_attention_reference
    from elesium.kernels.tree_attention import tree_attention_reference

    args = make_batch(BATCH, SLOTS, 4, 2, 7, 256, dtype, seed=5)
    ref = ragged_tree_attention_reference(**args)
    for splits in (1, 2, None):
        assert rel_err(ragged_tree_attention(**args, num_splits=splits), ref) < TOL[dtype], splits
    buf = torch.empty(args["q"].shape[1], 4, 64, dtype=dtype)
    got = ragged_tree_attention(**args, out=buf.transpose(0, 1))
    assert got.data_ptr() == buf.data_ptr() and rel_err(buf.transpose(0, 1), ref) < TOL[dtype]
    # The reference against the single-sequence reference, sequence 3 (the 4-node tree, prefix 64).
    slot, start = SLOTS[3], 5
    tree_ref = tree_attention_reference(args["q"][None, :, start:start + 4].double(),
                                        args["k_pool"][slot][None].double(),
                                        args["v_pool"][slot][None].double(), 64, args["ancestors"][5:9, :4])
    assert rel_err(ref[:, start:start + 4], tree_ref[0]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_batch_equals_each_sequence_alone(dtype: torch.dtype) -> None:
    """The serving decode step: six 1-node sequences (T = num_seq = 6), default splits (capacity 1024 gives
    2), sequences not in slot order; with full 128-column ancestor rows and with ``[T, 1]`` ones (the
    narrow scan), each row equals bitwise the sequence alone."""
    from elesium.kernels.ragged_attention import ragged_tree_attention

    batch = [(p, [-1]) for p in (5, 0, 200, 64, 127, 129)]
    args = make_batch(batch, [3, 1, 0, 6, 2, 5], 9, 3, 7, 1024, dtype, seed=21)
    expect = torch.cat(alone(args, batch), dim=1)
    assert torch.equal(ragged_tree_attention(**args), expect)
    narrow = dict(args, ancestors=torch.ones(6, 1, dtype=torch.bool))
    assert torch.equal(ragged_tree_attention(**narrow), expect)


def test_rejects_bad_input() -> None:
    """Shapes, node counts, dtypes and index tensors that cannot work raise ValueError naming the problem."""
    from elesium.kernels.ragged_attention import ragged_tree_attention

    args = make_batch(BATCH[:2], SLOTS[:2], 4, 2, 3, 64, torch.float32, seed=1)
    cases = [
        (dict(q=args["q"][:, :1]), "ancestors"),  # T of q and of the index tensors differ
        (dict(q=args["q"][..., :32]), "head_dim"),
        (dict(v_pool=args["v_pool"][:, :1]), "differ"),
        (dict(q=args["q"][:3]), "not a multiple"),
        (dict(ancestors=torch.zeros(2, MAX_NODES + 1, dtype=torch.bool)), "1 to 128 nodes"),
        (dict(q=args["q"].half()), "dtypes"),
        (dict(node_seq=args["node_seq"][:1]), "node_seq"),
        (dict(seq_prefix=args["seq_prefix"][:1]), "seq_prefix"),
        (dict(seq_slots=args["seq_slots"].float()), "int32 or int64"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=f"ragged tree attention: .*{message}"):
            ragged_tree_attention(**dict(args, **change))
    with pytest.raises(ValueError, match="out .* does not fit"):
        ragged_tree_attention(**args, out=torch.empty(4, 2, 64, dtype=torch.float16))


# Run in a child process without TRITON_INTERPRET (set above for this whole session): test 1 on the GPU,
# bf16 and fp16, capacity 8192 (8 splits by default, and 1), 16 and 64 sequences of random prefixes and
# trees (half of them 1-node), Hq/Hkv 9/3 and 4/2.
_GPU_CHECK = """
import random, sys, torch
sys.path.insert(0, {tests!r})
from test_ragged_attention import alone, make_batch
from elesium.kernels.ragged_attention import ragged_tree_attention, ragged_tree_attention_reference
bad = []
for dtype in (torch.bfloat16, torch.float16):
    for num_seq, (hq, hkv) in ((16, (9, 3)), (64, (4, 2))):
        rnd = random.Random(num_seq)
        batch = []
        for s in range(num_seq):
            n = 1 if s % 2 else rnd.choice([2, 5, 17, 64, 128])
            parents = [-1] + [rnd.randrange(0, i) for i in range(1, n)]
            batch.append((rnd.randrange(0, 8192 - n), parents))
        slots = rnd.sample(range(num_seq + 3), num_seq)
        args = make_batch(batch, slots, hq, hkv, num_seq + 3, 8192, dtype, seed=num_seq, device="cuda")
        for splits in (None, 1):
            out = ragged_tree_attention(**args, num_splits=splits)
            expect = torch.cat(alone(args, batch, num_splits=splits), dim=1)
            if not torch.equal(out, expect):
                rows = (out != expect).any(0).any(-1).nonzero().flatten().tolist()
                bad.append((str(dtype), num_seq, splits, "rows", rows[:10]))
        small = [i for i, (_, p) in enumerate(batch) if len(p) <= 5][:6]
        if small:
            keep = torch.cat([torch.nonzero(args["node_seq"] == i).flatten() for i in small])
            sub = dict(args, q=args["q"][:, keep], ancestors=args["ancestors"][keep],
                       node_seq=args["node_seq"][keep], seq_slots=args["seq_slots"],
                       seq_prefix=args["seq_prefix"])
            ref = ragged_tree_attention_reference(**sub)
            got = ragged_tree_attention(**sub)
            rel = float((got.double() - ref.double()).norm() / ref.double().norm())
            if not rel < 1e-2:
                bad.append((str(dtype), num_seq, "rel_err", rel))
from test_ragged_attention import causal_batch
from elesium.kernels.ragged_attention import ragged_causal_attention
for dtype in (torch.bfloat16, torch.float16):
    for per_seq, (hq, hkv) in ((64, (9, 3)), (23, (9, 3)), (64, (4, 2))):
        rnd = random.Random(per_seq + hq)
        prefixes = [rnd.randrange(0, 8192 - per_seq) for _ in range(8)] + [0, 63]
        args = causal_batch(prefixes, per_seq, rnd.sample(range(12), 10), hq, hkv, 8192, dtype, seed=per_seq,
                            device="cuda")
        for splits in (None, 1):
            expect = ragged_tree_attention(**args, num_splits=splits)
            got = ragged_causal_attention(args["q"], args["k_pool"], args["v_pool"], args["seq_slots"],
                                          args["seq_prefix"], num_splits=splits)
            if not torch.equal(got, expect):
                bad.append((str(dtype), "causal", per_seq, hq, splits))
print("BAD", bad)
assert not bad, bad
print("OK: ragged rows equal the single-sequence kernel bitwise (bf16, fp16; 16 and 64 sequences), and "
      "causal blocks the per-node kernel")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests run on a CUDA machine")
def test_rows_equal_each_sequence_alone_on_gpu() -> None:
    """Test 1 with compiled kernels in bf16 and fp16, capacity 8192, 16 and 64 sequences (trees of up to
    128 nodes, prefixes up to the capacity), plus the reference on a few of them; and the causal kernel
    against the per-node kernel on prompt blocks of 64 and 23 nodes after random prefixes."""
    import subprocess
    import tempfile

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    tests = os.path.dirname(os.path.abspath(__file__))
    # cwd away from the checkout: its root holds an ``elesium/`` folder that would shadow the package.
    done = subprocess.run([sys.executable, "-c", _GPU_CHECK.format(tests=tests)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=tempfile.gettempdir())
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def causal_batch(prefixes: list[int], per_seq: int, slots: list[int], hq: int, hkv: int, capacity: int,
                 dtype: torch.dtype, seed: int, device: str = "cpu") -> dict:
    """``make_batch`` for sequences that each add a causal block of ``per_seq`` nodes (prompt blocks)."""
    chain = [-1] + list(range(per_seq - 1))
    return make_batch([(p, chain) for p in prefixes], slots, hq, hkv, max(slots) + 2, capacity, dtype, seed,
                      device=device)


# (dtype, Hq, Hkv, splits, nodes a block): SmolLM2's full 64-token prompt block; short blocks (a prompt's
# last) of both GQA shapes, one split and two; one token. The interpreter runs a program at a time, so
# the full block gets two sequences and the rest five.
CAUSAL_CASES = [(torch.float16, 9, 3, 2, 64), (torch.float32, 4, 2, 1, 17), (torch.float32, 9, 3, 2, 7),
                (torch.float16, 4, 2, 2, 1), (torch.float16, 9, 3, 1, 5)]


@pytest.mark.parametrize(("dtype", "hq", "hkv", "splits", "per_seq"), CAUSAL_CASES)
def test_causal_blocks_equal_the_per_node_kernel(dtype: torch.dtype, hq: int, hkv: int, splits: int,
                                                 per_seq: int) -> None:
    """Prompt blocks after prefixes on both sides of a key block's boundary, in slots out of order: the
    multi-query causal kernel gives bitwise the per-node kernel's rows with lower-triangular ancestors,
    and so (checked for the short blocks) each sequence's single-sequence prefill block."""
    from elesium.kernels.ragged_attention import ragged_causal_attention, ragged_tree_attention

    prefixes, slots = ([0, 130], [2, 0]) if per_seq == 64 else ([0, 1, 63, 64, 130], [4, 0, 6, 2, 5])
    args = causal_batch(prefixes, per_seq, slots, hq, hkv, 256, dtype, seed=per_seq + hq + splits)
    expect = ragged_tree_attention(**args, num_splits=splits)
    got = ragged_causal_attention(args["q"], args["k_pool"], args["v_pool"], args["seq_slots"],
                                  args["seq_prefix"], num_splits=splits)
    assert torch.equal(got, expect)
    if per_seq < 64:
        chain = [-1] + list(range(per_seq - 1))
        solo = alone(args, [(p, chain) for p in prefixes], num_splits=splits)
        assert torch.equal(got, torch.cat(solo, dim=1))


def test_causal_blocks_match_reference_and_reject_bad_input() -> None:
    """The default split count and an ``out`` view against the reference; node counts that do not split
    into equal blocks, blocks over 128 nodes and the shared shape checks raise ValueError."""
    from elesium.kernels.ragged_attention import ragged_causal_attention, ragged_tree_attention_reference

    args = causal_batch([3, 70, 0], 20, [2, 0, 1], 9, 3, 1024, torch.float32, seed=8)
    ref = ragged_tree_attention_reference(**args)
    buf = torch.empty(args["q"].shape[1], 9, 64)
    got = ragged_causal_attention(args["q"], args["k_pool"], args["v_pool"], args["seq_slots"],
                                  args["seq_prefix"], out=buf.transpose(0, 1))
    assert got.data_ptr() == buf.data_ptr() and rel_err(got, ref) < TOL[torch.float32]
    pools = (args["k_pool"], args["v_pool"])
    cases = [
        ((args["q"][:, :59], *pools, args["seq_slots"], args["seq_prefix"]), "do not split"),
        ((torch.zeros(9, 3 * 129, 64), *pools, args["seq_slots"], args["seq_prefix"]), "1 to 128 nodes"),
        ((args["q"], *pools, args["seq_slots"], args["seq_prefix"][:2]), "seq_prefix"),
        ((args["q"].half(), *pools, args["seq_slots"], args["seq_prefix"]), "dtypes"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=f"ragged causal attention: .*{message}"):
            ragged_causal_attention(*call)
