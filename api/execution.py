"""What the routes share: the engine worker, the stores, the workflows, and how a run executes.

Routes stay thin: they authenticate, validate and translate to HTTP; everything stateful is here.
A run is created on the event loop (validated, then recorded as pending and enqueued on the durable
run queue, so nothing is written for a bad request) and executed by whichever queue worker claims it:
this server's in-process one or ``elesium worker`` on any machine (:mod:`elesium.api.run_executor`).
Its stream parts travel through Redis; this server's :class:`~elesium.api.events.EventPump` feeds
them into the run's local :class:`~elesium.api.events.RunChannel`, which closes when the run ends:
that is what ``wait``, ``join`` and SSE readers await. The engine worker thread
(:mod:`elesium.api.worker`) still runs what is not a queued run: chat completions and replays.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from elesium.api.auth import Principal
from elesium.api.errors import Conflict, InvalidRequest, NotFound
from elesium.api.events import EventPump, RunChannel
from elesium.api.metrics import Metrics
from elesium.api.schemas import SUPPORTED_STREAM_MODES, RunCreate
from elesium.api.settings import ApiSettings
from elesium.api.tracing import Tracing
from elesium.api.worker import EngineWorker
from elesium.graphs.calibration import NodeCalibrator
from elesium.graphs.execution import RunEngine
from elesium.graphs.registry import Registry
from elesium.inference.types import TextEngine
from elesium.state.acceptance_log import AcceptanceLog
from elesium.state.queue import RunQueue
from elesium.state.run_events import RunEvents
from elesium.state.runs import RunRegistry
from elesium.state.threads import RunRow, ThreadRow, ThreadStore, public_id

log = logging.getLogger("elesium.api")
ASSISTANT_NS = uuid.UUID("6f1d2a52-7c3e-4f0b-9a57-5e1e51a0c0de")
TERMINAL = ("success", "error", "interrupted", "timeout")


def assistant_id_of(workflow: Any) -> str:
    """A stable UUID per (workflow, version): one assistant per registered workflow version."""
    return str(uuid.uuid5(ASSISTANT_NS, f"{workflow.name}@{workflow.version}"))


def iso(ms: int) -> str:
    """The protocol's timestamps: ISO 8601 in UTC with milliseconds, as langgraph-sdk parses them."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}+00:00"


def resolve_decode_mode(available: Iterable[str], requested: Any) -> str:
    """The decode mode an engine offering ``available`` runs for ``requested``, else InvalidRequest (422).

    The one resolution for runs and chat completions, so both accept the same names (the legacy alias
    "medusa") and refuse the rest the same way.
    """
    from elesium.inference.records import normalize_mode

    try:
        mode = normalize_mode(str(requested))
    except ValueError as exc:
        raise InvalidRequest(str(exc).splitlines()[0]) from None
    modes = tuple(available)
    if mode not in modes:
        raise InvalidRequest(
            f"decode mode {requested!r} is not available on this engine (available: {', '.join(modes)})"
        )
    return mode


