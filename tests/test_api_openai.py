"""The OpenAI-compatible endpoint through the ``openai`` package; SSE disconnects; ops routes."""

from __future__ import annotations

import time

import httpx
import pytest

from api_server import KEY_A

pytest_plugins = ["state_fixtures", "api_server"]


@pytest.fixture(scope="module")
def oai(api_server):
    from openai import OpenAI

    return OpenAI(base_url=f"{api_server.url}/v1", api_key=KEY_A, max_retries=0)


def test_models_and_completion(oai, api_server):
    models = [m.id for m in oai.models.list().data]
    assert models == [api_server.services.settings.model_name]
    out = oai.chat.completions.create(
        model=models[0], messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, seed=1
    )
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert (
        out.usage.completion_tokens >= 1
        and out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    )
    again = oai.chat.completions.create(
        model=models[0], messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, seed=1
    )
    assert again.choices[0].message.content == choice.message.content


def test_streaming_matches_non_streaming_and_reports_usage(oai, api_server):
    kwargs = dict(
        model="elesium",
        messages=[{"role": "user", "content": "Count: one, two,"}],
        max_tokens=8,
        temperature=0.7,
        top_p=0.9,
        seed=4,
    )
    whole = oai.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_stop_and_mode(oai):
    out = oai.chat.completions.create(
        model="elesium",
        messages=[{"role": "user", "content": "List: a, b, c, d"}],
        max_tokens=24,
        stop=[","],
        seed=2,
        extra_body={"mode": "vanilla"},
    )
    assert "," not in out.choices[0].message.content


def test_disconnect_mid_stream_frees_the_engine(api_server):
    """Walk away from a 48-token run's stream after its first token: the run is cancelled at once."""
    with api_server.http(KEY_A) as h:
        tid = h.post("/threads", json={}).json()["thread_id"]
        body = {"assistant_id": "story", "input": {"topic": "mountains"}, "stream_mode": ["messages-tuple"]}
        with h.stream("POST", f"/threads/{tid}/runs/stream", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("event: messages"):
                    break
        left = time.monotonic()
        deadline = left + 15
        while True:
            runs = h.get(f"/threads/{tid}/runs").json()
            if runs and runs[0]["status"] not in ("pending", "running"):
                break
            assert time.monotonic() < deadline, runs
            time.sleep(0.05)
        assert runs[0]["status"] == "interrupted" and runs[0]["error"] == "cancelled"
        assert api_server.services.worker.depth == 0
        # The next request completes normally.
        r = h.post(
            "/v1/chat/completions",
            json={"model": "elesium", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_chat_stream_disconnect_frees_the_engine(api_server):
    body = {"model": "elesium", "stream": True, "max_tokens": 400,
            "messages": [{"role": "user", "content": "Write a long essay about bridges."}]}
    with api_server.http(KEY_A) as h:
        with h.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    break
        deadline = time.monotonic() + 15
        while api_server.services.worker.depth:
            assert time.monotonic() < deadline, "the abandoned generation still holds the engine"
            time.sleep(0.05)
        t0 = time.monotonic()
        r = h.post("/v1/chat/completions", json={"model": "elesium", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and time.monotonic() - t0 < 30


def test_health_answers_while_the_engine_is_busy(api_server):
    with api_server.http(KEY_A) as h:
        tid = h.post("/threads", json={}).json()["thread_id"]
        run = h.post(
            f"/threads/{tid}/runs", json={"assistant_id": "story", "input": {"topic": "deserts"}}
        ).json()
        while h.get(f"/threads/{tid}/runs/{run['run_id']}").json()["status"] == "pending":
            time.sleep(0.02)
        t0 = time.monotonic()
        assert httpx.get(f"{api_server.url}/healthz").status_code == 200
        assert h.post("/threads/search", json={}).status_code == 200
        assert time.monotonic() - t0 < 1.0
        assert h.get(f"/threads/{tid}/runs/{run['run_id']}").json()["status"] == "running"
        h.get(f"/threads/{tid}/runs/{run['run_id']}/join")


def test_metrics(api_server):
    with api_server.http(KEY_A) as h:
        h.post(
            "/v1/chat/completions",
            json={"model": "elesium", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        )
        text = h.get("/metrics").text
    for name in (
        "elesium_http_requests_total",
        "elesium_http_request_duration_seconds",
        "elesium_runs_total",
        "elesium_generation_tokens_total",
        "elesium_spec_decode_num_drafts_total",
        "elesium_spec_decode_num_accepted_tokens_total",
        "elesium_checkpoint_write_seconds",
        "elesium_engine_queue_depth",
        "elesium_engine_chained_steps",
        "elesium_engine_ahead_rows",
        "elesium_engine_folded_prompt_blocks",
        "elesium_engine_drafter_swaps",
        "elesium_prefix_cache_queries",
        "elesium_prefix_cache_hits",
    ):
        assert name in text, name
    assert 'route="/v1/chat/completions"' in text
    generated = [line for line in text.splitlines() if line.startswith("elesium_generation_tokens_total")]
    assert float(generated[0].split()[-1]) >= 3
