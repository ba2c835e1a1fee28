"""Issue 43's last two audit gaps, on real Redis: (a) deleting one run follows the audit retention
(kept and hidden, purged with its thread or when its retention ends, a legal hold keeps it, 0 erases
it and its chain at once); (b) runs made without the API server (``WorkflowRunner``: ``elesium run``
without ``--server``) are hash-chained and sealed, verify clean by run id (``verify_run`` and
``elesium audit verify``), also after an interrupt and a resume of the same run id, and an edited
acceptance entry is named.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from api_server import KEY_A, KEY_B, LiveServer, live_server, server_settings
from api_workflows import build_registry

pytest_plugins = ["state_fixtures", "api_server"]

READER, OPERATOR, AUDITOR = (f"key-{r}-run-del-0123456789" for r in ("reader", "operator", "auditor"))
DAY_MS = 86_400_000
AUDIT_KEY = "test-audit-key-runs-0123456789"


@pytest.fixture(scope="module")
def signed() -> Iterator[None]:
    """Seals signed with an HMAC key (read from the environment at each run and by the CLI)."""
    before = os.environ.get("ELESIUM_AUDIT_KEY")
    os.environ["ELESIUM_AUDIT_KEY"] = AUDIT_KEY
    yield
    if before is None:
        os.environ.pop("ELESIUM_AUDIT_KEY", None)
    else:
        os.environ["ELESIUM_AUDIT_KEY"] = before


# ---------------------------------------------------------------- (a) deleting a run
@pytest.fixture(scope="module")
def server(engine: Any, state_server: Any, signed: None) -> Iterator[LiveServer]:
    from elesium.api.settings import parse_api_key_roles, parse_api_keys

    text = (f"{READER}=tenant-a:reader, {OPERATOR}=tenant-a:operator, {AUDITOR}=tenant-a:auditor, "
            f"{KEY_A}=tenant-a, {KEY_B}=tenant-b")
    settings = server_settings(state_server.url, queue_name="run-deletion", audit_sweep_interval_s=0,
                               audit_retention_days=30)
    settings.api_keys, settings.api_key_roles = parse_api_keys(text), parse_api_key_roles(text)
    with live_server(settings, engine, build_registry()) as srv:
        yield srv


def thread_with_run(server: LiveServer) -> tuple[str, str]:
    with server.http(OPERATOR) as c:
        tid = c.post("/threads", json={}).json()["thread_id"]
        r = c.post(f"/threads/{tid}/runs/wait", json={"assistant_id": "summary", "input": {"topic": "salt"}})
        assert r.status_code == 200, r.text
        return tid, r.headers["content-location"].rsplit("/", 1)[1]


def records(server: LiveServer, tid: str, rid: str) -> dict[str, bool]:
    """Which of the run's audit records are in Redis (read directly)."""
    from elesium.state.audit_chain import AuditChain

    svc, r = server.services, server.redis()
    store, chain = svc.store, AuditChain(r)
    return {
        "run_row": bool(r.exists(store._t(tid, "run", rid))),  # noqa: SLF001
        "calls": bool(r.exists(store._t(tid, "calls", rid))),  # noqa: SLF001
        "acceptance": bool(r.exists(svc.acceptance.key(rid))),
        "chain": bool(chain.entries(tid, rid)),
        "seal": chain.get_seal(rid) is not None,
    }


def events(server: LiveServer, tid: str) -> list[dict[str, Any]]:
    with server.http(AUDITOR) as c:
        r = c.get("/elesium/audit/events", params={"limit": 1000})
        assert r.status_code == 200, r.text
        return [e for e in r.json()["events"] if e["thread_id"] == tid]


def test_deleted_run_is_hidden_kept_verifiable_and_purged_with_its_thread(server):
    tid, rid = thread_with_run(server)
    assert all(records(server, tid, rid).values()), records(server, tid, rid)
    with server.http(OPERATOR) as c:
        assert c.delete(f"/threads/{tid}/runs/{rid}").status_code == 204
        assert c.delete(f"/threads/{tid}/runs/{rid}").status_code == 404  # deleted once
    for key in (READER, OPERATOR, KEY_A):
        with server.http(key) as c:
            for path in (f"/threads/{tid}/runs/{rid}", f"/threads/{tid}/runs/{rid}/join"):
                r = c.get(path)
                assert r.status_code == 404 and "not found" in r.json()["detail"], (key, path, r.text)
            assert rid not in [x["run_id"] for x in c.get(f"/threads/{tid}/runs").json()]
            assert c.get(f"/threads/{tid}").status_code == 200  # the thread itself is untouched
    assert all(records(server, tid, rid).values()), records(server, tid, rid)
    with server.http(AUDITOR) as c:  # the auditor still reads and verifies it
        v = c.get(f"/threads/{tid}/runs/{rid}/audit")
        assert v.status_code == 200 and v.json()["ok"] and v.json()["signature_ok"], v.text
        assert c.get(f"/threads/{tid}/runs/{rid}/acceptance").status_code == 200
    with server.http(KEY_B) as b:
        assert b.get(f"/threads/{tid}/runs/{rid}/audit").status_code == 404
    row = server.services.store.get_run_any(rid)
    assert row.deleted and row.status == "success" and row.purge_after_ms > row.deleted_ms
    [event] = events(server, tid)
    assert event["event"] == "run.deleted" and event["run_id"] == rid and event["purge_after_ms"]
    # a purge of the thread erases the deleted run's records with it
    with server.http(AUDITOR) as c:
        r = c.post(f"/threads/{tid}/purge")
        assert r.status_code == 200 and r.json()["runs"] == [rid], r.text
    assert not any(records(server, tid, rid).values()), records(server, tid, rid)
    assert rid not in server.services.store.retained_runs_due(row.purge_after_ms + DAY_MS)


