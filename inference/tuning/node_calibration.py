"""Per-(workflow, node) tree policies from the acceptance log, in place of the engine's global one.

Why per node: the heads' acceptance differs a lot between a classification node (a few constrained
tokens) and a free-text drafting node, while the engine's profile holds one tree policy, tuned on
generic calibration prompts. The dynamic policy (:mod:`elesium.inference.decoding.tree_policy`)
already adapts its calibration factor (observed accepted drafts over predicted) during a
generation, but it starts every generation from 1.0 and a workflow call lasts 8 to 64 tokens,
too short for its moving average to settle. So we keep what every call of a node taught it:

- :class:`NodeStats` sums, over the node's logged decode steps, accepted drafts, the heads' own
  (uncalibrated) predictions, tree sizes, per-depth acceptance, time and tokens per call;
- :func:`derive` turns them into a :class:`NodeCalibration`: the calibration factor to start from
  (a ratio estimator shrunk towards 1.0 by a prior, so thin evidence stays near the global policy)
  and a tree budget sized to the trees the node actually uses; every value clamped to
  :class:`CalibrationBounds`. The draft temperature stays the global policy's: moving it with the
  factor (``1 / sqrt(c)``, the policy's own online rule) lowered tau on two incident-summary nodes in
  the first benchmark (BENCHMARKS.md section 9), because it reorders the ranked drafts, whereas a
  larger factor alone only extends the tree along the same ranking. A version may still pin a
  temperature (``draft_temperature`` set);
- :func:`apply` makes the engine's policy with those values, and :func:`material_change` decides
  whether a new estimate is worth a new (immutable) calibration version;
- :func:`efficiency`, :func:`sample_counters` and :class:`ArmSamples` are the statistics a trial
  compares its two arms with (the rule that turns them into a verdict is the calibrator's).

Everything here is a pure function of its arguments: the calibrator
(:mod:`elesium.graphs.calibration`) reads the log and the store, calls these, and writes back. The
log's entries are taken structurally (:class:`LoggedStepLike`, :class:`LoggedEntryLike`), so this
module needs neither the state layer nor its types.

Nothing here touches the target distribution: a calibration only changes which drafts are proposed.
It does change which tokens a seeded sampled (T > 0) call produces, which is why runs record the
version each node used and re-execution reuses it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.runtime.forward import TREE_BUCKETS

MAX_DEPTH = 8  # per-depth acceptance is kept for depths 1..MAX_DEPTH


class LoggedStepLike(Protocol):
    """The fields of a step record that the statistics read: the engine's
    :class:`~elesium.inference.records.StepRecord` and the acceptance log's stored copy both have them."""

    @property
    def mode(self) -> str: ...
    @property
    def tree_size(self) -> int: ...
    @property
    def accepted_length(self) -> int: ...
    @property
    def accepted_by_depth(self) -> Sequence[bool]: ...
    @property
    def elapsed_s(self) -> float: ...
    @property
    def predicted(self) -> float: ...
    @property
    def calibration(self) -> float: ...


