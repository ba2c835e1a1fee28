"""Retention of deleted threads' audit records, purges, legal holds, and per-key roles (issue 43, items
3 and 4), on a live server with real Redis.

The module runs its own server (same engine and Valkey as the session's, its own run queue) with keys
of one tenant carrying each role, a full-access key per tenant (no roles: today's behaviour), and a
30-day retention with the periodic sweep off (tests call it with a later clock).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from api_server import KEY_A, KEY_B, LiveServer, live_server, server_settings
from api_workflows import build_registry

pytest_plugins = ["state_fixtures", "api_server"]

READER, OPERATOR, APPROVER, AUDITOR, ADMIN = (f"key-{r}-0123456789" for r in
                                               ("reader", "operator", "approver", "auditor", "admin"))
DAY_MS = 86_400_000
TICKET = {"subject": "Login page returns HTTP 502",
          "body": "Nobody on our team can log in since 09:10, the page shows HTTP 502."}


@pytest.fixture(scope="module")
def server(engine: Any, state_server: Any) -> Iterator[LiveServer]:
    from elesium.api.settings import parse_api_key_roles, parse_api_keys

    text = (f"{READER}=tenant-a:reader, {OPERATOR}=tenant-a:operator, {APPROVER}=tenant-a:approver,"
            f"{AUDITOR}=tenant-a:auditor, {ADMIN}=tenant-a:admin, {KEY_A}=tenant-a, {KEY_B}=tenant-b")
    settings = server_settings(state_server.url, queue_name="retention-roles", audit_sweep_interval_s=0,
                               audit_retention_days=30)
    settings.api_keys, settings.api_key_roles = parse_api_keys(text), parse_api_key_roles(text)
    with live_server(settings, engine, build_registry()) as srv:
        yield srv


def identity(server: LiveServer, key: str) -> str:
    with server.http(key) as c:
        return c.get("/elesium/whoami").json()["identity"]


def thread_with_run(server: LiveServer, key: str = OPERATOR) -> tuple[str, str]:
    with server.http(key) as c:
        tid = c.post("/threads", json={}).json()["thread_id"]
        r = c.post(f"/threads/{tid}/runs/wait", json={"assistant_id": "summary", "input": {"topic": "salt"}})
        assert r.status_code == 200, r.text
        return tid, r.headers["content-location"].rsplit("/", 1)[1]


def records(server: LiveServer, tid: str, rid: str) -> dict[str, bool]:
    """Which of the thread's audit records are in Redis (read directly, not through the API)."""
    svc, r = server.services, server.redis()
    store = svc.store
    return {
        "thread": bool(r.exists(store.thread_key(tid))),
        "run_row": bool(r.exists(store._t(tid, "run", rid))),
        "calls": bool(r.exists(store._t(tid, "calls", rid))),
        "replays": bool(r.exists(store._t(tid, "replays", rid))),
        "acceptance": bool(r.exists(svc.acceptance.key(rid))),
        "checkpoints": svc.saver.get_tuple({"configurable": {"thread_id": tid, "checkpoint_ns": ""}})
        is not None,
    }


def events(server: LiveServer, tid: str) -> list[dict[str, Any]]:
    with server.http(AUDITOR) as c:
        r = c.get("/elesium/audit/events", params={"limit": 1000})
        assert r.status_code == 200, r.text
        return [e for e in r.json()["events"] if e["thread_id"] == tid]


# ---------------------------------------------------------------- retention
@pytest.fixture(scope="module")
def deleted(server: LiveServer) -> tuple[str, str]:
    """A thread with a run and a replay report, deleted by an operator."""
    tid, rid = thread_with_run(server)
    with server.http(AUDITOR) as c:
        assert c.post(f"/threads/{tid}/runs/{rid}/replay", json={"mode": "recorded"}).status_code == 200
    assert all(records(server, tid, rid).values()), records(server, tid, rid)
    with server.http(OPERATOR) as c:
        assert c.delete(f"/threads/{tid}").status_code == 204
    return tid, rid


