"""Hydra heads on tiny synthetic models: identity at init, own weights, teacher forcing, and the
level-by-level drafting (fast path) against teacher forcing (reference) on random weights."""

from __future__ import annotations

import math

import pytest
import torch

from elesium.inference.decoding.drafts import ExpandedDrafts, FactoredDrafts, contains
from elesium.inference.decoding.tree import Tree, restricted, top_paths
from elesium.inference.drafters.files import load_heads, read_manifest, save_heads
from elesium.inference.drafters.hydra import HydraHeads
from elesium.inference.training.head_training import cache_hidden_states
from helpers import SHA, VOCAB, cycle_records, tiny_model
from test_heads import fit_briefly

CONDITIONINGS = ["concat", "chain"]


def randomised(heads: HydraHeads, seed: int, scale: float = 0.3) -> HydraHeads:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return heads.eval()


@pytest.mark.parametrize("conditioning", CONDITIONINGS)
def test_untrained_hydra_heads_reproduce_lm_head(conditioning):
    model = tiny_model()
    heads = HydraHeads(32, num_heads=3, num_layers=2, conditioning=conditioning)
    hidden = torch.randn(5, 32)
    path = torch.randint(VOCAB, (5, 3))
    out = heads.teacher_forced(model, hidden, path)
    assert out.shape == (3, 5, 32)
    for k in range(3):  # R = [I 0 ...] and W = 0: the head returns h_t whatever the path
        torch.testing.assert_close(out[k], hidden, rtol=0, atol=0)


def test_hydra_blocks_own_their_weights_and_grow_with_depth():
    heads = HydraHeads(32, num_heads=3, num_layers=2, conditioning="concat")
    ptrs = [p.data_ptr() for p in heads.parameters()]
    assert len(ptrs) == len(set(ptrs))
    # Head k's first block reads [h; e_1 .. e_{k+1}]; "chain" reads [s_{k-1}; e_{k+1}] at every depth.
    assert [h[0].linear.in_features for h in heads.heads] == [64, 96, 128]
    chain = HydraHeads(32, num_heads=3, conditioning="chain")
    assert [h[0].linear.in_features for h in chain.heads] == [64, 64, 64]


@pytest.mark.parametrize("conditioning", CONDITIONINGS)
def test_heads_read_the_path(conditioning):
    """Trained (here: random) heads give different outputs for different earlier tokens."""
    model = tiny_model()
    heads = randomised(HydraHeads(32, num_heads=2, conditioning=conditioning), seed=0)
    hidden = torch.randn(1, 32).expand(2, 32)
    path = torch.tensor([[1, 2], [1, 3]])
    out = heads.teacher_forced(model, hidden, path)
    torch.testing.assert_close(out[0, 0], out[0, 1])  # head 1 sees only x_{t+1}: same
    assert not torch.allclose(out[1, 0], out[1, 1])   # head 2 also sees x_{t+2}: differs


@pytest.mark.parametrize("conditioning", CONDITIONINGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expand_matches_teacher_forcing(conditioning, seed):
    """Every list the batched drafting produces is the top-k of teacher forcing on that path."""
    model = tiny_model(seed)
    heads = randomised(HydraHeads(32, num_heads=3, conditioning=conditioning), seed=seed + 10)
    hidden, first, width, k = torch.randn(32), int(torch.randint(VOCAB, ()).item()), 3, 5
    tokens, logprobs, parents = heads.expand(model, hidden, torch.tensor([first]), width, k)
    drafts = ExpandedDrafts.from_expansion(tokens.tolist(), logprobs.tolist(), parents.tolist(), width)
    assert len(drafts.children) == 1 + 2 * width
    cumulative: dict[tuple[int, ...], float] = {(): 0.0}
    for path, (toks, lps) in sorted(drafts.children.items(), key=lambda kv: len(kv[0])):
        seq = [first] + [drafts.token(path[:i + 1]) for i in range(len(path))]
        padded = torch.tensor(seq + [0] * (3 - len(seq)))[None]
        ref = torch.log_softmax(model.logits(heads.teacher_forced(model, hidden[None], padded)[len(path), 0]),
                                -1)
        top = torch.topk(ref, k)
        assert toks == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(lps), top.values, rtol=1e-5, atol=1e-5)
        for r, lp in enumerate(lps):
            cumulative[path + (r,)] = cumulative[path] + lp
    # Expanded nodes are exactly the best `width` candidates of their level by total log-probability.
    for depth in (1, 2):
        level = [p for p in cumulative if len(p) == depth]
        best = sorted(level, key=cumulative.__getitem__, reverse=True)[:width]
        assert {p for p in drafts.children if len(p) == depth} == set(best)


