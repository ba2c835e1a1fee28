"""Background workflow runs: the glue between the durable queue (state/) and the workflows (graphs/).

``submit`` is the producer side (what ``POST`` of a background run calls): validate the input, record
the run as pending in the run registry, enqueue it. ``WorkflowExecutor`` is the consumer side, the
C6 callback ``elesium worker`` runs by default: it reads the run record, refuses an engine other than
the one the run was recorded with (tokens would differ), builds the workflow's graph on the lease's
fenced checkpointer, gives the LLM nodes the lease's fenced acceptance log, and starts or resumes the
graph (:func:`elesium.state.graph_executor.drive`), keeping the registry's status in step.

Idempotency: with an ``idempotency_key`` the run id is derived from (tenant, key), so two concurrent
identical requests create one record (the second sees ``RunExistsError``) and one queue entry (the
queue's enqueue script is idempotent by the same key). A crash between the two writes is repaired by
the client's retry with the same key.
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from elesium.state.acceptance_log import Retention
from elesium.state.errors import RedisUnavailableError, RunExistsError
from elesium.state.graph_executor import drive
from elesium.state.queue import EnqueueResult, Lease, LeaseLostError, RunCancelledError, RunQueue
from elesium.state.runs import RunRecord, RunStatus, hash_input

RUN_NS = uuid.UUID("0c3f4a9e-5b7d-4e21-9a6f-2d8c1b7e5f30")


def run_id_for(tenant: str, idempotency_key: str) -> str:
    """The run id of a keyed request: stable, so retries and concurrent duplicates name one run."""
    return uuid.uuid5(RUN_NS, f"{tenant}\x1f{idempotency_key}").hex


def submit(runner: Any, queue: RunQueue, workflow: Any, input: Any, *, seed: int | None = None,
           tenant: str = "default", idempotency_key: str | None = None, timeout_s: float | None = None,
           version: str | None = None) -> EnqueueResult:
    """Validate, record as pending and enqueue a background run of ``workflow``.

    Raises (before writing anything): UnknownWorkflowError, InputValidationError (from graphs);
    IdempotencyConflictError when the key was used with another input.
    """
    from elesium.graphs.fingerprint import engine_fingerprint
    from elesium.graphs.runner import validate
    from elesium.graphs.seeds import fresh_run_seed

    wf = runner.workflow(workflow, version) if isinstance(workflow, str) else workflow
    values = validate(wf.input_model, input, f"invalid input for workflow {wf.name!r}")
    run_id = run_id_for(tenant, idempotency_key) if idempotency_key else uuid.uuid4().hex
    payload = {"workflow": wf.name, "version": wf.version, "input": values, "tenant": tenant}
    record = RunRecord(run_id=run_id, workflow=wf.name, workflow_version=wf.version,
                       input_hash=hash_input(values),
                       seeds={"run": int(seed) if seed is not None else fresh_run_seed()}, tenant=tenant,
                       thread_id=run_id, input=values, engine=engine_fingerprint(runner.engine, runner.mode))
    try:
        runner.runs.create(record)
    except RunExistsError:
        existing = runner.runs.get(run_id)
        if existing is not None and existing.input_hash != record.input_hash:
            from elesium.state.queue import IdempotencyConflictError

            raise IdempotencyConflictError(
                f"idempotency key {idempotency_key!r} was already used with a different input") from None
    return queue.enqueue(run_id, payload, idempotency_key=idempotency_key, timeout_s=timeout_s)


class LeaseBoundEngine:
    """The engine as a run's LLM nodes see it: every stream it opens is closed when the lease aborts
    (cancel, timeout, lease lost), so a long call stops after its current decode step instead of
    running to the end of the node. Everything else is the engine's own."""

    def __init__(self, engine: Any, lease: Lease) -> None:
        self._engine = engine
        self._lease = lease

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        stream = self._engine.stream(*args, **kwargs)
        self._lease.on_abort(stream.close)
        return stream

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        stream = self.stream(*args, **kwargs)
        for _chunk in stream:
            pass
        return stream.result


class WorkflowExecutor:
    """Executes queued workflow runs (C6) with a :class:`~elesium.graphs.runner.WorkflowRunner`'s
    engine, registry and run records, on the lease's fenced saver and acceptance log."""

    def __init__(self, runner: Any, *, prefix: str = "elesium") -> None:
        self.runner = runner
        self.prefix = prefix

    def __call__(self, run_id: str, lease: Lease) -> str:
        from elesium.graphs.context import run_config
        from elesium.graphs.fingerprint import engine_fingerprint

        runs = self.runner.runs
        record = runs.get(run_id)
        if record is None:
            raise ValueError(f"run {run_id!r} is queued but has no run record")
        wf = self.runner.registry.get(record.workflow, record.workflow_version)
        mode = record.engine.get("mode") or self.runner.mode
        current = engine_fingerprint(self.runner.engine, mode)
        if record.engine and current != record.engine:
            diff = sorted(k for k in set(current) | set(record.engine)
                          if current.get(k) != record.engine.get(k))
            self._fail(run_id, f"engine differs from the run's ({', '.join(diff)})")
            raise ValueError(f"this worker's engine differs from run {run_id!r}'s ({', '.join(diff)})")
        if record.status == RunStatus.PENDING:
            runs.update_status(run_id, RunStatus.RUNNING)
        graph = wf.build(lease.saver(prefix=f"{self.prefix}:cp"))
        log = lease.acceptance_log(prefix=f"{self.prefix}:acc", retention=Retention(maxlen=None))
        config = run_config(LeaseBoundEngine(self.runner.engine, lease), run_seed=record.seeds["run"],
                            run_id=run_id, thread_id=record.thread_id or run_id, tenant=record.tenant,
                            log=log, mode=mode, workflow=wf.name)
        try:
            try:
                outcome = drive(graph, lease, record.input, config)
            except Exception:
                lease.check()  # a stream closed by a cancel/timeout/lost lease: raise the real reason
                raise
        except RunCancelledError:
            runs.update_status(run_id, RunStatus.CANCELLED)
            raise
        except (LeaseLostError, RedisUnavailableError):
            raise  # another worker owns the run now, or it will be retried: no outcome to record
        except Exception as exc:
            self._fail(run_id, (str(exc).splitlines() or [type(exc).__name__])[0])
            raise
        runs.update_status(run_id, RunStatus.INTERRUPTED if outcome == "interrupted" else RunStatus.SUCCEEDED)
        return outcome

    def _fail(self, run_id: str, error: str) -> None:
        try:
            self.runner.runs.update_status(run_id, RunStatus.FAILED, error=error)
        except ValueError:
            pass  # already final


def make_executor(args: argparse.Namespace, queue: RunQueue) -> Any:
    """``elesium worker``'s default executor: runs created through the API and runs submitted with
    :func:`submit`, on this machine's engine and the shipped workflows."""
    from elesium.api.app import build_services
    from elesium.api.run_executor import ApiRunExecutor, Dispatcher
    from elesium.api.settings import ApiSettings, env_flag
    from elesium.cli import CliError
    from elesium.commands.common import load_engine
    from elesium.graphs.runner import WorkflowRunner

    try:
        self_tuning = env_flag("ELESIUM_SELF_TUNING") or bool(getattr(args, "self_tuning", False))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    runner = WorkflowRunner(load_engine(args), args.redis_url)
    services = build_services(ApiSettings(redis_url=args.redis_url, self_tuning=self_tuning), runner.engine,
                              runner.registry)
    return Dispatcher(ApiRunExecutor(services), WorkflowExecutor(runner))