def test_delete_keeps_the_audit_records_and_hides_the_thread(server, deleted):
    tid, rid = deleted
    assert all(records(server, tid, rid).values()), records(server, tid, rid)
    for key in (READER, OPERATOR, KEY_A):
        with server.http(key) as c:
            for path in (f"/threads/{tid}", f"/threads/{tid}/state", f"/threads/{tid}/runs",
                         f"/threads/{tid}/runs/{rid}", f"/threads/{tid}/history"):
                r = c.get(path)
                assert r.status_code == 404 and "not found" in r.json()["detail"], (key, path, r.text)
            assert tid not in [t["thread_id"] for t in c.post("/threads/search", json={"limit": 1000}).json()]
            assert c.post("/threads/count", json={"ids": [tid]}).json() == 0
    with server.http(OPERATOR) as c:
        assert c.delete(f"/threads/{tid}").status_code == 404  # deleted once
        # the id is not reusable while the records are kept: a new thread would read them
        again = c.post("/threads", json={"thread_id": tid})
        assert again.status_code == 409 and "kept for audit" in again.json()["detail"]
        r = c.post(f"/threads/{tid}/runs/wait",
                   json={"assistant_id": "summary", "input": {"topic": "x"}, "if_not_exists": "create"})
        assert r.status_code == 409
    with server.http(AUDITOR) as c:  # the auditor still reads the records
        kept = c.get(f"/threads/{tid}/retention").json()
        assert kept["deleted"] and kept["deleted_by"] == identity(server, OPERATOR) and kept["purge_after"]
        assert c.get(f"/threads/{tid}/runs/{rid}/acceptance").status_code == 200
        assert c.get(f"/threads/{tid}/runs/{rid}/replays").json()
    with server.http(KEY_B) as b:  # another tenant: as missing as ever
        assert b.get(f"/threads/{tid}/retention").status_code == 404
    [event] = events(server, tid)
    assert event["event"] == "thread.deleted" and event["by"] == identity(server, OPERATOR)
    assert event["runs"] == [rid] and event["at_ms"] > 0


def test_purge_needs_the_auditor_role_and_is_recorded(server, deleted):
    tid, rid = deleted
    for key in (READER, OPERATOR, APPROVER):
        with server.http(key) as c:
            r = c.post(f"/threads/{tid}/purge")
            assert r.status_code == 403 and "'auditor'" in r.json()["detail"], (key, r.text)
    with server.http(KEY_B) as b:
        assert b.post(f"/threads/{tid}/purge").status_code == 404
    assert all(records(server, tid, rid).values())
    with server.http(AUDITOR) as c:
        r = c.post(f"/threads/{tid}/purge")
        assert r.status_code == 200 and r.json()["runs"] == [rid], r.text
        assert c.get(f"/threads/{tid}/retention").status_code == 404
        assert c.post(f"/threads/{tid}/purge").status_code == 404
    assert not any(records(server, tid, rid).values()), records(server, tid, rid)
    purged = [e for e in events(server, tid) if e["event"] == "thread.purged"]
    assert len(purged) == 1 and purged[0]["by"] == identity(server, AUDITOR) and purged[0]["runs"] == [rid]
    with server.http(OPERATOR) as c:  # purged: the id is free again
        assert c.post("/threads", json={"thread_id": tid}).json()["values"] == {}


def test_legal_hold_blocks_purge_and_expiry(server):
    from elesium.api import retention

    tid, rid = thread_with_run(server)
    with server.http(OPERATOR) as c:
        assert c.put(f"/threads/{tid}/legal-hold", json={"reason": "x"}).status_code == 403
        assert c.delete(f"/threads/{tid}").status_code == 204
    with server.http(AUDITOR) as c:
        held = c.put(f"/threads/{tid}/legal-hold", json={"reason": "case 7"})
        assert held.status_code == 200 and held.json()["legal_hold"]["reason"] == "case 7", held.text
        r = c.post(f"/threads/{tid}/purge")
        assert r.status_code == 409 and "legal hold" in r.json()["detail"] and "case 7" in r.json()["detail"]
    later = server.services.store.thread_any(tid).purge_after_ms + DAY_MS
    assert tid not in [t for _, t in retention.purge_expired(server.services, now=later)]
    kept = records(server, tid, rid)
    assert all(v for k, v in kept.items() if k != "replays"), kept  # (no replay was made)
    with server.http(AUDITOR) as c:
        assert c.delete(f"/threads/{tid}/legal-hold").json()["legal_hold"] is None
    # not yet expired: kept; past the retention: purged by the sweep, and recorded
    assert tid not in [t for _, t in retention.purge_expired(server.services)]
    assert ("tenant-a", tid) in retention.purge_expired(server.services, now=later)
    assert not any(records(server, tid, rid).values())
    kinds = [(e["event"], e["by"]) for e in events(server, tid)]
    auditor = identity(server, AUDITOR)
    assert kinds == [("thread.deleted", identity(server, OPERATOR)), ("legal_hold.set", auditor),
                     ("legal_hold.released", auditor), ("thread.purged", "system/retention")]
    assert events(server, tid)[-1]["reason"] == "retention expired"


