"""OpenTelemetry spans, off unless ``ELESIUM_OTEL_EXPORTER`` is ``console`` or ``otlp``.

Spans follow the GenAI semantic conventions and are timed as things happen, on the threads they happen on:

- ``<METHOD> <route>`` per HTTP request, a server span (:class:`RequestSpans`, an ASGI middleware the app
  installs only when tracing is on), continuing the caller's trace when the request carries a W3C
  ``traceparent`` (and ``tracestate``) header; it is the current span while the route runs, so a run
  created by the request carries its context in the queue payload (:meth:`Tracing.context`, field
  ``trace``);
- ``invoke_workflow <workflow>`` per executed run (an attempt of a queued run), opened when a queue worker
  starts executing it and closed once its outcome is recorded (:meth:`Tracing.run`), a child of the request
  span that created the run when the payload carries its context, so server and worker (any process, any
  machine) share one trace; a run without it (an older payload, a cron, tracing off at the server) is a
  root;
- ``langgraph.node <node>`` per node execution, a child of the run span, opened and closed by a LangChain
  callback on the LangGraph task's own thread (:attr:`RunTrace.callbacks`); a subgraph's node is a child of
  the node that runs the subgraph;
- ``chat <model>`` per LLM call, a child of the node span that makes it, from the engine call's start to its
  last token (:meth:`RunTrace.engine`), and one per ``/v1/chat/completions`` request, a root span
  (:meth:`Tracing.engine`), with ``gen_ai.*`` request and usage attributes and the decode's mode, τ, seed,
  elapsed time and the run's call tag under ``elesium.*``;
- ``prefill`` and ``decode`` per LLM call, children of its chat span (:class:`TracedHandle`): the prefill
  from the first request for a token until the first token is out (it includes any wait for the engine,
  which decodes one sequence at a time), the decode from there to the last token, with its steps, tokens
  and τ (tokens per verification step).

Below the request span, parents are passed explicitly, never taken from the thread's current context, so
the spans nest correctly across the queue worker's threads, LangGraph's task pool and a node's own threads,
and a run span's parent crosses processes in the queue payload. The tracer provider is private to the app,
so tests and embedding apps are unaffected. With tracing off, :meth:`Tracing.run` yields None,
:meth:`Tracing.engine` returns the engine itself, :meth:`Tracing.context` is empty and no middleware is
installed: nothing of OpenTelemetry runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler

from elesium.errors import UserError

if TYPE_CHECKING:
    from elesium.inference.types import TextEngine

EXPORTERS = ("none", "console", "otlp")
OTLP_PACKAGE = "opentelemetry-exporter-otlp-proto-http"
PROVIDER = "elesium"
"""``gen_ai.provider.name``: the model runs in this process, on Elesium's own engine."""


class TracingConfigError(UserError, ValueError):
    """``ELESIUM_OTEL_EXPORTER`` names an unknown exporter, or one whose package is not installed."""


def exporter_problem(exporter: str | None) -> str | None:
    """Why ``ELESIUM_OTEL_EXPORTER=exporter`` cannot be used in this environment (one line), else None.

    What ``elesium serve`` and ``elesium worker`` check at startup, before the model loads."""
    name = (exporter or "none").strip().lower() or "none"
    if name not in EXPORTERS:
        return f"ELESIUM_OTEL_EXPORTER={exporter!r}: use console, otlp or none"
    if name == "otlp":
        try:
            import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        except ImportError:
            return (f"ELESIUM_OTEL_EXPORTER=otlp needs the {OTLP_PACKAGE} package, which is not installed: "
                    f"pip install {OTLP_PACKAGE} (or set ELESIUM_OTEL_EXPORTER=console or none)")
    return None


