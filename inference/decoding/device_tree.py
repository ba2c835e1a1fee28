"""A Hydra step's tree choice and greedy acceptance as tensor operations, for one captured graph.

The host path (``expanded_tree.py``, ``verify.verify_greedy``) reads the drafts back, chooses the tree
with numpy, sends it to the device, and reads the verify forward's argmax back to walk the tree: two
synchronisations a step, with the GPU idle while the host works. Here the same choice and the same
walk are fixed-shape tensor operations, so drafting, the tree, the verify forward, acceptance and the
KV compaction of the accepted path can be captured together and replayed without the host
(``runtime/tree_chain.py``).

What is the same as the host path, and what is not:

* The candidates' scores are ``Expansion.from_arrays``'s, in the same float64 arithmetic, and the
  chosen set is ``best_candidates``'s: the ``count`` best by score, ties to the shallower, then to the
  lower index. A child never scores above its parent, so the set is prefix-closed (a tree).
* The size is fixed (``count + 1`` nodes: a graph has one shape), where the host policy picks a size
  per step from its cost curve and calibration. Nodes are numbered best first instead of in
  ``Tree.from_paths`` order; any numbering whose parents precede their children verifies the same.
* Greedy acceptance follows ``verify_greedy``: a node is accepted when its parent is and its token is
  the parent's argmax. Siblings come from one top-k row and so hold distinct tokens, so at most one
  child matches and the accepted nodes form one path: the same path and bonus token as the host walk
  on the same tree. Greedy output therefore stays vanilla's (every node's logits are its 1-token
  logits under invariant numerics; the tree only decides how many tokens a step keeps).
* Sampled acceptance (``accept_sampled``) is ``verify.verify_sampled``'s rejection walk with one
  change in where its uniforms come from: node c's trial reads ``u[c]`` and the bonus draw ``u[0]``,
  instead of the next uniform of a sequence. Each node is tried at most once per step and the root
  never is, so every draw the walk uses is a fresh independent uniform, which is all the exactness
  argument needs; but then every node's trial can be decided at once, before the walk: child c of n
  is accepted, given that its earlier siblings were rejected, when ``u[c] * R < p_n(x_c)``, where R
  is p_n's mass minus those siblings' masses. The walk takes each node's first accepted child, and
  the bonus is drawn at the last node with its children's tokens removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elesium.inference.sampling import sample_from, sample_on_device


@dataclass(frozen=True)
class ExpansionLayout:
    """How ``HydraHeads.expand`` lays its rows out: level 0 is one row, each later level
    ``min(width, rows_before * topk)`` rows, concatenated; candidate ``c = row * topk + rank``."""

    level_rows: tuple[int, ...]
    topk: int

    @classmethod
    def of(cls, levels: int, width: int, topk: int) -> ExpansionLayout:
        rows = [1]
        for _ in range(levels - 1):
            rows.append(min(width, rows[-1] * topk))
        return cls(tuple(rows), topk)

    @property
    def rows(self) -> int:
        return sum(self.level_rows)

    @property
    def candidates(self) -> int:
        return self.rows * self.topk


@dataclass(frozen=True)
class Candidates:
    """Every drafted candidate's path score, parent candidate (-1: the root's child) and depth."""

    cum: torch.Tensor  # [C] float64
    parent: torch.Tensor  # [C] int64
    depth: torch.Tensor  # [C] int64


def candidate_scores(logprobs: torch.Tensor, parents: torch.Tensor, layout: ExpansionLayout,
                     temperature: float | torch.Tensor) -> Candidates:
    """``Expansion.from_arrays`` on the device: ``logprobs`` ``[rows, topk]``, ``parents`` ``[rows]``
    (the previous level's flat candidate index each row extends)."""
    k = layout.topk
    scores = logprobs.double() / temperature
    flat = scores.reshape(-1)
    dev = logprobs.device
    row_cum = [torch.zeros(1, dtype=torch.float64, device=dev)]
    row_parent = [torch.full((1,), -1, dtype=torch.long, device=dev)]
    start = 1
    prev_start = 0
    for n in layout.level_rows[1:]:
        glob = prev_start * k + parents[start:start + n]
        row_parent.append(glob)
        prev_cum = torch.cat(row_cum)
        row_cum.append(prev_cum[torch.div(glob, k, rounding_mode="floor")] + flat[glob])
        prev_start, start = start, start + n
    cum_rows = torch.cat(row_cum)
    depth_rows = torch.cat([torch.full((n,), d + 1, dtype=torch.long, device=dev)
                            for d, n in enumerate(layout.level_rows)])
    return Candidates((cum_rows[:, None] + scores).reshape(-1),
                      torch.cat(row_parent).repeat_interleave(k), depth_rows.repeat_interleave(k))


def best_first(cand: Candidates, count: int) -> torch.Tensor:
    """``best_candidates``: the ``count`` best candidates by score, ties to the shallower, then to the
    lower index.

    By rank rather than by sorting: a candidate's rank is how many others beat it under that total
    order, so the ranks are a permutation and the candidate of rank i is put at position i. That is
    one ``[C, C]`` comparison, which fuses into a kernel or two, where a stable sort on a GPU is a
    multi-pass radix sort (``best_first_by_sorting`` is the sorting form, kept as its reference)."""
    c = cand.cum.numel()
    idx = torch.arange(c, device=cand.cum.device)
    s_a, s_b = cand.cum[:, None], cand.cum[None, :]
    d_a, d_b = cand.depth[:, None], cand.depth[None, :]
    tie_break = (d_a < d_b) | ((d_a == d_b) & (idx[:, None] < idx[None, :]))
    beats = (s_a > s_b) | ((s_a == s_b) & tie_break)  # beats[a, b]: a comes before b
    rank = beats.sum(0)
    return torch.zeros_like(idx).scatter_(0, rank, idx)[:count]


def best_first_by_sorting(cand: Candidates, count: int) -> torch.Tensor:
    """``best_first`` as two stable sorts: by depth, then by score."""
    by_depth = torch.sort(cand.depth, stable=True).indices
    order = by_depth[torch.sort(-cand.cum[by_depth], stable=True).indices]
    return order[:count]


@dataclass(frozen=True)
class DeviceTree:
    """A tree of ``N`` nodes on the device, node 0 the root (the pending token), parents first."""

    tokens: torch.Tensor  # [N] int64
    parent: torch.Tensor  # [N] int64, the root its own parent
    depth: torch.Tensor  # [N] int64
    ancestors: torch.Tensor  # [N, N] bool, a node's own row: itself and every ancestor


def device_tree(root_token: torch.Tensor, draft_tokens: torch.Tensor, cand: Candidates, chosen: torch.Tensor,
                max_depth: int) -> DeviceTree:
    """The tree of ``chosen`` candidates (best first, so every parent precedes its children)."""
    dev = chosen.device
    n = chosen.numel() + 1
    c = cand.cum.numel()
    node_of = torch.zeros(c + 1, dtype=torch.long, device=dev)  # the last slot: "parent -1", the root
    node_of[chosen] = torch.arange(1, n, device=dev)
    up = cand.parent[chosen]
    parent = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), node_of[torch.where(up < 0, c, up)]])
    depth = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), cand.depth[chosen]])
    tokens = torch.cat([root_token.reshape(1), draft_tokens.reshape(-1)[chosen]])
    ancestors = torch.eye(n, dtype=torch.bool, device=dev)
    cur = torch.arange(n, device=dev)
    for _ in range(max_depth):
        cur = parent[cur]
        ancestors.scatter_(1, cur[:, None], True)
    return DeviceTree(tokens, parent, depth, ancestors)


