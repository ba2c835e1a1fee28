"""Running registered workflows on the Redis checkpointer, with a run record and an audit trail.

:class:`WorkflowRunner` is what the CLI calls (runs are driven by :mod:`elesium.graphs.execution`). Order
matters: the input is validated (and the workflow and version looked up) before anything is
written, so a bad request leaves no run record, no checkpoint and no acceptance stream. Then the
run is registered with everything a re-execution needs (workflow version, input, run seed, tenant,
engine fingerprint), and the graph runs on the checkpointer under the run's thread. A run that
stops at a LangGraph ``interrupt`` is marked ``interrupted``; :meth:`WorkflowRunner.resume`
continues it with ``Command(resume=value)`` after checking the engine is the one it started on.

Every run is hash-chained as it goes (:mod:`elesium.graphs.audit_chain`: its registry record,
checkpoints and pending writes, acceptance entries) under ``<prefix>:audit`` and sealed when it ends
or stops at an interrupt; a resume continues the same run's chain and seals it again.
``elesium audit verify RUN_ID`` checks it (:func:`audit_verify`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from langgraph.types import Command
from pydantic import BaseModel, ValidationError

from elesium.errors import UserError
from elesium.graphs.audit_chain import AuditVerdict, open_run_audit, verify_run
from elesium.graphs.calibration import NodeCalibrator
from elesium.graphs.context import set_record_trees
from elesium.graphs.execution import EngineMismatchError, RunEngine, check_engine, drive, learn, run_config
from elesium.graphs.registry import Registry, Workflow
from elesium.graphs.seeds import fresh_run_seed
from elesium.graphs.workflows import default_registry
from elesium.inference.types import TextEngine
from elesium.state.acceptance_log import AcceptanceLog, Retention
from elesium.state.audit_chain import AuditChain
from elesium.state.calibrations import CalibrationStore
from elesium.state.checkpointer import RedisSaver
from elesium.state.connection import default_url
from elesium.state.errors import RunNotFoundError
from elesium.state.runs import RunRecord, RunRegistry, RunStatus, hash_input

RunOutcome = Literal["succeeded", "interrupted", "failed"]
EventSink = Callable[[str, Any], None]


class InputValidationError(UserError, ValueError):
    """The workflow input (or a resume value) does not match its schema. One line, for users."""


class RunStateError(UserError, ValueError):
    """The run cannot do what was asked in its current state (e.g. resume a finished run)."""


__all__ = ["EngineMismatchError", "InputValidationError", "RunResult", "RunStateError", "WorkflowRunner",
           "validate"]


def validate(model: type[BaseModel], value: Any, what: str) -> dict[str, Any]:
    """``value`` validated by ``model``, as JSON-able data; else one line naming the first problem."""
    if not isinstance(value, Mapping):
        raise InputValidationError(f"{what}: must be a JSON object, got {type(value).__name__}")
    try:
        return model.model_validate(dict(value)).model_dump(mode="json")
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise InputValidationError(f"{what}: field {where!r}: {err['msg']}{more}") from None


@dataclass
class RunResult:
    """How a run (or a resume) ended, and what it produced."""

    run_id: str
    thread_id: str
    workflow: str
    workflow_version: str
    status: RunOutcome
    seed: int
    state: dict[str, Any] = field(default_factory=dict)
    interrupt: list[dict[str, Any]] | None = None
    acceptance: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, str] = field(default_factory=dict)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class WorkflowRunner:
    """Start and resume runs of registered workflows.

    Args:
        engine: the loaded engine every LLM node decodes on.
        redis_url: state server (default: ``REDIS_URL``, else the embedded Valkey).
        registry: where workflow names resolve (default: the shipped workflows).
        mode: decode mode for nodes that do not pin one (None: the engine's default).
        prefix: key root for checkpoints, run records and acceptance streams (tests isolate by it).
        record_trees: record every drafted tree of every run's decode steps (workflows can ask for it
            themselves: ``Workflow.define(..., record_trees=True)``).
    """

    def __init__(
        self,
        engine: TextEngine,
        redis_url: str | None = None,
        *,
        registry: Registry | None = None,
        mode: str | None = None,
        prefix: str = "elesium",
        record_trees: bool = False,
    ) -> None:
        url = redis_url or default_url()
        self.prefix = prefix
        self.engine = engine
        self.registry = registry or default_registry()
        self.mode = mode
        self.record_trees = record_trees
        self.saver = RedisSaver.from_url(url, prefix=f"{prefix}:cp")
        self.runs = RunRegistry.from_url(url, prefix=f"{prefix}:runs")
        # The audit trail of a run is kept whole: replay compares every step.
        self.log = AcceptanceLog.from_url(url, prefix=f"{prefix}:acc", retention=Retention(maxlen=None))
        # Per-node tree calibrations (graphs/calibration.py): used by tree-decoding nodes, learnt from
        # runs that succeed. Set .use / .learn False for the global policy / a frozen calibration.
        # Trials compare arms on the engine's own cost curve (read at decision time: a re-tuned
        # engine's curve is the one that matters).
        self.calibrator = NodeCalibrator(CalibrationStore.from_url(url, prefix=f"{prefix}:calib"), self.log,
                                         runs=self.runs, cost=self.engine.step_cost)

    def workflow(self, workflow: Workflow | str, version: str | None = None) -> Workflow:
        return workflow if isinstance(workflow, Workflow) else self.registry.get(workflow, version)

    def start(
        self,
        workflow: Workflow | str,
        input: Any,
        *,
        seed: int | None = None,
        thread_id: str | None = None,
        run_id: str | None = None,
        tenant: str = "default",
        on_event: EventSink | None = None,
        calibrations: Mapping[str, str] | None = None,
    ) -> RunResult:
        """Validate, register and run; returns when the run ends or stops at an interrupt.

        ``calibrations`` pins nodes' calibration versions (node -> ``v<n>`` | ``global``), as a
        re-execution does (:func:`elesium.graphs.calibration.reexecute`); other nodes use the current one.

        Raises (before writing anything): UnknownWorkflowError, InputValidationError; RunExistsError
        for a taken run id.
        """
        wf = self.workflow(workflow)
        values = validate(wf.input_model, input, f"invalid input for workflow {wf.name!r}")
        run_seed = int(seed) if seed is not None else fresh_run_seed()
        run_id = run_id or uuid.uuid4().hex
        record = RunRecord(
            run_id=run_id,
            workflow=wf.name,
            workflow_version=wf.version,
            input_hash=hash_input(values),
            seeds={"run": run_seed},
            tenant=tenant,
            thread_id=thread_id or run_id,
            input=values,
            engine=self.engine.fingerprint(self.mode),
            calibrations=dict(calibrations or {}),
        )
        self.runs.create(record)
        self.runs.update_status(run_id, RunStatus.RUNNING)
        return self._execute(wf, record, values, on_event)

    def resume(self, run_id: str, value: Any, *, on_event: EventSink | None = None) -> RunResult:
        """Continue an interrupted run with ``value`` as the interrupt's answer.

        Raises (before writing anything): RunNotFoundError, RunStateError (not interrupted),
        UnknownWorkflowError (its version is not registered here), InputValidationError (value),
        EngineMismatchError.
        """
        record = self.runs.get(run_id)
        if record is None:
            raise RunNotFoundError(f"no run {run_id!r} in the registry")
        if record.status != RunStatus.INTERRUPTED:
            raise RunStateError(
                f"run {run_id!r} is {record.status.value}; only an interrupted run can be resumed"
            )
        wf = self.registry.get(record.workflow, record.workflow_version)
        if wf.resume_model is not None:
            value = validate(wf.resume_model, value, f"invalid resume value for workflow {wf.name!r}")
        check_engine(self.engine, record.engine, record.engine.get("mode") or None, what=f"run {run_id!r}")
        self.runs.update_status(run_id, RunStatus.RUNNING)
        return self._execute(wf, record, Command(resume=value), on_event)

    def _execute(
        self, wf: Workflow, record: RunRecord, graph_input: Any, on_event: EventSink | None
    ) -> RunResult:
        seed = record.seeds["run"]
        thread_id = record.thread_id or record.run_id
        graph = wf.build(self.saver)
        engine = RunEngine(self.engine)
        config = run_config(engine, run_id=record.run_id, thread_id=thread_id, seed=seed,
                            tenant=record.tenant, log=self.log, mode=record.engine.get("mode") or self.mode,
                            workflow=wf.name,
                            calibrator=self.calibrator, calibrations=record.calibrations)
        set_record_trees(config, self.record_trees or wf.record_trees)
        result = RunResult(run_id=record.run_id, thread_id=thread_id, workflow=wf.name,
                           workflow_version=wf.version, status="failed", seed=seed,
                           fingerprint=dict(record.engine))
        # The run's hash chain (a resume continues it: same run id): per super-step, sealed at the end.
        audit = open_run_audit(self.runs.client, thread_id=thread_id, run_id=record.run_id,
                               registry=self.runs, cp_prefix=self.saver.prefix, acceptance=self.log,
                               chain_prefix=f"{self.prefix}:audit")
        outcome = drive(graph, graph_input, config, emit=on_event, stream_modes=("updates", "custom"),
                        audit=audit)
        if outcome.status == "error":
            exc = outcome.exception
            message = str(exc) if exc is not None else (outcome.error or "")
            name = type(exc).__name__ if exc is not None else "Error"
            result.error = (message.splitlines() or [name])[0] or name
            self.runs.update_status(record.run_id, RunStatus.FAILED, error=f"{name}: {result.error}")
        elif outcome.status == "interrupted":
            result.state = dict(outcome.values)
            result.status = "interrupted"
            result.interrupt = [{"id": i["id"], "value": i["value"]} for i in outcome.interrupts]
            self.runs.update_status(record.run_id, RunStatus.INTERRUPTED)
        else:
            result.state = dict(outcome.values)
            result.status = "succeeded"
            self.runs.update_status(record.run_id, RunStatus.SUCCEEDED)
            learn(self.calibrator, wf.name, record.run_id)
        result.acceptance = self.acceptance_summary(record.run_id)
        return result

    def audit_verify(self, run_id: str, *, signer: Any = None) -> AuditVerdict:
        """Verify the run's hash chain and seal (:func:`elesium.graphs.audit_chain.verify_run`) with
        this runner's key prefixes. Raises KeyError for an unknown run."""
        return verify_run(self.runs.client, run_id, registry=self.runs, cp_prefix=self.saver.prefix,
                          acceptance=self.log, signer=signer,
                          chain=AuditChain(self.runs.client, prefix=f"{self.prefix}:audit"))

    def acceptance_summary(self, run_id: str) -> dict[str, Any]:
        """Whole-run and per-node tau, tokens and LLM calls, from the run's acceptance stream."""
        entries = list(self.log.iter_entries(run_id))
        nodes: dict[str, dict[str, Any]] = {}
        for e in entries:
            node = nodes.setdefault(e.node_id, {"calls": 0, "tokens": 0})
            if e.kind == "call":
                node["calls"] += 1
                node["tokens"] += len(e.tokens or ())
        for name, node in nodes.items():
            s = self.log.summary(run_id, name)
            node.update(steps=s.steps, tau=round(s.tau, 4))
        total = self.log.summary(run_id)
        return {
            "calls": sum(n["calls"] for n in nodes.values()),
            "tokens": sum(n["tokens"] for n in nodes.values()),
            "steps": total.steps,
            "tau": round(total.tau, 4),
            "nodes": nodes,
        }
