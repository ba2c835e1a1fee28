"""The Triton tree-attention kernel against the reference, on the CPU through Triton's interpreter.

TRITON_INTERPRET must be set before Triton is imported, so it is set here at the top and the kernel
module is imported inside the tests (the dispatcher imports it lazily too). The interpreter has no
bf16, so fp32 and fp16 stand in; bf16 is checked on the GPU by kernels/bench_tree_attention.py.
"""

# ruff: noqa: E402
from __future__ import annotations

import os
import sys

# Triton's own @jit helpers (tl.zeros, ...) are bound when triton is first imported, so the
# interpreter only works if the variable was set before that import anywhere in the session.
_TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ.setdefault("TRITON_INTERPRET", "1")

# The imports below must follow the environment variable (E402 is off for this file).
import importlib
import zlib
from types import ModuleType

import pytest
import torch

from elesium.kernels.tree_attention import (
    masked_attention,
    tree_attention,
    tree_attention_mask,
    tree_attention_reference,
)
from helpers import ancestors_from_parents

# The module (the package re-exports its function under the same name).
tree_attention_module = importlib.import_module("elesium.kernels.tree_attention")

# No skip when triton is missing: it is a dev dependency (pyproject's dev extras), so `./dev test` always
# has it, and a skip would let a broken environment pass for a tested kernel.

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _kernel() -> ModuleType:
    if _TRITON_IMPORTED_TOO_EARLY:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; set it in tests/conftest.py")
    from elesium.kernels import triton_tree_attention

    return triton_tree_attention


