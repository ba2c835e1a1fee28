"""Sampled acceptance on the device (``device_tree.accept_sampled``): the same walk as the host's, and
exact.

Two checks. On random trees of every shape the engine drafts, with random target distributions and
uniforms, the vectorised decisions must give the path and bonus of the sequential rejection walk
(``accept_sampled_reference``). And on a fixed small tree, the tokens a step commits must follow the
target distribution (chi-square on the joint of the first two tokens), while a walk that reuses one
uniform for every draw, the independence the exactness argument rests on, must fail the same test.
"""

from __future__ import annotations

import numpy as np
import torch

from elesium.inference.decoding.device_tree import (
    DeviceTree,
    ExpansionLayout,
    accept_sampled,
    accept_sampled_reference,
    best_first,
    candidate_scores,
    device_tree,
)
from elesium.inference.sampling import SamplingParams, target_probs
from tests.spec_harness import chi_square_p
from tests.test_expanded_tree import random_expansion

VOCAB = 40  # random_expansion's


def _random_tree(rng: np.random.Generator) -> tuple[DeviceTree, int]:
    levels, width, k = int(rng.integers(1, 6)), int(rng.integers(1, 10)), int(rng.integers(1, 11))
    tokens, logprobs, parents = random_expansion(rng, levels, width, k)
    layout = ExpansionLayout.of(levels, width, k)
    cand = candidate_scores(torch.from_numpy(logprobs), torch.from_numpy(parents), layout, 1.0)
    count = int(rng.integers(1, layout.candidates + 1))
    tree = device_tree(torch.tensor(3), torch.from_numpy(tokens), cand, best_first(cand, count), levels)
    return tree, levels


def _targets(rng: np.random.Generator, tree: DeviceTree, params: SamplingParams) -> torch.Tensor:
    """Random target rows in which one child of each node is likely, so that deep paths are accepted
    as well as rejected."""
    n = tree.tokens.numel()
    logits = torch.from_numpy(rng.normal(size=(n, VOCAB)).astype(np.float32)) * 1.5
    for node in range(1, n):
        if rng.random() < 0.6:
            logits[tree.parent[node], tree.tokens[node]] += 4.0
    return target_probs(logits, params)


def test_sampled_acceptance_is_the_sequential_walk() -> None:
    rng = np.random.default_rng(100)
    depths: list[int] = []
    for _ in range(48):
        tree, levels = _random_tree(rng)
        params = SamplingParams(temperature=float(rng.uniform(0.5, 1.5)), top_p=float(rng.choice([1.0, 0.8])))
        probs = _targets(rng, tree, params)
        for _trial in range(10):
            u = torch.from_numpy(rng.random(tree.tokens.numel()))
            acc = accept_sampled(tree, probs, u, levels)
            path, bonus = accept_sampled_reference(tree.parent.tolist(), tree.tokens.tolist(), probs,
                                                   u.tolist())
            length = int(acc.length)
            assert acc.path.tolist()[:length] == path and int(acc.bonus) == bonus
            padding = [path[-1]] * (levels + 1 - length)
            assert acc.path.tolist()[length:] == padding, "padded with the last node"
            committed = [int(tree.tokens[c]) for c in path[1:]] + [bonus]
            assert acc.committed.tolist()[:length] == committed
            assert float(probs[path[-1], bonus]) > 0.0, "the bonus must have mass at its node"
            depths.append(length - 1)
    assert max(depths) >= 2 and min(depths) == 0, f"both deep acceptance and rejection should occur: {depths}"


# A fixed tree over 6 tokens: the root's children hold 0, 1, 2; node 1 (token 0) has children 1, 3;
# node 2 (token 1) has child 0; node 4 (token 1, under node 1) has child 5.
PARENT = [0, 0, 0, 0, 1, 1, 2, 4]
TOKENS = [5, 0, 1, 2, 1, 3, 0, 5]
V = 6
SAMPLES = 10_000


def _fixed_tree() -> tuple[DeviceTree, torch.Tensor]:
    parent, tokens = torch.tensor(PARENT), torch.tensor(TOKENS)
    depth = torch.zeros(len(PARENT), dtype=torch.long)
    for c in range(1, len(PARENT)):
        depth[c] = depth[PARENT[c]] + 1
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    probs = target_probs(torch.randn(len(PARENT), V, generator=g) * 1.2, params)
    return DeviceTree(tokens, parent, depth, torch.eye(len(PARENT), dtype=torch.bool)), probs


def _expected_first_two(probs: torch.Tensor) -> dict[tuple[int, int | None], float]:
    """P(first committed token, second): the second is drawn at the first's node when the first is a
    child of the root (the residual never yields a child's token), else the step commits one token."""
    node_of = {TOKENS[c]: c for c in range(1, len(PARENT)) if PARENT[c] == 0}
    out: dict[tuple[int, int | None], float] = {}
    for x in range(V):
        px = float(probs[0, x])
        if x in node_of:
            for y in range(V):
                out[(x, y)] = px * float(probs[node_of[x], y])
        else:
            out[(x, None)] = px
    return out


def _first_two(tree: DeviceTree, probs: torch.Tensor, u: torch.Tensor) -> tuple[int, int | None]:
    acc = accept_sampled(tree, probs, u, 3)
    committed = acc.committed.tolist()
    return committed[0], committed[1] if int(acc.length) >= 2 else None


def _counts(uniforms: torch.Tensor) -> dict[tuple[int, int | None], int]:
    tree, probs = _fixed_tree()
    counts: dict[tuple[int, int | None], int] = {}
    for u in uniforms:
        key = _first_two(tree, probs, u)
        counts[key] = counts.get(key, 0) + 1
    return counts


@torch.inference_mode()
def test_sampled_acceptance_is_exact() -> None:
    _, probs = _fixed_tree()
    g = torch.Generator().manual_seed(11)
    counts = _counts(torch.rand(SAMPLES, len(PARENT), generator=g, dtype=torch.float64))
    accepted = sum(c for (x, _y), c in counts.items() if x in (0, 1, 2))
    assert 0.2 * SAMPLES < accepted < 0.95 * SAMPLES, "the root's children should be accepted and rejected"
    p = chi_square_p(counts, _expected_first_two(probs), SAMPLES)
    assert p > 0.01, f"device sampled acceptance does not fit the target (p = {p:.2e})"


@torch.inference_mode()
def test_one_uniform_for_every_draw_is_detected() -> None:
    """The negative control: the same test must reject a walk whose draws are not independent."""
    _, probs = _fixed_tree()
    n = 3000  # the bias is gross: p ~ 1e-249 at this size
    g = torch.Generator().manual_seed(11)
    shared = torch.rand(n, 1, generator=g, dtype=torch.float64).expand(n, len(PARENT))
    p = chi_square_p(_counts(shared), _expected_first_two(probs), n)
    assert p < 1e-6, f"a correlated walk passed the exactness test (p = {p:.2e})"
