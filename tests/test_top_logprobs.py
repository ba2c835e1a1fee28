"""The drafting's top-k forms (inference/drafters/top_logprobs.py) against their definition.

``top_logprobs`` (a shift of the top logits, optionally selected in slices) must return the tokens that
``topk(log_softmax)`` returns, with the same log-probabilities up to rounding (the two sum the
exponentials in different orders: a few float32 ulps over 49,152 terms), on random logits, on
logits full of exact ties, with ``-inf`` entries and with a vocabulary that is not a multiple of the
slice width; and drafting through it must draft the same trees and keep greedy output vanilla's.
"""

from __future__ import annotations

import pytest
import torch

from elesium.inference.drafters.top_logprobs import top_logprobs, top_logprobs_reference
from test_feature_drafter import random_setup
from test_tree_chain import decode, setup  # noqa: F401  (setup is a fixture)


@pytest.mark.parametrize("shape", [(1, 49_152), (8, 49_152), (3, 1_000), (2, 4, 300)])
@pytest.mark.parametrize("k", [1, 8, 10])
@pytest.mark.parametrize("chunk", [None, 64, 1_024, 100_000])
def test_the_same_tokens_and_logprobs_as_the_definition(shape: tuple[int, ...], k: int,
                                                        chunk: int | None) -> None:
    gen = torch.Generator().manual_seed(sum(shape) + k)
    logits = torch.randn(shape, generator=gen) * 4
    idx, values = top_logprobs(logits, k, chunk)
    ref_idx, ref_values = top_logprobs_reference(logits, k)
    assert idx.shape == values.shape == (*shape[:-1], k)
    assert torch.equal(idx, ref_idx), "random logits have no ties: the very same tokens, best first"
    torch.testing.assert_close(values, ref_values, rtol=0, atol=5e-5)


@pytest.mark.parametrize("chunk", [None, 16, 50])
def test_exact_ties_give_a_valid_top_k(chunk: int | None) -> None:
    """Logits drawn from 5 values tie everywhere: any k of the best are right, none may repeat, and
    the log-probabilities are the definition's."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randint(0, 5, (6, 230), generator=gen).float()
    k = 9
    idx, values = top_logprobs(logits, k, chunk)
    _, ref_values = top_logprobs_reference(logits, k)
    torch.testing.assert_close(values, ref_values, rtol=0, atol=5e-5)
    for row in range(logits.shape[0]):
        assert len(set(idx[row].tolist())) == k, "a token was selected twice"
        kth = torch.topk(logits[row], k).values[-1]
        assert bool((logits[row, idx[row]] >= kth).all()), "a token below the k-th best was selected"
    torch.testing.assert_close(torch.log_softmax(logits, -1).gather(-1, idx), values, rtol=0, atol=5e-5)


def test_masked_logits_and_padding() -> None:
    """``-inf`` entries (a top-k or top-p filter's) are never chosen while k finite ones exist, also
    where the slices are padded with ``-inf``."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 1_003, generator=gen)
    logits[:, ::3] = float("-inf")
    idx, values = top_logprobs(logits, 8, 64)
    ref_idx, ref_values = top_logprobs_reference(logits, 8)
    assert torch.equal(idx, ref_idx) and bool(torch.isfinite(values).all())
    torch.testing.assert_close(values, ref_values, rtol=0, atol=5e-5)


def test_a_slice_narrower_than_k_is_refused() -> None:
    with pytest.raises(ValueError, match="narrower than k"):
        top_logprobs(torch.randn(2, 100), 8, 4)


@torch.no_grad()
@pytest.mark.parametrize("chunk", [8, 1_000])
def test_drafting_with_slices_drafts_the_same_tree(chunk: int) -> None:
    """``HydraHeads.expand`` through the sliced form: the same candidate tree as the reference form."""
    model, heads = random_setup(4)
    hidden, token, feature = torch.randn(32), torch.tensor([3]), torch.randn(1, 32)
    plain = heads.expand(model, hidden, token, 4, 3, first=feature)
    sliced = heads.expand(model, hidden, token, 4, 3, first=feature, topk_chunk=chunk)
    assert torch.equal(plain[0], sliced[0]) and torch.equal(plain[2], sliced[2])
    torch.testing.assert_close(plain[1], sliced[1], rtol=0, atol=5e-5)


@torch.inference_mode()
def test_chained_greedy_steps_with_sliced_drafting_equal_vanilla(setup: tuple) -> None:  # noqa: F811
    """The self-feeding step (its body run eagerly) with the sliced drafting: vanilla's tokens, and a
    graph of its own beside the reference form's."""
    from helpers import ChainRunner

    model, heads, want = setup
    runner = ChainRunner(model, model.new_cache(128), heads)
    runner.draft_topk_chunk = 8
    got, records, _ = decode(setup, 60, 16, runner)
    assert got == want[:60]
    assert [key[3] for key in runner.graphs] == [8], "the chain did not run with the sliced drafting"
    assert max(r.accepted_length for r in records) == 4
