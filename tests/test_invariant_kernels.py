"""Shape-invariant kernels (matmul, RMSNorm, tree attention) on the CPU through Triton's interpreter.

Two properties each: the kernel computes the reference function on fresh random inputs, and a row's
result is bit-for-bit the same whatever else is in the call (rows of an M-row product equal the
1-row products; a tree node's attention equals the 1-token decode of the same logical sequence).
The interpreter has no bf16, so fp32 and fp16 stand in; bf16 is checked on the GPU (tests/test_gpu.py).
TRITON_INTERPRET must be set before Triton is imported, hence the top of the file.
"""

from __future__ import annotations

import os
import sys

_TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402
import torch  # noqa: E402

from elesium.kernels.tree_attention import tree_attention_reference  # noqa: E402
from helpers import ancestors_from_parents  # noqa: E402

# No skip without Triton: it is a dev dependency, and these tests are the kernels' only CPU check.

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _interpreted() -> None:
    if _TRITON_IMPORTED_TOO_EARLY:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "n", "k", "bias"),
                         [(1, 96, 80, False), (70, 130, 100, True), (5, 64, 64, True)])
def test_matmul_matches_reference(dtype: torch.dtype, m: int, n: int, k: int, bias: bool) -> None:
    from elesium.kernels.invariant_matmul import invariant_linear, linear_reference

    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = invariant_linear(x, w, b)
    assert out.shape == (m, n) and out.dtype == dtype
    ref = linear_reference(x.double(), w.double(), None if b is None else b.double())
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matmul_rows_do_not_depend_on_m(dtype: torch.dtype) -> None:
    """A row's result does not depend on M: rows of a 70-row product (two tiles) equal the same rows
    computed in smaller products, bitwise.

    The interpreter's dot is numpy's BLAS, whose result for a row depends on the row's position in
    the tile (SIMD lanes), so here every comparison keeps that position: the 1-row products are
    compared at tile offsets 0, growing products at their last row. On the GPU each MMA output
    element is computed the same way wherever it sits, and tests/test_gpu.py checks M=1 against
    M=N for every row."""
    from elesium.kernels.invariant_matmul import invariant_linear

    g = torch.Generator().manual_seed(7)
    m, n, k = 70, 72, 96
    x = torch.randn(2, m // 2, k, generator=g).to(dtype)  # leading dims are flattened
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    full = invariant_linear(x, w, b).reshape(m, n)
    rows = x.reshape(m, k)
    for i in (0, 64):
        assert torch.equal(invariant_linear(rows[i:i + 1], w, b)[0], full[i]), f"row {i}"
    for i in (1, 33, 63, 69):
        assert torch.equal(invariant_linear(rows[:i + 1], w, b)[i], full[i]), f"row {i}"
    assert torch.equal(invariant_linear(rows[64:69], w, b), full[64:69])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matmul_split_k_matches_reference_and_rows_do_not_depend_on_m(dtype: torch.dtype) -> None:
    """The split-K path (fp32 partials per K range, summed in split order by a second kernel): the reference
    function, with bias, and rows bitwise equal across M at the same tile positions (16-row tiles here)."""
    from elesium.kernels.invariant_matmul import Config, invariant_linear, linear_reference

    cfg = Config(16, 32, 32, 3)  # K = 200: ranges of 96, 96, 8 (the last one masked)
    g = torch.Generator().manual_seed(17)
    m, n, k = 40, 70, 200
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    full = invariant_linear(x, w, b, config=cfg)
    ref = linear_reference(x.double(), w.double(), b.double())
    assert rel_err(full, ref) < TOL[dtype]
    for i in (0, 16, 32):
        assert torch.equal(invariant_linear(x[i:i + 1], w, b, config=cfg)[0], full[i]), f"row {i}"
    for i in (5, 20, 39):
        assert torch.equal(invariant_linear(x[:i + 1], w, b, config=cfg)[i], full[i]), f"row {i}"


def test_matmul_config_is_a_function_of_the_weight() -> None:
    """Launch configs come from (N, K, dtype) alone; the model's shapes get the H200-tuned table, which the
    heuristic reproduces; the heuristic's split-K path runs (fp16 default config, interpreter)."""
    import inspect

    from elesium.kernels import invariant_matmul as im

    assert list(inspect.signature(im.config_for).parameters) == ["n", "k", "dtype"]
    for (n, k), cfg in im._TABLE.items():
        assert im.config_for(n, k, torch.bfloat16) == cfg == im._heuristic(n, k)
        assert cfg.block_m >= 16 and cfg.block_k <= k
    assert im.config_for(576, 1536, torch.bfloat16).split_k > 1  # w2: few output tiles, long K
    n, k = 48, 1024
    assert im.config_for(n, k, torch.float16).split_k == 2
    g = torch.Generator().manual_seed(23)
    x = torch.randn(18, k, generator=g).to(torch.float16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.float16)
    full = im.invariant_linear(x, w)
    assert rel_err(full, im.linear_reference(x.double(), w.double())) < TOL[torch.float16]
    assert torch.equal(im.invariant_linear(x[16:17], w)[0], full[16])
    assert torch.equal(im.invariant_linear(x[:3], w)[2], full[2])


# Run in a child process without TRITON_INTERPRET (this file's interpreter setting would otherwise run the
# kernels on the host): every model shape with its shipped config, bf16, bias and none.
_GPU_ROWS_CHECK = """
import torch
from elesium.kernels import invariant_matmul as im
from elesium.kernels.invariant_matmul import _TABLE, invariant_linear, linear_reference
bad = []
for (n, k) in _TABLE:
    for bias in (False, True):
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
        b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16) if bias else None
        x = torch.randn(310, k, device="cuda", generator=g).to(torch.bfloat16)
        alone = torch.stack([invariant_linear(x[i:i + 1], w, b)[0] for i in range(310)])
        table = im.config_for(n, k, torch.bfloat16)
        for height in (None, 32, 64):  # None: the table's config; else taller tiles, the rest the table's
            cfg = None if height is None else table._replace(block_m=height)
            for m in (1, 7, 64, 128, 300):
                for off in (0, 5):
                    got = invariant_linear(x[off:off + m], w, b, config=cfg)
                    if not torch.equal(got, alone[off:off + m]):
                        bad.append((n, k, bias, height, m, off))
        ref = linear_reference(x.double(), w.double(), None if b is None else b.double())
        rel = float((invariant_linear(x, w, b).double() - ref).norm() / ref.norm())
        if not rel < 1e-2:
            bad.append((n, k, bias, "rel_err", rel))
print("BAD", bad)
assert not bad, bad
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests run on a CUDA machine")
def test_matmul_rows_do_not_depend_on_m_on_gpu() -> None:
    """bf16 on the GPU, each model shape with its shipped config (split-K for w2): rows of M = 1, 7, 64, 128
    and 300 products, at batch offsets 0 and 5, equal bitwise the same rows computed alone, with the
    table's config and with taller tiles (32 and 64 rows; on the H100 a row's bits depend on no part of the
    tile configuration but the split's K ranges, BENCHMARKS §27f)."""
    import subprocess
    import tempfile

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    # cwd away from the checkout: its root holds an ``elesium/`` folder that would shadow the package.
    done = subprocess.run([sys.executable, "-c", _GPU_ROWS_CHECK], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tempfile.gettempdir())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_matmul_rejects_what_it_cannot_do() -> None:
    from elesium.kernels.invariant_matmul import invariant_linear

    with pytest.raises(ValueError, match="unsupported"):
        invariant_linear(torch.randn(2, 8), torch.randn(4, 9))
    w = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="unsupported"):
        invariant_linear(torch.randn(2, 8), w)  # autograd needs F.linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_matches_reference_and_is_row_invariant(dtype: torch.dtype) -> None:
    from elesium.kernels.invariant_norm import invariant_rms_norm, rms_norm_reference

    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 37, 96, generator=g).to(dtype) * 3
    w = torch.randn(96, generator=g).to(dtype)
    out = invariant_rms_norm(x, w, 1e-5)
    assert out.shape == x.shape
    assert rel_err(out, rms_norm_reference(x.double(), w.double(), 1e-5)) < TOL[dtype]
    for i in (0, 20, 36):
        assert torch.equal(invariant_rms_norm(x[:, i:i + 1], w, 1e-5)[0, 0], out[0, i])