@pytest.mark.parametrize("conditioning", CONDITIONINGS)
def test_a_shallower_expansion_is_the_full_one_cut_short(conditioning):
    """``levels``: the first levels of a full expansion, row for row, and no more rows."""
    model = tiny_model(3)
    heads = randomised(HydraHeads(32, num_heads=4, conditioning=conditioning), seed=13)
    hidden, first, width, k = torch.randn(32), torch.tensor([7]), 3, 4
    full = heads.expand(model, hidden, first, width, k)
    rows_by_level = [1, 3, 3, 3]
    for levels in (1, 2, 3, 4, 9):
        part = heads.expand(model, hidden, first, width, k, levels=levels)
        rows = sum(rows_by_level[:levels])
        assert part[0].shape[0] == rows
        for got, want in zip(part, full):
            assert torch.equal(got, want[:rows])


def test_draft_levels_follow_the_deepest_tree_the_policy_can_build():
    from elesium.inference.decoding.tree_policy import TreePolicy

    assert TreePolicy(kind="static", static_paths=((0,), (0, 0))).draft_levels(4) == 2
    assert TreePolicy(kind="static", static_paths=((0,), (1,), (0, 0), (0, 0, 0))).draft_levels(2) == 2
    assert TreePolicy(kind="dynamic", max_nodes=3).draft_levels(4) == 2
    assert TreePolicy(kind="dynamic", max_nodes=64).draft_levels(4) == 4
    assert TreePolicy(kind="dynamic", max_nodes=1).draft_levels(4) == 1


def test_top_paths_over_expanded_drafts_equals_brute_force():
    children = {(): ([5, 6, 7], [-0.2, -1.0, -2.5]), (0,): ([1, 2], [-0.1, -3.0]),
                (1,): ([3, 4], [-0.4, -0.5]),
                (0, 0): ([9], [-0.05])}
    drafts = ExpandedDrafts(children)
    every = [p for p in [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0)] if contains(drafts, p)]
    score = {p: sum(drafts.score(p[:i + 1]) for i in range(len(p))) for p in every}
    for budget in range(1, len(every) + 2):
        tree = top_paths(drafts, budget)
        assert set(tree.paths[1:]) == set(sorted(every, key=score.__getitem__, reverse=True)[:budget - 1])
    assert drafts.token((1, 1)) == 4 and not contains(drafts, (2, 0))
    # A static tree keeps only the nodes that were drafted this step.
    static = Tree.from_paths([(0, 0, 0), (2, 0), (1, 1)])
    assert set(restricted(static, drafts).paths) == {(), (0,), (0, 0), (0, 0, 0), (1,), (1, 1), (2,)}
    # Medusa's factored drafts answer the same questions.
    factored = FactoredDrafts([[1, 2], [3, 4]],
                              [[math.log(0.6), math.log(0.3)], [math.log(0.5), math.log(0.1)]])
    assert factored.num_children((1,)) == 2 and factored.num_children((1, 0)) == 0
    assert factored.token((1, 0)) == 3


@pytest.mark.parametrize(("conditioning", "loss"), [("concat", "ce"), ("chain", "ce"), ("concat", "kl")])
def test_hydra_training_lowers_the_loss(conditioning, loss):
    """CE to the data's tokens; KL to the (random) base model's own distribution, its actual target."""
    model = tiny_model()
    recs = cycle_records()
    cache = cache_hidden_states(model, [(r["prompt_ids"], r["response_ids"]) for r in recs])
    heads = HydraHeads(32, num_heads=2, conditioning=conditioning)
    before, after, top1_before, top1_after = fit_briefly(heads, model, cache, loss, lr=1e-2, measure=loss,
                                                         head=1)
    assert after < 0.7 * before
    if loss == "ce":
        assert top1_after > top1_before + 0.2


def test_hydra_save_load_round_trip(tmp_path):
    heads = randomised(HydraHeads(32, num_heads=3, num_layers=2, conditioning="chain"), seed=4)
    save_heads(heads, tmp_path / "h", {"base_model": {"sha256": SHA}})
    loaded = load_heads(tmp_path / "h", base_sha256=SHA)
    assert isinstance(loaded, HydraHeads) and loaded.conditioning == "chain" and loaded.num_layers == 2
    model = tiny_model()
    hidden, path = torch.randn(4, 32), torch.randint(VOCAB, (4, 3))
    torch.testing.assert_close(loaded.teacher_forced(model, hidden, path),
                               heads.teacher_forced(model, hidden, path),
                               rtol=0, atol=0)
    assert read_manifest(tmp_path / "h")["heads"]["kind"] == "hydra"

