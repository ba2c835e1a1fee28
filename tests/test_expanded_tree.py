"""The array tree choice for Hydra heads (expanded_tree.py) against the general path it replaces.

``TreePolicy.build_expanded`` must give the tree that ``TreePolicy.build(ExpandedDrafts.from_expansion
(...))`` gives, node for node, with the same node tokens and ancestor matrix: on random expansions of
every shape the engine drafts (widths, ranks, levels), calibrations and cost curves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elesium.inference.decoding.drafts import ExpandedDrafts
from elesium.inference.decoding.expanded_tree import Expansion, best_candidates
from elesium.inference.decoding.tree_policy import CostCurve, TreePolicy


def random_expansion(rng: np.random.Generator, levels: int, width: int,
                     k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arrays shaped as HydraHeads.expand returns them: level 0 one row, then min(width, rows * k) rows
    per level, each extending a distinct candidate of the level before; sorted log-probabilities."""
    tokens, logprobs, parents = [], [], []
    rows = 1
    for level in range(levels):
        if level > 0:
            take = min(width, rows * k)
            parents.append(rng.choice(rows * k, size=take, replace=False))
            rows = take
        else:
            parents.append(np.array([-1]))
        logits = rng.normal(size=(rows, 40)) * 2.5
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        top = np.argsort(-logp, axis=1)[:, :k]
        tokens.append(top)
        logprobs.append(np.take_along_axis(logp, top, axis=1))
    return np.concatenate(tokens), np.concatenate(logprobs).astype(np.float32), np.concatenate(parents)


@pytest.mark.parametrize("seed", range(40))
def test_array_tree_is_the_best_first_tree(seed: int) -> None:
    rng = np.random.default_rng(seed)
    levels, width, k = int(rng.integers(1, 6)), int(rng.integers(1, 10)), int(rng.integers(1, 11))
    temperature = float(rng.uniform(0.5, 2.0))
    tokens, logprobs, parents = random_expansion(rng, levels, width, k)
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    slope, power = float(rng.uniform(0, 0.05)), float(rng.uniform(0.5, 1.5))
    cost = CostCurve(sizes, [1.0 + slope * s ** power + float(rng.uniform(0, 0.1)) for s in sizes])
    policy = TreePolicy(max_nodes=int(rng.choice([2, 8, 24, 64, 128])), min_nodes=int(rng.integers(1, 4)),
                        expand_width=width, cost=cost, calibration=float(rng.uniform(0.3, 3.0)))
    twin = TreePolicy(max_nodes=policy.max_nodes, min_nodes=policy.min_nodes, expand_width=width, cost=cost,
                      calibration=policy.calibration)

    drafts = ExpandedDrafts.from_expansion(tokens.tolist(), logprobs.tolist(), parents.tolist(), width,
                                           temperature)
    expected = policy.build(drafts)
    tree, drafted, ancestors = twin.build_expanded(
        Expansion.from_device(torch.from_numpy(tokens), torch.from_numpy(logprobs), torch.from_numpy(parents),
                              width, temperature))
    assert tree == expected, f"levels {levels}, width {width}, k {k}"
    assert drafted == [drafts.token(p) for p in expected.paths[1:]]
    assert torch.equal(ancestors, expected.ancestors())
    assert twin.predicted == pytest.approx(policy.predicted, rel=1e-9, abs=1e-12)


def test_ties_keep_the_tree_prefix_closed() -> None:
    """A draft of probability 1 (log-probability 0) ties its parent: the parent must still come first."""
    tokens = np.array([[5, 6], [7, 8]])
    logprobs = np.array([[-0.5, -0.5], [0.0, -3.0]], dtype=np.float32)
    expansion = Expansion.from_arrays(tokens, logprobs, np.array([-1, 0]), width=1)
    chosen = best_candidates(expansion, 3).tolist()
    assert chosen.index(0) < chosen.index(2)  # candidate 2 (token 7) extends candidate 0 at the same score
    tree, drafted, _ = TreePolicy(max_nodes=4, cost=CostCurve.flat()).build_expanded(expansion)
    assert tree.parents == (-1, 0, 0, 1) and drafted == [5, 6, 7]


@pytest.mark.parametrize("seed", range(5))
def test_packed_read_back_is_the_three_read_backs(seed: int) -> None:
    """``host_arrays``' one-transfer form (what a CUDA step uses) gives the three arrays exactly: token ids
    up to the vocabulary's size, float32 log-probabilities (-inf included), parents with -1."""
    from elesium.inference.decoding.expanded_tree import host_arrays

    g = torch.Generator().manual_seed(seed)
    rows, k = 1 + 4 * seed, 8
    tokens = torch.randint(0, 49152, (rows, k), generator=g)
    logprobs = torch.randn(rows, k, generator=g) * 7 - 3
    logprobs[0, -1] = float("-inf")
    parents = torch.randint(-1, rows * k, (rows,), generator=g)
    plain = host_arrays(tokens, logprobs, parents, packed=False)
    packed = host_arrays(tokens, logprobs, parents, packed=True)
    for a, b in zip(plain, packed, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
