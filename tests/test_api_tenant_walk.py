"""Every route × another tenant (issue 41, item 5), on a live server.

Tenant A owns a thread with finished runs (one created with an Idempotency-Key), a checkpoint and a
replay; tenant B then walks the whole OpenAPI document with A's ids in every path parameter (and in the
bodies that carry ids: forks, state updates). Each per-resource route must answer 404, with the same
status and message as for ids that never existed (so the answer says nothing about A), and Redis must be
byte-for-byte unchanged afterwards. Routes that are not per-resource (assistants are global, searches
list the caller's own objects) are classified explicitly: a new route fails :func:`test_every_route_is_
classified` until it is added to one of the tables below.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
import redis
from langgraph_sdk import get_sync_client

from api_server import KEY_A, KEY_B

pytest_plugins = ["state_fixtures", "api_server"]

Route = tuple[str, str]

# ---------------------------------------------------------------- the route tables
# Per-resource routes: tenant B with A's ids must get 404, exactly as for ids that never existed.
# The value is the body sent (placeholders {thread_id}, {run_id}, {checkpoint_id} are A's ids, or the
# missing ones); bodies are valid, so the ownership check is what answers, never body validation.
_RUN_BODY = {"assistant_id": "summary", "input": {"topic": "tenant walk"}}
_FORK_BODY = {**_RUN_BODY, "checkpoint_id": "{checkpoint_id}"}
PER_RESOURCE: dict[Route, dict[str, Any] | None] = {
    ("GET", "/threads/{thread_id}"): None,
    ("PATCH", "/threads/{thread_id}"): {"metadata": {"owner": "b"}},
    ("DELETE", "/threads/{thread_id}"): None,
    ("GET", "/threads/{thread_id}/state"): None,
    ("POST", "/threads/{thread_id}/state"): {"values": {"topic": "b"}, "checkpoint_id": "{checkpoint_id}"},
    ("GET", "/threads/{thread_id}/state/{checkpoint_id}"): None,
    ("POST", "/threads/{thread_id}/state/checkpoint"): {"checkpoint": {"checkpoint_id": "{checkpoint_id}"}},
    ("POST", "/threads/{thread_id}/history"): {"limit": 10},
    ("GET", "/threads/{thread_id}/history"): None,
    ("POST", "/threads/{thread_id}/runs"): _FORK_BODY,
    ("GET", "/threads/{thread_id}/runs"): None,
    ("POST", "/threads/{thread_id}/runs/wait"): _FORK_BODY,
    ("POST", "/threads/{thread_id}/runs/stream"): _FORK_BODY,
    ("GET", "/threads/{thread_id}/runs/{run_id}"): None,
    ("DELETE", "/threads/{thread_id}/runs/{run_id}"): None,
    ("GET", "/threads/{thread_id}/runs/{run_id}/join"): None,
    ("GET", "/threads/{thread_id}/runs/{run_id}/stream"): None,
    ("POST", "/threads/{thread_id}/runs/{run_id}/cancel"): None,
    ("GET", "/threads/{thread_id}/runs/{run_id}/acceptance"): None,
    ("POST", "/threads/{thread_id}/runs/{run_id}/replay"): {"mode": "recorded"},
    ("GET", "/threads/{thread_id}/runs/{run_id}/replays"): None,
    ("GET", "/threads/{thread_id}/runs/{run_id}/audit"): None,
    # retention (issue 43): B's keys have every role, so the ownership check is what answers
    ("GET", "/threads/{thread_id}/retention"): None,
    ("POST", "/threads/{thread_id}/purge"): None,
    ("PUT", "/threads/{thread_id}/legal-hold"): {"reason": "tenant walk"},
    ("DELETE", "/threads/{thread_id}/legal-hold"): None,
    # crons (issue 39): on A's thread, and A's cron by its id
    ("POST", "/threads/{thread_id}/runs/crons"): {**_RUN_BODY, "schedule": "0 0 1 1 *"},
    ("PATCH", "/runs/crons/{cron_id}"): {"metadata": {"owner": "b"}},
    ("DELETE", "/runs/crons/{cron_id}"): None,
}
# Per-resource routes whose ids besides the thread's (a run id in the path, a checkpoint id in the
# body) are walked a second time on B's *own* thread: A's run or checkpoint must be as missing there too.
MIXED = {
    ("POST", "/threads/{thread_id}/state"),
    ("GET", "/threads/{thread_id}/state/{checkpoint_id}"),
    ("POST", "/threads/{thread_id}/state/checkpoint"),
    ("POST", "/threads/{thread_id}/runs"),
    ("POST", "/threads/{thread_id}/runs/wait"),
    ("POST", "/threads/{thread_id}/runs/stream"),
    ("GET", "/threads/{thread_id}/runs/{run_id}"),
    ("DELETE", "/threads/{thread_id}/runs/{run_id}"),
    ("GET", "/threads/{thread_id}/runs/{run_id}/join"),
    ("GET", "/threads/{thread_id}/runs/{run_id}/stream"),
    ("POST", "/threads/{thread_id}/runs/{run_id}/cancel"),
    ("GET", "/threads/{thread_id}/runs/{run_id}/acceptance"),
    ("POST", "/threads/{thread_id}/runs/{run_id}/replay"),
    ("GET", "/threads/{thread_id}/runs/{run_id}/replays"),
    ("GET", "/threads/{thread_id}/runs/{run_id}/audit"),
}
# Not per-resource, so neither 404 nor 403: any tenant may call them and gets 200 (assistants are the
# registered workflows, shared by every tenant; searches and counts list the caller's own objects;
# ops and the model list hold no tenant data; the audit event stream is the caller's tenant's, and the
# retention sweep answers with the caller's purges only). Walked with B's key: 200, no A id in the
# answer, no write. No route is restricted to some tenants; roles (403) are per key, and these keys have
# every role (keys without roles: full access), see test_api_retention_roles.py.
SHARED: dict[Route, dict[str, Any] | None] = {
    ("GET", "/healthz"): None,
    ("GET", "/readyz"): None,
    ("GET", "/info"): None,
    ("GET", "/metrics"): None,
    ("GET", "/v1/models"): None,
    ("GET", "/elesium/whoami"): None,
    ("POST", "/assistants/search"): {},
    ("POST", "/assistants/count"): {},
    ("GET", "/assistants/{assistant_id}"): None,
    ("GET", "/assistants/{assistant_id}/schemas"): None,
    ("GET", "/assistants/{assistant_id}/graph"): None,
    ("GET", "/assistants/{assistant_id}/subgraphs"): None,
    ("POST", "/assistants/{assistant_id}/versions"): None,
    ("GET", "/assistants/{assistant_id}/subgraphs/{namespace}"): None,
    ("POST", "/store/items/search"): {},
    ("POST", "/store/namespaces"): {},
    ("POST", "/runs/crons/search"): {},
    ("POST", "/runs/crons/count"): {},
    ("POST", "/threads/search"): {"limit": 1000},
    ("POST", "/threads/count"): {},
    ("GET", "/elesium/audit/events"): None,
    ("POST", "/elesium/audit/purge-expired"): None,
}
# Routes that create the caller's own objects and take no id of an existing object in the path: not
# walked here with a generic body (they would rightly write B's objects). Each has its own test below:
# POST /threads with A's thread id (test_creating_a_thread_with_a_foreign_id_reveals_nothing), the
# stateless runs with A's Idempotency-Key (test_idempotency_key_reuse_across_tenants), and chat
# completions, which store nothing (test_chat_completion_writes_nothing).
CREATES_OWN: set[Route] = {
    ("POST", "/threads"),
    ("POST", "/runs"),
    ("POST", "/runs/wait"),
    ("POST", "/runs/stream"),
    ("POST", "/v1/chat/completions"),
    # the store is per tenant and keyed by (namespace, key), not by an id of an object: B's writes and
    # reads name B's items (test_store_and_crons_are_per_tenant); a stateless cron is B's own
    ("PUT", "/store/items"),
    ("GET", "/store/items"),
    ("DELETE", "/store/items"),
    ("POST", "/runs/crons"),
}


# ---------------------------------------------------------------- fixtures and helpers
@pytest.fixture(scope="module")
def owned(api_server) -> dict[str, str]:
    """Tenant A's objects, and B's own thread (with a run, so it has a graph and checkpoints)."""
    a = get_sync_client(url=api_server.url, api_key=KEY_A)
    tid = a.threads.create(metadata={"owner": "a"})["thread_id"]
    a.runs.wait(tid, "summary", input={"topic": "salt"})
    with api_server.http(KEY_A) as http:
        r = http.post(f"/threads/{tid}/runs/wait",
                      json={"assistant_id": "summary", "input": {"topic": "pepper"}},
                      headers={"Idempotency-Key": "shared-key"})
        assert r.status_code == 200, r.text
        idem_run = r.headers["content-location"].rsplit("/", 1)[1]
        stateless = http.post("/runs/wait", json={"assistant_id": "summary", "input": {"topic": "thyme"}},
                              headers={"Idempotency-Key": "stateless-key"})
        assert stateless.status_code == 200, stateless.text
        stateless_run = stateless.headers["content-location"].rsplit("/", 1)[1]
        stateless_thread = stateless.headers["content-location"].split("/")[2]
    runs = a.runs.list(tid)
    rid = [r["run_id"] for r in runs if r["run_id"] != idem_run][0]
    cid = a.threads.get_history(tid, limit=1)[0]["checkpoint"]["checkpoint_id"]
    with api_server.http(KEY_A) as http:
        assert http.post(f"/threads/{tid}/runs/{rid}/replay", json={"mode": "recorded"}).status_code == 200
    b = get_sync_client(url=api_server.url, api_key=KEY_B)
    b_tid = b.threads.create(metadata={"owner": "b"})["thread_id"]
    b.runs.wait(b_tid, "summary", input={"topic": "cumin"})
    assistant = a.assistants.search(graph_id="summary")[0]["assistant_id"]
    cron = a.crons.create_for_thread(tid, "summary", schedule="0 0 1 1 *", input={"topic": "nutmeg"},
                                     enabled=False)  # disabled: never fires
    return {"thread_id": tid, "run_id": rid, "checkpoint_id": cid, "cron_id": cron["cron_id"],
            "idem_run": idem_run,
            "stateless_run": stateless_run, "stateless_thread": stateless_thread, "b_thread": b_tid,
            "assistant_id": assistant}


def snapshot(r: redis.Redis) -> dict[bytes, Any]:
    """Every key's type and value. Values are compared as DUMP bytes, except streams: a stream's DUMP
    holds its consumers' last-seen times, which the idle queue worker's polling (XREADGROUP) moves on
    every poll without writing anything; for them the entries and each group's delivery state are
    compared. Keys with a TTL also record it, so a refreshed TTL (a write) shows as a larger one."""
    out: dict[bytes, Any] = {}
    for key in r.scan_iter(count=1000):
        kind = r.type(key)
        if kind == b"none":
            continue  # expired between SCAN and TYPE
        if kind == b"stream":
            groups = [(g["name"], g["last-delivered-id"], g["pending"]) for g in r.xinfo_groups(key)]
            value: Any = (r.xrange(key), groups)
        else:
            value = r.dump(key)
        out[key] = (kind, value, r.pttl(key))
    return out


def assert_unchanged(before: dict[bytes, Any], after: dict[bytes, Any]) -> None:
    added = sorted(set(after) - set(before))
    removed = sorted(k for k in set(before) - set(after) if before[k][2] < 0)  # a TTL may expire
    changed = sorted(k for k in set(before) & set(after) if before[k][:2] != after[k][:2])
    refreshed = sorted(k for k in set(before) & set(after)
                       if before[k][2] >= 0 and (after[k][2] < 0 or after[k][2] > before[k][2]))
    assert not (added or removed or changed or refreshed), (
        f"Redis changed: added {added}, removed {removed}, changed {changed}, TTL refreshed {refreshed}")


def settled_snapshot(r: redis.Redis) -> dict[bytes, Any]:
    """A snapshot once the setup's runs have finished writing (two equal snapshots in a row)."""
    import time

    prev = snapshot(r)
    for _ in range(50):
        time.sleep(0.2)
        cur = snapshot(r)
        if {k: v[:2] for k, v in cur.items()} == {k: v[:2] for k, v in prev.items()}:
            return cur
        prev = cur
    raise AssertionError("Redis did not settle after the setup runs")