class Tracing:
    def __init__(self, exporter: str = "none", model: str = "elesium", *, span_exporter: Any = None) -> None:
        """``span_exporter``: an SDK SpanExporter to use instead (exported synchronously; tests use it).

        Raises :class:`TracingConfigError` for an exporter :func:`exporter_problem` refuses."""
        self.model = model
        self.tracer: Any = None
        self.exporter: Any = span_exporter
        name = (exporter or "none").strip().lower() or "none"
        self.enabled = name != "none" or span_exporter is not None
        if not self.enabled:
            return
        if span_exporter is None:
            problem = exporter_problem(name)
            if problem is not None:
                raise TracingConfigError(problem)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )

        provider = TracerProvider(resource=Resource.create({"service.name": "elesium"}))
        if span_exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        else:
            if name == "otlp":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                self.exporter = OTLPSpanExporter()
            else:
                self.exporter = ConsoleSpanExporter()
            provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.provider = provider
        self.tracer = provider.get_tracer("elesium.api")

    @contextlib.contextmanager
    def run(self, workflow: str, *, run_id: str, thread_id: str, version: str | None = None,
            attempt: int | None = None, parent: Mapping[str, Any] | None = None) -> Iterator[RunTrace | None]:
        """The ``invoke_workflow`` span of one executed run, around the block that executes it.

        ``parent``: the W3C trace context the run was enqueued with (the queue payload's ``trace``:
        ``traceparent``, ``tracestate``), whose span becomes the run span's parent; None, empty or
        invalid: the run span is a root.

        Yields the run's :class:`RunTrace` (None when tracing is off). An exception leaving the block
        is recorded on the span (``error.type``; a cancellation is not an error) and propagates."""
        if self.tracer is None:
            yield None
            return
        from opentelemetry import context as otel_context
        from opentelemetry import trace as otel_trace

        span = self.tracer.start_span(
            f"invoke_workflow {workflow}", kind=otel_trace.SpanKind.INTERNAL,
            context=_extract(parent) if parent else otel_context.Context(),
            attributes=_clean({
                "gen_ai.operation.name": "invoke_workflow",
                "gen_ai.provider.name": PROVIDER,
                "gen_ai.agent.name": workflow,
                "gen_ai.agent.version": version,
                "gen_ai.request.model": self.model,
                "gen_ai.conversation.id": thread_id,
                "elesium.run_id": run_id,
                "elesium.thread_id": thread_id,
                "elesium.run.attempt": attempt,
            }))
        trace = RunTrace(self, span, run_id=run_id, thread_id=thread_id)
        token = otel_context.attach(otel_trace.set_span_in_context(span))
        try:
            yield trace
        except BaseException as exc:
            trace.failed(exc)
            raise
        finally:
            otel_context.detach(token)
            trace.close()

    def context(self) -> dict[str, str]:
        """The current trace context (the request span, on a request's thread or task) as W3C headers,
        ``{"traceparent": ..., "tracestate": ...}``, to put in a queue payload; empty when tracing is off
        or no span is current."""
        if self.tracer is None:
            return {}
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        return carrier if "traceparent" in carrier else {}

    def engine(self, engine: TextEngine, *, response_id: str | None = None) -> TextEngine:
        """``engine`` with a root ``chat <model>`` span per generation it starts (an OpenAI chat
        completion's): ``engine`` itself when tracing is off."""
        if self.tracer is None:
            return engine
        return cast("TextEngine", TracedEngine(engine, self, None, response_id=response_id))

    def shutdown(self) -> None:
        if self.tracer is not None:
            self.provider.shutdown()


def _extract(carrier: Mapping[str, Any]) -> Any:
    """The OpenTelemetry context of W3C trace headers (an empty context for invalid ones)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({str(k).lower(): str(v) for k, v in carrier.items()
                                                    if isinstance(v, str)})


UNTRACED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
"""Probes and scrapes: no request span (they would be most of the traces)."""


class RequestSpans:
    """ASGI middleware: a server span per HTTP request, ``<METHOD> <route>``, from the request's arrival to
    the end of its response (a stream's last byte), continuing the caller's trace from its ``traceparent``
    / ``tracestate`` headers. The span is the current one while the route runs (contextvars reach the
    routes' thread pool), which is how a run created by the request carries it to the queue.

    ``tracing_of`` gives the app's :class:`Tracing` (None before startup); with tracing off a request
    passes straight through."""

    def __init__(self, app: Any, tracing_of: Callable[[], Tracing | None]) -> None:
        self.app, self.tracing_of = app, tracing_of

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        tracing = self.tracing_of() if scope["type"] == "http" else None
        if tracing is None or tracing.tracer is None or scope.get("path") in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        from opentelemetry import context as otel_context
        from opentelemetry import trace as otel_trace

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or ()
                   if k.lower() in (b"traceparent", b"tracestate")}
        method = str(scope.get("method") or "HTTP")
        parent = _extract(headers)
        span = tracing.tracer.start_span(method, context=parent, kind=otel_trace.SpanKind.SERVER,
                                         attributes=_clean({
                                             "http.request.method": method,
                                             "url.path": scope.get("path"),
                                             "url.scheme": scope.get("scheme"),
                                             "network.protocol.version": scope.get("http_version"),
                                         }))
        status: dict[str, int] = {}

        async def traced_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
                span.set_attribute("http.response.status_code", status["code"])
            await send(message)

        token = otel_context.attach(otel_trace.set_span_in_context(span, parent))
        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            if _error_type(exc) in (*_CANCELLED, "CancelledError"):  # the client went away
                span.set_attribute("error.type", "cancelled")
            else:
                _set_error(span, exc)
            raise
        finally:
            otel_context.detach(token)
            route = getattr(scope.get("route"), "path", None)
            if route:
                span.set_attribute("http.route", route)
                span.update_name(f"{method} {route}")
            code = status.get("code")
            if code is not None and code >= 500:
                _set_error(span, str(code))
            span.end()


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Attributes without the unset ones (OpenTelemetry refuses None)."""
    return {k: v for k, v in attributes.items() if v is not None}


def _error_type(error: BaseException | str) -> str:
    return error if isinstance(error, str) else type(error).__name__


def _set_error(span: Any, error: BaseException | str) -> None:
    """``error.type`` and an ERROR status with the error's first line (the recording-errors convention)."""
    from opentelemetry.trace import Status, StatusCode

    kind = _error_type(error)
    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR, str(error).splitlines()[0][:300] if str(error) else kind))


