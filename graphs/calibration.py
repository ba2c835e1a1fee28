"""Self-tuning from the acceptance log: per-node tree calibrations for workflow runs.

:class:`NodeCalibrator` is the loop the issue asks for. When an LLM node decodes with a tree
(speculative or typical mode) it starts from its node's current calibration version instead of the
engine's global policy (:func:`node_policy`); the run pins that version for the node, records it in
its run record (``calibrations``: node -> ``v<n>`` or ``global``) and keeps using it for every
call of the node, across interrupts and resumes. When the run succeeds, its acceptance entries are
folded into each node's counters (:meth:`NodeCalibrator.fold_run`).

A new estimate is never adopted on faith. The first benchmark (BENCHMARKS.md section 9) showed why:
a factor that matches the heads' predictions to what a node accepts can still build trees that cost
more than they return on the machine's cost curve. So where the estimate moved materially, the new
version goes *on trial*: the node's runs alternate between it and the current version, each arm's
runs are counted apart, and the trial version is promoted only if its runs' tokens per unit of
modeled forward time (the profile's cost curve, which the machine's load does not distort) beat the
incumbent's by more than their noise (:class:`TrialRule`); otherwise it is rejected and the node
keeps what it had. A rejected estimate is not retried until the evidence moves it materially
again. ``elesium tune --from-log`` rebuilds the counters from the stored runs and starts a trial the
same way (:meth:`NodeCalibrator.rebuild`; ``adopt=True`` publishes directly, an operator override).

Layering: every decision of the loop (which arm a run takes, whether an estimate goes on trial, a
trial's verdict and the record of it) is taken in this module. :mod:`elesium.state.calibrations`
only stores and reads (versions, pointers, counters, trial arms, each change one atomic write) and
:mod:`elesium.inference.tuning.node_calibration` only computes (statistics, the estimate, the tree
policy); neither calls back up.

Determinism: a seeded sampled call's tokens depend on its trees, so a run's tokens are a function
of (workflow version, input, seed, engine fingerprint, calibration versions). Re-executing a run
(:func:`reexecute`) pins the versions it recorded, so it reproduces the run's tokens even after
newer calibrations were published.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from elesium.errors import UserError
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.tuning.node_calibration import (
    ArmSamples,
    CalibrationBounds,
    NodeCalibration,
    NodeStats,
    apply,
    derive,
    difference,
    efficiency,
    material_change,
    sample_counters,
    stats_by_node,
)
from elesium.state.acceptance_log import AcceptanceLog
from elesium.state.calibrations import GLOBAL, CalibrationStore

log = logging.getLogger(__name__)


class CalibrationNotFoundError(UserError, LookupError):
    """A run pins a calibration version that is not in the store (deleted, or another database)."""


@dataclass(frozen=True)
class TrialRule:
    """When a trial is decided, and how: a one-sided comparison of per-run efficiencies.

    Each run that decodes a node during its trial is one sample of that arm: the run's tokens per
    unit of modeled forward time at the node (:func:`efficiency`). Runs differ in their inputs, and
    a node's efficiency varies from input to input by more than a good calibration gains, so a
    plain comparison of a few runs promotes noise (the first trial benchmark promoted a version on
    3 runs per arm that lost on held-out inputs). So, once both arms have ``min_runs`` samples:
    promote when the trial's mean beats the incumbent's by more than ``margin`` (relative) plus
    ``z`` standard errors of the difference; reject when it is ``z`` standard errors *below*, or
    when both arms reached ``max_runs`` without a promotion (no evidence of a gain: keep what we
    have). ``z`` = 1.28 is a one-sided 90 % bound per look; the repeated looks make the real error
    rate higher, which the ``max_runs`` cut-off and a rejection as the default outcome bound.
    """

    min_runs: int = 3
    max_runs: int = 12
    z: float = 1.28
    margin: float = 0.0

    def outcome(self, trial: ArmSamples, incumbent: ArmSamples) -> bool | None:
        """True: promote the trial version; False: reject it; None: not decided yet."""
        if min(trial.n, incumbent.n) < self.min_runs:
            return None
        diff, se = difference(trial, incumbent)
        if diff - self.z * se > self.margin * incumbent.mean:
            return True
        if diff + self.z * se < 0 or min(trial.n, incumbent.n) >= self.max_runs:
            return False
        return None


@dataclass(frozen=True)
class CalibrationRow:
    """One node's line of the before/after table of a rebuild (or of an online update).

    ``after`` is the version new runs start from (the current one); ``trial`` the version on trial
    after this update, if any; ``event`` what happened: "unchanged", "trial", "promoted",
    "rejected" or "adopted" (published directly).
    """

    workflow: str
    node: str
    before: str
    after: str
    stats: dict[str, Any]
    old: NodeCalibration | None
    new: NodeCalibration | None
    trial: str | None = None
    event: str = "unchanged"
    verdict: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Trial:
    """A running trial as the store holds it: the version on trial and the one it runs against (the
    version that was current when it was published, recorded in its document as ``previous``)."""

    label: str
    incumbent: str

    def arm(self, label: str | None) -> str | None:
        """The arm a run that used ``label`` is a sample of; None for a version outside the trial."""
        return label if label in (self.label, self.incumbent) else None


class NodeCalibrator:
    """Chooses each node's tree policy and learns it from finished runs.

    Every self-tuning decision is taken here, in one direction: read the store and the log
    (:mod:`elesium.state`), compute with the pure statistics of
    :mod:`elesium.inference.tuning.node_calibration`, decide, write the outcome back in one store
    call. Neither layer below calls back up, so one run's fold can be followed top to bottom in
    :meth:`fold_run`.

    Args:
        store: versions and counters.
        log: the acceptance log runs append to (where ``fold_run`` reads a run's steps).
        runs: the run registry; when given, a node's chosen version is written to the run record
            as soon as the node first decodes (so an interrupted run resumed elsewhere reuses it).
        use: start nodes from their current calibration (False: the global policy, still recorded).
        learn: fold finished runs and publish new versions.
        bounds: how far a node may move from the global policy.
        rule: when a trial is decided (None: adopt new estimates directly, the behaviour before trials).
        cost: the engine's cost curve (time of a verify forward by tree size) that trials compare
            arms on; None: measured decode time.
    """

    def __init__(self, store: CalibrationStore, log: AcceptanceLog, *, runs: Any = None, use: bool = True,
                 learn: bool = True, bounds: CalibrationBounds = CalibrationBounds(),
                 rule: TrialRule | None = TrialRule(), cost: Callable[[int], float] | None = None) -> None:
        self.store = store
        self.log = log
        self.runs = runs
        self.use = use
        self.learn = learn
        self.bounds = bounds
        self.rule = rule
        self.cost = cost

    # -- reading the store ------------------------------------------------------------------------
    def calibration(self, workflow: str, node: str, label: str) -> NodeCalibration | None:
        """Version ``label``'s values (None for ``global``); raises CalibrationNotFoundError."""
        if label == GLOBAL:
            return None
        doc = self.store.get(workflow, node, label)
        if doc is None:
            raise CalibrationNotFoundError(
                f"calibration {label} of {workflow}/{node} is not in the store; re-execute against the "
                "database the run was recorded in")
        return NodeCalibration.from_dict(doc["policy"])

    def current(self, workflow: str, node: str) -> tuple[str, NodeCalibration | None]:
        label = self.store.current(workflow, node)
        return label, self.calibration(workflow, node, label)

    def _trial(self, workflow: str, node: str) -> _Trial | None:
        label = self.store.trial(workflow, node)
        if label is None:
            return None
        doc = self.store.get(workflow, node, label) or {}
        return _Trial(label, str(doc.get("previous", GLOBAL)))

    def _rejected(self, workflow: str, node: str) -> NodeCalibration | None:
        """The policy of the node's last rejected trial (not proposed again until the estimate moves)."""
        for verdict in reversed(self.store.decisions(workflow, node)):
            if verdict.get("verdict") == "rejected":
                doc = self.store.get(workflow, node, verdict["trial"])
                return None if doc is None else NodeCalibration.from_dict(doc["policy"])
        return None

    def _label_of(self, run_id: str, node: str, labels: Mapping[str, str] | None) -> str | None:
        if labels is not None:
            return labels.get(node)
        record = self.runs.get(run_id) if self.runs is not None else None
        return None if record is None else record.calibrations.get(node)

    def _node_stats(self, run_id: str) -> dict[str, NodeStats]:
        """The run's per-node evidence; nodes with no tree step (vanilla only) carry none."""
        return {node: stats for node, stats in stats_by_node(self.log.iter_entries(run_id)).items()
                if stats.steps}

    # -- choosing ---------------------------------------------------------------------------------
    def choose(self, base: TreePolicy, workflow: str, node: str,
               pinned: str | None) -> tuple[str, TreePolicy | None]:
        """(version label, policy to decode with; None = the engine's own) for one call of ``node``.

        While a version is on trial, successive runs alternate between it and the current one (the
        run records which it got, so re-execution is unaffected)."""
        if base.kind != "dynamic":
            return GLOBAL, None
        if pinned:
            label = pinned
        elif not self.use:
            label = GLOBAL
        else:
            label = self.store.current(workflow, node)
            trial = self.store.trial(workflow, node) if self.rule is not None else None
            if trial is not None and self.store.next_turn(workflow, node) % 2 == 1:
                label = trial
        calib = self.calibration(workflow, node, label)
        return label, None if calib is None else apply(base, calib)

    # -- deciding ---------------------------------------------------------------------------------
    def _end_trial(self, workflow: str, node: str, trial: _Trial, *, promote: bool,
                   verdict: Mapping[str, Any]) -> bool:
        """Store the verdict on ``trial`` (False: another fold stored one first). The record's shape is
        the one stored since trials exist: ``verdict`` plus trial, incumbent, outcome and time."""
        record = {**verdict, "trial": trial.label, "incumbent": trial.incumbent,
                  "verdict": "promoted" if promote else "rejected",
                  "decided": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        return self.store.end_trial(workflow, node, trial.label, trial.incumbent, make_current=promote,
                                    record=record)

    def _judge(self, workflow: str, node: str, trial: _Trial, row: CalibrationRow) -> CalibrationRow:
        """Decide ``trial`` by :class:`TrialRule`; else report it still running."""
        rule = self.rule
        assert rule is not None
        raw = {label: self.store.counters(workflow, node, arm=label)
               for label in (trial.label, trial.incumbent)}
        arms = {label: ArmSamples.from_counters(c) for label, c in raw.items()}
        promote = rule.outcome(arms[trial.label], arms[trial.incumbent])
        if promote is None:
            return dataclasses.replace(row, trial=trial.label, event="trial")
        diff, se = difference(arms[trial.label], arms[trial.incumbent])
        evidence = {label: NodeStats.from_counters(c) for label, c in raw.items()}
        verdict = {"efficiency": {k: round(a.mean, 6) for k, a in arms.items()},
                   "stdev": {k: round(math.sqrt(a.variance), 6) for k, a in arms.items()},
                   "runs": {k: a.n for k, a in arms.items()}, "difference": round(diff, 6),
                   "stderr": round(se, 6),
                   "tau": {k: round(s.tau, 4) for k, s in evidence.items()},
                   "steps": {k: s.steps for k, s in evidence.items()},
                   "modeled": self.cost is not None}
        if not self._end_trial(workflow, node, trial, promote=promote, verdict=verdict):
            return dataclasses.replace(row, trial=self.store.trial(workflow, node))  # decided elsewhere
        after, new = self.current(workflow, node)
        log.info("calibration %s of %s/%s %s: efficiency %.4g against %s's %.4g", trial.label, workflow,
                 node, "promoted" if promote else "rejected", arms[trial.label].mean, trial.incumbent,
                 arms[trial.incumbent].mean)
        return dataclasses.replace(row, after=after, new=new, trial=None,
                                   event="promoted" if promote else "rejected", verdict=verdict)

    def _update(self, workflow: str, node: str, source: str, *, adopt: bool = False) -> CalibrationRow:
        """After the node's counters changed: decide a running trial, or start one (``adopt``:
        publish directly) where the estimate moved materially."""
        stats = NodeStats.from_counters(self.store.counters(workflow, node))
        before, old = self.current(workflow, node)
        row = CalibrationRow(workflow, node, before, before, stats.summary(), old, old)
        if not self.learn:
            return row
        trial = self._trial(workflow, node)
        if trial is not None and adopt:  # an operator's adoption ends the trial undecided
            self._end_trial(workflow, node, trial, promote=False,
                            verdict={"reason": "superseded by an adopted version"})
        elif trial is not None and self.rule is not None:
            return self._judge(workflow, node, trial, row)
        new = derive(stats, self.bounds)
        if not material_change(old, new):
            return row
        assert new is not None
        on_trial = self.rule is not None and not adopt
        if on_trial and not material_change(self._rejected(workflow, node), new):
            return row  # the same estimate lost its trial already
        label = self.store.publish(workflow, node, {
            "policy": new.to_dict(), "stats": stats.summary(), "source": source, "previous": before,
            "runs": self.store.folded_runs(workflow, node)}, trial=on_trial)
        if on_trial:
            return dataclasses.replace(row, new=new, trial=label, event="trial")
        return dataclasses.replace(row, after=label, new=new, event="adopted")

    # -- learning ---------------------------------------------------------------------------------
    def fold_run(self, workflow: str, run_id: str,
                 labels: Mapping[str, str] | None = None) -> list[CalibrationRow]:
        """Fold a finished run's acceptance into its nodes' counters (and a running trial's arm);
        start, continue or decide trials.

        ``labels``: the version each node used (default: from the run record, when the calibrator
        has the registry). Idempotent per run. Vanilla calls carry no tree evidence: a node only
        ever decoded in vanilla mode gets no calibration.
        """
        rows = []
        for node, stats in self._node_stats(run_id).items():
            counters = stats.to_counters()
            label = self._label_of(run_id, node, labels)
            trial = self._trial(workflow, node) if self.rule is not None and label is not None else None
            arm = trial.arm(label) if trial is not None else None
            if arm is not None:  # the run is one sample of its arm (TrialRule)
                counters.update(sample_counters(efficiency(stats, self.cost)))
            if self.store.fold(workflow, node, run_id, counters, arm=arm) and self.learn:
                rows.append(self._update(workflow, node, f"run {run_id}"))
        return rows

    def rebuild(self, workflow: str, run_ids: list[str], *, adopt: bool = False) -> list[CalibrationRow]:
        """Recount every node of ``workflow`` from the given runs' logs; where the estimate moved,
        start a trial (``adopt``: publish it as current at once, skipping the trial)."""
        per_node: dict[str, dict[str, NodeStats]] = {}
        for run_id in run_ids:
            for node, stats in self._node_stats(run_id).items():
                per_node.setdefault(node, {})[run_id] = stats
        for node in set(per_node) | set(self.store.nodes(workflow)):
            self.store.reset_counters(workflow, node)
        rows = []
        for node in sorted(per_node):
            for run_id, stats in per_node[node].items():
                self.store.fold(workflow, node, run_id, stats.to_counters())
            rows.append(self._update(workflow, node, "tune --from-log", adopt=adopt))
        return rows


def node_policy(ctx: Any, node: str, mode: str | None) -> TreePolicy | None:
    """The policy an LLM call of ``node`` decodes with under run context ``ctx`` (None: the engine's).

    Pins the node's version in ``ctx.calibrations`` on its first call in the run, and writes it to
    the run record when the calibrator has the run registry. Vanilla calls need no tree.
    """
    calibrator: NodeCalibrator | None = getattr(ctx, "calibrator", None)
    if calibrator is None or not ctx.workflow:
        return None
    engine = ctx.engine
    if engine.resolve_mode(mode) == "vanilla":
        return None
    pinned = ctx.calibrations.get(node)
    label, policy = calibrator.choose(engine.policy, ctx.workflow, node, pinned)
    if pinned is None:
        ctx.calibrations[node] = label
        if calibrator.runs is not None:
            from elesium.state.errors import RunNotFoundError

            try:
                calibrator.runs.set_calibration(ctx.run_id, node, label)
            except RunNotFoundError:  # the registry is a secondary index (the API tolerates its loss)
                log.warning("run %s is not in the registry; node %s's calibration %s is not recorded",
                            ctx.run_id, node, label)
    return policy


def reexecute(runner: Any, run_id: str, *, new_run_id: str | None = None,
              calibrations: Mapping[str, str] | None = None) -> Any:
    """Run a recorded run again as a new run: same workflow version, input, seed, tenant, mode and
    calibration versions (``calibrations`` overrides them, e.g. to compare with the current ones).

    ``runner`` is a :class:`~elesium.graphs.runner.WorkflowRunner` on the same engine; returns its
    RunResult. The recorded run itself is not touched.
    """
    from elesium.state.errors import RunNotFoundError

    record = runner.runs.get(run_id)
    if record is None:
        raise RunNotFoundError(f"no run {run_id!r} in the registry")
    wf = runner.registry.get(record.workflow, record.workflow_version)
    mode = runner.engine.resolve_mode(runner.mode)
    if record.engine.get("mode") and record.engine["mode"] != mode:
        raise UserError(f"run {run_id!r} decoded in {record.engine['mode']} mode; re-execute it with a "
                        f"runner in that mode (this one runs {mode})")
    pins = dict(record.calibrations if calibrations is None else calibrations)
    return runner.start(wf, record.input or {}, seed=record.seeds["run"], tenant=record.tenant,
                        run_id=new_run_id, calibrations=pins)