@dataclass
class Services:
    """Everything a request may need; one per app (``app.state.services``)."""

    settings: ApiSettings
    engine: TextEngine
    registry: Registry
    store: ThreadStore
    saver: Any  # a RedisSaver, wrapped by Metrics.timed_checkpoints
    acceptance: AcceptanceLog
    runs_registry: RunRegistry
    worker: EngineWorker
    metrics: Metrics
    tracing: Tracing
    queue: RunQueue
    events: RunEvents
    pump: EventPump
    calibrator: NodeCalibrator | None = None  # per-node tree calibrations
    channels: dict[str, RunChannel] = field(default_factory=dict)
    server_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    _graphs: dict[tuple[str, str], Any] = field(default_factory=dict)
    _graph_lock: threading.Lock = field(default_factory=threading.Lock)
    # Runs are created and followed from the thread pool (no Redis call on the event loop), so the
    # channel map is shared between threads.
    _channels_lock: threading.Lock = field(default_factory=threading.Lock)

    # ---------------------------------------------------------------- workflows
    def workflows(self) -> list[Any]:
        """Every registered version of every workflow (``Registry.list()`` gives the latest of each)."""
        by_name = getattr(self.registry, "_by_name", None)
        if isinstance(by_name, dict):
            return [wf for name in sorted(by_name) for wf in by_name[name].values()]
        return list(self.registry.list())

    def resolve_assistant(self, assistant_id: str) -> Any:
        """The workflow behind an assistant id, a graph name (its newest version) or ``name:version``."""
        for wf in self.workflows():
            if assistant_id_of(wf) == assistant_id:
                return wf
        name, _, version = assistant_id.partition(":")
        try:
            return self.registry.get(name, version or None)
        except KeyError:
            raise NotFound.of("assistant", assistant_id) from None

    def workflow_version(self, name: str, version: str) -> Any:
        """The registered workflow ``name`` at ``version``, else its current version (replay reports it)."""
        try:
            return self.registry.get(name, version)
        except KeyError:
            try:
                return self.registry.get(name)
            except KeyError:
                raise Conflict(f"workflow {name!r} is no longer registered") from None

    def graph(self, workflow: Any) -> Any:
        key = (workflow.name, workflow.version)
        with self._graph_lock:
            if key not in self._graphs:
                self._graphs[key] = workflow.build(self.saver)
            return self._graphs[key]

    def thread_graph(self, thread: ThreadRow) -> Any | None:
        """The compiled graph of the thread's workflow (None before its first run)."""
        if not thread.graph_id:
            return None
        name, _, version = thread.graph_id.partition("@")
        try:
            wf = self.registry.get(name, version or None)
        except KeyError:
            wf = self.registry.get(name)
        return self.graph(wf)

    def fingerprint(self, mode: str | None = None) -> dict[str, str]:
        """What decides the tokens of a run in ``mode`` (recorded with it; a replay compares it)."""
        return self.engine.fingerprint(mode)

    def decode_mode(self, requested: Any) -> str:
        """:func:`resolve_decode_mode` against this server's engine."""
        return resolve_decode_mode(self.engine.modes, requested)

    # ---------------------------------------------------------------- threads
    def thread_or_404(self, thread_id: str, who: Principal) -> ThreadRow:
        """The caller's thread; another tenant's is as missing as one that never existed, and so is a
        deleted one (kept for audit) unless the caller has the auditor's view of this request."""
        row = self.get_thread(thread_id, who.tenant, include_deleted=who.audit_view)
        if row is None:
            raise NotFound.of("thread", thread_id)
        return row

    def run_or_404(self, thread_id: str, run_id: str, who: Principal) -> RunRow:
        """The caller's run on that thread (the thread checked first, so it is settled if stale)."""
        thread = self.thread_or_404(thread_id, who)
        row = self.store.get_run(run_id, who.tenant, thread.thread_id, include_deleted=who.audit_view)
        if row is None:
            raise NotFound.of("run", run_id)
        return row

    def get_thread(self, thread_id: str, tenant: str, *, include_deleted: bool = False) -> ThreadRow | None:
        """The thread, after settling any run of it that the queue has finished without its row saying so.

        A run whose workers all died (``max_attempts`` claims), that was cancelled before any worker
        claimed it, or that was never enqueued (its server stopped between the two writes) would leave
        the thread busy forever; the queue's record of the run decides, checked lazily on read.
        A deleted thread (kept for audit) is None unless ``include_deleted``.
        """
        row = self.store.get_thread(thread_id, tenant)
        if row is not None and row.deleted and not include_deleted:
            return None
        if row is None or row.status != "busy" or self.queue is None:
            return row
        for run in self.store.list_runs(row.thread_id, tenant, limit=5):
            if run.status not in ("pending", "running"):
                continue
            state = self.queue.status(run.run_id)
            if state is None and time.time() * 1000 - run.created_ms > 30_000:
                self.settle(run, "error", "the run was never queued (its server stopped while creating it)")
            elif state is not None and state.status == "cancelled":
                self.settle(run, "interrupted", "cancelled")
            elif state is not None and state.status == "failed":
                self.settle(run, "error", state.error or "the run failed")
        return self.store.get_thread(row.thread_id, tenant)

    def settle(self, run: RunRow, status: str, error: str | None) -> None:
        """Record the end of a run no executor will record (see :meth:`get_thread`, :meth:`cancel`)."""
        fresh = self.store.get_run_any(run.run_id)
        if fresh is None or fresh.status not in ("pending", "running"):
            return
        self.store.update_run(run.run_id, status=status, error=error)
        self.after_run(run, None, status, error)
        if self.events is not None:
            self.events.end(run.thread_id, run.run_id)

    def create_thread(
        self,
        who: Principal,
        thread_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        if_exists: str | None = None,
    ) -> ThreadRow:
        who.require("operator", "creating a thread")
        tid = thread_id or str(uuid.uuid4())
        # Another tenant's thread with this id is no conflict: the store keeps ids per tenant, so the
        # answer is the same as for an unused id and says nothing about the other tenant.
        row = self.store.create_thread(ThreadRow(thread_id=tid, tenant=who.tenant, metadata=metadata or {}))
        if row is None:
            existing = self.store.get_thread(tid, who.tenant)
            if existing is not None and existing.deleted:
                # Not reusable until purged: a new thread under this id would read the old records.
                raise Conflict(f"thread {tid!r} was deleted and its records are kept for audit until "
                               "purged; use another thread id")
            if if_exists == "do_nothing" and existing is not None:
                return existing
            raise Conflict(f"thread {tid!r} already exists")
        return row

    # ---------------------------------------------------------------- runs
    def prepare_run(self, who: Principal, thread: ThreadRow, body: RunCreate) -> tuple[Any, RunRow]:
        """Validate a run request against the thread and the workflow; write nothing (4xx on bad input).

        Resuming an interrupt (``command.resume``) needs the approver role, anything else the operator
        role (403 naming it; the thread's ownership was settled before, so a 403 never concerns another
        tenant's thread). A dict resume value gets the caller's identity under ``reviewer``
        (:func:`with_reviewer`).
        """
        resuming = body.command is not None and "resume" in body.command.model_fields_set
        if resuming:
            who.require("approver", "resuming an interrupt (command.resume)")
        else:
            who.require("operator", "starting a run")
        unsupported = [m for m in body.modes if m not in SUPPORTED_STREAM_MODES]
        if unsupported:
            raise InvalidRequest(
                f"stream_mode {unsupported[0]!r} is not supported; use {', '.join(SUPPORTED_STREAM_MODES)}"
            )
        if body.multitask_strategy not in (None, "reject"):
            raise InvalidRequest("only multitask_strategy='reject' is supported")
        wf = self.resolve_assistant(body.assistant_id)
        if thread.graph_id and thread.graph_id.partition("@")[0] != wf.name:
            raise Conflict(
                f"thread {public_id(thread.thread_id)!r} belongs to workflow "
                f"{thread.graph_id.partition('@')[0]!r}, not {wf.name!r}"
            )
        if thread.status == "busy":
            raise Conflict(
                f"thread {public_id(thread.thread_id)!r} has a run in progress (multitask_strategy=reject)"
            )
        if body.input is not None and body.command is not None:
            raise InvalidRequest("send input or command, not both")
        request: dict[str, Any] = {}
        if body.input is not None:
            request["input"] = _validated(
                wf.input_model, body.input, f"invalid input for workflow {wf.name!r}"
            )
        if body.command is not None:
            command = body.command.model_dump(exclude_none=True)
            if "resume" in body.command.model_fields_set:
                command["resume"] = body.command.resume
            if not command:
                raise InvalidRequest("command is empty; send resume, update or goto")
            if "resume" in command and thread.status != "interrupted":
                raise Conflict(
                    f"thread {public_id(thread.thread_id)!r} is not waiting at an interrupt; "
                    "nothing to resume"
                )
            if "resume" in command and getattr(wf, "resume_model", None) is not None:
                command["resume"] = _validated(
                    wf.resume_model, command["resume"], f"invalid resume value for workflow {wf.name!r}"
                )
            if "resume" in command:
                command["resume"] = with_reviewer(wf, command["resume"], who.identity)
            request["command"] = command
        fork = body.fork_checkpoint
        if fork:
            graph = self.graph(wf)
            cfg = {
                "configurable": {"thread_id": thread.thread_id, "checkpoint_ns": "", "checkpoint_id": fork}
            }
            if graph.checkpointer.get_tuple(cfg) is None:
                raise NotFound.of("checkpoint", fork)
            request["checkpoint_id"] = fork
        if not request:
            raise InvalidRequest("send an input, a command, or a checkpoint to resume from")
        configurable = (body.config or {}).get("configurable") or {}
        seed = body.seed if body.seed is not None else configurable.get("run_seed")
        if seed is not None and (
            not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63
        ):
            raise InvalidRequest("run seed must be an integer in [0, 2**63)")
        request["stream_mode"] = body.modes
        # The effective decode mode is recorded even when the engine chose it: a replay on an engine whose
        # default differs (another tuning profile) must still decode the same way.
        # A resume or fork without a mode continues in the thread's mode.
        requested = configurable.get("mode")
        if requested is None and "input" not in request:
            previous = self.store.list_runs(thread.thread_id, thread.tenant, limit=1)
            requested = previous[0].request.get("mode") if previous else None
        request["mode"] = self.decode_mode(requested or self.engine.default_mode)
        # Recording every drafted tree (the console's tree view): asked per run; a resume or fork
        # without it continues as the thread's last run did, like the mode.
        record = configurable.get("record_trees")
        if record is not None and not isinstance(record, bool):
            raise InvalidRequest("configurable.record_trees must be true or false")
        if record is None and "input" not in request:
            last = self.store.list_runs(thread.thread_id, thread.tenant, limit=1)
            record = bool(last and last[0].request.get("record_trees"))
        if record:  # only when on: the requests of runs without it stay as they were
            request["record_trees"] = True
        row = RunRow(
            run_id=str(uuid.uuid4()),
            thread_id=thread.thread_id,
            tenant=who.tenant,
            assistant_id=assistant_id_of(wf),
            workflow=wf.name,
            workflow_version=wf.version,
            metadata=body.metadata or {},
            request=request,
            seed=int(seed) if seed is not None else secrets.randbits(63),
            approver=who.identity if "command" in request and "resume" in request["command"] else None,
            server=self.server_id,
            fingerprint=self.fingerprint(request.get("mode")),
        )
        return wf, row

    def start_run(self, wf: Any, row: RunRow) -> RunChannel:
        """Claim the thread, record the run as pending and enqueue it; the channel follows its events.

        The thread is claimed atomically (busy only from a status that allows this run), so the same
        resume sent twice, to one server or two, starts one run; the other gets 409 before writing.
        """
        from elesium.state import RunRecord, hash_input

        allowed = ("interrupted",) if "resume" in (row.request.get("command") or {}) else (
            "idle", "interrupted", "error")
        previous = self.store.claim_thread(row.thread_id, allowed)
        if previous is None:
            raise Conflict(
                f"thread {public_id(row.thread_id)!r} has a run in progress or is not waiting at an interrupt"
            )
        if self.store.create_run(row) is None:
            self.store.update_thread(row.thread_id, status=previous)
            raise Conflict(f"run {row.run_id!r} already exists")
        self.store.update_thread(row.thread_id, graph_id=f"{wf.name}@{wf.version}")
        if self.runs_registry is not None:
            try:
                self.runs_registry.create(
                    RunRecord(
                        run_id=row.run_id,
                        workflow=wf.name,
                        workflow_version=wf.version,
                        input_hash=hash_input(row.request),
                        seeds={"run": row.seed},
                        tenant=row.tenant,
                        **_optional_record_fields(row),
                    )
                )
            except Exception as exc:
                # Re-raised: a run without its record could not be replayed as it ran (the record holds
                # its per-node calibration versions), so it ends as an error before any worker sees it.
                self.settle(row, "error", f"the run's record could not be written: {type(exc).__name__}")
                raise
        timeout = self.settings.run_timeout_s or None
        try:
            payload: dict[str, Any] = {"kind": "api", "thread_id": row.thread_id}
            trace = self.tracing.context()  # the request's span: the worker's run span continues its trace
            if trace:
                payload["trace"] = trace
            self.queue.enqueue(row.run_id, payload, thread_id=row.thread_id, timeout_s=timeout)
        except Exception:
            # Re-raised: only ends the run that no worker will ever claim, so its thread is not left busy.
            self.settle(row, "error", "the run could not be queued (Redis unavailable)")
            raise
        return self.follow(row)

    def follow(self, row: RunRow) -> RunChannel:
        """This server's channel of the run, fed from its Redis events (created on first use)."""
        with self._channels_lock:
            channel = self.channels.get(row.run_id)
            if channel is not None:
                return channel
            self._forget_old_channels()
            channel = RunChannel()
            self.channels[row.run_id] = channel
        self.pump.follow(row.thread_id, row.run_id, channel)
        return channel

    def registry_status(self, run_id: str, status: str, error: str | None = None) -> None:
        """Mirror a run's end into the run registry, best effort."""
        if self.runs_registry is None:
            return
        try:
            self.runs_registry.update_status(run_id, status, error=error)
        except Exception:  # noqa: BLE001
            # Safe to drop: the run's row in the thread store (written before this) is what the API
            # reports, and a replay reads only the record's calibration versions, never this status.
            log.debug("run registry status %s for %s not applied", status, run_id, exc_info=True)

    def after_run(self, row: RunRow, tap: RunEngine | None, status: str, error: str | None) -> None:
        """The thread's status, the registry's and the metrics once a run has ended."""
        thread_status = {"success": "idle", "interrupted": "interrupted", "error": "error"}.get(
            status, "idle"
        )
        if error == "cancelled":
            thread_status = "idle"
        self.store.update_thread(row.thread_id, status=thread_status)
        self.registry_status(
            row.run_id,
            {"success": "succeeded", "interrupted": "interrupted", "error": "failed"}.get(status, "failed")
            if error != "cancelled"
            else "cancelled",
            error,
        )
        self.metrics.runs.labels(status=status if error != "cancelled" else "cancelled").inc()
        if tap is None:
            return
        for call in tap.calls:
            self.metrics.generated_tokens.inc(len(call.token_ids))
            self.metrics.prompt_tokens.inc(call.prompt_tokens)
        self.metrics.observe_steps([rec for _, rec in tap.steps])

    def _forget_old_channels(self, keep_s: float = 600.0) -> None:
        """Drop event channels of runs that ended more than ``keep_s`` ago (a late ``join`` then reads the
        final state from Redis; only the streamed events are gone). Called with ``_channels_lock`` held."""
        now = time.monotonic()
        for rid in [
            r for r, c in self.channels.items() if c.closed_at is not None and now - c.closed_at > keep_s
        ]:
            self.channels.pop(rid, None)

    def channel_or_none(self, row: RunRow) -> RunChannel | None:
        """The run's channel on this server: the existing one, or a new one following the run's events
        in Redis (a run created on another server, or one that ended within the events' TTL); None when
        the run ended and its events have expired."""
        with self._channels_lock:
            channel = self.channels.get(row.run_id)
        active = row.status in ("pending", "running")
        if channel is None and (active or self.events.exists(row.thread_id, row.run_id)):
            channel = self.follow(row)
        return channel

    def cancel(self, run_id: str) -> bool:
        """Ask the run to stop, wherever it executes (the queue's cancel key reaches its worker's
        heartbeat); a run no worker had claimed yet ends here. False if it had already ended."""
        from elesium.state.errors import RunNotFoundError

        try:
            status = self.queue.cancel(run_id)
        except RunNotFoundError:
            return False
        if status == "cancelled":
            row = self.store.get_run_any(run_id)
            if row is not None:
                self.settle(row, "interrupted", "cancelled")
            return True
        return status == "cancelling"


