"""Serving-latency metrics (issue 38 item 7): the engine's per-generation timing record, its observers,
and the vLLM-style histograms and gauges the API derives from them.

Orderings and counts are asserted, never wall-clock thresholds: the machine may be busy.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from api_server import live_server, server_settings

pytest_plugins = ["state_fixtures", "api_server"]

HISTOGRAMS = ("elesium_time_to_first_token_seconds", "elesium_request_queue_time_seconds",
              "elesium_request_prefill_time_seconds", "elesium_request_decode_time_seconds",
              "elesium_e2e_request_latency_seconds")
ITL = "elesium_inter_token_latency_seconds"


def _chat(max_tokens: int, seed: int, prompt: str = "Say hello.", **extra: Any) -> dict[str, Any]:
    return {"model": "elesium", "max_tokens": max_tokens, "seed": seed,
            "messages": [{"role": "user", "content": prompt}], **extra}


def _sample(api_server: Any, name: str) -> float:
    return api_server.services.metrics.registry.get_sample_value(name) or 0.0


def _snapshot(api_server: Any) -> dict[str, float]:
    out = {}
    for name in (*HISTOGRAMS, ITL):
        out[f"{name}_count"] = _sample(api_server, f"{name}_count")
        out[f"{name}_sum"] = _sample(api_server, f"{name}_sum")
    return out


def _scraped(api_server: Any, name: str) -> float:
    """``name``'s value as ``/metrics`` serves it."""
    with api_server.http() as http:
        text = http.get("/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture
def captured(api_server: Any) -> Iterator[list[Any]]:
    """Timing records of the generations the server's engine ends during the test."""
    timings: list[Any] = []
    engine = api_server.services.engine
    engine.add_observer(timings.append)
    try:
        yield timings
    finally:
        engine.remove_observer(timings.append)


# -- the engine's timing record -------------------------------------------------------------------

def _check_record(t: Any, new_tokens: int) -> None:
    assert t.state == "done" and t.output_tokens == new_tokens
    assert t.created_at <= t.gate_at <= t.first_token_at <= t.finished_at
    assert all(a <= b for a, b in zip([t.first_token_at, *t.token_at], [*t.token_at, t.finished_at],
                                      strict=True))
    assert sum(t.token_counts) == new_tokens - 1 and min(t.token_counts, default=1) >= 1
    itl = t.inter_token_latencies()
    assert len(itl) == new_tokens - 1 and all(x >= 0 for x in itl)
    assert t.queue_s + t.prefill_s == pytest.approx(t.ttft_s)
    assert t.ttft_s + t.decode_s == pytest.approx(t.e2e_s)


def test_timing_record_and_observers(engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    from elesium.inference.sampling import SamplingParams

    seen: list[Any] = []

    def broken(timing: Any) -> None:
        raise RuntimeError("observer bug")

    engine.add_observer(broken)
    engine.add_observer(seen.append)
    try:
        with caplog.at_level(logging.ERROR, logger="elesium"):
            stream = engine.stream("Say hello.", SamplingParams(max_tokens=8, seed=1), mode="vanilla")
            text = "".join(c.text for c in stream)
        gen = stream.result
        assert text == gen.text and gen.new_tokens >= 2  # the failing observer broke nothing
        assert "observer bug" in caplog.text
        assert seen == [stream.timing]
        _check_record(stream.timing, gen.new_tokens)
        assert stream.timing.token_counts == [1] * (gen.new_tokens - 1)  # vanilla: one token a step
    finally:
        engine.remove_observer(broken)
        engine.remove_observer(seen.append)
    engine.generate("Say hello.", SamplingParams(max_tokens=3, seed=1), mode="vanilla")
    assert len(seen) == 1  # removed: no longer called


def test_a_multi_token_step_splits_its_interval() -> None:
    """A speculative step committing k tokens counts k inter-token latencies of interval/k (as vLLM)."""
    from elesium.inference.records import GenerationTiming

    t = GenerationTiming(created_at=0.0, prompt_tokens=5, mode="speculative", gate_at=0.5,
                         first_token_at=1.0, finished_at=2.0, state="done", output_tokens=6,
                         token_at=[1.25, 1.85], token_counts=[1, 4])
    assert t.inter_token_latencies() == pytest.approx([0.25, 0.15, 0.15, 0.15, 0.15])
    assert (t.queue_s, t.prefill_s, t.ttft_s, t.decode_s, t.e2e_s) == (0.5, 0.5, 1.0, 1.0, 2.0)


def test_closed_while_queued_never_ran(engine: Any) -> None:
    from elesium.inference.sampling import SamplingParams

    first = engine.stream("Say hello.", SamplingParams(max_tokens=4, seed=1), mode="vanilla")
    second = engine.stream("Say hello.", SamplingParams(max_tokens=4, seed=1), mode="vanilla")
    next(first)  # holds the engine
    second.close()
    first.close()
    assert second.timing.state == "closed" and second.timing.gate_at is None
    assert second.timing.queue_s is None and second.timing.inter_token_latencies() == []
    assert first.timing.state == "closed" and first.timing.first_token_at is not None


# -- the API's histograms and gauges --------------------------------------------------------------

def test_chat_completions_fill_the_histograms(api_server: Any, captured: list[Any]) -> None:
    before = _snapshot(api_server)
    completion_tokens = []
    with api_server.http() as http:
        for seed in (1, 2):
            r = http.post("/v1/chat/completions", json=_chat(6, seed))
            assert r.status_code == 200, r.text
            completion_tokens.append(r.json()["usage"]["completion_tokens"])
        with http.stream("POST", "/v1/chat/completions", json=_chat(6, 3, stream=True)) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[0][6:])["object"] == "chat.completion.chunk"
    after = _snapshot(api_server)
    n = 3
    assert len(captured) == n and all(t.state == "done" for t in captured)
    assert [t.output_tokens for t in captured[:2]] == completion_tokens
    for name in HISTOGRAMS:
        assert after[f"{name}_count"] - before[f"{name}_count"] == n, name
    assert after[f"{ITL}_count"] - before[f"{ITL}_count"] == sum(t.output_tokens - 1 for t in captured)

    def added(name: str) -> float:
        return after[f"{name}_sum"] - before[f"{name}_sum"]

    assert added("elesium_request_queue_time_seconds") >= 0
    assert added("elesium_time_to_first_token_seconds") <= added("elesium_e2e_request_latency_seconds")
    assert added("elesium_request_prefill_time_seconds") <= added("elesium_time_to_first_token_seconds")
    assert added(ITL) <= added("elesium_request_decode_time_seconds") + 1e-9
    # What /metrics serves is the registry's (the help texts name the vLLM equivalents' semantics).
    assert _scraped(api_server, "elesium_e2e_request_latency_seconds_count") == \
        after["elesium_e2e_request_latency_seconds_count"]


def test_second_request_queues_behind_the_first(api_server: Any, captured: list[Any]) -> None:
    engine = api_server.services.engine
    long_body = _chat(48, 5, "Write a long essay about bridges.")
    replies: dict[str, Any] = {}

    def post(name: str, body: dict[str, Any]) -> None:
        with api_server.http() as http:
            replies[name] = http.post("/v1/chat/completions", json=body)

    first = threading.Thread(target=post, args=("first", long_body))
    first.start()
    deadline = time.monotonic() + 30
    while not engine.busy and time.monotonic() < deadline:
        time.sleep(0.005)
    second = threading.Thread(target=post, args=("second", _chat(4, 6)))
    second.start()
    waiting_seen = running_seen = 0.0
    while second.is_alive():
        waiting_seen = max(waiting_seen, _sample(api_server, "elesium_num_requests_waiting"))
        running_seen = max(running_seen, _sample(api_server, "elesium_num_requests_running"))
        time.sleep(0.01)
    first.join(60)
    second.join(60)
    assert replies["first"].status_code == 200 and replies["second"].status_code == 200
    assert len(captured) == 2
    one, two = captured  # in the order they ended: FIFO
    assert one.output_tokens == replies["first"].json()["usage"]["completion_tokens"]
    assert two.gate_at >= one.finished_at  # the second ran only once the first had ended
    assert two.queue_s >= 0.5 * one.decode_s  # it waited (about) through the first's whole decode
    assert two.queue_s > one.queue_s
    assert running_seen == 1 and waiting_seen == 1
    assert _scraped(api_server, "elesium_num_requests_running") == 0
    assert _scraped(api_server, "elesium_num_requests_waiting") == 0


def test_a_failing_observer_does_not_break_a_completion(api_server: Any) -> None:
    engine = api_server.services.engine
    before = _sample(api_server, "elesium_e2e_request_latency_seconds_count")

    def broken(timing: Any) -> None:
        raise ValueError("observer bug")

    engine.add_observer(broken)
    try:
        with api_server.http() as http:
            r = http.post("/v1/chat/completions", json=_chat(4, 7))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    finally:
        engine.remove_observer(broken)
    assert _sample(api_server, "elesium_e2e_request_latency_seconds_count") == before + 1


def test_an_app_observes_only_while_it_lives(api_server: Any, state_server: Any) -> None:
    """Two apps share one engine: each counts every generation while it lives, and a stopped one
    neither stays registered nor counts."""
    engine = api_server.services.engine
    observers = engine._observers
    with live_server(server_settings(state_server.url), engine, api_server.registry) as other:
        metrics = other.services.metrics
        assert len(engine._observers) == len(observers) + 1
        before = _sample(api_server, "elesium_e2e_request_latency_seconds_count")
        with other.http() as http:
            assert http.post("/v1/chat/completions", json=_chat(3, 8)).status_code == 200
        assert metrics.registry.get_sample_value("elesium_e2e_request_latency_seconds_count") == 1
        assert _sample(api_server, "elesium_e2e_request_latency_seconds_count") == before + 1
    assert engine._observers == observers


def test_a_workflow_run_counts_too(api_server: Any, captured: list[Any]) -> None:
    """Workflow runs reach the engine through RunEngine, not the chat route: counted all the same."""
    before = _snapshot(api_server)
    with api_server.http() as http:
        tid = http.post("/threads", json={}).json()["thread_id"]
        body = {"assistant_id": "summary", "input": {"topic": "salt"}}
        r = http.post(f"/threads/{tid}/runs/wait", json=body)
        assert r.status_code == 200, r.text
    after = _snapshot(api_server)
    assert len(captured) == 1 and captured[0].state == "done"
    for name in HISTOGRAMS:
        assert after[f"{name}_count"] - before[f"{name}_count"] == 1, name
    assert after[f"{ITL}_count"] - before[f"{ITL}_count"] == captured[0].output_tokens - 1
