"""Executing an API run from the durable queue: the queue's executor of protocol runs.

``POST .../runs`` records the run and enqueues it (:meth:`Services.start_run`); whichever worker
claims it (the server's in-process one, or ``elesium worker`` on any machine) executes it here,
under its lease:

* the graph is built on the lease's fenced checkpointer and its LLM nodes append to the lease's
  fenced acceptance log, so a worker that was only paused cannot write after another took over;
* every stream part goes to the run's Redis event stream (:mod:`elesium.state.run_events`), which
  any API server relays to its SSE readers; each finished LLM call is stored as it finishes;
* a cancel (from any server, through the queue's cancel key), a per-run timeout or a lost lease
  reaches the run through the lease, stops the engine stream after its current decode step, and is
  recorded as such; a lost lease or a hand-back records nothing (the next owner finishes the run).

Resuming after a crash: when the thread's newest checkpoint was written by this run (LangGraph copies
the config's ``metadata.run_id`` into each checkpoint), an earlier attempt got that far, so the graph
continues from it with input ``None``: LangGraph's durable execution re-runs only the tasks without
a checkpointed result. Seeds come from (run seed, node, call index in the state), so a re-run LLM
call decodes the same tokens the dead attempt would have.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from elesium.graphs.audit_chain import open_run_audit
from elesium.graphs.context import set_record_trees
from elesium.graphs.execution import (
    EngineMismatchError,
    LLMCall,
    RunCancelled,
    RunEngine,
    check_engine,
    checkpoint_ids,
    command_from,
    drive,
    learn,
    outcome_now,
    recorded_calibrations,
    resume_point,
    run_config,
)
from elesium.state.acceptance_log import Retention
from elesium.state.queue import Lease, LeaseLostError, RunCancelledError, RunTimeoutError
from elesium.state.threads import public_id

if TYPE_CHECKING:
    from elesium.api.tracing import RunTrace

log = logging.getLogger("elesium.api")


class RunFailed(Exception):
    """The run ended in error (recorded); the queue marks it failed."""


def _trace_context(payload: Any) -> dict[str, Any] | None:
    """The W3C trace context a run was enqueued with (None for a payload without one: a new root)."""
    trace = payload.get("trace") if isinstance(payload, dict) else None
    return trace if isinstance(trace, dict) else None


def dedupe_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (node, call index), in first-seen order: a call that a dead attempt finished
    and the resumed attempt re-ran is recorded once (both decoded the same tokens, from the same
    checkpointed call index)."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for call in calls:
        out[(str(call.get("node")), int(call.get("call", 0)))] = call
    return list(out.values())


class ApiRunExecutor:
    """``execute(run_id, lease)`` for runs created through the API (payload ``kind: "api"``): the API's
    records (run row, event stream, calls, metrics) around one pass of :mod:`elesium.graphs.execution`."""

    def __init__(self, services: Any) -> None:
        self.svc = services

    def __call__(self, run_id: str, lease: Lease) -> str:
        svc = self.svc
        row = svc.store.get_run_any(run_id)
        if row is None:
            raise ValueError(f"run {run_id!r} is queued but has no run row")
        # The run's trace (tracing on): its span from here until its outcome is recorded, a span per node
        # execution and per LLM call (api/tracing.py). None when tracing is off.
        # Its parent: the span of the request that created the run (payload "trace"), in whatever process.
        with svc.tracing.run(row.workflow, run_id=run_id, thread_id=public_id(row.thread_id),
                             version=row.workflow_version, attempt=lease.attempt,
                             parent=_trace_context(lease.payload)) as trace:
            status = self._execute(row, lease, trace)
            if trace is not None:
                trace.outcome(status)
            return status

    def _execute(self, row: Any, lease: Lease, trace: RunTrace | None) -> str:
        svc, run_id = self.svc, row.run_id
        try:
            wf = svc.registry.get(row.workflow, row.workflow_version)
        except KeyError:
            why = f"workflow {row.workflow}@{row.workflow_version} is not registered here"
            self._end(row, "error", why)
            raise RunFailed(why) from None
        mode = row.request.get("mode")
        try:
            check_engine(svc.engine, row.fingerprint, mode, what=f"run {run_id!r}")
        except EngineMismatchError as exc:
            differing = ", ".join(exc.differing)
            self._end(row, "error", f"this worker's engine differs from the run's ({differing})")
            raise RunFailed(f"engine differs ({differing})") from None

        def publish(event: str, data: Any) -> None:
            svc.events.publish(row.thread_id, run_id, event, data)

        publish("metadata",
                {"run_id": run_id, "thread_id": public_id(row.thread_id), "attempt": lease.attempt})
        # A retried attempt re-decodes a call the dead one finished; where that call's deadline cut it, the
        # retry cuts at the same token (RunEngine's ``cuts``), so the record and the state agree.
        earlier = [LLMCall.model_validate(c) for c in svc.store.calls(run_id)] if lease.attempt > 1 else []
        tap = RunEngine(svc.engine if trace is None else trace.engine(svc.engine),
                        on_call=lambda call: svc.store.add_call(run_id, call.model_dump()), cuts=earlier)
        unregister = lease.on_abort(tap.cancel)
        modes = row.request.get("stream_mode") or ["values"]
        graph = wf.build(svc.metrics.timed_checkpoints(lease.saver()))
        config = run_config(
            tap, thread_id=row.thread_id, run_id=run_id, seed=row.seed, tenant=row.tenant,
            log=lease.acceptance_log(retention=Retention(maxlen=None)), workflow=wf.name, mode=mode,
            # A retried attempt keeps the versions its nodes already decoded with (the run record
            # holds them), so its remaining calls build the trees the dead attempt would have.
            calibrator=svc.calibrator, calibrations=recorded_calibrations(svc.runs_registry, run_id),
        )
        # Every drafted tree in the acceptance log when the run or its workflow asks (console tree view).
        set_record_trees(config, bool(row.request.get("record_trees")) or wf.record_trees)
        if trace is not None:
            config["callbacks"] = trace.callbacks  # a span per node execution, on the task's own thread
        point = resume_point(graph, config, run_id)
        # The run's hash chain (a retried attempt continues it): chained per super-step, sealed at the end.
        audit = open_run_audit(svc.store.client, thread_id=row.thread_id, run_id=run_id, store=svc.store,
                               cp_prefix=graph.checkpointer.prefix, acceptance=config_log(config))
        resuming = point != "start"
        if not resuming and row.request.get("checkpoint_id"):
            config["configurable"]["checkpoint_id"] = row.request["checkpoint_id"]
        svc.store.update_run(run_id, status="running", server=lease.worker_id)
        svc.registry_status(run_id, "running")
        try:
            # "done": an earlier attempt finished (or reached an interrupt) and died before recording it.
            emit = _emitter(publish, modes)
            outcome = outcome_now(graph, row.thread_id) if point == "done" else drive(
                graph, None if resuming else command_from(row.request), config,
                emit=emit, cancelled=tap.cancelled,
                stream_modes=tuple(dict.fromkeys("messages" if m == "messages-tuple" else m for m in modes)),
                audit=audit,
            )
            if outcome.status != "error":
                emit.flush()  # the last message ended with the run (messages/complete)
            if point == "done" and audit is not None:
                audit.seal(outcome.status)
            if outcome.status == "error":
                lease.verify()  # a node failed because the lease was lost? then record nothing
        except RunCancelled:
            try:
                lease.check()
            except RunCancelledError:
                self._end(row, "interrupted", "cancelled", tap)
                raise
            except RunTimeoutError as exc:
                self._end(row, "timeout", str(exc), tap)
                raise
            raise LeaseLostError("the run was stopped without a recorded reason") from None
        finally:
            unregister()
        if outcome.status == "success":
            # Before the outcome is published: a run started after this one's reply sees what it taught.
            learn(svc.calibrator, wf.name, run_id)
        self._end(row, outcome.status, outcome.error, tap, checkpoint_ids(graph, row.thread_id, run_id))
        if outcome.status == "error":
            raise RunFailed(outcome.error or "error")
        return "interrupted" if outcome.status == "interrupted" else "succeeded"

    def _end(self, row: Any, status: str, error: str | None, tap: RunEngine | None = None,
             checkpoints: list[str] | None = None) -> None:
        """Record how the run ended (run row, calls, thread, registry, metrics), then close its events."""
        svc = self.svc
        fields: dict[str, Any] = {"status": status, "error": error}
        if checkpoints is not None:
            fields["checkpoints"] = checkpoints
        svc.store.update_run(row.run_id, **fields)
        svc.store.set_calls(row.run_id, dedupe_calls(svc.store.calls(row.run_id)))
        svc.after_run(row, tap, status, error)
        if status == "error":
            svc.events.publish(row.thread_id, row.run_id, "error",
                               {"error": (error or "error").split(":")[0], "message": error})
        svc.events.end(row.thread_id, row.run_id)


def config_log(config: Any) -> Any:
    """The acceptance log the run's nodes append to (the lease's fenced one)."""
    return config["configurable"]["elesium"].log


def _is_chunk(message: dict[str, Any]) -> bool:
    return "chunk" in str(message.get("type", "")).lower()


def _merged(acc: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """``acc + part`` as LangChain adds AIMessageChunks: content concatenated, lists appended, the latest
    non-empty value of every other field."""
    out = dict(acc)
    for field, value in part.items():
        have = out.get(field)
        if field == "content" and isinstance(have, str) and isinstance(value, str):
            out[field] = have + value
        elif field == "response_metadata" and isinstance(have, dict) and isinstance(value, dict):
            meta = dict(have)
            for k, v in value.items():
                meta[k] = meta[k] + v if isinstance(meta.get(k), list) and isinstance(v, list) else v
            out[field] = meta
        elif isinstance(have, list) and isinstance(value, list):
            out[field] = have + value
        elif value not in (None, "", {}, []):
            out[field] = value
    return out


def _completed(message: dict[str, Any]) -> dict[str, Any]:
    """The accumulated chunk as the whole message (``type: "ai"``), what ``messages/complete`` carries."""
    done = {k: v for k, v in message.items() if k not in ("tool_call_chunks", "chunk_position")}
    if _is_chunk(message):
        done["type"] = "ai"
    return done


class _Emitter:
    """The graph's stream parts as the protocol's SSE events, with the Platform's ``messages`` semantics:

    * ``messages``: ``messages/metadata`` once per message id (``{id: {"metadata": ...}}``), then
      ``messages/partial`` per token chunk whose data is the *whole message so far* (``[chunk]``: the
      AIMessageChunk accumulated from the first token, content included), then ``messages/complete``
      with the final message when it ends: when the next message starts, when the graph streams its
      next non-token part (the node's ``updates``/``values``), at the end of the run (:meth:`flush`),
      or when the graph streams a whole (non-chunk) message, which is complete as it comes;
    * ``messages-tuple``: LangGraph's own ``stream_mode="messages"`` pairs ``[chunk, metadata]``, one
      per token chunk, as ``messages`` events.
    """

    def __init__(self, publish: Any, modes: list[str]) -> None:
        self.publish, self.modes = publish, modes
        self.seen: set[str] = set()
        self.open: dict[str, dict[str, Any]] = {}  # message id -> accumulated chunk, not yet complete

    def __call__(self, mode: str, chunk: Any) -> None:
        if mode != "messages":
            if mode != "custom":  # custom parts interleave with a node's tokens; anything else follows them
                self.flush()
            self.publish(mode, chunk)
            return
        message, meta = chunk if isinstance(chunk, list) and len(chunk) == 2 else (chunk, {})
        if "messages-tuple" in self.modes:
            self.publish("messages", [message, meta])
        if "messages" not in self.modes or not isinstance(message, dict):
            return
        mid = str(message.get("id") or "")
        for other in [m for m in self.open if m != mid]:
            self._complete(other)
        if mid not in self.seen:
            self.seen.add(mid)
            self.publish("messages/metadata", {mid: {"metadata": meta}})
        if _is_chunk(message):
            self.open[mid] = _merged(self.open[mid], message) if mid in self.open else dict(message)
            self.publish("messages/partial", [self.open[mid]])
        else:
            self.open.pop(mid, None)
            self.publish("messages/complete", [message])

    def _complete(self, mid: str) -> None:
        message = self.open.pop(mid, None)
        if message is not None:
            self.publish("messages/complete", [_completed(message)])

    def flush(self) -> None:
        """Complete every message still open (the run ended, or its node moved on)."""
        for mid in list(self.open):
            self._complete(mid)


def _emitter(publish: Any, modes: list[str]) -> _Emitter:
    """The emitter of a run's stream parts (see :class:`_Emitter`)."""
    return _Emitter(publish, modes)


class Dispatcher:
    """One queue, two kinds of run: API runs (``kind: "api"``) and workflow runs submitted with
    :func:`elesium.graphs.background.submit` (no kind). ``elesium serve`` and ``elesium worker`` both
    run it."""

    def __init__(self, api: ApiRunExecutor | None, workflows: Any | None) -> None:
        self.api, self.workflows = api, workflows

    def __call__(self, run_id: str, lease: Lease) -> str:
        kind = lease.payload.get("kind")
        target = self.api if kind == "api" else self.workflows
        if target is None:
            raise ValueError(f"this worker does not execute {kind or 'workflow'} runs")
        return str(target(run_id, lease) or "succeeded")
