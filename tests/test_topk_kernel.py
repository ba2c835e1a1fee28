"""Drafting's two-stage top-k kernel (kernels/topk_logprobs.py) through Triton's interpreter.

It must give ``topk(log_softmax(x))``: the same tokens in the same order, log-probabilities equal to
float32 rounding, ties to the lower index, for any row count, a vocabulary that is not a multiple of the
slice width, and rows whose best tokens crowd into one slice. TRITON_INTERPRET must be set before Triton
is imported, hence the top of the file.
"""

from __future__ import annotations

import os
import sys

_TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402
import torch  # noqa: E402

from elesium.inference.drafters.top_logprobs import top_logprobs, top_logprobs_reference  # noqa: E402

# No skip without Triton: it is a dev dependency, and these tests are the kernels' only CPU check.


@pytest.fixture(autouse=True)
def _interpreted() -> None:
    if _TRITON_IMPORTED_TOO_EARLY:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set")


def _stable(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The reference's tokens with ties ordered by index (torch.topk leaves their order open)."""
    logp = torch.log_softmax(logits.float(), -1)
    return torch.sort(logp, dim=-1, descending=True, stable=True).indices[..., :k]


def _kernel(logits: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    from elesium.kernels.topk_logprobs import topk_logprobs

    return topk_logprobs(logits, k, chunk)


@pytest.mark.parametrize(("rows", "vocab", "k", "chunk", "dtype"),
                         [(1, 1000, 10, 128, torch.float32), (7, 3000, 8, 256, torch.float32),
                          (5, 2048, 10, 512, torch.float16), (3, 130, 4, 64, torch.float32)])
def test_kernel_is_topk_of_log_softmax(rows: int, vocab: int, k: int, chunk: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * 7 + vocab + k)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    idx, val = _kernel(logits, k, chunk)
    ref_idx, ref_val = top_logprobs_reference(logits, k)
    assert idx.dtype == torch.int64 and val.dtype == torch.float32 and idx.shape == (rows, k)
    assert torch.equal(idx, _stable(logits, k))  # float16 logits tie often: lower index first
    assert torch.equal(idx.sort(-1).values, ref_idx.sort(-1).values) or dtype == torch.float16
    torch.testing.assert_close(val, ref_val, rtol=0, atol=2e-5)


def test_best_tokens_in_one_slice_and_ties_to_the_lower_index() -> None:
    """All k best in one slice (the first stage must keep k per slice, not fewer), exact ties inside and
    across slices (lower index first), and leading dimensions."""
    logits = torch.full((2, 3, 600), -5.0)
    logits[0, 0, 200:210] = torch.arange(10, 0, -1).float()  # ten best, all in slice 1 (of width 128)
    logits[0, 1, [7, 300, 150, 599]] = 3.0  # a four-way tie across slices
    logits[1, 2, 5] = float("-inf")
    idx, val = _kernel(logits, 6, 128)
    assert idx.shape == val.shape == (2, 3, 6)
    assert idx[0, 0].tolist() == list(range(200, 206))
    assert idx[0, 1, :4].tolist() == [7, 150, 300, 599]
    assert idx[0, 1, 4:].tolist() == [0, 1]  # then the -5.0 plateau from index 0, skipping 7
    assert idx[1, 2].tolist() == [0, 1, 2, 3, 4, 6]  # the -inf logit is never picked
    _, ref_val = top_logprobs_reference(logits, 6)
    torch.testing.assert_close(val, ref_val, rtol=0, atol=2e-5)
    assert torch.equal(idx, _stable(logits, 6))


def test_torch_slice_form_agrees_with_the_kernel() -> None:
    """``top_logprobs`` with a chunk on a CPU tensor (the torch slice form, which non-CUDA devices run)
    selects what the kernel selects."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 2500, generator=g) * 3
    torch_idx, torch_val = top_logprobs(logits, 10, 256)
    idx, val = _kernel(logits, 10, 256)
    assert torch.equal(idx, torch_idx)
    torch.testing.assert_close(val, torch_val, rtol=0, atol=2e-5)


@pytest.mark.parametrize("chunk", [100, 4])
def test_bad_chunk_is_refused(chunk: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        _kernel(torch.zeros(1, 64), 8, chunk)