REVIEWER_KEY = "reviewer"
"""Where a resume value carries who approved: set by the server, never by the client."""


def with_reviewer(wf: Any, resume: Any, identity: str) -> Any:
    """The resume value with the approver's identity (``tenant/key-id``) under :data:`REVIEWER_KEY`.

    Only the server knows who approved, so a ``reviewer`` the client sent is overwritten, not kept
    beside it: the interrupt's node (e.g. ticket-triage's ``approval.reviewer``) then records the
    authenticated identity, and the run row, the replay input, says the same. Applied to dict values
    of workflows whose resume model has a ``reviewer`` field or that have no resume model; any other
    resume value is passed as sent (the identity is still the run row's ``approver``).
    """
    if not isinstance(resume, dict):
        return resume
    model = getattr(wf, "resume_model", None)
    if model is not None and REVIEWER_KEY not in getattr(model, "model_fields", {}):
        return resume
    return {**resume, REVIEWER_KEY: identity}


def _validated(model: Any, value: Any, what: str) -> Any:
    """``value`` checked by ``model`` and dumped as JSON data (defaults filled); 422 naming the problem."""
    from elesium.graphs.runner import InputValidationError, validate

    try:
        return validate(model, value, what)
    except InputValidationError as exc:
        raise InvalidRequest(str(exc)) from None


def _optional_record_fields(row: RunRow) -> dict[str, Any]:
    """RunRecord fields that newer registries have (thread id, input, engine); older ones lack them."""
    from elesium.state import RunRecord

    fields = RunRecord.model_fields
    out: dict[str, Any] = {}
    if "thread_id" in fields:
        out["thread_id"] = row.thread_id
    if "input" in fields and isinstance(row.request.get("input"), dict):
        out["input"] = row.request["input"]
    if "engine" in fields:
        out["engine"] = row.fingerprint
    return out
