"""Host-side fast paths of a speculative step against their references, on random trees and logits."""

from __future__ import annotations

import torch

from elesium.inference.decoding.tree import Tree
from elesium.inference.decoding.verify import verify_sampled, verify_sampled_reference
from elesium.inference.sampling import Sampler, SamplingParams


def ancestors_reference(tree: Tree) -> torch.Tensor:
    """The obvious per-node loop that ``Tree.ancestors`` replaces with one bitmask unpack."""
    anc = torch.zeros(tree.size, tree.size, dtype=torch.bool)
    for node in range(tree.size):
        anc[node, node] = True
        parent = tree.parents[node]
        if parent >= 0:
            anc[node] |= anc[parent]
    return anc


def test_sampled_verification_matches_its_reference():
    """The read-back-light walk takes the same decisions as the full-row reference, same uniforms."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        paths = {(int(torch.randint(3, (), generator=gen)),) for _ in range(3)}
        paths |= {p + (int(torch.randint(3, (), generator=gen)),) for p in list(paths) for _ in range(2)}
        tree = Tree.from_paths(sorted(paths))
        logits = torch.randn(tree.size, 12, generator=gen) * 2
        tokens = torch.randint(4, (tree.size,), generator=gen).tolist()  # small range: duplicate siblings
        params = SamplingParams(temperature=[0.5, 1.0, 1.5][trial % 3], top_p=[1.0, 0.9][trial % 2])
        a = verify_sampled(tree, tokens, logits, params, Sampler(trial))
        b = verify_sampled_reference(tree, tokens, logits, params, Sampler(trial))
        assert a == b, trial


def test_tree_masks_match_the_per_node_loop():
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        size = int(torch.randint(1, 140, (), generator=gen))
        parents = [-1] + [int(torch.randint(max(0, i - 6), i, (), generator=gen)) for i in range(1, size)]
        depths = [0] * size
        for i in range(1, size):
            depths[i] = depths[parents[i]] + 1
        tree = Tree(tuple(parents), tuple(depths), tuple([-1] + [0] * (size - 1)))
        assert torch.equal(tree.ancestors(), ancestors_reference(tree))
