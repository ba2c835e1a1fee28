"""What the heads proposed this step, as a set of rank paths the tree policy can choose from.

A rank path names a candidate continuation: ``(0,)`` is the best guess for the first draft position,
``(0, 2)`` the third-best guess for the next position *given* that first guess, and so on. Two kinds
of heads fill this space differently:

* **Medusa heads** read only the hidden state, so head d's top-k list is the same under every parent:
  ``FactoredDrafts`` stores one list per depth, and every path of ranks < k exists.
* **Hydra heads** read the tokens drafted so far, so each expanded path has its own top-k list:
  ``ExpandedDrafts`` stores a list per expanded path, and only paths under expanded nodes exist.

Both answer the same three questions (how many children a path has, the token at a path, its
log-probability given its parent), which is all the best-first tree search and the static trees need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from elesium.inference.drafters.protocol import Proposal

RankPath = tuple[int, ...]
"""Ranks from the root: ``(0, 2)`` is the third-best draft under the best first draft."""


class DraftSet(Protocol):
    """Candidate continuations; children of a path are ranked by log-probability, best first."""

    def num_children(self, path: RankPath) -> int:
        """Ranks available under ``path`` (0: a leaf, nothing was drafted after it)."""
        ...

    def token(self, path: RankPath) -> int:
        """The drafted token at a non-empty path."""
        ...

    def score(self, path: RankPath) -> float:
        """Log-probability (at the draft temperature) of the path's last token given its parent."""
        ...


def contains(drafts: DraftSet, path: RankPath) -> bool:
    """Whether every step of ``path`` was drafted."""
    return all(r < drafts.num_children(path[:i]) for i, r in enumerate(path))


@dataclass(frozen=True)
class FactoredDrafts:
    """Medusa: ``tokens[d][r]`` / ``scores[d][r]`` for head d+1, the same under every parent."""

    tokens: Sequence[Sequence[int]]
    scores: Sequence[Sequence[float]]

    def num_children(self, path: RankPath) -> int:
        return len(self.scores[len(path)]) if len(path) < len(self.scores) else 0

    def token(self, path: RankPath) -> int:
        return self.tokens[len(path) - 1][path[-1]]

    def score(self, path: RankPath) -> float:
        return self.scores[len(path) - 1][path[-1]]

    @classmethod
    def from_scores(cls, scores: Sequence[Sequence[float]]) -> FactoredDrafts:
        """Rank-only drafts (each token is its rank), for searches over calibrated acceptance tables."""
        return cls([list(range(len(row))) for row in scores], [list(row) for row in scores])


@dataclass(frozen=True)
class ExpandedDrafts:
    """Hydra: ``children[path] = (tokens, scores)`` for every path the heads expanded."""

    children: dict[RankPath, tuple[Sequence[int], Sequence[float]]]

    def num_children(self, path: RankPath) -> int:
        kids = self.children.get(path)
        return len(kids[0]) if kids is not None else 0

    def token(self, path: RankPath) -> int:
        return self.children[path[:-1]][0][path[-1]]

    def score(self, path: RankPath) -> float:
        return self.children[path[:-1]][1][path[-1]]

    @classmethod
    def from_expansion(cls, tokens: Sequence[Sequence[int]], scores: Sequence[Sequence[float]],
                       parents: Sequence[int], width: int, temperature: float = 1.0) -> ExpandedDrafts:
        """Rebuild the paths from ``HydraHeads.expand``'s output, read back as lists.

        Rows are concatenated over levels: level 0 is one row (the root's children), and each later
        level has ``min(width, rows * k)`` rows, where ``rows`` is the level before's. Row i of level
        l > 0 extends candidate ``parents[i]`` of level l-1: a flat index ``row * k + rank`` into it.
        """
        children: dict[RankPath, tuple[Sequence[int], Sequence[float]]] = {}
        level_paths: list[RankPath] = [()]
        start, k = 0, len(tokens[0]) if tokens else 0
        while start < len(tokens):
            if start > 0:
                prev = level_paths
                rows = parents[start:start + min(width, len(prev) * k)]
                level_paths = [prev[f // k] + (f % k,) for f in rows]
            for i, path in enumerate(level_paths):
                children[path] = (list(tokens[start + i]), [x / temperature for x in scores[start + i]])
            start += len(level_paths)
        return cls(children)


def draft_set(proposal: Proposal, temperature: float) -> DraftSet:
    """A proposal's candidates as rank paths, scored over the draft temperature.

    Dividing log-probabilities by the temperature is a monotone reshaping: it changes which paths
    win across depths (the tree's shape), never the order among siblings. Each layout keeps the
    arithmetic it always had (a float32 division for per-depth lists, float64 for expansions), so
    trees, and with them the sampled outputs of a seed, stay what they were.
    """
    if proposal.parents is None:
        return FactoredDrafts(proposal.tokens.tolist(), (proposal.logprobs / temperature).tolist())
    return ExpandedDrafts.from_expansion(proposal.tokens.tolist(), proposal.logprobs.float().tolist(),
                                         proposal.parents.tolist(), proposal.width, temperature)