def test_an_expired_deleted_run_is_purged_unless_its_thread_is_held(server):
    from elesium.api import retention

    tid, rid = thread_with_run(server)
    with server.http(OPERATOR) as c:
        assert c.delete(f"/threads/{tid}/runs/{rid}").status_code == 204
    later = server.services.store.get_run_any(rid).purge_after_ms + DAY_MS
    def purged(now: int | None = None) -> list[str]:
        return [r for _, _, r in retention.purge_expired_runs(server.services, now=now)]

    assert rid not in purged()  # not expired yet
    with server.http(AUDITOR) as c:
        assert c.put(f"/threads/{tid}/legal-hold", json={"reason": "case 9"}).status_code == 200
    assert rid not in purged(later)
    assert all(records(server, tid, rid).values()), records(server, tid, rid)
    with server.http(AUDITOR) as c:
        assert c.delete(f"/threads/{tid}/legal-hold").status_code == 200
    retention.purge_expired(server.services, now=later)  # the sweep purges expired runs too
    assert not any(records(server, tid, rid).values()), records(server, tid, rid)
    assert server.services.store.get_run_any(rid) is None
    with server.http(OPERATOR) as c:
        assert c.get(f"/threads/{tid}").status_code == 200  # the live thread keeps its checkpoints
        assert c.get(f"/threads/{tid}/state").json()["values"]
    kinds = [(e["event"], e.get("run_id")) for e in events(server, tid)]
    assert kinds == [("run.deleted", rid), ("legal_hold.set", None), ("legal_hold.released", None),
                     ("run.purged", rid)]
    assert events(server, tid)[-1]["by"] == "system/retention"


def test_retention_zero_erases_the_run_and_its_chain_unless_held(server):
    tid, rid = thread_with_run(server)
    settings = server.services.settings
    settings.audit_retention_days = 0
    try:
        with server.http(AUDITOR) as c:
            assert c.put(f"/threads/{tid}/legal-hold", json={"reason": "case 10"}).status_code == 200
        with server.http(OPERATOR) as c:
            r = c.delete(f"/threads/{tid}/runs/{rid}")
            assert r.status_code == 409 and "legal hold" in r.json()["detail"], r.text
        assert all(records(server, tid, rid).values())
        with server.http(AUDITOR) as c:
            assert c.delete(f"/threads/{tid}/legal-hold").status_code == 200
        with server.http(OPERATOR) as c:
            assert c.delete(f"/threads/{tid}/runs/{rid}").status_code == 204
            assert c.get(f"/threads/{tid}/runs/{rid}").status_code == 404
        with server.http(AUDITOR) as c:
            assert c.get(f"/threads/{tid}/runs/{rid}/audit").status_code == 404
    finally:
        settings.audit_retention_days = 30
    assert not any(records(server, tid, rid).values()), records(server, tid, rid)
    assert server.services.store.get_run_any(rid) is None
    purged = [e for e in events(server, tid) if e["event"] == "run.purged"]
    assert len(purged) == 1 and purged[0]["run_id"] == rid and "retention 0" in purged[0]["reason"]


# ---------------------------------------------------------------- (b) runs without the server
TICKET = {
    "subject": "Login page returns HTTP 502",
    "body": "Since 09:10 UTC none of our 40 agents can log in; the login page returns HTTP 502. Order 88412.",
    "customer": "Acme Corp",
}


