"""Choosing each step's tree: a tuned static tree, or a dynamic one sized by expected payoff.

The dynamic policy is EAGLE-2's idea on Medusa heads with Sequoia's objective: a path's score is the
product of its heads' probabilities (a proxy for the chance the base model accepts it), the tree
holds the best-scoring paths, and its size is the one that maximises expected tokens per second,
``(1 + sum of accepted-path probabilities) / forward_time(size)``, using the forward cost curve
``elesium tune`` measured on this hardware.

Online adaptation: heads are over- or under-confident, so we keep a running calibration factor,
observed accepted drafts over predicted ones, and scale the path probabilities by it. The budget
therefore shrinks when the heads disappoint and grows when they beat their own predictions. The
draft temperature is nudged to the same end. None of this touches the target distribution: it only
changes which candidates are proposed, never how they are verified.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from elesium.inference.decoding.drafts import DraftSet, RankPath
from elesium.inference.decoding.expanded_tree import Expansion, best_candidates, tree_of
from elesium.inference.decoding.tree import Tree, ranked_paths, restricted
from elesium.inference.records import StepRecord
from elesium.inference.runtime.drafting import DRAFT_TOPK

TreeKind = Literal["static", "dynamic"]


@dataclass
class CostCurve:
    """Forward time (any unit) against the number of new tokens, interpolated piecewise-linearly."""

    sizes: list[int]
    times: list[float]

    def __call__(self, n: int) -> float:
        i = bisect.bisect_left(self.sizes, n)
        if i < len(self.sizes) and self.sizes[i] == n:
            return self.times[i]
        if i == 0:
            return self.times[0]
        if i == len(self.sizes):
            # Past the measured range: extrapolate with the last segment's slope.
            (a, ta), (b, tb) = (self.sizes[-2], self.times[-2]), (self.sizes[-1], self.times[-1])
            return tb + (n - b) * (tb - ta) / (b - a)
        a, b = self.sizes[i - 1], self.sizes[i]
        ta, tb = self.times[i - 1], self.times[i]
        return ta + (tb - ta) * (n - a) / (b - a)

    @classmethod
    def flat(cls) -> "CostCurve":
        """No measurement: every size costs the same (bandwidth-bound GPU-like)."""
        return cls([1, 256], [1.0, 1.0])


@dataclass
class TreePolicy:
    """Builds each step's tree from the heads' top-k log-probabilities ``[heads, k]``."""

    kind: TreeKind = "dynamic"
    static_paths: tuple[RankPath, ...] = ()
    max_nodes: int = 64
    min_nodes: int = 2
    topk: int = 8
    expand_width: int = 8  # Hydra heads: paths expanded per level (EAGLE-2's top-k expansion)
    draft_temperature: float = 1.0
    cost: CostCurve = field(default_factory=CostCurve.flat)
    adapt: bool = True
    calibration: float = 1.0
    # Whether each step's record carries its whole drafted tree (``StepRecord.tree``): a run's or a
    # workflow's opt-in for the audit console; it changes no tree and no token, so it is not compared.
    record_trees: bool = field(default=False, compare=False)
    _predicted: float = 0.0
    _static: Tree | None = None
    # (cost curve's key, cost(1..max_nodes)): a cache, left out of comparisons and repr.
    _costs: tuple[tuple[object, ...], np.ndarray] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind == "static":
            self._static = Tree.from_paths(self.static_paths)
            self.max_nodes = self._static.size

    @property
    def max_tree_size(self) -> int:
        return self._static.size if self._static is not None else self.max_nodes

    @property
    def predicted(self) -> float:
        """Accepted drafts expected of the last tree built (dynamic trees; 0.0 for static ones)."""
        return self._predicted if self._static is None else 0.0

    def draft_levels(self, heads: int) -> int:
        """Levels worth drafting for ``heads`` path-conditioned heads: no deeper than this policy's trees
        can be (a static tree's depth; a dynamic tree of N nodes holds at most N - 1 levels)."""
        deepest = self._static.depth if self._static is not None else self.max_nodes - 1
        return max(1, min(heads, deepest))

    def draft_topk(self) -> int:
        return min(DRAFT_TOPK, self._static.max_rank if self._static is not None else self.topk)

    def build(self, drafts: DraftSet) -> Tree:
        """This step's tree from the drafted candidates (scores already at the draft temperature)."""
        if self._static is not None:
            return restricted(self._static, drafts)
        ranked = ranked_paths(drafts, self.max_nodes - 1)
        # Probability of acceptance ~ calibrated product of the path's draft probabilities.
        probs = [min(1.0, self.calibration * math.exp(score)) for _, score in ranked]
        best_n, best_rate, gain = 1, 1.0 / self.cost(1), 1.0
        for i, p in enumerate(probs, start=2):
            gain += p
            rate = gain / self.cost(i)
            if rate > best_rate:
                best_n, best_rate = i, rate
        best_n = max(best_n, min(self.min_nodes, len(ranked) + 1))
        tree = Tree.from_paths([p for p, _ in ranked[: best_n - 1]])
        self._predicted = sum(probs[: best_n - 1])
        return tree

    def build_expanded(self, expansion: Expansion) -> tuple[Tree, list[int], torch.Tensor]:
        """``build`` for a dynamic policy over Hydra heads' expansion, in array operations
        (``expanded_tree.py``): the same tree, plus its node tokens after the root and its ancestor
        matrix, which the caller would otherwise rebuild from the tree node by node."""
        if self._static is not None:
            raise ValueError("build_expanded is the dynamic policy's; static trees use build()")
        chosen = best_candidates(expansion, self.max_nodes - 1)
        probs = np.minimum(1.0, self.calibration * np.exp(expansion.cum[chosen]))
        costs = self._cost_table()
        best_n = 1
        if probs.size:
            rates = (1.0 + np.cumsum(probs)) / costs[1:probs.size + 1]
            i = int(np.argmax(rates))
            if rates[i] > 1.0 / costs[0]:
                best_n = i + 2
        best_n = max(best_n, min(self.min_nodes, probs.size + 1))
        self._predicted = float(probs[:best_n - 1].sum())
        return tree_of(expansion, chosen[:best_n - 1])

    def _cost_table(self) -> np.ndarray:
        """``cost(n)`` for n = 1..max_nodes, kept until the curve or the budget changes."""
        key = (tuple(self.cost.sizes), tuple(self.cost.times), self.max_nodes)
        if self._costs is None or self._costs[0] != key:
            self._costs = (key, np.array([self.cost(n) for n in range(1, self.max_nodes + 1)]))
        return self._costs[1]

    def observe(self, record: StepRecord) -> None:
        """Update the calibration from one step's outcome (dynamic trees only)."""
        if not self.adapt or self._static is not None or self._predicted <= 0:
            return
        observed = record.accepted_length - 1
        ratio = (observed + 0.5) / (self._predicted + 0.5)
        self.calibration = min(4.0, max(0.1, 0.9 * self.calibration + 0.1 * self.calibration * ratio))
        # Over-confident heads (calibration < 1) get a softer draft distribution, and vice versa.
        target = 1.0 / math.sqrt(self.calibration)
        self.draft_temperature = min(2.0, max(0.5, 0.95 * self.draft_temperature + 0.05 * target))