class LoggedEntryLike(Protocol):
    """An acceptance-log entry as the statistics read it (node, kind, call tokens, step record)."""

    @property
    def node_id(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def tokens(self) -> Sequence[int] | None: ...
    @property
    def record(self) -> LoggedStepLike: ...


@dataclass(frozen=True)
class CalibrationBounds:
    """How far a node's policy may move from the global one.

    ``max_nodes`` is also capped, when applied, by the engine's own policy budget (the profile's).
    ``min_steps``: below this many logged tree steps a node keeps the global policy.
    ``prior``: pseudo-drafts (observed = predicted) added to the calibration estimate.
    """

    min_nodes: int = 4
    max_nodes: int = 64
    min_calibration: float = 0.25
    max_calibration: float = 4.0
    min_temperature: float = 0.5
    max_temperature: float = 2.0
    min_steps: int = 8
    prior: float = 4.0


@dataclass
class NodeStats:
    """Sums over a node's logged calls and tree steps; adding two is merging their evidence."""

    calls: int = 0
    call_tokens: int = 0
    steps: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    drafts: int = 0  # accepted drafts (accepted length - 1), all tree steps
    raw_predicted: float = 0.0  # the heads' own prediction (predicted / calibration), dynamic steps
    raw_observed: int = 0  # accepted drafts on those same steps
    calibrated: float = 0.0  # sum of the calibrated predictions on those steps
    tree_nodes: int = 0
    reached: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    accepted: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    sizes: dict[int, int] = field(default_factory=dict)  # tree size -> steps

    def add_call(self, tokens: int) -> None:
        self.calls += 1
        self.call_tokens += tokens

    def add_step(self, rec: LoggedStepLike) -> None:
        """Fold one verification step (vanilla steps carry no tree evidence and are skipped)."""
        if rec.mode == "vanilla":
            return
        self.steps += 1
        self.tokens += rec.accepted_length
        self.elapsed_s += rec.elapsed_s
        self.drafts += rec.accepted_length - 1
        self.tree_nodes += rec.tree_size
        self.sizes[rec.tree_size] = self.sizes.get(rec.tree_size, 0) + 1
        for depth, ok in enumerate(rec.accepted_by_depth[:MAX_DEPTH]):
            self.reached[depth] += 1
            self.accepted[depth] += int(ok)
        if rec.calibration > 0 and rec.predicted > 0:
            self.raw_predicted += rec.predicted / rec.calibration
            self.calibrated += rec.predicted
            self.raw_observed += rec.accepted_length - 1

    # -- derived figures ------------------------------------------------------------------------
    @property
    def tau(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_call(self) -> float:
        return self.call_tokens / self.calls if self.calls else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        return [a / r for a, r in zip(self.accepted, self.reached) if r]

    def size_quantile(self, q: float) -> int:
        """The tree size below which a share ``q`` of the steps fell (0 with no steps)."""
        total, seen = sum(self.sizes.values()), 0
        for size in sorted(self.sizes):
            seen += self.sizes[size]
            if seen >= q * total:
                return size
        return 0

    # -- storage as flat counters (Redis HINCRBYFLOAT) ------------------------------------------
    _SCALARS = ("calls", "call_tokens", "steps", "tokens", "elapsed_s", "drafts", "raw_predicted",
                "raw_observed", "calibrated", "tree_nodes")

    def to_counters(self) -> dict[str, float]:
        out: dict[str, float] = {k: float(getattr(self, k)) for k in self._SCALARS}
        for d in range(MAX_DEPTH):
            if self.reached[d]:
                out[f"reached:{d + 1}"] = float(self.reached[d])
                out[f"accepted:{d + 1}"] = float(self.accepted[d])
        out.update({f"size:{n}": float(c) for n, c in self.sizes.items()})
        return {k: v for k, v in out.items() if v}

    @classmethod
    def from_counters(cls, counters: Mapping[str, float]) -> NodeStats:
        s = cls()
        for key, value in counters.items():
            name, _, arg = key.partition(":")
            if name in cls._SCALARS:
                setattr(s, name, int(round(value)) if isinstance(getattr(s, name), int) else float(value))
            elif name in ("reached", "accepted") and 1 <= int(arg) <= MAX_DEPTH:
                getattr(s, name)[int(arg) - 1] = int(round(value))
            elif name == "size":
                s.sizes[int(arg)] = int(round(value))
        return s

    def summary(self) -> dict[str, Any]:
        """The figures a calibration version and ``elesium tune --from-log`` show."""
        return {"calls": self.calls, "steps": self.steps, "tau": round(self.tau, 4),
                "tokens_per_call": round(self.tokens_per_call, 2),
                "tokens_per_s": round(self.tokens_per_s, 2),
                "acceptance_by_depth": [round(a, 4) for a in self.acceptance_by_depth]}


def stats_by_node(entries: Iterable[LoggedEntryLike]) -> dict[str, NodeStats]:
    """Per-node stats of a run's acceptance-log entries (a ``call`` entry counts a call, the others a
    step)."""
    out: dict[str, NodeStats] = {}
    for e in entries:
        s = out.setdefault(e.node_id, NodeStats())
        if e.kind == "call":
            s.add_call(len(e.tokens or ()))
        else:
            s.add_step(e.record)
    return out


@dataclass(frozen=True)
class NodeCalibration:
    """The tree-policy values a node starts each call from (see the module docstring)."""

    max_nodes: int
    calibration: float
    draft_temperature: float | None = None  # None: the engine policy's

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NodeCalibration:
        temperature = d.get("draft_temperature")
        return cls(int(d["max_nodes"]), float(d["calibration"]),
                   None if temperature is None else float(temperature))


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, x))


