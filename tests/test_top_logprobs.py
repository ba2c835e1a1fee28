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

from elesium.inference.drafters.top_logprobs import (
    best_paths,
    level_candidates,
    top_logprobs,
    top_logprobs_reference,
)
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


@pytest.mark.parametrize("chunk", [None, 64])
def test_a_logit_scale_drafts_from_the_tempered_distribution(chunk: int | None) -> None:
    """``level_candidates(..., logit_scale=s)`` is ``topk(log_softmax(s * logits))``: each row keeps its own
    candidates in the same order, only their log-probabilities move."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(11)) * 3
    idx, values = level_candidates(logits, 8, chunk, 1 / 0.7)
    ref_idx, ref_values = top_logprobs_reference(logits / 0.7, 8)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(values, ref_values, rtol=0, atol=5e-5)
    plain_idx, plain_values = level_candidates(logits, 8, chunk)
    assert torch.equal(idx, plain_idx)
    assert bool((values[:, 0] > plain_values[:, 0]).all()), "sharper: the best candidate gains mass"


def test_a_logit_scale_changes_which_parent_wins() -> None:
    """What the policy's ``draft_temperature`` (a scale of the log-probabilities) cannot do: row 0's best
    token has probability 0.35 at scale 1 against row 1's 0.48, and 0.60 against 0.50 at scale 3, so the
    one path kept by ``best_paths`` moves from row 1 to row 0."""
    logits = torch.tensor([[0.5, 0.0, 0.0, 0.0], [3.0, 3.0, 0.0, 0.0]])
    cum = torch.zeros(2)
    for scale, row in ((1.0, 1), (3.0, 0)):
        _, values = level_candidates(logits, 2, None, scale)
        _, rows, _ = best_paths(cum, values, 1, 2)
        assert rows.tolist() == [row]
        _, rows, _ = best_paths(cum, values * 0.5, 1, 2)
        assert rows.tolist() == [row], "a scale of the log-probabilities ranks the paths the same"


@torch.no_grad()
def test_the_heads_draft_with_their_logit_scale() -> None:
    """``HydraHeads.logit_scale`` reaches every level: level 0's log-probabilities are the tempered ones."""
    model, heads = random_setup(4)
    hidden, token, feature = torch.randn(32), torch.tensor([3]), torch.randn(1, 32)
    plain = heads.expand(model, hidden, token, 4, 3, first=feature)
    heads.logit_scale = 2.0
    scaled = heads.expand(model, hidden, token, 4, 3, first=feature)
    ref_idx, ref_values = top_logprobs_reference(model.logits(feature) * 2.0, 3)
    assert torch.equal(scaled[0][:1], ref_idx)
    torch.testing.assert_close(scaled[1][:1], ref_values, rtol=0, atol=5e-5)
    assert not torch.allclose(scaled[1], plain[1])


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
