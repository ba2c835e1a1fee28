"""One trace from the caller to the worker (issue 39 item 4): request span, trace context through the queue,
prefill and decode spans.

A real API server (uvicorn, the session's float32 engine, the embedded Valkey) that executes nothing itself
(``workers=0``) receives a run request carrying a W3C ``traceparent``; a real ``elesium worker`` process
executes the run. The server's spans go to an in-memory exporter; the worker's to a file, one JSON span per
line (tests/tracing_worker.py: a test-only exporter set by its executor factory, chosen by
``ELESIUM_TEST_SPANS_FILE``). Together they must be one trace: the request span (server kind) continues the
caller's trace, the worker's run span is its child through the queue payload's ``trace`` field, and below
it node → chat → prefill, decode nest and last as long as what they time.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from api_server import KEY_A, LiveServer, live_server, server_settings
from api_workflows import build_registry
from elesium.api.tracing import RequestSpans, Tracing
from elesium.inference.sampling import SamplingParams
from elesium.inference.types import GenerationRequest, generate
from queue_harness import TESTS, WorkerProc

pytest_plugins = ["state_fixtures"]

MODEL = "elesium-smollm2-135m"
TIMEOUT_S = 60.0
WAIT_ROUTE = "/threads/{thread_id}/runs/wait"


def _wait(predicate: Any, what: str, logs: Any = lambda: "", timeout_s: float = TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{logs()}"
        time.sleep(0.05)
    return value


class Traced:
    """The server (its spans in memory) and one worker process (its spans in a file)."""

    def __init__(self, server: LiveServer, queue: str, spans: InMemorySpanExporter, worker: WorkerProc,
                 spans_file: Path) -> None:
        self.server, self.queue, self.spans, self.worker, self.spans_file = (server, queue, spans, worker,
                                                                             spans_file)

    def worker_spans(self) -> list[dict[str, Any]]:
        if not self.spans_file.exists():
            return []
        return [json.loads(line) for line in self.spans_file.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def traced(engine: Any, state_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    queue = f"traced-{uuid.uuid4().hex[:8]}"
    tmp = tmp_path_factory.mktemp("traced")
    spans_file = tmp / "worker-spans.jsonl"
    env = dict(os.environ, ELESIUM_TEST_SPANS_FILE=str(spans_file))
    env.pop("ELESIUM_OTEL_EXPORTER", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    cmd = [str(Path(sys.executable).parent / "elesium"), "worker", "--redis-url", state_server.url,
           "--queue", queue, "--executor", "tracing_worker:make_executor", "--lease-ttl", "2",
           "--worker-id", "traced-w", "--grace", "5"]
    log_path = tmp / "worker.log"
    with open(log_path, "ab") as log:  # started first: it loads its engine while the server starts
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    worker = WorkerProc("traced-w", proc, log_path)
    try:
        # Tracing on (so the request-span middleware is installed); its spans then go to memory.
        settings = server_settings(state_server.url, workers=0, queue_name=queue, otel_exporter="console")
        with live_server(settings, engine, build_registry()) as server:
            spans = InMemorySpanExporter()
            console = server.services.tracing
            server.services.tracing = Tracing(model=MODEL, span_exporter=spans)
            console.shutdown()
            _wait(lambda: f"queue {queue!r}" in worker.log(), "the worker to start", worker.log)
            yield Traced(server, queue, spans, worker, spans_file)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _contains(outer: dict[str, Any], inner: dict[str, Any]) -> bool:
    return outer["start_ns"] <= inner["start_ns"] and inner["end_ns"] <= outer["end_ns"]


def test_a_request_and_the_run_it_queues_on_another_process_are_one_trace(traced: Traced):
    trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
    headers = {"traceparent": f"00-{trace_id}-{caller}-01", "tracestate": "caller=1"}
    server = traced.server
    payloads: list[Any] = []  # what this server enqueues (the stream entry is gone once the run is done)
    enqueue = server.services.queue.enqueue

    def recording_enqueue(run_id: str, payload: dict[str, Any], **kwargs: Any) -> Any:
        payloads.append((run_id, payload))
        return enqueue(run_id, payload, **kwargs)

    server.services.queue.enqueue = recording_enqueue
    try:
        with server.http(KEY_A) as http:
            tid = http.post("/threads", json={}).json()["thread_id"]
            r = http.post(f"/threads/{tid}/runs/wait", headers=headers,
                          json={"assistant_id": "summary", "input": {"topic": "tea"}})
            assert r.status_code == 200, r.text + traced.worker.log()
            run_id = http.get(f"/threads/{tid}/runs").json()[0]["run_id"]
    finally:
        del server.services.queue.enqueue

    # The server: a server span per request; the run request's continues the caller's trace.
    def request_span() -> Any:
        found = [s for s in traced.spans.get_finished_spans() if s.attributes.get("http.route") == WAIT_ROUTE]
        return found[0] if found else None

    req = _wait(request_span, "the request span")
    assert req.name == f"POST {WAIT_ROUTE}" and req.kind.name == "SERVER"
    assert f"{req.context.trace_id:032x}" == trace_id
    assert req.parent is not None and req.parent.is_remote and f"{req.parent.span_id:016x}" == caller
    assert req.attributes["http.request.method"] == "POST"
    assert req.attributes["url.path"] == f"/threads/{tid}/runs/wait"
    assert req.attributes["http.response.status_code"] == 200
    (create,) = [s for s in traced.spans.get_finished_spans() if s.attributes.get("http.route") == "/threads"]
    assert create.parent is None and create.context.trace_id != req.context.trace_id  # no traceparent: a root

    # The queue payload carries the request span's context (the worker has nothing else of the server).
    (payload,) = [p for r, p in payloads if r == run_id]
    assert payload["trace"]["traceparent"] == f"00-{trace_id}-{req.context.span_id:016x}-01"
    assert payload["kind"] == "api" and payload["thread_id"]

    # The worker, another process: the run span is the request span's child, in the same trace.
    done = _wait(lambda: (s := traced.worker_spans()) and any(x["name"] == "invoke_workflow summary"
                                                              for x in s) and s, "the worker's run span",
                 traced.worker.log)
    assert {s["pid"] for s in done} == {traced.worker.proc.pid} != {os.getpid()}
    assert {s["trace_id"] for s in done} == {trace_id}
    by_name = {s["name"]: s for s in done}
    assert sorted(by_name) == ["chat " + MODEL, "decode", "invoke_workflow summary",
                               "langgraph.node summarize", "prefill"], sorted(by_name)
    run, node = by_name["invoke_workflow summary"], by_name["langgraph.node summarize"]
    chat, prefill, decode = by_name["chat " + MODEL], by_name["prefill"], by_name["decode"]
    assert run["parent_id"] == f"{req.context.span_id:016x}" and run["parent_remote"] is True
    assert run["trace_state"] == "caller=1"
    assert run["attributes"]["elesium.run_id"] == run_id
    assert run["attributes"]["elesium.run.status"] == "succeeded"
    assert req.start_time <= run["start_ns"]  # one machine, one clock
    # run → node → chat → prefill, decode: each inside its parent, timed as it ran.
    assert node["parent_id"] == run["span_id"] and chat["parent_id"] == node["span_id"]
    assert prefill["parent_id"] == decode["parent_id"] == chat["span_id"]
    assert _contains(run, node) and _contains(node, chat)
    assert _contains(chat, prefill) and _contains(chat, decode)
    assert prefill["end_ns"] <= decode["start_ns"]  # the decode starts once the first token is out
    for span in (prefill, decode):
        assert span["end_ns"] - span["start_ns"] > 0 and span["status"] == "UNSET"
    c, p, d = chat["attributes"], prefill["attributes"], decode["attributes"]
    assert p["elesium.prefill.tokens"] == c["gen_ai.usage.input_tokens"] > 0
    assert p["elesium.prefill.new_tokens"] + d["elesium.decode.tokens"] == c["gen_ai.usage.output_tokens"]
    assert d["elesium.decode.steps"] == c["elesium.decode.steps"] >= 1
    assert d["elesium.decode.tau"] == c["elesium.decode.tau"] >= 1.0
    # The chat span lasts at least the engine's own time for the call, prefill and decode included.
    assert (chat["end_ns"] - chat["start_ns"]) / 1e9 >= c["elesium.decode.elapsed_s"] - 1e-3


def test_a_chat_completion_continues_its_requests_trace(traced: Traced):
    """The completion's generation runs on the engine's thread; the request's context goes with it, so its
    chat span (and prefill, decode) is the request span's child, in the caller's trace."""
    trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
    traced.spans.clear()
    with traced.server.http(KEY_A) as http:
        r = http.post("/v1/chat/completions", headers={"traceparent": f"00-{trace_id}-{caller}-01"},
                      json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text

    def child(done: Any, name: str, parent_id: int) -> Any:
        return next((s for s in done if s.name == name and s.parent is not None
                     and s.parent.span_id == parent_id), None)

    def finished() -> Any:
        # Found by parentage, not by name alone: a span of an earlier test's run may still end after the
        # clear above (the last CI run saw one, in another trace).
        done = traced.spans.get_finished_spans()
        req = child(done, "POST /v1/chat/completions", int(caller, 16))
        chat = child(done, f"chat {MODEL}", req.context.span_id) if req is not None else None
        if chat is None:
            return None
        steps = [child(done, n, chat.context.span_id) for n in ("prefill", "decode")]
        return (req, chat, *steps) if None not in steps else None

    # The request span is the caller's child, the chat span the request's, prefill and decode the chat's:
    # a context lost on the way to the engine's thread leaves this waiting, and the test fails.
    spans = _wait(finished, "the completion's spans, each the child of the one before")
    assert {f"{s.context.trace_id:032x}" for s in spans} == {trace_id}


def test_a_traced_generation_has_prefill_and_decode_spans_and_a_closed_one_ends_them(engine: Any):
    exporter = InMemorySpanExporter()
    tracing = Tracing(model=MODEL, span_exporter=exporter)
    gen = generate(tracing.engine(engine), GenerationRequest("Hi", SamplingParams(max_tokens=6, seed=1)))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert sorted(spans) == ["chat " + MODEL, "decode", "prefill"]
    chat, prefill, decode = spans["chat " + MODEL], spans["prefill"], spans["decode"]
    assert prefill.parent.span_id == decode.parent.span_id == chat.context.span_id
    assert chat.start_time <= prefill.start_time <= prefill.end_time <= decode.start_time
    assert decode.end_time <= chat.end_time
    assert prefill.attributes["elesium.prefill.tokens"] == gen.prompt_tokens
    assert decode.attributes["elesium.decode.steps"] == len(gen.steps)
    assert decode.attributes["elesium.decode.tokens"] == gen.new_tokens - prefill.attributes[
        "elesium.prefill.new_tokens"]
    # A stream left after its first chunk: the prefill ended when the token was out, the decode is cancelled.
    exporter.clear()
    stream = tracing.engine(engine).start(GenerationRequest("Count to ten.", SamplingParams(max_tokens=40)))
    next(iter(stream))
    assert [s.name for s in exporter.get_finished_spans()] == ["prefill"]
    stream.close()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["decode"].attributes["error.type"] == "cancelled"
    assert spans["decode"].end_time <= spans["chat " + MODEL].end_time


def test_tracing_off_installs_nothing_and_puts_no_context_in_payloads(state_server: Any):
    from elesium.api.app import create_app

    def middleware(exporter: str) -> list[Any]:
        app = create_app(server_settings(state_server.url, otel_exporter=exporter), engine=object(),
                         registry=build_registry())
        return [m.cls for m in app.user_middleware]

    assert RequestSpans not in middleware("none") and RequestSpans in middleware("console")
    assert Tracing("none").context() == {}
    # A payload without a context (an older one, a cron's, a server with tracing off): the run is a root.
    exporter = InMemorySpanExporter()
    tracing = Tracing(model=MODEL, span_exporter=exporter)
    assert tracing.context() == {}  # no current span: nothing to pass on
    for parent in (None, {}, {"traceparent": "not-a-traceparent"}):
        with tracing.run("w", run_id="r", thread_id="t", parent=parent):
            pass
    assert [s.parent for s in exporter.get_finished_spans()] == [None, None, None]
