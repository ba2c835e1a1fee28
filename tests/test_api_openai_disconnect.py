"""A non-streaming chat completion whose client disconnects stops decoding and frees the engine; a
``runs/wait`` request does the same for its run when it asks for ``on_disconnect: "cancel"``.

The engine serves one generation at a time, so an abandoned 400-token completion that kept decoding
would make the next caller wait for all of it (issue 38: 24 s instead of 0.3 s). Timings are compared
with the next request's own solo time measured in the same test, never with absolute thresholds.
"""

from __future__ import annotations

import json
import logging
import socket
import statistics
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

from api_server import KEY_A

pytest_plugins = ["state_fixtures", "api_server"]

LONG = {"model": "elesium", "max_tokens": 400, "seed": 3,
        "messages": [{"role": "user", "content": "Write a long essay about bridges."}]}
SHORT = {"model": "elesium", "max_tokens": 7, "seed": 1,
         "messages": [{"role": "user", "content": "Say hello."}]}


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def server_errors() -> Iterator[list[logging.LogRecord]]:
    """ERROR records of the server's loggers (uvicorn's do not reach the root logger) during the test."""
    handler = _Errors()
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "elesium", "elesium.api")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield handler.records
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def _sample(api_server, name: str, **labels: str) -> float:
    return api_server.services.metrics.registry.get_sample_value(name, labels or None) or 0.0


def _send(api_server, body: dict, path: str = "/v1/chat/completions") -> socket.socket:
    """POST ``body`` to ``path`` over a raw socket and return the socket, its answer unread."""
    url = urlparse(api_server.url)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {url.hostname}:{url.port}\r\n"
            f"x-api-key: {KEY_A}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    sock.sendall(head + payload)
    return sock


def _leave(sock: socket.socket) -> None:
    """Close the connection without reading, checking that nothing was answered yet."""
    sock.settimeout(0)
    try:
        with pytest.raises(BlockingIOError):
            sock.recv(1)  # the generation is still running when we leave
    finally:
        sock.close()


def _abandon(api_server, body: dict, after_s: float) -> None:
    """POST ``body``, then close the connection after ``after_s`` without reading."""
    sock = _send(api_server, body)
    time.sleep(after_s)
    _leave(sock)