def make_tree(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "chain":
        parents = [i - 1 for i in range(n)]
    elif kind == "star":
        parents = [-1] + [0] * (n - 1)
    elif kind == "random":
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    elif kind == "permuted":
        # A random tree whose node ids are not in topological order.
        base = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        perm = torch.randperm(n, generator=gen).tolist()
        parents = [-1] * n
        for i, p in enumerate(base):
            parents[perm[i]] = perm[p] if p >= 0 else -1
    else:
        raise ValueError(kind)
    return ancestors_from_parents(parents)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def reference64(q, k, v, prefix_len, anc, scale=None) -> torch.Tensor:
    p = int(prefix_len)
    return tree_attention_reference(q.double(), k.double(), v.double(), p, anc, scale)


# (dtype, tree, n, hq, hkv, d, prefix, prefix_as_tensor)
CASES = [
    (torch.float32, "chain", 8, 2, 2, 64, 0, False),
    (torch.float32, "star", 12, 6, 2, 64, 37, True),
    (torch.float32, "random", 40, 4, 1, 128, 70, False),
    (torch.float32, "permuted", 9, 8, 2, 64, 129, True),
    (torch.float32, "random", 33, 3, 1, 128, 0, True),
    (torch.float16, "chain", 16, 4, 4, 128, 50, True),
    (torch.float16, "star", 20, 3, 1, 64, 0, False),
    (torch.float16, "random", 70, 3, 1, 64, 65, True),
    (torch.float16, "random", 24, 8, 2, 128, 100, False),
    (torch.float16, "permuted", 31, 9, 3, 64, 63, False),
]


@pytest.mark.parametrize("dtype,tree,n,hq,hkv,d,prefix,as_tensor", CASES)
def test_kernel_matches_reference(dtype, tree, n, hq, hkv, d, prefix, as_tensor) -> None:
    mod = _kernel()
    gen = torch.Generator().manual_seed(zlib.crc32(f"{tree}-{n}-{hq}-{d}-{prefix}".encode()))
    capacity = prefix + n + 11  # slots past prefix + N are garbage the kernel must not read
    q = torch.randn(1, hq, n, d, generator=gen).to(dtype)
    k = torch.randn(1, hkv, capacity, d, generator=gen).to(dtype)
    v = torch.randn(1, hkv, capacity, d, generator=gen).to(dtype)
    k[:, :, prefix + n :] = float("nan")
    v[:, :, prefix + n :] = float("nan")
    anc = make_tree(tree, n, gen)
    pl = torch.tensor(prefix) if as_tensor else prefix
    out = torch.full_like(q, float("nan"))
    got = mod.tree_attention_triton(q, k, v, pl, anc, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all(), "output not fully written"
    assert rel_err(out, reference64(q, k, v, prefix, anc)) < TOL[dtype]


def test_many_splits_batches_and_strided_q() -> None:
    """Forced split count well above the live blocks (empty splits), B=2, q as a transposed view."""
    mod = _kernel()
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv, n, d, prefix = 2, 4, 2, 13, 64, 150
    capacity = 256
    q = torch.randn(b, n, hq, d, generator=gen).transpose(1, 2)  # [B, Hq, N, D], not contiguous
    k = torch.randn(b, hkv, capacity, d, generator=gen)
    v = torch.randn(b, hkv, capacity, d, generator=gen)
    anc = make_tree("random", n, gen)
    cfg = mod.choose_config(
        b, hq, hkv, n, d, capacity, q.dtype, q.device, num_prefix_splits=20
    )  # > 16: merge loops over chunks
    for pl in (torch.tensor(prefix), torch.tensor(0), torch.tensor(1)):
        out = torch.full((b, hq, n, d), float("nan"))
        mod.tree_attention_triton(q, k, v, pl, anc, out=out, config=cfg)
        assert torch.isfinite(out).all()
        assert rel_err(out, reference64(q, k, v, pl, anc)) < 1e-5


def test_scale_argument() -> None:
    mod = _kernel()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 5, 64, generator=gen)
    k = torch.randn(1, 1, 40, 64, generator=gen)
    v = torch.randn(1, 1, 40, 64, generator=gen)
    anc = make_tree("random", 5, gen)
    out = mod.tree_attention_triton(q, k, v, 30, anc, scale=0.37)
    assert rel_err(out, reference64(q, k, v, 30, anc, scale=0.37)) < 1e-5


@pytest.mark.parametrize("n", [1, 7, 32, 33, 64, 100, 256])
def test_pack_ancestor_bits_matches_dense(n: int) -> None:
    mod = _kernel()
    gen = torch.Generator().manual_seed(n)
    for kind in ("random", "permuted", "chain"):
        anc = make_tree(kind, n, gen)
        bits = mod.pack_ancestor_bits(anc)
        assert bits.dtype == torch.int32 and bits.shape == (n, (n + 31) // 32)
        j = torch.arange(n)
        unpacked = ((bits[:, j // 32] >> (j % 32)) & 1).bool()
        assert torch.equal(unpacked, anc)
    # Also a dense random relation, bit 31 included: the words are exact two's complement.
    rnd = torch.rand(n, n, generator=gen) < 0.5
    bits = mod.pack_ancestor_bits(rnd)
    j = torch.arange(n)
    assert torch.equal(((bits[:, j // 32] >> (j % 32)) & 1).bool(), rnd)


def test_mask_and_reference_agree_for_tensor_prefix() -> None:
    """The reference's two paths (int: sliced; tensor: full-capacity mask) define the same thing."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 4, 6, 64, generator=gen)
    k = torch.randn(1, 2, 50, 64, generator=gen)
    v = torch.randn(1, 2, 50, 64, generator=gen)
    anc = make_tree("random", 6, gen)
    a = tree_attention_reference(q, k, v, 20, anc)
    bb = tree_attention_reference(q, k, v, torch.tensor(20), anc)
    c = masked_attention(q, k, v, tree_attention_mask(20, anc, 50))
    assert torch.allclose(a, bb, atol=1e-6) and torch.allclose(a, c, atol=1e-6)


def test_dispatcher_override(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 3, 6, 64, generator=gen)
    k = torch.randn(1, 1, 30, 64, generator=gen)
    v = torch.randn(1, 1, 30, 64, generator=gen)
    anc = make_tree("random", 6, gen)
    ref = tree_attention_reference(q, k, v, 20, anc)
    # The choice is process-wide state (Settings.tree_attention, set at Engine.load): restore it.
    monkeypatch.setattr(tree_attention_module, "_backend_choice", None)
    tree_attention_module.set_backend("reference")
    assert torch.equal(tree_attention(q, k, v, 20, anc), ref)
    tree_attention_module.set_backend("auto")
    assert torch.equal(tree_attention(q, k, v, 20, anc), ref)  # CPU tensors: reference
    tree_attention_module.set_backend("triton")  # interpreter runs it on the CPU
    assert rel_err(tree_attention(q, k, v, torch.tensor(20), anc), ref.double()) < 1e-5
    bits = _kernel().pack_ancestor_bits(anc)
    assert rel_err(tree_attention(q, k, v, 20, anc, ancestor_bits=bits), ref.double()) < 1e-5
    with pytest.raises(ValueError):
        tree_attention_module.set_backend("bogus")