def random_tree(n: int, gen: torch.Generator, chain: int = 1) -> tuple[list[int], torch.Tensor]:
    """A random topologically ordered tree (parent index < child index) whose first ``chain`` nodes are a
    path, and its ancestor relation."""
    parents = [i - 1 for i in range(min(n, chain))]
    parents += [int(torch.randint(0, i, (1,), generator=gen)) for i in range(len(parents), n)]
    return parents, ancestors_from_parents(parents)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("prefix", "n", "hq", "hkv", "d"),
                         [(0, 5, 3, 1, 64), (70, 6, 6, 2, 64), (33, 4, 2, 1, 128)])
def test_attention_matches_reference(dtype: torch.dtype, prefix: int, n: int, hq: int, hkv: int,
                                     d: int) -> None:
    from elesium.kernels.invariant_attention import invariant_tree_attention

    g = torch.Generator().manual_seed(prefix + n)
    _, anc = random_tree(n, g)
    cap = prefix + n + 40
    q = torch.randn(1, hq, n, d, generator=g).to(dtype)
    k = torch.randn(1, hkv, cap, d, generator=g).to(dtype)
    v = torch.randn(1, hkv, cap, d, generator=g).to(dtype)
    ref = tree_attention_reference(q.double(), k.double(), v.double(), prefix, anc)
    for splits in (1, 3):
        out = invariant_tree_attention(q, k, v, prefix, anc, num_splits=splits)
        assert rel_err(out, ref) < TOL[dtype], splits
    out = invariant_tree_attention(q, k, v, torch.tensor(prefix), anc, num_splits=2)  # prefix in a tensor
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_node_equals_its_one_token_decode(dtype: torch.dtype) -> None:
    """Each node of an N-node tree gets, bitwise, what decoding it alone after its path would give:
    a cache holding the prefix, then the node's ancestors root-first in contiguous slots, N = 1."""
    from elesium.kernels.invariant_attention import invariant_tree_attention

    g = torch.Generator().manual_seed(11)
    prefix, n, hq, hkv, d, cap = 59, 10, 4, 2, 64, 160
    parents, anc = random_tree(n, g, chain=5)  # paths up to depth >= 4 cross the block boundary at 64
    q = torch.randn(1, hq, n, d, generator=g).to(dtype)
    k = torch.randn(1, hkv, cap, d, generator=g).to(dtype)
    v = torch.randn(1, hkv, cap, d, generator=g).to(dtype)
    tree = invariant_tree_attention(q, k, v, prefix, anc, num_splits=2)
    one = torch.ones(1, 1, dtype=torch.bool)
    for node in range(n):
        path = torch.nonzero(anc[node]).flatten()  # root-first, ends with the node itself
        kk, vv = k.clone(), v.clone()
        kk[:, :, prefix:prefix + len(path)] = k[:, :, prefix + path]
        vv[:, :, prefix:prefix + len(path)] = v[:, :, prefix + path]
        alone = invariant_tree_attention(q[:, :, node:node + 1], kk, vv, prefix + len(path) - 1, one,
                                         num_splits=2)
        assert torch.equal(alone[:, :, 0], tree[:, :, node]), f"node {node} (depth {len(path) - 1})"


