"""The dynamic tree for Hydra heads, chosen with array operations instead of a best-first search.

Why: on the H200 a speculative step's GPU work is ~1.7 ms, and the host spent ~0.6 ms of Python per
step between the drafting and the verify graph rebuilding the expansion as a dict of rank paths
(``ExpandedDrafts.from_expansion``), searching it best first (``ranked_paths``), and building the
tree and its ancestor matrix node by node. Here the same choice is a handful of numpy calls over
the expansion's ``[rows, k]`` arrays.

The same tree: every drafted candidate gets its cumulative score (its parent's plus its own
log-probability over the draft temperature). A child never scores above its parent, so the
``count`` best candidates form a prefix-closed set, and it is the set the best-first search pops;
ties are broken by depth, so a parent always precedes an equal-scoring child. The nodes are then
ordered as ``Tree.from_paths`` orders them (by depth, then rank path), so the tree is identical,
node for node, to ``TreePolicy.build(ExpandedDrafts.from_expansion(...))``; tests compare the two
on random expansions. Grammar-constrained decoding and static trees keep the general path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from elesium.inference.decoding.tree import Tree

if TYPE_CHECKING:
    from elesium.inference.drafters.protocol import Proposal


@dataclass(frozen=True)
class Expansion:
    """``HydraHeads.expand``'s output as arrays: candidate ``c = row * k + rank``.

    ``cum`` is each candidate's path score, ``parent`` its parent candidate (-1: a child of the
    root), ``depth`` its depth (1 for the root's children), ``rank`` its rank among its siblings.
    """

    tokens: np.ndarray  # [rows * k] int64
    cum: np.ndarray  # [rows * k] float64
    parent: np.ndarray  # [rows * k] int64
    depth: np.ndarray  # [rows * k] int64
    rank: np.ndarray  # [rows * k] int64

    @classmethod
    def from_arrays(cls, tokens: np.ndarray, logprobs: np.ndarray, parents: np.ndarray, width: int,
                    temperature: float = 1.0) -> Expansion:
        """Rows concatenated over levels as in ``ExpandedDrafts.from_expansion``: level 0 is one row,
        each later level ``min(width, rows * k)`` rows whose ``parents`` index the level before's
        candidates flatly (``row * k + rank``)."""
        rows, k = tokens.shape
        scores = logprobs.astype(np.float64) / temperature
        row_cum = np.zeros(rows)
        row_parent = np.full(rows, -1, dtype=np.int64)
        row_depth = np.ones(rows, dtype=np.int64)
        start, level_rows, depth = 0, 1, 1
        while start < rows:
            if start > 0:
                prev_start, prev_rows = start - level_rows, level_rows
                level_rows = min(width, prev_rows * k)
                sl = slice(start, start + level_rows)
                row_parent[sl] = prev_start * k + parents[sl]
                row_cum[sl] = row_cum[prev_start + parents[sl] // k] + scores.reshape(-1)[row_parent[sl]]
                depth += 1
                row_depth[sl] = depth
            start += level_rows
        cum = (row_cum[:, None] + scores).reshape(-1)
        return cls(tokens.reshape(-1).astype(np.int64), cum, np.repeat(row_parent, k),
                   np.repeat(row_depth, k), np.tile(np.arange(k, dtype=np.int64), rows))

    @classmethod
    def from_device(cls, tokens: torch.Tensor, logprobs: torch.Tensor, parents: torch.Tensor, width: int,
                    temperature: float = 1.0) -> Expansion:
        return cls.from_arrays(*host_arrays(tokens, logprobs, parents), width, temperature)

    @classmethod
    def of(cls, proposal: Proposal, temperature: float) -> Expansion | None:
        """A proposal's expansion, read back as arrays; None where its rows are per-depth lists (every
        rank path exists, so there is no expansion to choose from)."""
        if proposal.parents is None:
            return None
        return cls.from_device(proposal.tokens, proposal.logprobs, proposal.parents, proposal.width,
                               temperature)


def host_arrays(tokens: torch.Tensor, logprobs: torch.Tensor, parents: torch.Tensor,
                packed: bool | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The drafting's output as numpy (int64 tokens, float32 log-probabilities, int64 parents). From a GPU
    (``packed``; None: when the tensors are on CUDA) in one read-back, not three (each a sync): packed as
    float64, which holds token ids, parents and float32 values exactly."""
    if not (tokens.is_cuda if packed is None else packed):
        return tokens.cpu().numpy(), logprobs.float().cpu().numpy(), parents.cpu().numpy()
    flat = [t.flatten().double() for t in (tokens, logprobs, parents)]
    host = torch.cat(flat).cpu().numpy()
    n, m = tokens.numel(), logprobs.numel()
    return (host[:n].astype(np.int64).reshape(tokens.shape),
            host[n:n + m].astype(np.float32).reshape(logprobs.shape),
            host[n + m:].astype(np.int64).reshape(parents.shape))


def best_candidates(expansion: Expansion, count: int) -> np.ndarray:
    """The ``count`` best candidates, best first (ties: shallower first, then by index)."""
    order = np.lexsort((np.arange(expansion.cum.size), expansion.depth, -expansion.cum))
    return order[:count]


def tree_of(expansion: Expansion, chosen: np.ndarray) -> tuple[Tree, list[int], torch.Tensor]:
    """The tree of ``chosen`` candidates (prefix-closed) in ``Tree.from_paths`` order, the node tokens
    after the root, and the ``[N, N]`` ancestor matrix."""
    depth = expansion.depth[chosen]
    # Rank paths as digits, root-first, so that sorting by (depth, digits) is from_paths' order.
    digits = np.zeros((chosen.size, int(depth.max(initial=0))), dtype=np.int64)
    cur, level = chosen.copy(), depth.copy()  # walking up: an ancestor and its depth
    for _ in range(digits.shape[1]):
        live = np.nonzero(cur >= 0)[0]
        digits[live, level[live] - 1] = expansion.rank[cur[live]]
        level[live] -= 1
        cur[live] = expansion.parent[cur[live]]
    keys = [digits[:, i] for i in range(digits.shape[1] - 1, -1, -1)] + [depth]
    ordered = chosen[np.lexsort(keys)] if chosen.size else chosen
    node_index = np.zeros(expansion.cum.size + 1, dtype=np.int64)  # the extra last slot: parent -1, the root
    node_index[ordered] = np.arange(1, ordered.size + 1)
    parents = node_index[expansion.parent[ordered]].tolist()
    tree = Tree((-1, *parents), (0, *expansion.depth[ordered].tolist()),
                (-1, *expansion.rank[ordered].tolist()))
    n = tree.size
    anc = np.eye(n, dtype=bool)
    up = np.array(tree.parents, dtype=np.int64)
    up[0] = 0
    cur_nodes = np.arange(n)
    for _ in range(tree.depth):
        cur_nodes = up[cur_nodes]
        anc[np.arange(n), cur_nodes] = True
    return tree, expansion.tokens[ordered].tolist(), torch.from_numpy(anc)