@dataclass(frozen=True)
class Acceptance:
    """The accepted path padded to ``max_depth + 1``: ``path[j]`` is its node at depth j for
    ``j < length`` and the last accepted node after; ``committed[j]`` the token the step commits after
    ``path[j]`` (the path's next token, then the bonus), padded with the bonus."""

    path: torch.Tensor  # [D + 1] int64
    length: torch.Tensor  # [1] int64, accepted nodes (root included) = tokens committed
    committed: torch.Tensor  # [D + 1] int64
    bonus: torch.Tensor  # [1] int64


def accept_greedy(tree: DeviceTree, greedy: torch.Tensor, max_depth: int) -> Acceptance:
    """``verify_greedy`` as tensor operations; ``greedy`` ``[N]`` is every node's argmax.

    Indices stay one-element tensors: indexing with a 0-d tensor reads it back to the host, which a
    CUDA graph cannot capture."""
    accepted = tree.depth == 0
    matches = tree.tokens == greedy[tree.parent]
    for d in range(1, max_depth + 1):
        accepted = accepted | ((tree.depth == d) & accepted[tree.parent] & matches)
    deepest = torch.where(accepted, tree.depth, -1).argmax().reshape(1)
    length = tree.depth[deepest] + 1
    ups = [deepest]
    for _ in range(max_depth):
        ups.append(tree.parent[ups[-1]])
    walk = torch.cat(ups)  # walk[i]: the ancestor i levels above the deepest accepted node
    j = torch.arange(max_depth + 1, device=greedy.device)
    return _acceptance(tree, walk[(length - 1 - j).clamp(min=0)], length, greedy[deepest])


