"""The device tree choice and greedy acceptance (device_tree.py) against the host path they replace.

On random expansions of every shape the engine drafts: the chosen candidates and their scores must be
``best_candidates``'s exactly, the tree the same set of rank paths as ``tree_of``'s (numbered
differently), its ancestor matrix consistent with it, and the accepted path, committed tokens and
bonus those of ``verify_greedy`` on the host tree, for argmax vectors that accept at every depth.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elesium.inference.decoding.device_tree import (
    Candidates,
    ExpansionLayout,
    accept_greedy,
    best_first,
    best_first_by_sorting,
    candidate_scores,
    device_tree,
)
from elesium.inference.decoding.expanded_tree import Expansion, best_candidates, tree_of
from elesium.inference.decoding.verify import verify_greedy
from tests.test_expanded_tree import random_expansion


def _paths(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """Every node's token path from the root (root excluded), the numbering-free form of a tree."""
    out = []
    for node in range(len(tokens)):
        path = []
        while node != 0:
            path.append(tokens[node])
            node = parents[node]
        out.append(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_device_tree_and_acceptance_equal_the_host_path(seed: int) -> None:
    rng = np.random.default_rng(seed)
    levels, width, k = int(rng.integers(1, 6)), int(rng.integers(1, 10)), int(rng.integers(1, 11))
    temperature = float(rng.uniform(0.5, 2.0))
    tokens, logprobs, parents = random_expansion(rng, levels, width, k)
    layout = ExpansionLayout.of(levels, width, k)
    assert layout.rows == tokens.shape[0]
    count = int(rng.integers(1, layout.candidates + 1))

    host = Expansion.from_arrays(tokens, logprobs, parents, width, temperature)
    cand = candidate_scores(torch.from_numpy(logprobs), torch.from_numpy(parents), layout, temperature)
    assert torch.equal(cand.cum, torch.from_numpy(host.cum)), "scores differ from the host's float64 ones"
    assert torch.equal(cand.parent, torch.from_numpy(host.parent))
    assert torch.equal(cand.depth, torch.from_numpy(host.depth))
    chosen = best_first(cand, count)
    expected = best_candidates(host, count)
    assert chosen.tolist() == expected.tolist()
    assert best_first_by_sorting(cand, count).tolist() == expected.tolist()

    root = 7
    tree = device_tree(torch.tensor(root), torch.from_numpy(tokens), cand, chosen, levels)
    host_tree, host_drafted, host_anc = tree_of(host, expected)
    node_tokens = tree.tokens.tolist()
    parent = tree.parent.tolist()
    assert node_tokens[0] == root and parent[0] == 0
    assert all(parent[i] < i for i in range(1, len(parent))), "parents must precede children"
    host_tokens = [root, *host_drafted]
    assert sorted(_paths(node_tokens, parent)) == sorted(_paths(host_tokens, [0, *host_tree.parents[1:]]))
    assert tree.depth.tolist() == [len(p) for p in _paths(node_tokens, parent)]
    for i in range(len(node_tokens)):  # a row of the ancestor matrix: the node and its ancestors only
        seen, cur = {i}, i
        while cur != 0:
            cur = parent[cur]
            seen.add(cur)
        assert set(torch.nonzero(tree.ancestors[i]).flatten().tolist()) == seen
    assert int(tree.ancestors.sum()) == int(host_anc.sum())

    # Argmax vectors: the host tree's acceptance walk drives a random path as deep as it goes.
    for trial in range(6):
        greedy = rng.integers(0, 40, size=len(node_tokens))
        if trial % 2 == 0:  # follow random children so that deep paths are accepted too
            node = 0
            while True:
                kids = [c for c in range(len(node_tokens)) if c and parent[c] == node]
                if not kids:
                    break
                node_next = int(rng.choice(kids))
                greedy[node] = node_tokens[node_next]
                node = node_next
        # The same argmax per node, in the host tree's numbering (matched by token path).
        index = {p: i for i, p in enumerate(_paths(node_tokens, parent))}
        host_best = [int(greedy[index[p]]) for p in _paths(host_tokens, [0, *host_tree.parents[1:]])]
        verdict = verify_greedy(host_tree, host_tokens, host_best)
        got = accept_greedy(tree, torch.from_numpy(greedy), levels)
        length = int(got.length)
        assert length == len(verdict.path)
        assert int(got.bonus) == verdict.bonus
        committed = [host_tokens[n] for n in verdict.path[1:]] + [verdict.bonus]
        assert got.committed.tolist()[:length] == committed
        assert got.committed.tolist()[length:] == [verdict.bonus] * (levels + 1 - length)
        path = got.path.tolist()
        assert [node_tokens[n] for n in path[1:length]] == [host_tokens[n] for n in verdict.path[1:]]
        assert tree.depth[got.path[:length]].tolist() == list(range(length))
        assert path[length:] == [path[length - 1]] * (levels + 1 - length)


def test_a_tie_with_the_parent_keeps_the_tree_prefix_closed() -> None:
    """A draft of log-probability 0 ties its parent's score: the parent must still be chosen first."""
    tokens = torch.tensor([[5, 6], [7, 8]])
    logprobs = torch.tensor([[-0.5, -0.5], [0.0, -3.0]])
    layout = ExpansionLayout.of(2, 1, 2)
    cand = candidate_scores(logprobs, torch.tensor([-1, 0]), layout, 1.0)
    chosen = best_first(cand, 3)
    assert chosen.tolist() == [0, 1, 2]
    tree = device_tree(torch.tensor(1), tokens, cand, chosen, 2)
    assert tree.parent.tolist() == [0, 0, 0, 1] and tree.tokens.tolist() == [1, 5, 6, 7]


@pytest.mark.parametrize("seed", range(5))
def test_ranking_equals_sorting_under_many_ties(seed: int) -> None:
    """Scores from three values and depths from four: almost every comparison is a tie, so the order
    rests on the tie-breaks (shallower, then lower index), which the rank form must apply as the
    stable sorts do."""
    g = torch.Generator().manual_seed(seed)
    c = 120
    cand = Candidates(-torch.randint(1, 4, (c,), generator=g).double(), torch.full((c,), -1),
                      torch.randint(1, 5, (c,), generator=g))
    for count in (1, 7, 60, c):
        assert best_first(cand, count).tolist() == best_first_by_sorting(cand, count).tolist()