def test_retention_zero_deletes_immediately(server):
    tid, rid = thread_with_run(server)
    settings = server.services.settings
    settings.audit_retention_days = 0
    try:
        with server.http(OPERATOR) as c:
            assert c.delete(f"/threads/{tid}").status_code == 204
            assert c.get(f"/threads/{tid}").status_code == 404
    finally:
        settings.audit_retention_days = 30
    assert not any(records(server, tid, rid).values()), records(server, tid, rid)
    [event] = events(server, tid)
    assert event["event"] == "thread.purged" and event["by"] == identity(server, OPERATOR)


# ---------------------------------------------------------------- roles
def test_reader_reads_and_nothing_else(server):
    tid, rid = thread_with_run(server)
    with server.http(READER) as c:
        assert c.get(f"/threads/{tid}").status_code == 200
        assert c.get(f"/threads/{tid}/runs/{rid}").status_code == 200
        assert c.post("/threads/search", json={}).status_code == 200
        for method, path, body in [
            ("POST", f"/threads/{tid}/runs", {"assistant_id": "summary", "input": {"topic": "x"}}),
            ("POST", "/runs/wait", {"assistant_id": "summary", "input": {"topic": "x"}}),
            ("POST", "/threads", {}),
            ("DELETE", f"/threads/{tid}", None),
            ("PATCH", f"/threads/{tid}", {"metadata": {"x": 1}}),
        ]:
            r = c.request(method, path, json=body)
            assert r.status_code == 403 and "'operator'" in r.json()["detail"], (method, path, r.text)
        # ownership first: another tenant's (or a missing) thread is 404, never 403
        with server.http(KEY_B) as b:
            b_tid = b.post("/threads", json={}).json()["thread_id"]
        for path in (f"/threads/{b_tid}", f"/threads/{uuid.uuid4()}"):
            assert c.delete(path).status_code == 404
            assert c.post(f"{path}/runs", json={"assistant_id": "summary", "input": {"topic": "x"}}
                          ).status_code == 404
        assert c.post(f"/threads/{tid}/runs/{uuid.uuid4()}/cancel").status_code == 404


def test_operator_cannot_approve_and_the_approver_is_recorded_in_the_state(server):
    with server.http(OPERATOR) as op:
        tid = op.post("/threads", json={}).json()["thread_id"]
        first = op.post(f"/threads/{tid}/runs/wait", json={"assistant_id": "ticket-triage", "input": TICKET})
        assert first.status_code == 200 and first.json()["__interrupt__"], first.text
        resume = {"assistant_id": "ticket-triage",
                  "command": {"resume": {"approved": True, "reviewer": "mallory"}}}
        r = op.post(f"/threads/{tid}/runs/wait", json=resume)
        assert r.status_code == 403 and "'approver'" in r.json()["detail"], r.text
    with server.http(KEY_B) as b:  # another tenant's resume of this thread: 404, not 403
        assert b.post(f"/threads/{tid}/runs/wait", json=resume).status_code == 404
    with server.http(APPROVER) as ap:
        started = ap.post(f"/threads/{tid}/runs", json={"assistant_id": "ticket-triage", "input": TICKET})
        assert started.status_code == 403 and "'operator'" in started.json()["detail"]
        final = ap.post(f"/threads/{tid}/runs/wait", json=resume)
        assert final.status_code == 200, final.text
        run_id = final.headers["content-location"].rsplit("/", 1)[1]
        run = ap.get(f"/threads/{tid}/runs/{run_id}").json()
        state = ap.get(f"/threads/{tid}/state").json()["values"]
    who = identity(server, APPROVER)
    assert final.json()["outcome"] == "sent"
    assert state["approval"]["reviewer"] == who  # the server's identity, not the client's "mallory"
    assert run["approver"] == who and run["kwargs"]["command"]["resume"]["reviewer"] == who