def _timed(h, body: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = h.post("/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    return elapsed, r.json()


def _idle(api_server, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while api_server.services.worker.depth:
        assert time.monotonic() < deadline, "the engine thread is still busy"
        time.sleep(0.02)


def test_disconnected_completion_stops_and_frees_the_engine(api_server, server_errors):
    with api_server.http(KEY_A) as h:
        _idle(api_server)
        solo = statistics.median(_timed(h, SHORT)[0] for _ in range(3))
        aborts = _sample(api_server, "elesium_chat_completions_total", finish_reason="abort")
        tokens = _sample(api_server, "elesium_generation_tokens_total")
        prompts = _sample(api_server, "elesium_prompt_tokens_total")

        _abandon(api_server, LONG, after_s=0.5)
        after, answer = _timed(h, SHORT)
        _idle(api_server)

    # The next caller was served at once, not after the abandoned 400 tokens.
    assert after < 4 * solo, (after, solo)
    # The abandoned generation ended as an abort, long before its max_tokens.
    assert _sample(api_server, "elesium_chat_completions_total", finish_reason="abort") == aborts + 1
    decoded = (_sample(api_server, "elesium_generation_tokens_total") - tokens
               - answer["usage"]["completion_tokens"])
    assert 0 <= decoded < LONG["max_tokens"] // 4, decoded
    # Its prompt was prefilled and counted, once.
    prompt = len(api_server.services.engine.encode_prompt(LONG["messages"]))
    prefilled = (_sample(api_server, "elesium_prompt_tokens_total") - prompts
                 - answer["usage"]["prompt_tokens"])
    assert prefilled == prompt, (prefilled, prompt)
    assert not server_errors, [r.getMessage() for r in server_errors]


def test_completion_without_disconnect_is_unchanged(api_server, server_errors):
    body = {**SHORT, "max_tokens": 24, "messages": [{"role": "user", "content": "Count from one to twenty."}]}
    aborts = _sample(api_server, "elesium_chat_completions_total", finish_reason="abort")
    with api_server.http(KEY_A) as h:
        _, first = _timed(h, body)
        with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            streamed = "".join(
                (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                for line in response.iter_lines()
                if line.startswith("data: {"))
    choice = first["choices"][0]
    assert choice["message"]["content"] == streamed  # the whole answer, the same as streamed
    usage = first["usage"]
    assert choice["finish_reason"] in ("length", "stop")
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == body["max_tokens"]
    finished = _sample(api_server, "elesium_chat_completions_total", finish_reason=choice["finish_reason"])
    assert finished >= 2  # counted, both the plain and the streamed answer
    assert _sample(api_server, "elesium_chat_completions_total", finish_reason="abort") == aborts
    assert not server_errors, [r.getMessage() for r in server_errors]


def test_disconnect_while_queued_drops_the_job(api_server, server_errors):
    """A completion whose client leaves while it waits behind another one never runs."""
    with api_server.http(KEY_A) as h:
        _idle(api_server)
        solo = statistics.median(_timed(h, SHORT)[0] for _ in range(2))
        aborts = _sample(api_server, "elesium_chat_completions_total", finish_reason="abort")
        tokens = _sample(api_server, "elesium_generation_tokens_total")
        prompts = _sample(api_server, "elesium_prompt_tokens_total")
        running = _send(api_server, LONG)
        time.sleep(0.3)
        queued = _send(api_server, {**LONG, "seed": 4})
        time.sleep(0.3)
        assert api_server.services.worker.depth == 2
        _leave(queued)
        _leave(running)
        after, answer = _timed(h, SHORT)
        _idle(api_server)
    assert after < 4 * solo, (after, solo)
    assert _sample(api_server, "elesium_chat_completions_total", finish_reason="abort") == aborts + 2
    decoded = (_sample(api_server, "elesium_generation_tokens_total") - tokens
               - answer["usage"]["completion_tokens"])
    assert 0 <= decoded < LONG["max_tokens"] // 4, decoded
    # Only the running one was prefilled: the queued one never reached the engine.
    prompt = len(api_server.services.engine.encode_prompt(LONG["messages"]))
    prefilled = (_sample(api_server, "elesium_prompt_tokens_total") - prompts
                 - answer["usage"]["prompt_tokens"])
    assert prefilled == prompt, (prefilled, prompt)
    assert not server_errors, [r.getMessage() for r in server_errors]


@pytest.mark.parametrize(("on_disconnect", "status"), [("cancel", "interrupted"), (None, "success")])
def test_wait_run_whose_client_leaves(api_server, server_errors, on_disconnect, status):
    """``runs/wait`` cancels its run on disconnect when asked to; by default (continue) the run
    finishes, its result readable afterwards."""
    with api_server.http(KEY_A) as h:
        _idle(api_server)
        tid = h.post("/threads", json={}).json()["thread_id"]
        body = {"assistant_id": "story", "input": {"topic": "rivers"},
                **({"on_disconnect": on_disconnect} if on_disconnect else {})}
        sock = _send(api_server, body, f"/threads/{tid}/runs/wait")
        deadline = time.monotonic() + 15
        while not (runs := h.get(f"/threads/{tid}/runs").json()) or runs[0]["status"] == "pending":
            assert time.monotonic() < deadline, runs
            time.sleep(0.02)
        time.sleep(0.3)  # decoding
        _leave(sock)
        deadline = time.monotonic() + 30
        while (run := h.get(f"/threads/{tid}/runs").json()[0])["status"] in ("pending", "running"):
            assert time.monotonic() < deadline, run
            time.sleep(0.02)
    assert run["status"] == status, run
    if status == "interrupted":
        assert run["error"] == "cancelled"
    assert not server_errors, [r.getMessage() for r in server_errors]
