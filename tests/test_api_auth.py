"""Auth and bad input on a live server.

Every route but health needs a key (x-api-key or Bearer); another tenant's objects answer 404 and
never show up in searches; refused requests answer 4xx with a message and write nothing to Redis.
"""

from __future__ import annotations

import pytest
from langgraph_sdk import get_sync_client

from api_server import KEY_A, KEY_B

pytest_plugins = ["state_fixtures", "api_server"]


@pytest.fixture(scope="module")
def owned(api_server):
    """A thread of tenant A with one finished run."""
    client = get_sync_client(url=api_server.url, api_key=KEY_A)
    tid = client.threads.create(metadata={"owner": "a"})["thread_id"]
    client.runs.wait(tid, "summary", input={"topic": "salt"})
    return tid, client.runs.list(tid)[0]["run_id"]


def test_health_is_public_everything_else_needs_a_key(api_server):
    with api_server.http(None) as anon:
        assert anon.get("/healthz").json() == {"status": "ok"}
        ready = anon.get("/readyz")
        assert ready.status_code == 200 and ready.json()["checks"] == {"engine": True, "redis": True}
        for method, path in [
            ("POST", "/assistants/search"),
            ("POST", "/threads/search"),
            ("GET", "/metrics"),
            ("GET", "/v1/models"),
            ("GET", "/openapi.json"),
            ("POST", "/threads"),
        ]:
            r = anon.request(method, path, json={})
            assert r.status_code == 401 and "API key" in r.json()["detail"], path
    with api_server.http("wrong-key") as wrong:
        assert wrong.post("/threads/search", json={}).status_code == 401
    with api_server.http(
        None,
    ) as bearer:
        r = bearer.post("/threads/search", json={}, headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 200


def test_other_tenants_objects_are_404_and_never_listed(api_server, owned):
    tid, rid = owned
    with api_server.http(KEY_B) as b:
        for method, path in [
            ("GET", f"/threads/{tid}"),
            ("GET", f"/threads/{tid}/state"),
            ("POST", f"/threads/{tid}/history"),
            ("GET", f"/threads/{tid}/runs"),
            ("GET", f"/threads/{tid}/runs/{rid}"),
            ("GET", f"/threads/{tid}/runs/{rid}/acceptance"),
            ("POST", f"/threads/{tid}/runs/{rid}/replay"),
            ("GET", f"/threads/{tid}/runs/{rid}/replays"),
            ("DELETE", f"/threads/{tid}"),
        ]:
            r = b.request(method, path, json={"mode": "reexecute"} if path.endswith("replay") else {})
            assert r.status_code == 404, (method, path, r.text)
        r = b.post(f"/threads/{tid}/runs/wait", json={"assistant_id": "summary", "input": {"topic": "x"}})
        assert r.status_code == 404
        assert tid not in [t["thread_id"] for t in b.post("/threads/search", json={"limit": 1000}).json()]
        # ids are per tenant: B gets its own new thread, as for an unused id (test_api_tenant_walk.py)
        mine = b.post("/threads", json={"thread_id": tid})
        assert mine.status_code == 200 and mine.json()["metadata"] == {}
        assert b.get("/elesium/whoami").json()["tenant"] == "tenant-b"
    with api_server.http(KEY_A) as a:
        assert a.get(f"/threads/{tid}").status_code == 200
        assert tid in [t["thread_id"] for t in a.post("/threads/search", json={"limit": 1000}).json()]


def test_bad_input_is_4xx_with_a_message_and_writes_nothing(api_server, owned):
    tid, _ = owned
    r = api_server.redis()
    before = r.dbsize()
    with api_server.http(KEY_A) as a:
        cases = [
            (
                "malformed json",
                a.post(
                    f"/threads/{tid}/runs", content=b"{not json", headers={"content-type": "application/json"}
                ),
                422,
            ),
            (
                "oversized body",
                a.post(
                    f"/threads/{tid}/runs/wait",
                    json={"assistant_id": "summary", "input": {"topic": "x" * 70_000}},
                ),
                413,
            ),
            (
                "input too long",
                a.post(
                    f"/threads/{tid}/runs/wait",
                    json={"assistant_id": "summary", "input": {"topic": "x" * 500}},
                ),
                422,
            ),
            (
                "missing field",
                a.post(f"/threads/{tid}/runs", json={"assistant_id": "summary", "input": {}}),
                422,
            ),
            (
                "unknown assistant",
                a.post(f"/threads/{tid}/runs", json={"assistant_id": "nope", "input": {}}),
                404,
            ),
            (
                "unknown thread",
                a.post("/threads/nope/runs", json={"assistant_id": "summary", "input": {"topic": "x"}}),
                404,
            ),
            ("unknown run", a.get(f"/threads/{tid}/runs/nope"), 404),
            (
                "stateless bad input",
                a.post("/runs/wait", json={"assistant_id": "summary", "input": {"topic": ""}}),
                422,
            ),
            (
                "resume without interrupt",
                a.post(f"/threads/{tid}/runs", json={"assistant_id": "summary", "command": {"resume": 1}}),
                409,
            ),
            (
                "unknown stream mode",
                a.post(
                    f"/threads/{tid}/runs/stream",
                    json={"assistant_id": "summary", "input": {"topic": "x"}, "stream_mode": "events"},
                ),
                422,
            ),
            (
                "bad seed",
                a.post(
                    f"/threads/{tid}/runs",
                    json={
                        "assistant_id": "summary",
                        "input": {"topic": "x"},
                        "config": {"configurable": {"run_seed": -1}},
                    },
                ),
                422,
            ),
            (
                "bad temperature",
                a.post(
                    "/v1/chat/completions",
                    json={
                        "model": "elesium",
                        "messages": [{"role": "user", "content": "hi"}],
                        "temperature": -1,
                    },
                ),
                422,
            ),
            (
                "bad top_p",
                a.post(
                    "/v1/chat/completions",
                    json={"model": "elesium", "messages": [{"role": "user", "content": "hi"}], "top_p": 0},
                ),
                422,
            ),
            (
                "max_tokens over cap",
                a.post(
                    "/v1/chat/completions",
                    json={
                        "model": "elesium",
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 10**6,
                    },
                ),
                400,
            ),
            (
                "oversized prompt",
                a.post(
                    "/v1/chat/completions",
                    json={"model": "elesium", "messages": [{"role": "user", "content": "word " * 2500}]},
                ),
                400,
            ),
            (
                "unknown model",
                a.post(
                    "/v1/chat/completions",
                    json={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]},
                ),
                404,
            ),
        ]
        for name, response, status in cases:
            assert response.status_code == status, (name, response.status_code, response.text)
            detail = response.json()["detail"]
            assert isinstance(detail, str) and len(detail) > 5, name
        assert a.get(f"/threads/{tid}").json()["status"] == "idle"
        assert len(a.get(f"/threads/{tid}/runs").json()) == 1
    assert r.dbsize() == before
