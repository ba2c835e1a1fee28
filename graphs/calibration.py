"""Self-tuning from the acceptance log: per-node tree calibrations for workflow runs.

:class:`NodeCalibrator` is the loop the issue asks for. When an LLM node decodes with a tree
(speculative or typical mode) it starts from its node's current calibration version instead of the
engine's global policy (:func:`node_policy`); the run pins that version for the node, records it in
its run record (``calibrations``: node -> ``v<n>`` or ``global``) and keeps using it for every
call of the node, across interrupts and resumes. When the run succeeds, its acceptance entries are
folded into each node's counters and a new version is published where the estimate moved
materially (:meth:`NodeCalibrator.fold_run`). ``elesium tune --from-log`` rebuilds all of it from
the stored runs (:meth:`NodeCalibrator.rebuild`).

Determinism: a seeded sampled call's tokens depend on its trees, so a run's tokens are a function
of (workflow version, input, seed, engine fingerprint, calibration versions). Re-executing a run
(:func:`reexecute`) pins the versions it recorded, so it reproduces the run's tokens even after
newer calibrations were published.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elesium.errors import UserError
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.tuning.node_calibration import (
    CalibrationBounds,
    NodeCalibration,
    NodeStats,
    apply,
    derive,
    material_change,
    stats_by_node,
)
from elesium.state.acceptance_log import AcceptanceLog
from elesium.state.calibrations import GLOBAL, CalibrationStore

log = logging.getLogger(__name__)


class CalibrationNotFoundError(UserError, LookupError):
    """A run pins a calibration version that is not in the store (deleted, or another database)."""


@dataclass(frozen=True)
class CalibrationRow:
    """One node's line of the before/after table of a rebuild (or of an online update)."""

    workflow: str
    node: str
    before: str
    after: str
    stats: dict[str, Any]
    old: NodeCalibration | None
    new: NodeCalibration | None


class NodeCalibrator:
    """Chooses each node's tree policy and learns it from finished runs.

    Args:
        store: versions and counters.
        log: the acceptance log runs append to (where ``fold_run`` reads a run's steps).
        runs: the run registry; when given, a node's chosen version is written to the run record
            as soon as the node first decodes (so an interrupted run resumed elsewhere reuses it).
        use: start nodes from their current calibration (False: the global policy, still recorded).
        learn: fold finished runs and publish new versions.
        bounds: how far a node may move from the global policy.
    """

    def __init__(self, store: CalibrationStore, log: AcceptanceLog, *, runs: Any = None, use: bool = True,
                 learn: bool = True, bounds: CalibrationBounds = CalibrationBounds()) -> None:
        self.store = store
        self.log = log
        self.runs = runs
        self.use = use
        self.learn = learn
        self.bounds = bounds

    # -- choosing ---------------------------------------------------------------------------------
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

    def choose(self, base: TreePolicy, workflow: str, node: str,
               pinned: str | None) -> tuple[str, TreePolicy | None]:
        """(version label, policy to decode with; None = the engine's own) for one call of ``node``."""
        if base.kind != "dynamic":
            return GLOBAL, None
        label = pinned or (self.store.current(workflow, node) if self.use else GLOBAL)
        calib = self.calibration(workflow, node, label)
        return label, None if calib is None else apply(base, calib)

    # -- learning ---------------------------------------------------------------------------------
    def current(self, workflow: str, node: str) -> tuple[str, NodeCalibration | None]:
        label = self.store.current(workflow, node)
        return label, self.calibration(workflow, node, label)

    def _update(self, workflow: str, node: str, source: str) -> CalibrationRow:
        stats = NodeStats.from_counters(self.store.counters(workflow, node))
        before, old = self.current(workflow, node)
        new = derive(stats, self.bounds)
        after = before
        if self.learn and material_change(old, new):
            assert new is not None
            after = self.store.publish(workflow, node, {
                "policy": new.to_dict(), "stats": stats.summary(), "source": source, "previous": before,
                "runs": self.store.folded_runs(workflow, node)})
        return CalibrationRow(workflow, node, before, after, stats.summary(), old,
                              new if after != before else old)

    def fold_run(self, workflow: str, run_id: str) -> list[CalibrationRow]:
        """Fold a finished run's acceptance into its nodes' counters; publish where it moved materially.

        Idempotent per run. Vanilla calls carry no tree evidence: a node only ever decoded in vanilla
        mode gets no calibration.
        """
        rows = []
        for node, stats in stats_by_node(self.log.iter_entries(run_id)).items():
            if not stats.steps:
                continue
            if self.store.fold(workflow, node, run_id, stats.to_counters()) and self.learn:
                rows.append(self._update(workflow, node, f"run {run_id}"))
        return rows

    def rebuild(self, workflow: str, run_ids: list[str]) -> list[CalibrationRow]:
        """Recount every node of ``workflow`` from the given runs' logs, then publish where it moved."""
        per_node: dict[str, dict[str, NodeStats]] = {}
        for run_id in run_ids:
            for node, stats in stats_by_node(self.log.iter_entries(run_id)).items():
                if stats.steps:
                    per_node.setdefault(node, {})[run_id] = stats
        for node in set(per_node) | set(self.store.nodes(workflow)):
            self.store.reset_counters(workflow, node)
        rows = []
        for node in sorted(per_node):
            for run_id, stats in per_node[node].items():
                self.store.fold(workflow, node, run_id, stats.to_counters())
            rows.append(self._update(workflow, node, "tune --from-log"))
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
            calibrator.runs.set_calibration(ctx.run_id, node, label)
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