_CANCELLED = ("RunCancelled", "RunCancelledError", "GeneratorExit", "cancelled")


class RunTrace:
    """The spans of one executed run: its ``invoke_workflow`` span, its node spans (opened by
    :attr:`callbacks`, put in the run's LangGraph config) and its LLM calls' chat spans (opened by the
    engine :meth:`engine` returns). Thread-safe: nodes and calls run on LangGraph's task threads."""

    def __init__(self, tracing: Tracing, span: Any, *, run_id: str, thread_id: str) -> None:
        from opentelemetry import trace as otel_trace

        self.tracing, self.span = tracing, span
        self.run_id, self.thread_id = run_id, thread_id
        self._context = otel_trace.set_span_in_context(span)
        self._lock = threading.Lock()
        self._nodes: dict[str, tuple[str, Any]] = {}  # task namespace -> (node, open span)
        self._tasks: dict[UUID, str] = {}  # LangChain run id of a node's execution -> its task namespace
        self.callbacks: list[BaseCallbackHandler] = [NodeSpans(self)]
        self._status: str | None = None

    # -- the run
    def outcome(self, status: str) -> None:
        """How the run ended (``elesium.run.status``): succeeded, interrupted, ..."""
        self._status = status

    def failed(self, exc: BaseException) -> None:
        if _error_type(exc) in _CANCELLED:
            self._status = self._status or "cancelled"
            return
        self._status = self._status or "failed"
        _set_error(self.span, exc)

    def close(self) -> None:
        """End node spans still open (a run stopped mid-node), then the run span."""
        with self._lock:
            left = list(self._nodes.values())
            self._nodes.clear()
            self._tasks.clear()
        for _, span in left:
            span.set_attribute("elesium.node.unfinished", True)
            span.end()
        if self._status is not None:
            self.span.set_attribute("elesium.run.status", self._status)
        self.span.end()

    # -- nodes
    def node_started(self, run_id: UUID, name: str | None, metadata: Mapping[str, Any] | None) -> None:
        meta = metadata or {}
        node, task = meta.get("langgraph_node"), str(meta.get("langgraph_checkpoint_ns") or "")
        if node is None or name != node or not task:
            return  # the graph itself, or a runnable inside a node
        with self._lock:
            if task in self._nodes:
                return
            parent_task = task.rpartition("|")[0]
            parent = self._nodes.get(parent_task) if parent_task else None
        from opentelemetry import trace as otel_trace

        context = otel_trace.set_span_in_context(parent[1]) if parent is not None else self._context
        step = meta.get("langgraph_step")
        span = self.tracing.tracer.start_span(
            f"langgraph.node {node}", context=context, kind=otel_trace.SpanKind.INTERNAL,
            attributes=_clean({
                "langgraph.node": str(node),
                "langgraph.step": int(step) if step is not None else None,
                "langgraph.task": task,
                "elesium.run_id": self.run_id,
            }))
        with self._lock:
            self._nodes[task] = (str(node), span)
            self._tasks[run_id] = task

    def node_ended(self, run_id: UUID, error: BaseException | None = None) -> None:
        with self._lock:
            task = self._tasks.pop(run_id, None)
            entry = self._nodes.pop(task, None) if task is not None else None
        if entry is None:
            return
        span = entry[1]
        if error is not None:
            from langgraph.errors import GraphBubbleUp

            if isinstance(error, GraphBubbleUp):  # an interrupt (or a Command to the parent): no failure
                span.set_attribute("elesium.node.interrupted", True)
            else:
                _set_error(span, error)
        span.end()

    def parent_of_call(self, node: str | None) -> Any:
        """The context a chat span of ``node`` starts in: the node span of the LangGraph task calling
        (found from the task's config on this thread), else the one open span of that node (a call from
        a thread of the node's own), else the run span."""
        from langgraph.config import get_config
        from opentelemetry import trace as otel_trace

        try:
            task = str((get_config().get("metadata") or {}).get("langgraph_checkpoint_ns") or "")
        except RuntimeError:  # not on a LangGraph task's thread
            task = ""
        with self._lock:
            entry = self._nodes.get(task) if task else None
            if entry is None and node is not None:
                same = [e for e in self._nodes.values() if e[0] == node]
                entry = same[0] if len(same) == 1 else None
        return otel_trace.set_span_in_context(entry[1]) if entry is not None else self._context

    def engine(self, engine: TextEngine) -> TextEngine:
        """``engine`` with a ``chat <model>`` span, child of its node's span, per call it starts."""
        return cast("TextEngine", TracedEngine(engine, self.tracing, self))


