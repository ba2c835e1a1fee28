"""Token trees: which candidate continuations one verification forward checks.

A tree is a parent index per node (node 0 is the root: the already-chosen next token) plus, for each
other node, its depth and the rank of its token among its parent's drafted children. A tree is
therefore a prefix-closed set of rank paths, Medusa's "choice lists": ``(0,)`` is the best first
draft, ``(0, 2)`` the third-best second draft under it, and so on. Which token a path stands for is
the heads' business (``drafts.py``): the same for every parent with Medusa heads, per parent with
Hydra heads.

Static trees come from a calibrated table of acceptance probabilities per (depth, rank); dynamic
trees (EAGLE-2's idea) use this step's head log-probabilities instead. Both pick the N paths with
the highest cumulative score. Scores only fall along a path, so the best N paths are automatically
prefix-closed and a best-first search finds them exactly.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from elesium.inference.decoding.drafts import DraftSet, RankPath, contains


@dataclass(frozen=True)
class Tree:
    """A token tree in topological order (every parent before its children)."""

    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]

    @classmethod
    def from_paths(cls, paths: Sequence[RankPath]) -> "Tree":
        """Build from rank paths; missing prefixes are added, order is (depth, path)."""
        closed: set[RankPath] = set()
        for p in paths:
            for i in range(1, len(p) + 1):
                closed.add(tuple(p[:i]))
        ordered = sorted(closed, key=lambda p: (len(p), p))
        index = {(): 0}
        parents, depths, ranks = [-1], [0], [-1]
        for p in ordered:
            index[p] = len(parents)
            parents.append(index[p[:-1]])
            depths.append(len(p))
            ranks.append(p[-1])
        return cls(tuple(parents), tuple(depths), tuple(ranks))

    def truncated(self, size: int) -> "Tree":
        """The first ``size`` nodes: still a tree, since parents precede their children."""
        return Tree(self.parents[:size], self.depths[:size], self.ranks[:size])

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths)

    @property
    def max_rank(self) -> int:
        return max(self.ranks) + 1 if self.size > 1 else 0

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of each node, ordered by rank (the verification order)."""
        kids: list[list[int]] = [[] for _ in self.parents]
        for node, parent in enumerate(self.parents[1:], start=1):
            kids[parent].append(node)
        return tuple(tuple(sorted(k, key=lambda n: self.ranks[n])) for k in kids)

    @cached_property
    def paths(self) -> tuple[RankPath, ...]:
        out: list[RankPath] = [()]
        for node in range(1, self.size):
            out.append(out[self.parents[node]] + (self.ranks[node],))
        return tuple(out)

    @cached_property
    def _ancestors(self) -> torch.Tensor:
        """One Python int bitmask per node (parent's | own bit), unpacked in one numpy call.

        Dynamic trees are rebuilt every step; the obvious per-node tensor loop (tests/test_verify.py
        holds this to it) cost ~10 us a node on the host, this ~0.3 us.
        """
        n = self.size
        width = (n + 7) // 8
        masks = [0] * n
        for node, parent in enumerate(self.parents):
            masks[node] = (masks[parent] if parent >= 0 else 0) | (1 << node)
        packed = np.frombuffer(b"".join(m.to_bytes(width, "little") for m in masks), dtype=np.uint8)
        bits = np.unpackbits(packed.reshape(n, width), axis=1, bitorder="little")[:, :n]
        return torch.from_numpy(bits.astype(bool))

    @cached_property
    def _depths(self) -> torch.Tensor:
        return torch.tensor(self.depths)

    def ancestors(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[N, N]`` bool: row i marks i and its ancestors (what node i may attend to)."""
        return self._ancestors.to(device)

    def positions(self, offset: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """RoPE positions: a node at depth d sits d places after the root's slot."""
        return (offset + self._depths).to(device)


def ranked_paths(drafts: DraftSet, count: int, max_depth: int | None = None) -> list[tuple[RankPath, float]]:
    """The ``count`` paths with the highest total score, best first, with their totals.

    Scores are log-probabilities (so <= 0; ``FactoredDrafts.from_scores`` wraps a bare Medusa-style
    ``scores[d][r]`` table). Best-first search: a path's children can only score lower than the path,
    so popping paths in score order yields exactly the top ``count`` paths, and every prefix of them
    comes out first.
    """
    depth_limit = max_depth if max_depth is not None else 1 << 30
    chosen: list[tuple[RankPath, float]] = []
    heap: list[tuple[float, RankPath]] = []
    if depth_limit and drafts.num_children(()):
        heapq.heappush(heap, (-drafts.score((0,)), (0,)))
    while heap and len(chosen) < count:
        neg, path = heapq.heappop(heap)
        chosen.append((path, -neg))
        parent, r = path[:-1], path[-1]
        if r + 1 < drafts.num_children(parent):  # next sibling
            sib = parent + (r + 1,)
            heapq.heappush(heap, (neg + drafts.score(path) - drafts.score(sib), sib))
        if len(path) < depth_limit and drafts.num_children(path):  # first child
            child = path + (0,)
            heapq.heappush(heap, (neg - drafts.score(child), child))
    return chosen


def top_paths(drafts: DraftSet, budget: int, max_depth: int | None = None) -> Tree:
    """The tree of ``budget`` nodes (root included) whose paths have the highest total score."""
    return Tree.from_paths([p for p, _ in ranked_paths(drafts, budget - 1, max_depth)])


def restricted(tree: Tree, drafts: DraftSet) -> Tree:
    """The part of a (static) tree whose every node was drafted this step."""
    if all(contains(drafts, p) for p in tree.paths[1:]):
        return tree
    return Tree.from_paths([p for p in tree.paths[1:] if contains(drafts, p)])