def test_admin_and_keys_without_roles_have_full_access(server):
    for key in (ADMIN, KEY_A):
        tid, rid = thread_with_run(server, key)
        with server.http(key) as c:
            assert c.put(f"/threads/{tid}/legal-hold", json={}).status_code == 200
            assert c.delete(f"/threads/{tid}/legal-hold").status_code == 200
            assert c.post(f"/threads/{tid}/purge").status_code == 200


def test_every_route_declares_its_role_and_is_guarded(server):
    """The role walk: every route of the OpenAPI document has a declared requirement and goes through
    the one ``authorize`` dependency; a reader is refused (403) on every route that needs more."""
    from elesium.api.auth import PUBLIC, ROUTE_ROLES, route_role
    from elesium.api.routers.common import authorize

    with server.http(KEY_A) as c:
        doc = c.get("/openapi.json").json()
    routes = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops
              if m.upper() in {"GET", "POST", "PUT", "PATCH", "DELETE"}}
    undeclared = sorted(r for r in routes if route_role(*r) is None)
    assert not undeclared, f"routes without a role in elesium.api.auth.ROUTE_ROLES: {undeclared}"
    assert set(ROUTE_ROLES) <= routes, f"declared routes gone: {sorted(set(ROUTE_ROLES) - routes)}"
    unguarded = sorted(
        (m, r.path) for r in server.app.routes if hasattr(r, "dependant")
        for m in r.methods if all(d.call is not authorize for d in r.dependant.dependencies)
    )
    assert not unguarded, f"routes not behind the authorize dependency: {unguarded}"
    tid, rid = thread_with_run(server)
    r = server.redis()
    before = r.dbsize()
    with server.http(READER) as reader:
        for method, path in sorted(routes):
            need = route_role(method, path)
            if need in (PUBLIC, "reader"):
                continue
            url = path.replace("{thread_id}", tid).replace("{run_id}", rid).replace("{assistant_id}", "x")
            resp = reader.request(method, url, json={})
            assert resp.status_code == 403, (method, path, resp.status_code, resp.text)
            assert all(f"'{role}'" in resp.json()["detail"] for role in need.split("|")), resp.text
    assert r.dbsize() <= before  # refused requests write nothing


def test_key_roles_parse_backward_compatibly(monkeypatch):
    from elesium.api.auth import ALL_ROLES, Principal
    from elesium.api.settings import ApiSettings, parse_api_key_roles, parse_api_keys

    text = "k1=acme, k2=acme:reader, k3 = acme : operator+approver\n# comment\nk4=other:admin"
    assert parse_api_keys(text) == {"k1": "acme", "k2": "acme", "k3": "acme", "k4": "other"}
    assert parse_api_key_roles(text) == {"k2": {"reader"}, "k3": {"operator", "approver"}, "k4": {"admin"}}
    for bad in ("k1=acme:", "k1=acme:root", "k1=acme:reader+", "k1=a,k1=b:reader"):
        with pytest.raises(ValueError):
            parse_api_keys(bad)
    monkeypatch.setenv("ELESIUM_API_KEYS", "k1=acme:auditor")
    monkeypatch.setenv("ELESIUM_AUDIT_RETENTION_DAYS", "0")
    s = ApiSettings.from_env()
    assert s.api_keys == {"k1": "acme"} and s.api_key_roles == {"k1": {"auditor"}}
    assert s.audit_retention_days == 0
    monkeypatch.setenv("ELESIUM_AUDIT_RETENTION_DAYS", "-1")
    with pytest.raises(ValueError, match="ELESIUM_AUDIT_RETENTION_DAYS"):
        ApiSettings.from_env()
    legacy, approver = Principal("t", "k"), Principal("t", "k", roles=frozenset({"approver"}))
    assert legacy.roles == ALL_ROLES and all(legacy.allows(r) for r in ALL_ROLES)
    assert approver.allows("reader") and approver.allows("approver") and not approver.allows("operator")