def _bucket(n: float) -> int:
    """The smallest tree-size bucket holding ``n`` nodes (the forward pads to these anyway)."""
    return next((b for b in TREE_BUCKETS if b >= n), TREE_BUCKETS[-1])


def derive(stats: NodeStats, bounds: CalibrationBounds = CalibrationBounds()) -> NodeCalibration | None:
    """The node's calibration from its stats; None while the evidence is too thin (global policy).

    - calibration: ``(observed + prior) / (raw predicted + prior)``, the factor that makes the heads'
      predictions match what this node accepts (what the online update converges to);
    - draft temperature: left to the engine's policy (see the module docstring);
    - budget: twice the 95th-percentile tree the node built, scaled by how much the new factor
      exceeds the one those trees were built with, rounded up to a forward bucket.
    """
    if stats.steps < bounds.min_steps or stats.raw_predicted <= 0:
        return None
    c = _clamp((stats.raw_observed + bounds.prior) / (stats.raw_predicted + bounds.prior),
               bounds.min_calibration, bounds.max_calibration)
    used = stats.calibrated / stats.raw_predicted  # mean factor the logged trees were built with
    grow = max(1.0, c / used) if used > 0 else 1.0
    budget = int(_clamp(_bucket(2 * stats.size_quantile(0.95) * grow), bounds.min_nodes, bounds.max_nodes))
    return NodeCalibration(max_nodes=budget, calibration=round(c, 4))


def material_change(old: NodeCalibration | None, new: NodeCalibration | None) -> bool:
    """Whether ``new`` differs enough from ``old`` to publish a version (avoids version churn)."""
    if new is None:
        return False
    if old is None:
        return True
    return (old.max_nodes != new.max_nodes or abs(math.log(new.calibration / old.calibration)) > 0.1
            or old.draft_temperature != new.draft_temperature)


def apply(base: TreePolicy, calib: NodeCalibration) -> TreePolicy | None:
    """The engine's policy started from ``calib``; None for a static tree (nothing to calibrate)."""
    if base.kind != "dynamic":
        return None
    temperature = base.draft_temperature if calib.draft_temperature is None else _clamp(
        calib.draft_temperature, CalibrationBounds.min_temperature, CalibrationBounds.max_temperature)
    return dataclasses.replace(base, max_nodes=max(base.min_nodes, min(calib.max_nodes, base.max_nodes)),
                               calibration=calib.calibration, draft_temperature=temperature)


# -- trial statistics ---------------------------------------------------------------------------------
def efficiency(stats: NodeStats, cost: Callable[[int], float] | None) -> float:
    """Tokens per unit of forward time over the node's tree steps: with ``cost`` (the profile's cost
    curve: time per verify forward by tree size) the time is modeled, which the machine's load does
    not move; without it, the measured decode time."""
    if cost is None:
        return stats.tokens_per_s
    modeled = sum(count * cost(size) for size, count in stats.sizes.items())
    return stats.tokens / modeled if modeled > 0 else 0.0


def sample_counters(value: float) -> dict[str, float]:
    """One run's sample of a trial arm as counters to add to the arm's (count, sum, sum of squares):
    additive, so a fold is one atomic increment and :class:`ArmSamples` reads the moments back."""
    return {"trial_n": 1.0, "trial_sum": value, "trial_sq": value * value}


@dataclass(frozen=True)
class ArmSamples:
    """The per-run samples of one trial arm, as moments (see :func:`sample_counters`)."""

    n: int
    total: float
    squares: float

    @classmethod
    def from_counters(cls, counters: Mapping[str, float]) -> ArmSamples:
        return cls(int(counters.get("trial_n", 0)), counters.get("trial_sum", 0.0),
                   counters.get("trial_sq", 0.0))

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    @property
    def variance(self) -> float:
        """Sample variance (n - 1 denominator; 0 below two samples, where it is undefined), floored at
        0 against rounding in ``squares - n * mean**2``."""
        if self.n < 2:
            return 0.0
        return max(0.0, (self.squares - self.n * self.mean ** 2) / (self.n - 1))


def difference(trial: ArmSamples, incumbent: ArmSamples) -> tuple[float, float]:
    """(trial mean - incumbent mean, standard error of that difference), arms taken as independent; an
    arm without samples adds no error (there is no mean to compare yet)."""
    spread = sum(a.variance / a.n for a in (trial, incumbent) if a.n)
    return trial.mean - incumbent.mean, math.sqrt(spread)
