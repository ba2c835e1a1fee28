"""Verifying a token tree against the base model: which drafted path to keep, and the next token.

Greedy: follow the child whose token is the base model's argmax; the argmax at the last accepted
node is the bonus token. Output is then token-identical to vanilla greedy decoding.

Sampling (exact): the drafts are the heads' deterministic top-k, i.e. each child is a point-mass
proposal. For point masses, sequential rejection sampling keeps the target exactly: with p the
target distribution at the current node, try the children in rank order; accept child x with
probability p(x); on rejection set p(x) = 0 and renormalise. If every child is rejected (or the node
is a leaf) sample the bonus token from what is left of p. Then P(output = x) = p(x) for every x:
a child token x is emitted either by acceptance or, never twice, from the residual; a token that
was tried and rejected has residual mass 0, and the residual is renormalised by exactly the
probability of reaching it. Duplicate child tokens are skipped (their p is already 0).

Constrained output: ``masks(node)`` is the grammar's allowed-token mask after the path to ``node``,
and the target at every node is the masked, renormalised distribution (``target_probs`` applies the
mask first), exactly what vanilla decoding samples from after the same tokens. Nothing else changes,
so the argument above holds for the constrained target as it does for the plain one.

Typical acceptance (Medusa's relaxed mode) accepts a child whose probability clears an
entropy-dependent threshold. It is faster at high temperature but NOT distribution-exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from elesium.inference.decoding.tree import Tree
from elesium.inference.sampling import Sampler, SamplingParams, sample_from, target_probs

NodeMasks = Callable[[int], torch.Tensor]
"""Node id -> bool ``[V]`` mask of the tokens the grammar allows after the path to that node."""


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # accepted node ids, root first
    bonus: int  # token sampled from the base model at the last accepted node


def verify_greedy(tree: Tree, node_tokens: list[int], best: Sequence[int]) -> Verdict:
    """``best[i]``: the base model's argmax token at node i (among the allowed ones, under a grammar)."""
    node = 0
    path = [0]
    while True:
        nxt = next((c for c in tree.children[node] if node_tokens[c] == best[node]), None)
        if nxt is None:
            return Verdict(path, best[node])
        node = nxt
        path.append(node)


def verify_sampled(tree: Tree, node_tokens: list[int], logits: torch.Tensor, params: SamplingParams,
                   sampler: Sampler, masks: NodeMasks | None = None) -> Verdict:
    """Exact sequential rejection sampling over point-mass drafts (see module docstring).

    Reads back only what the walk needs: per visited node, its total mass and its children's
    masses (a few numbers), and one full row at the end for the bonus draw. The reference below
    copied a whole ``[V]`` row to the host at every visited node.
    """
    node = 0
    path = [0]
    while True:
        p = target_probs(logits[node], params, None if masks is None else masks(node))
        kids = tree.children[node]
        masses: list[float] = []
        remaining = 1.0
        if kids:
            idx = torch.tensor([node_tokens[c] for c in kids], device=p.device)
            head = torch.cat([p.double().sum().view(1), p[idx].double()]).tolist()
            remaining, masses = head[0], head[1:]
        rejected: set[int] = set()
        moved = False
        for child, mass in zip(kids, masses):
            x = node_tokens[child]
            if mass <= 0.0 or x in rejected:
                continue  # a duplicate (already rejected) or outside top-k / top-p
            if sampler.uniform() * remaining < mass:
                node = child
                path.append(node)
                moved = True
                break
            rejected.add(x)
            remaining -= mass
        if not moved:
            row = p.double().cpu()
            if rejected:
                row[list(rejected)] = 0.0
            return Verdict(path, sample_from(row, sampler.uniform()))


def verify_sampled_reference(tree: Tree, node_tokens: list[int], logits: torch.Tensor, params: SamplingParams,
                             sampler: Sampler, masks: NodeMasks | None = None) -> Verdict:
    """The algorithm as written in the module docstring, on full host-side rows."""
    node = 0
    path = [0]
    while True:
        p = target_probs(logits[node], params, None if masks is None else masks(node)).double().cpu()
        moved = False
        for child in tree.children[node]:
            x = node_tokens[child]
            mass = float(p[x])
            if mass <= 0.0:
                continue
            if sampler.uniform() * float(p.sum()) < mass:
                node = child
                path.append(node)
                moved = True
                break
            p[x] = 0.0
        if not moved:
            return Verdict(path, sample_from(p, sampler.uniform()))


def verify_typical(tree: Tree, node_tokens: list[int], logits: torch.Tensor, params: SamplingParams,
                   sampler: Sampler, epsilon: float = 0.09, delta: float = 0.3,
                   masks: NodeMasks | None = None) -> Verdict:
    """Medusa's typical acceptance: keep a child whose probability exceeds min(eps, delta * e^-H)."""
    node = 0
    path = [0]
    while True:
        p = target_probs(logits[node], params, None if masks is None else masks(node)).double().cpu()
        entropy = float(-(p * p.clamp_min(1e-30).log()).sum())
        threshold = min(epsilon, delta * math.exp(-entropy))
        nxt = next((c for c in tree.children[node] if float(p[node_tokens[c]]) > threshold), None)
        if nxt is None:
            return Verdict(path, sample_from(p, sampler.uniform()))
        node = nxt
        path.append(node)