def _acceptance(tree: DeviceTree, path: torch.Tensor, length: torch.Tensor,
                bonus: torch.Tensor) -> Acceptance:
    j = torch.arange(path.numel(), device=path.device)
    following = torch.cat([tree.tokens[path[1:]], bonus])
    return Acceptance(path, length, torch.where(j < length - 1, following, bonus), bonus)


def accept_sampled(tree: DeviceTree, probs: torch.Tensor, uniforms: torch.Tensor,
                   max_depth: int) -> Acceptance:
    """Exact rejection sampling over the tree (module docstring): ``probs`` ``[N, V]`` is every node's
    target distribution (``sampling.target_probs``), ``uniforms`` ``[N]`` float64, one per node.

    The masses are ``verify_sampled``'s, in float64: a node's total, and its children's ``p(x)``.
    """
    n = tree.tokens.numel()
    dev = probs.device
    nodes = torch.arange(n, device=dev)
    child = tree.depth > 0
    total = probs.double().sum(-1)
    mass = torch.where(child, probs[tree.parent, tree.tokens].double(), 0.0)
    same_parent = tree.parent[:, None] == tree.parent[None, :]
    siblings = same_parent & (nodes[None, :] < nodes[:, None]) & child[None, :]
    before = torch.where(siblings, mass[None, :], 0.0).sum(-1)  # earlier siblings' masses (all rejected)
    accepted = child & (uniforms * (total[tree.parent] - before) < mass)
    # first[m]: node m's first accepted child in rank order (= node order), n for none.
    is_kid = (tree.parent[None, :] == nodes[:, None]) & accepted[None, :]
    first = torch.cat([torch.where(is_kid, nodes[None, :], n).amin(-1), torch.full((1,), n, device=dev)])
    steps = [torch.zeros(1, dtype=torch.long, device=dev)]
    for _ in range(max_depth):
        here = steps[-1]
        nxt = first[here]
        steps.append(torch.where(nxt < n, nxt, here))
    path = torch.cat(steps)
    last = path[-1:]
    length = (tree.depth[last] + 1)
    # The residual at the last node: its children were all tried and rejected (none was accepted).
    tried = torch.zeros(probs.shape[-1], dtype=torch.long, device=dev).index_add_(
        0, tree.tokens, (child & (tree.parent == last)).long())
    residual = torch.where(tried > 0, 0.0, probs.index_select(0, last)[0].double())
    bonus = sample_on_device(residual, uniforms[:1]).reshape(1)
    return _acceptance(tree, path, length, bonus)


def accept_sampled_reference(parent: list[int], tokens: list[int], probs: torch.Tensor,
                             uniforms: list[float]) -> tuple[list[int], int]:
    """``accept_sampled`` as the sequential walk of ``verify.verify_sampled_reference`` on host rows
    (node c's trial reads ``uniforms[c]``, the bonus ``uniforms[0]``): the accepted path and the bonus."""
    children: list[list[int]] = [[] for _ in parent]
    for c in range(1, len(parent)):
        children[parent[c]].append(c)
    node, path = 0, [0]
    while True:
        p = probs[node].double().cpu().clone()
        remaining = float(p.sum())
        moved = False
        for c in children[node]:
            m = float(p[tokens[c]])
            if m <= 0.0:
                continue
            if uniforms[c] * remaining < m:
                node = c
                path.append(c)
                moved = True
                break
            p[tokens[c]] = 0.0
            remaining -= m
        if not moved:
            return path, sample_from(p, uniforms[0])