@pytest.fixture(scope="module")
def triage(engine: Any, redis_url: str, signed: None) -> dict[str, Any]:
    """A ticket-triage run stopped at its approval interrupt, verified, then resumed (same run id)."""
    from elesium.graphs.runner import WorkflowRunner
    from elesium.state.audit_chain import AuditChain

    prefix = f"test:chain-runs:{uuid.uuid4().hex[:8]}"
    runner = WorkflowRunner(engine, redis_url, prefix=prefix)
    chain = AuditChain(runner.runs.client, prefix=f"{prefix}:audit")
    started = runner.start("ticket-triage", TICKET, seed=5)
    assert started.status == "interrupted"
    at_interrupt = runner.audit_verify(started.run_id)
    seal = chain.get_seal(started.run_id)
    finished = runner.resume(started.run_id, {"approved": True, "reply": "We are on it. -- Support"})
    assert finished.status == "succeeded"
    return {"runner": runner, "prefix": prefix, "chain": chain, "rid": started.run_id,
            "tid": started.thread_id, "at_interrupt": at_interrupt, "first_seal": seal,
            "url": redis_url}


def cli_verify(triage: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    from elesium.cli import main

    capsys.readouterr()
    rc = main(["audit", "verify", triage["rid"], "--json", "--redis-url", triage["url"],
               "--prefix", triage["prefix"]])
    return rc, json.loads(capsys.readouterr().out)


def test_a_runner_run_is_chained_and_sealed_at_its_interrupt(triage):
    v, seal = triage["at_interrupt"], triage["first_seal"]
    assert v.ok and v.sealed and v.signed and v.signature_ok, v
    assert seal.status == "interrupted" and seal.count == v.entries_checked
    assert seal.thread_id == triage["tid"]


def test_a_resumed_runner_run_is_resealed_and_verifies(triage, capsys):
    from elesium.graphs.audit_chain import verify_run

    runner, chain, rid, tid = triage["runner"], triage["chain"], triage["rid"], triage["tid"]
    v = verify_run(runner.runs.client, rid, registry=runner.runs, cp_prefix=runner.saver.prefix,
                   acceptance=runner.log, chain=chain)
    assert v.ok and v.signature_ok and v.first_bad is None, v
    entries = chain.entries(tid, rid)
    seal = chain.get_seal(rid)
    assert seal.status == "succeeded" and seal.count == len(entries) > triage["first_seal"].count
    assert seal.head == entries[-1].hash and chain.runs(tid) == [rid]  # one chain, appended after the seal
    assert {"run", "checkpoint", "writes", "acceptance"} <= {e.kind for e in entries}
    assert [e.ref for e in entries].count("run") == 1
    rc, out = cli_verify(triage, capsys)
    assert rc == 0 and out["ok"] and out["run_id"] == rid and out["entries_checked"] == len(entries), out
    # without the runner's prefix the run is unknown (exit 1, one line)
    from elesium.cli import main

    assert main(["audit", "verify", rid, "--redis-url", triage["url"]]) == 1


def test_an_edited_acceptance_entry_of_a_runner_run_is_named(triage, capsys):
    runner, rid = triage["runner"], triage["rid"]
    r, key = runner.runs.client, runner.log.key(rid)
    rows = r.xrange(key)
    target = None
    for eid, fields in rows:
        if target is None and fields.get(b"kind") == b"call":
            tokens = json.loads(fields[b"tokens"])
            tokens[-1] += 1
            fields[b"tokens"] = json.dumps(tokens, separators=(",", ":")).encode()
            target = eid.decode()
    assert target is not None
    r.delete(key)
    for eid, fields in rows:
        r.xadd(key, fields, id=eid)
    v = runner.audit_verify(rid)
    assert not v.ok and v.first_bad.kind == "acceptance" and v.first_bad.ref == f"acc:{target}", v
    assert "differs" in v.first_bad.reason
    rc, out = cli_verify(triage, capsys)
    assert rc == 3 and out["first_bad"]["ref"] == f"acc:{target}", out


def test_a_background_run_is_chained_and_verifies(engine, state_server, signed):
    from elesium.graphs.background import WorkflowExecutor, submit
    from elesium.graphs.runner import WorkflowRunner
    from elesium.state.queue import RunQueue
    from elesium.state.queue_worker import QueueWorker

    prefix = f"test:chain-bg:{uuid.uuid4().hex[:8]}"
    runner = WorkflowRunner(engine, state_server.url, prefix=prefix)
    queue = RunQueue.from_url(state_server.url, prefix=f"{prefix}:q")
    claim = {"employee": "Ada", "amount": 42.5, "currency": "EUR", "category": "meals",
             "description": "team lunch with the new hires"}
    run_id = submit(runner, queue, "expense-approval", claim, seed=7).run_id
    worker = QueueWorker(queue, WorkflowExecutor(runner, prefix=prefix), block_ms=100).start()
    try:
        state = queue.wait(run_id, timeout_s=300)
    finally:
        worker.stop(5)
    assert state.status == "succeeded", state.error
    v = runner.audit_verify(run_id)
    assert v.ok and v.sealed and v.signature_ok and v.entries_checked > 1, v
