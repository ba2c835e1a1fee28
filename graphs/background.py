"""Background workflow runs: the glue between the durable queue (state/) and the workflows (graphs/).

``submit`` is the producer side (what ``POST`` of a background run calls): validate the input, record
the run as pending in the run registry, enqueue it. ``WorkflowExecutor`` is the consumer side, the
``execute(run_id, lease)`` callback ``elesium worker`` runs: it reads the run record, refuses an engine
other than the one the run was recorded with (tokens would differ), builds the workflow's graph on the
lease's fenced checkpointer, gives the LLM nodes the lease's fenced acceptance log, and starts or
resumes the graph through :mod:`elesium.graphs.execution`, keeping the registry's status in step, and
hash-chains what the run writes (:mod:`elesium.graphs.audit_chain`, under ``<prefix>:audit``, as
``WorkflowRunner`` does; a retried attempt continues the chain), sealed when it ends.
``GraphExecutor`` does the same for any graph built per run (no workflow registry).

Idempotency: with an ``idempotency_key`` the run id is derived from (tenant, key), so two concurrent
identical requests create one record (the second sees ``RunExistsError``) and one queue entry (the
queue's enqueue script is idempotent by the same key). A crash between the two writes is repaired by
the client's retry with the same key.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

from langchain_core.runnables import RunnableConfig

from elesium.graphs.audit_chain import open_run_audit
from elesium.graphs.execution import (
    RunChain,
    RunEngine,
    check_engine,
    drive,
    outcome_now,
    resume_point,
    run_config,
)
from elesium.graphs.registry import Workflow
from elesium.graphs.runner import WorkflowRunner, validate
from elesium.graphs.seeds import fresh_run_seed
from elesium.state.acceptance_log import Retention
from elesium.state.errors import RedisUnavailableError, RunExistsError
from elesium.state.queue import (
    EnqueueResult,
    IdempotencyConflictError,
    Lease,
    LeaseLostError,
    RunCancelledError,
    RunQueue,
)
from elesium.state.runs import RunRecord, RunStatus, hash_input

RUN_NS = uuid.UUID("0c3f4a9e-5b7d-4e21-9a6f-2d8c1b7e5f30")


def run_id_for(tenant: str, idempotency_key: str) -> str:
    """The run id of a keyed request: stable, so retries and concurrent duplicates name one run."""
    return uuid.uuid5(RUN_NS, f"{tenant}\x1f{idempotency_key}").hex


def submit(runner: WorkflowRunner, queue: RunQueue, workflow: Workflow | str, input: Any, *,
           seed: int | None = None, tenant: str = "default", idempotency_key: str | None = None,
           timeout_s: float | None = None, version: str | None = None) -> EnqueueResult:
    """Validate, record as pending and enqueue a background run of ``workflow``.

    Raises (before writing anything): UnknownWorkflowError, InputValidationError (from graphs);
    IdempotencyConflictError when the key was used with another input.
    """
    wf = runner.workflow(workflow, version) if isinstance(workflow, str) else workflow
    values = validate(wf.input_model, input, f"invalid input for workflow {wf.name!r}")
    run_id = run_id_for(tenant, idempotency_key) if idempotency_key else uuid.uuid4().hex
    payload = {"workflow": wf.name, "version": wf.version, "input": values, "tenant": tenant}
    record = RunRecord(run_id=run_id, workflow=wf.name, workflow_version=wf.version,
                       input_hash=hash_input(values),
                       seeds={"run": int(seed) if seed is not None else fresh_run_seed()}, tenant=tenant,
                       thread_id=run_id, input=values, engine=runner.engine.fingerprint(runner.mode))
    try:
        runner.runs.create(record)
    except RunExistsError:
        existing = runner.runs.get(run_id)
        if existing is not None and existing.input_hash != record.input_hash:
            raise IdempotencyConflictError(
                f"idempotency key {idempotency_key!r} was already used with a different input") from None
    return queue.enqueue(run_id, payload, idempotency_key=idempotency_key, timeout_s=timeout_s)


def drive_leased(graph: Any, lease: Lease, graph_input: Any, config: RunnableConfig,
                 engine: RunEngine | None = None, audit: RunChain | None = None) -> str:
    """One attempt of a queued run: start it, continue it from the checkpoint an earlier attempt
    reached, or, when that attempt finished the graph and died before acknowledging, execute nothing.
    Returns "succeeded" or "interrupted"; a node's exception propagates (after the lease is asked for
    the real reason: a stream closed by a cancel, a timeout or a lost lease surfaces as that).

    The lease is checked after every super-step, and an abort closes the run's open generations at once
    (through ``engine``), so a long LLM call stops after its current decode step. ``audit``: the run's
    hash chain, chained per super-step and sealed with the outcome (also when an earlier attempt
    finished the graph and died before sealing)."""
    run_id = str(config["configurable"]["run_id"])
    thread_id = str(config["configurable"]["thread_id"])
    unregister = lease.on_abort(engine.cancel) if engine is not None else (lambda: None)
    try:
        point = resume_point(graph, config, run_id)
        if point == "done":
            outcome = outcome_now(graph, thread_id)
            if audit is not None:
                audit.seal(outcome.status)
        else:
            try:
                outcome = drive(graph, graph_input if point == "start" else None, config,
                                cancelled=engine.cancelled if engine is not None else None,
                                between_steps=lease.check, stream_modes=("updates",), audit=audit)
            except Exception:  # noqa: BLE001 - re-raised; only the lease's reason may replace it
                lease.check()  # cancelled, timed out or lost: raise that instead
                raise
            if outcome.status == "error":
                lease.check()
                assert outcome.exception is not None
                raise outcome.exception
    finally:
        unregister()
    return "interrupted" if outcome.status == "interrupted" else "succeeded"


GraphFactory = Callable[[Lease, Any], Any]
"""(lease, checkpointer) -> compiled graph."""


class GraphExecutor:
    """The queue's ``execute(run_id, lease)`` for any graph built per run.

    Args:
        build: ``(lease, checkpointer) -> compiled graph``; the checkpointer is the lease's fenced saver.
        config: ``(lease) -> RunnableConfig``; by default the lease's thread and run ids (LangGraph copies
            the run id into each checkpoint's metadata, which is how a retried attempt knows where it got to).
        input_of: the graph input from the payload (default: ``payload["input"]``).
        saver_options: passed to the fenced saver (``prefix``, ``ttl_s``, ``keep_last``, ``serde``).
    """

    def __init__(self, build: GraphFactory, *, config: Callable[[Lease], Mapping[str, Any]] | None = None,
                 input_of: Callable[[Mapping[str, Any]], Any] | None = None,
                 saver_options: Mapping[str, Any] | None = None) -> None:
        self.build = build
        self.config = config or (lambda lease: {"configurable": {"thread_id": lease.thread_id,
                                                                 "run_id": lease.run_id}})
        self.input_of = input_of or (lambda payload: payload.get("input"))
        self.saver_options = dict(saver_options or {})

    def __call__(self, run_id: str, lease: Lease) -> str:
        graph = self.build(lease, lease.saver(**self.saver_options))
        config = RunnableConfig(**self.config(lease))  # type: ignore[typeddict-item]
        return drive_leased(graph, lease, self.input_of(lease.payload), config)


class WorkflowExecutor:
    """Executes queued workflow runs with a :class:`~elesium.graphs.runner.WorkflowRunner`'s engine,
    registry and run records, on the lease's fenced saver and acceptance log."""

    def __init__(self, runner: WorkflowRunner, *, prefix: str = "elesium") -> None:
        self.runner = runner
        self.prefix = prefix

    def __call__(self, run_id: str, lease: Lease) -> str:
        runs = self.runner.runs
        record = runs.get(run_id)
        if record is None:
            raise ValueError(f"run {run_id!r} is queued but has no run record")
        wf = self.runner.registry.get(record.workflow, record.workflow_version)
        mode = record.engine.get("mode") or self.runner.mode
        try:
            check_engine(self.runner.engine, record.engine, mode, what=f"run {run_id!r}")
        except ValueError as exc:
            self._fail(run_id, str(exc))
            raise
        if record.status == RunStatus.PENDING:
            runs.update_status(run_id, RunStatus.RUNNING)
        graph = wf.build(lease.saver(prefix=f"{self.prefix}:cp"))
        log = lease.acceptance_log(prefix=f"{self.prefix}:acc", retention=Retention(maxlen=None))
        engine = RunEngine(self.runner.engine)
        config = run_config(engine, seed=record.seeds["run"], run_id=run_id,
                            thread_id=record.thread_id or run_id, tenant=record.tenant, log=log, mode=mode,
                            workflow=wf.name)
        audit = open_run_audit(runs.client, thread_id=record.thread_id or run_id, run_id=run_id,
                               registry=runs, cp_prefix=f"{self.prefix}:cp", acceptance=log,
                               chain_prefix=f"{self.prefix}:audit")
        try:
            outcome = drive_leased(graph, lease, record.input, config, engine, audit)
        except RunCancelledError:
            runs.update_status(run_id, RunStatus.CANCELLED)
            raise
        except (LeaseLostError, RedisUnavailableError):
            raise  # another worker owns the run now, or it will be retried: no outcome to record
        except Exception as exc:  # noqa: BLE001 - recorded as the run's failure, then re-raised
            self._fail(run_id, (str(exc).splitlines() or [type(exc).__name__])[0])
            raise
        runs.update_status(run_id, RunStatus.INTERRUPTED if outcome == "interrupted" else RunStatus.SUCCEEDED)
        return outcome

    def _fail(self, run_id: str, error: str) -> None:
        try:
            self.runner.runs.update_status(run_id, RunStatus.FAILED, error=error)
        except ValueError:
            pass  # already final: a finished run keeps its outcome