# -- fused elementwise kernels (kernels/fused_pointwise.py, runtime/fused.py) ------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("offset_on_device", [False, True])
def test_rope_qkv_to_cache_matches_reference(dtype: torch.dtype, offset_on_device: bool) -> None:
    """q comes back rotated; k (rotated) and v land in slots offset..offset+N of every batch row, and
    no other slot changes."""
    from elesium.inference.runtime.config import ModelConfig
    from elesium.inference.runtime.model import rope_tables
    from elesium.kernels.fused_pointwise import rope_qkv_to_cache, rope_qkv_to_cache_reference

    g = torch.Generator().manual_seed(5)
    b, n, hq, hkv, d, cap, offset = 2, 7, 3, 1, 64, 40, 21
    config = ModelConfig(vocab_size=8, hidden_size=hq * d, intermediate_size=8, num_layers=1, num_heads=hq,
                         num_kv_heads=hkv, head_dim=d, max_position_embeddings=64)
    cos_t, sin_t = rope_tables(config, 64)
    positions = torch.randint(0, 64, (b, n), generator=g)
    qkv = torch.randn(b, n, (hq + 2 * hkv) * d, generator=g).to(dtype)
    caches = [torch.randn(b, hkv, cap, d, generator=g).to(dtype) for _ in range(2)]
    ours, ref = [c.clone() for c in caches], [c.clone() for c in caches]
    off = torch.tensor(offset) if offset_on_device else offset
    q = rope_qkv_to_cache(qkv, cos_t[positions], sin_t[positions], *ours, off, hq, hkv)
    q_ref = rope_qkv_to_cache_reference(qkv, cos_t[positions], sin_t[positions], *ref, offset, hq, hkv)
    assert q.shape == (b, hq, n, d) and q.dtype == dtype
    assert rel_err(q, q_ref) < TOL[dtype]
    for mine, theirs, before in zip(ours, ref, caches, strict=True):
        assert rel_err(mine[:, :, offset:offset + n], theirs[:, :, offset:offset + n]) < TOL[dtype]
        assert torch.equal(mine[:, :, :offset], before[:, :, :offset])
        assert torch.equal(mine[:, :, offset + n:], before[:, :, offset + n:])
    assert torch.equal(ours[1][:, :, offset:offset + n], ref[1][:, :, offset:offset + n])  # v is copied as is
    with pytest.raises(ValueError, match="does not hold"):
        rope_qkv_to_cache(qkv[..., :-1], cos_t[positions], sin_t[positions], *ours, off, hq, hkv)
    # q_out: the queries written into a slice of a larger buffer (the drafter tree's level rows), the
    # rows around it untouched, the same values as the allocated q and the caches written the same way.
    buffer = torch.randn(b, hq, n + 9, d, generator=g).to(dtype)
    before_buf, into = buffer.clone(), [c.clone() for c in caches]
    got = rope_qkv_to_cache(qkv, cos_t[positions], sin_t[positions], *into, off, hq, hkv,
                            q_out=buffer[:, :, 4:4 + n])
    assert got.data_ptr() == buffer[:, :, 4:4 + n].data_ptr() and torch.equal(buffer[:, :, 4:4 + n], q)
    assert torch.equal(buffer[:, :, :4], before_buf[:, :, :4]) and torch.equal(buffer[:, :, 4 + n:],
                                                                               before_buf[:, :, 4 + n:])
    assert all(torch.equal(a, c) for a, c in zip(into, ours, strict=True))
    with pytest.raises(ValueError, match="unit last stride"):
        rope_qkv_to_cache(qkv, cos_t[positions], sin_t[positions], *into, off, hq, hkv,
                          q_out=buffer[:, :, 4:4 + n].transpose(-1, -2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_and_swiglu_match_reference_and_are_row_invariant(dtype: torch.dtype) -> None:
    from elesium.kernels.fused_pointwise import add_rms_norm, add_rms_norm_reference, swiglu, swiglu_reference

    g = torch.Generator().manual_seed(9)
    x = (torch.randn(1, 23, 96, generator=g) * 3).to(dtype)
    delta = torch.randn(1, 23, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    total, normed = add_rms_norm(x, delta, w, 1e-5)
    total_ref, normed_ref = add_rms_norm_reference(x, delta, w, 1e-5)
    assert torch.equal(total, total_ref)  # one rounding of an exact fp32 sum, as torch's add
    assert rel_err(normed, normed_ref) < TOL[dtype]
    gate_up = (torch.randn(1, 23, 2 * 1100, generator=g) * 2).to(dtype)  # two column blocks, a ragged tail
    act = swiglu(gate_up)
    assert act.shape == (1, 23, 1100)
    assert rel_err(act, swiglu_reference(gate_up.double())) < TOL[dtype]
    for i in (0, 11, 22):
        one_total, one_normed = add_rms_norm(x[:, i:i + 1], delta[:, i:i + 1], w, 1e-5)
        assert torch.equal(one_total[0, 0], total[0, i]) and torch.equal(one_normed[0, 0], normed[0, i])
        assert torch.equal(swiglu(gate_up[:, i:i + 1])[0, 0], act[0, i])
    with pytest.raises(ValueError, match="differ"):
        add_rms_norm(x, delta[:, :3], w, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_rope_reference_is_the_models_rope(dtype: torch.dtype) -> None:
    """kernels/ restate RoPE rather than import the engine's: the two must stay the same function."""
    from elesium.inference.runtime.model import apply_rope
    from elesium.kernels.fused_pointwise import rope_reference

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, 16, generator=g).to(dtype)
    cos, sin = torch.randn(2, 1, 5, 16, generator=g), torch.randn(2, 1, 5, 16, generator=g)
    assert torch.equal(rope_reference(x, cos, sin), apply_rope(x, cos, sin))


@pytest.mark.parametrize("invariant", [False, True])
def test_fused_forward_computes_the_models_forward(invariant: bool) -> None:
    """runtime/fused.py against Transformer.forward on a random fp32 model: a prompt chunk, then a tree
    step at an offset held in a tensor (the CUDA-graph path); hidden states and caches agree."""
    from elesium.inference.runtime.config import ModelConfig
    from elesium.inference.runtime.fused import fused_forward
    from elesium.inference.runtime.invariant import apply_invariant_numerics
    from elesium.inference.runtime.model import Transformer

    torch.manual_seed(4)
    config = ModelConfig(vocab_size=50, hidden_size=128, intermediate_size=96, num_layers=3, num_heads=2,
                         num_kv_heads=1, head_dim=64, max_position_embeddings=128)
    model = apply_invariant_numerics(Transformer(config).eval().requires_grad_(False), invariant)
    for layer in model.layers:  # non-trivial norm weights, so a wrong norm cannot pass
        layer.attn_norm.weight.uniform_(0.5, 1.5)
        layer.mlp_norm.weight.uniform_(0.5, 1.5)
    model.norm.weight.uniform_(0.5, 1.5)
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 50, (1, 13), generator=g)
    parents, anc = random_tree(9, g, chain=3)
    depth = anc.sum(1) - 1
    tree_tokens = torch.randint(0, 50, (1, 9), generator=g)
    ours, ref = model.new_cache(64), model.new_cache(64)
    h_ours = fused_forward(model, prompt, torch.arange(13), ours, 0, model.causal(13))
    h_ref = model(prompt, torch.arange(13), ref, 0)
    assert rel_err(h_ours, h_ref) < 1e-5
    h_ours = fused_forward(model, tree_tokens, 13 + depth, ours, torch.tensor(13), anc)
    h_ref = model(tree_tokens, 13 + depth, ref, 13, anc)
    assert rel_err(h_ours, h_ref) < 1e-5
    assert rel_err(ours.k[:, :, :, :22], ref.k[:, :, :, :22]) < 1e-5
    assert rel_err(ours.v[:, :, :, :22], ref.v[:, :, :, :22]) < 1e-5
    assert model.fused_pointwise is invariant  # the switch that routes CUDA forwards through it


@pytest.mark.parametrize("root_on_device", [False, True])
def test_fused_drafter_tree_levels_compute_the_plain_levels(root_on_device: bool) -> None:
    """drafters/drafter_tree.py's fused levels (the kernels above) against its plain levels on a random fp32
    drafter: the same tree, log-probabilities and drafter-cache writes, eager (int root) and static."""
    from elesium.inference.drafters.attention_drafter import FeatureDrafter
    from elesium.inference.drafters.drafter_tree import DrafterTree
    from elesium.inference.runtime.config import ModelConfig
    from elesium.inference.runtime.model import Transformer

    torch.manual_seed(5)
    config = ModelConfig(vocab_size=50, hidden_size=128, intermediate_size=96, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=64, max_position_embeddings=128)
    model = Transformer(config).eval().requires_grad_(False)
    drafter = FeatureDrafter.for_model(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    tree = DrafterTree(drafter, depth=4).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(9)
    first = torch.randn(1, 128, generator=g)
    token = torch.tensor([7])
    caches = []
    for _ in range(2):
        k, v = drafter.new_cache(64 + tree.scratch_slots, "cpu", torch.float32)
        k.normal_(generator=g) if not caches else k.copy_(caches[0][0])
        v.normal_(generator=g) if not caches else v.copy_(caches[0][1])
        caches.append((k, v))
    root = torch.tensor(20) if root_on_device else 20
    with torch.inference_mode():
        plain = tree.expand(model, first, token, 4, 3, caches[0], root, fused=False)
        fused = tree.expand(model, first, token, 4, 3, caches[1], root, fused=True)
    assert torch.equal(plain[0], fused[0]) and torch.equal(plain[2], fused[2])
    assert rel_err(fused[1], plain[1]) < 1e-5
    for a, b in zip(caches[0], caches[1]):
        assert rel_err(b[:, :, :21 + 3 * 4], a[:, :, :21 + 3 * 4]) < 1e-5