def fill(template: Any, ids: dict[str, str]) -> Any:
    if isinstance(template, str):
        for name, value in ids.items():
            template = template.replace("{" + name + "}", value)
        return template
    if isinstance(template, dict):
        return {k: fill(v, ids) for k, v in template.items()}
    return template


def send(client: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
    kwargs: dict[str, Any] = {} if body is None else {"json": body}
    with client.stream(method, path, **kwargs) as response:
        response.read()  # a stream route that (wrongly) started streaming is read to its end
    return response


def normalized(response: httpx.Response, ids: dict[str, str]) -> tuple[int, str]:
    """Status and body with the ids sent replaced by their names: equal for A's ids and missing ones
    only if the answer says nothing about A's objects."""
    text = response.text
    for name, value in ids.items():
        text = text.replace(value, "<" + name + ">")
    return response.status_code, text


def listed_ids(client: httpx.Client) -> list[str]:
    return [t["thread_id"] for t in client.post("/threads/search", json={"limit": 1000}).json()]


def openapi_routes(api_server) -> set[Route]:
    with api_server.http(KEY_A) as a:
        doc = a.get("/openapi.json").json()
    return {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops
            if m.upper() in {"GET", "POST", "PUT", "PATCH", "DELETE"}}


# ---------------------------------------------------------------- the walk
def test_every_route_is_classified(api_server):
    tables = [set(PER_RESOURCE), set(SHARED), CREATES_OWN]
    assert sum(len(t) for t in tables) == len(set().union(*tables)), "a route is in two tables"
    assert MIXED <= set(PER_RESOURCE)
    routes = openapi_routes(api_server)
    assert routes - set().union(*tables) == set(), "new routes: classify them in test_api_tenant_walk.py"
    assert set().union(*tables) - routes == set(), "routes gone from the OpenAPI document"


def test_every_route_with_another_tenants_ids_is_404_and_writes_nothing(api_server, owned):
    a_ids = {k: owned[k] for k in ("thread_id", "run_id", "checkpoint_id", "cron_id")}
    missing = {k: str(uuid.uuid4()) for k in a_ids}
    r = api_server.redis()
    before = settled_snapshot(r)
    walked: set[Route] = set()
    failures: list[str] = []
    with api_server.http(KEY_B) as b:
        for (method, template), body in sorted(PER_RESOURCE.items()):
            for run_id in (owned["run_id"], owned["idem_run"]):
                ids = {**a_ids, "run_id": run_id}
                gone = missing
                foreign = send(b, method, fill(template, ids), fill(body, ids))
                absent = send(b, method, fill(template, gone), fill(body, gone))
                if foreign.status_code != 404:
                    failures.append(f"{method} {template}: {foreign.status_code} {foreign.text[:200]}")
                elif normalized(foreign, ids) != normalized(absent, gone):
                    failures.append(f"{method} {template}: {foreign.text} differs from {absent.text}")
                if (method, template) in MIXED:  # B's own thread, A's run or checkpoint
                    own = {**ids, "thread_id": owned["b_thread"]}
                    own_gone = {**gone, "thread_id": owned["b_thread"]}
                    foreign = send(b, method, fill(template, own), fill(body, own))
                    absent = send(b, method, fill(template, own_gone), fill(body, own_gone))
                    if foreign.status_code != 404:
                        failures.append(f"{method} {template} on B's thread: {foreign.status_code} "
                                        f"{foreign.text[:200]}")
                    elif normalized(foreign, own) != normalized(absent, own_gone):
                        failures.append(f"{method} {template} on B's thread: {foreign.text} differs "
                                        f"from {absent.text}")
            walked.add((method, template))
        for (method, template), body in sorted(SHARED.items()):
            response = send(b, method, fill(template, {"assistant_id": owned["assistant_id"]}), body)
            if response.status_code != 200:
                failures.append(f"{method} {template}: {response.status_code} {response.text[:200]}")
            leaked = [k for k, v in owned.items()
                      if k not in ("b_thread", "assistant_id") and v in response.text]
            if leaked:
                failures.append(f"{method} {template} shows A's {leaked}")
            walked.add((method, template))
    assert not failures, "\n".join(failures)
    assert walked == openapi_routes(api_server) - CREATES_OWN
    after = snapshot(r)
    assert_unchanged(before, after)
    with api_server.http(KEY_A) as a:  # negative control: the snapshot sees a one-field write
        assert a.patch(f"/threads/{owned['thread_id']}", json={}).status_code == 200
    with pytest.raises(AssertionError, match="changed"):
        assert_unchanged(after, snapshot(r))
    with api_server.http(KEY_A) as a:  # A's objects are as they were
        assert a.get(f"/threads/{owned['thread_id']}").json()["metadata"] == {"owner": "a"}
        assert a.get(f"/threads/{owned['thread_id']}/runs/{owned['run_id']}").status_code == 200


def test_b_searching_by_a_s_ids_finds_nothing(api_server, owned):
    with api_server.http(KEY_B) as b:
        body = {"ids": [owned["thread_id"], owned["stateless_thread"]], "limit": 1000}
        assert b.post("/threads/search", json=body).json() == []
        assert b.post("/threads/count", json=body).json() == 0


# ---------------------------------------------------------------- creation routes
def test_creating_a_thread_with_a_foreign_id_reveals_nothing(api_server, owned):
    """B creating a thread with A's id gets what it gets for an unused id: its own new thread. A's
    thread is untouched, and each tenant then sees only its own thread under that id."""
    tid = owned["thread_id"]
    r = api_server.redis()
    a_thread = r.hgetall(api_server.services.store.thread_key(tid))
    with api_server.http(KEY_B) as b:
        fresh = b.post("/threads", json={"thread_id": str(uuid.uuid4())})
        foreign = b.post("/threads", json={"thread_id": tid})
        assert foreign.status_code == fresh.status_code == 200, foreign.text
        assert foreign.json()["thread_id"] == tid and foreign.json()["metadata"] == {}
        # from now on the id is B's too: the owner's if_exists semantics, on B's thread
        assert b.post("/threads", json={"thread_id": tid}).status_code == 409
        assert b.post("/threads", json={"thread_id": tid, "if_exists": "do_nothing"}).json()["metadata"] == {}
        assert b.patch(f"/threads/{tid}", json={"metadata": {"owner": "b"}}).status_code == 200
        assert b.get(f"/threads/{tid}").json()["metadata"] == {"owner": "b"}
        assert b.get(f"/threads/{tid}/runs").json() == []
        assert b.get(f"/threads/{tid}/runs/{owned['run_id']}").status_code == 404
        assert listed_ids(b).count(tid) == 1
        run = b.post(f"/threads/{tid}/runs/wait", json={"assistant_id": "summary", "input": {"topic": "b"}})
        assert run.status_code == 200 and run.json()["topic"] == "b"
        assert run.headers["content-location"].startswith(f"/threads/{tid}/runs/")  # the id B knows
        assert {x["thread_id"] for x in b.get(f"/threads/{tid}/runs").json()} == {tid}
        streamed = b.post(f"/threads/{tid}/runs/stream", json={**_RUN_BODY, "input": {"topic": "b"}})
        assert f'"thread_id": "{tid}"' in streamed.text
        assert b.get(f"/threads/{tid}/state").json()["values"]["topic"] == "b"
        assert len(b.post(f"/threads/{tid}/history", json={"limit": 100}).json()) >= 1
    assert r.hgetall(api_server.services.store.thread_key(tid)) == a_thread
    with api_server.http(KEY_A) as a:
        mine = a.get(f"/threads/{tid}").json()
        assert mine["metadata"] == {"owner": "a"} and mine["values"]["topic"] == "pepper"
        assert a.post("/threads", json={"thread_id": tid}).status_code == 409  # A's own id: raise
        assert a.post("/threads", json={"thread_id": tid, "if_exists": "do_nothing"}).json()["metadata"] == {
            "owner": "a"}
        assert {x["run_id"] for x in a.get(f"/threads/{tid}/runs").json()} >= {
            owned["run_id"], owned["idem_run"]}
        assert listed_ids(a).count(tid) == 1
    with api_server.http(KEY_B) as b:
        assert b.delete(f"/threads/{tid}").status_code == 204
        assert b.get(f"/threads/{tid}").status_code == 404
    with api_server.http(KEY_A) as a:
        assert a.get(f"/threads/{tid}").json()["metadata"] == {"owner": "a"}


def test_a_run_creating_its_thread_with_a_foreign_id_reveals_nothing(api_server, owned):
    """``if_not_exists="create"`` on A's thread id creates B's own thread, as on an unused id."""
    tid = owned["stateless_thread"]
    with api_server.http(KEY_B) as b:
        for path in (f"/threads/{tid}/runs/wait", f"/threads/{uuid.uuid4()}/runs/wait"):
            r = b.post(path, json={**_RUN_BODY, "if_not_exists": "create"})
            assert r.status_code == 200 and r.json()["topic"] == "tenant walk", r.text
        assert listed_ids(b).count(tid) == 1
    with api_server.http(KEY_A) as a:
        assert a.get(f"/threads/{tid}").json()["values"]["topic"] == "thyme"


def test_idempotency_key_reuse_across_tenants(api_server, owned):
    """B sending A's Idempotency-Key gets a run of its own: neither A's run nor a 409 saying the key is
    taken, on threaded, stateless and streamed creation alike."""
    with api_server.http(KEY_B) as b:
        threaded = b.post(f"/threads/{owned['b_thread']}/runs/wait",
                          json={"assistant_id": "summary", "input": {"topic": "other"}},
                          headers={"Idempotency-Key": "shared-key"})
        assert threaded.status_code == 200, threaded.text
        assert owned["idem_run"] not in threaded.headers["content-location"]
        assert threaded.json()["topic"] == "other"
        for path in ("/runs/wait", "/runs/stream", "/runs"):
            # the same body each time: the first call creates B's run, the others replay B's run
            r = b.post(path, json={"assistant_id": "summary", "input": {"topic": "other"}},
                       headers={"Idempotency-Key": "stateless-key"})
            assert r.status_code == 200, (path, r.text)
            location = r.headers["content-location"]
            assert owned["stateless_run"] not in location and owned["stateless_thread"] not in location, path
            assert "thyme" not in r.text, path
            if path == "/runs/stream":
                assert "event: metadata" in r.text and owned["stateless_run"] not in r.text
    with api_server.http(KEY_A) as a:
        again = a.post("/runs/wait", json={"assistant_id": "summary", "input": {"topic": "thyme"}},
                       headers={"Idempotency-Key": "stateless-key"})
        assert again.status_code == 200 and owned["stateless_run"] in again.headers["content-location"]


def test_store_and_crons_are_per_tenant(api_server, owned):
    """B's store reads and writes name B's items only: A's item is missing for B (the same 404 as an item
    that never existed), B's delete of it deletes nothing, B's put of the same (namespace, key) is B's own
    item. A's cron is in no search or count of B's."""
    item = {"namespace": ["walk", "notes"], "key": "k"}
    with api_server.http(KEY_A) as a:
        assert a.put("/store/items", json={**item, "value": {"owner": "a"}}).status_code == 204
    query = {"namespace": "walk.notes", "key": "k"}
    with api_server.http(KEY_B) as b:
        foreign = b.get("/store/items", params=query)
        absent = b.get("/store/items", params={**query, "key": "never"})
        assert foreign.status_code == absent.status_code == 404
        assert foreign.json()["detail"].replace("'k'", "'never'") == absent.json()["detail"]
        assert b.request("DELETE", "/store/items", json=item).status_code == 204
        assert b.post("/store/items/search", json={"namespace_prefix": ["walk"]}).json() == {"items": []}
        assert b.post("/store/namespaces", json={}).json()["namespaces"] == []
        assert b.put("/store/items", json={**item, "value": {"owner": "b"}}).status_code == 204
        assert b.get("/store/items", params=query).json()["value"] == {"owner": "b"}
        assert owned["cron_id"] not in b.post("/runs/crons/search", json={"limit": 1000}).text
        assert b.post("/runs/crons/count", json={"thread_id": owned["thread_id"]}).json() == 0
    with api_server.http(KEY_A) as a:
        assert a.get("/store/items", params=query).json()["value"] == {"owner": "a"}
        assert owned["cron_id"] in a.post("/runs/crons/search", json={"limit": 1000}).text


def test_chat_completion_writes_nothing(api_server, owned):
    r = api_server.redis()
    before = settled_snapshot(r)
    with api_server.http(KEY_B) as b:
        reply = b.post("/v1/chat/completions", json={"model": "elesium", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200, reply.text
    assert_unchanged(before, snapshot(r))