class NodeSpans(BaseCallbackHandler):
    """A LangChain callback that opens a span when a LangGraph node starts and ends it when it ends.

    LangGraph calls it on the task's own thread, at the node's real start and end."""

    ignore_llm = True
    ignore_chat_model = True
    ignore_retriever = True
    ignore_agent = True
    ignore_retry = True
    ignore_custom_event = True

    def __init__(self, trace: RunTrace) -> None:
        self.trace = trace

    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                       tags: Any = None, metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.trace.node_started(run_id, kwargs.get("name"), metadata)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self.trace.node_ended(run_id)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self.trace.node_ended(run_id, error)


class TracedEngine:
    """An engine whose every ``start`` opens a ``chat <model>`` span, ended when the generation ends
    (its last token, an error, or ``close``). Everything else is the wrapped engine's."""

    def __init__(self, engine: TextEngine, tracing: Tracing, run: RunTrace | None, *,
                 response_id: str | None = None) -> None:
        self._engine, self._tracing, self._run, self._response_id = engine, tracing, run, response_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def start(self, request: Any, **kwargs: Any) -> TracedHandle:
        from opentelemetry import trace as otel_trace

        tag, sampling, run = request.tag, request.sampling, self._run
        model = self._tracing.model
        span = self._tracing.tracer.start_span(
            f"chat {model}", kind=otel_trace.SpanKind.INTERNAL,
            context=run.parent_of_call(tag.node if tag is not None else None) if run is not None else None,
            attributes=_clean({
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": PROVIDER,
                "gen_ai.request.model": model,
                "gen_ai.request.temperature": float(sampling.temperature),
                "gen_ai.request.top_p": float(sampling.top_p),
                "gen_ai.request.top_k": int(sampling.top_k) if sampling.top_k else None,
                "gen_ai.request.max_tokens": int(sampling.max_tokens),
                "gen_ai.request.seed": sampling.seed,
                "gen_ai.request.stop_sequences": list(sampling.stop) or None,
                "gen_ai.response.id": self._response_id,
                "gen_ai.conversation.id": run.thread_id if run is not None else None,
                "elesium.run_id": run.run_id if run is not None else None,
                "elesium.call.node": tag.node if tag is not None else None,
                "elesium.call.index": tag.index if tag is not None else None,
                "elesium.decode.mode": request.mode,
            }))
        try:
            inner = self._engine.start(request, **kwargs)
        except BaseException as exc:
            _end_chat(span, None, exc)
            raise
        return TracedHandle(inner, span, model, self._tracing.tracer)


class TracedHandle:
    """A generation handle that ends its chat span with the result, or with why it stopped early, and
    times the call's two phases as children of it, as the handle is iterated: ``prefill`` from the first
    request for a token until the first token is out (the first chunk), ``decode`` from there to the end
    (the last token, an error or ``close``)."""

    def __init__(self, inner: Any, span: Any, model: str, tracer: Any) -> None:
        self.inner, self.span, self.model, self.tracer = inner, span, model, tracer
        self._iter = iter(inner)
        self._ended = False
        self._lock = threading.Lock()
        self._phase: tuple[str, Any] | None = None  # ("prefill" | "decode", its open span)
        self._first_tokens = 0  # tokens of the first chunk (the prefill's)
        self._chunks = self._tokens = self._steps = 0  # what the decode produced so far

    def __iter__(self) -> TracedHandle:
        return self

    def __next__(self) -> Any:
        if self._chunks == 0 and self._phase is None:
            self._open("prefill")
        try:
            chunk = next(self._iter)
        except StopIteration:
            try:
                result = self.inner.result
            except RuntimeError:  # closed before it finished: no result
                result = None
            self._end(result, None if result is not None else "cancelled")
            raise
        except BaseException as exc:
            self._end(None, exc)
            raise
        self._chunk(chunk)
        return chunk

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self._end(None, "cancelled")

    @property
    def result(self) -> Any:
        return self.inner.result

    # -- phases
    def _open(self, name: str) -> None:
        from opentelemetry import trace as otel_trace

        with self._lock:
            if self._ended:
                return
            child = self.tracer.start_span(
                name, context=otel_trace.set_span_in_context(self.span), kind=otel_trace.SpanKind.INTERNAL,
                attributes={"elesium.phase": name})
            self._phase = (name, child)

    def _chunk(self, chunk: Any) -> None:
        tokens = len(getattr(chunk, "token_ids", ()) or ())
        with self._lock:
            first = self._chunks == 0
            self._chunks += 1
            if first:
                self._first_tokens = tokens
            else:
                self._tokens += tokens
                self._steps += getattr(chunk, "step", None) is not None
            phase = self._phase if first and self._phase is not None and self._phase[0] == "prefill" else None
            if phase is not None:
                self._phase = None  # this thread ends it
        if phase is not None:
            prompt = getattr(self.inner, "prompt_ids", None)
            phase[1].set_attributes(_clean({
                "elesium.prefill.tokens": len(prompt) if prompt is not None else None,
                "elesium.prefill.new_tokens": tokens,
            }))
            phase[1].end()
            self._open("decode")

    def _close_phase(self, result: Any, error: BaseException | str | None) -> None:
        """End the open phase (called once, before the chat span ends)."""
        with self._lock:
            phase, self._phase = self._phase, None
        if phase is None:
            return
        name, span = phase
        if name == "decode":
            tau: float | None
            if result is not None:
                steps, tokens = len(result.steps), int(result.new_tokens) - self._first_tokens
                tau = round(float(result.mean_accepted), 4)
            else:
                steps, tokens = self._steps, self._tokens
                tau = round(tokens / steps, 4) if steps else None
            span.set_attributes(_clean({"elesium.decode.steps": steps, "elesium.decode.tokens": tokens,
                                        "elesium.decode.tau": tau}))
        elif result is not None:  # finished in its prefill (the first token ended it)
            span.set_attribute("elesium.prefill.tokens", int(result.prompt_tokens))
        if error is not None and _error_type(error) in _CANCELLED:
            span.set_attribute("error.type", "cancelled")
        elif error is not None:
            _set_error(span, error)
        span.end()

    def _end(self, result: Any, error: BaseException | str | None) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._close_phase(result, error)
        if result is not None:
            self.span.set_attribute("gen_ai.response.model", self.model)
        _end_chat(self.span, result, error)


def _end_chat(span: Any, gen: Any, error: BaseException | str | None) -> None:
    """Record a chat span's result (a :class:`~elesium.inference.records.Generation`) or error, and end it."""
    if gen is not None:
        steps = len(gen.steps)
        span.set_attributes(_clean({
            "gen_ai.usage.input_tokens": int(gen.prompt_tokens),
            "gen_ai.usage.output_tokens": int(gen.new_tokens),
            "gen_ai.response.finish_reasons": [str(gen.finish_reason)],
            "gen_ai.request.seed": int(gen.seed),
            "elesium.decode.mode": str(gen.mode),
            "elesium.decode.tau": round(float(gen.mean_accepted), 4),
            "elesium.decode.steps": steps,
            "elesium.decode.elapsed_s": round(float(gen.elapsed_s), 6),
        }))
    if error is not None and _error_type(error) in _CANCELLED:
        span.set_attribute("error.type", "cancelled")  # stopped on purpose: not a failure
    elif error is not None:
        _set_error(span, error)
    span.end()
