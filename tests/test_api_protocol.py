"""The LangGraph protocol against a live server, through the real langgraph-sdk (sync and async).

Covers assistants (search, get, schemas, graph), threads (create, get, search, delete), runs
(background + join, wait, SSE stream with values/updates/messages, list, get, cancel), thread
state and history, interrupt + resume (the approver recorded), update_state and fork.
"""

from __future__ import annotations

import time

import pytest
from langgraph_sdk import get_client, get_sync_client
from langgraph_sdk.errors import NotFoundError

from api_server import KEY_A

pytest_plugins = ["state_fixtures", "api_server"]


@pytest.fixture(scope="module")
def client(api_server):
    return get_sync_client(url=api_server.url, api_key=KEY_A)


def test_assistants_one_per_workflow_version(client):
    found = client.assistants.search(limit=100)
    names = sorted(a["graph_id"] for a in found)
    assert names == [
        "approval",
        "approval-versioned",
        "expense-approval",
        "hurried",
        "incident-summary",
        "loop",
        "relay",
        "story",
        "summary",
        "ticket-triage",
    ]
    approval = next(a for a in found if a["graph_id"] == "approval")
    assert len(approval["metadata"]["workflow_version"]) == 16
    assert client.assistants.get(approval["assistant_id"])["graph_id"] == "approval"
    schemas = client.assistants.get_schemas(approval["assistant_id"])
    assert schemas["input_schema"]["properties"]["topic"]["type"] == "string"
    graph = client.assistants.get_graph(approval["assistant_id"])
    assert {n["id"] for n in graph["nodes"]} >= {"draft", "approve", "finish"}
    with pytest.raises(NotFoundError):
        client.assistants.get("no-such-assistant")


def test_interrupt_resume_stream_state_history_and_fork(client, api_server):
    thread = client.threads.create(metadata={"case": "interrupt"})
    tid = thread["thread_id"]
    events = list(
        client.runs.stream(
            tid, "approval", input={"topic": "tea"}, stream_mode=["values", "updates", "messages-tuple"]
        )
    )
    kinds = [e.event for e in events]
    assert kinds[0] == "metadata"
    assert "messages" in kinds and "updates" in kinds and "values" in kinds
    tokens = "".join(e.data[0]["content"] for e in events if e.event == "messages")
    interrupted = [e for e in events if e.event == "updates" and "__interrupt__" in e.data]
    assert interrupted, kinds
    draft = interrupted[0].data["__interrupt__"][0]["value"]["draft"]
    assert draft and draft.strip() == tokens.strip()

    state = client.threads.get_state(tid)
    assert state["next"] == ["approve"] and state["interrupts"]
    assert client.threads.get(tid)["status"] == "interrupted"

    result = client.runs.wait(tid, "approval", command={"resume": {"approved": True, "note": "fine"}})
    assert result["final"] == f"APPROVED: {draft}" and result["approver_note"] == "fine"
    runs = client.runs.list(tid)
    assert [r["status"] for r in runs] == ["success", "interrupted"]
    assert runs[0]["approver"].startswith("tenant-a/key-") and runs[1]["approver"] is None
    assert client.runs.get(tid, runs[0]["run_id"])["status"] == "success"

    history = client.threads.get_history(tid, limit=20)
    assert history[0]["values"]["final"].startswith("APPROVED")
    at_approval = next(h for h in history if h["next"] == ["approve"])

    # Edit the draft at the approval point, then fork from that edit and reject it.
    edited = client.threads.update_state(
        tid,
        {"draft": "edited draft"},
        as_node="draft",
        checkpoint_id=at_approval["checkpoint"]["checkpoint_id"],
    )
    fork_id = edited["checkpoint"]["checkpoint_id"]
    forked = client.runs.wait(tid, "approval", checkpoint_id=fork_id)
    assert forked["__interrupt__"][0]["value"]["draft"] == "edited draft"
    final = client.runs.wait(tid, "approval", command={"resume": {"approved": False}})
    assert final["final"] == "REJECTED: edited draft"
    assert client.threads.get_state(tid)["values"]["final"] == "REJECTED: edited draft"
    # The original branch is still in the history.
    assert any(
        (h["values"].get("final") or "").startswith("APPROVED")
        for h in client.threads.get_history(tid, limit=50)
    )
    api_server.approval_thread = tid  # reused by the replay tests


def test_background_run_join_and_threads(client):
    thread = client.threads.create(metadata={"case": "background"})
    run = client.runs.create(thread["thread_id"], "summary", input={"topic": "rain"})
    assert run["status"] in ("pending", "running", "success")
    joined = client.runs.join(thread["thread_id"], run["run_id"])
    assert joined["topic"] == "rain" and joined["summary"]
    assert client.runs.get(thread["thread_id"], run["run_id"])["status"] == "success"
    found = client.threads.search(metadata={"case": "background"})
    assert [t["thread_id"] for t in found] == [thread["thread_id"]]
    assert client.threads.get(thread["thread_id"])["values"]["summary"] == joined["summary"]
    client.threads.delete(thread["thread_id"])
    with pytest.raises(NotFoundError):
        client.threads.get(thread["thread_id"])


def test_join_stream_follows_a_background_run(client):
    thread = client.threads.create()
    run = client.runs.create(thread["thread_id"], "summary", input={"topic": "hills"},
                             stream_mode=["values", "messages-tuple"])
    parts = list(client.runs.join_stream(thread["thread_id"], run["run_id"]))
    events = [p.event for p in parts]
    assert events[0] == "metadata" and "messages" in events
    final = [p.data for p in parts if p.event == "values"][-1]
    assert final["summary"] and final == client.runs.join(thread["thread_id"], run["run_id"])


def test_cancel_a_running_run(client, api_server):
    thread = client.threads.create()
    run = client.runs.create(thread["thread_id"], "story", input={"topic": "the sea"})
    deadline = time.monotonic() + 60
    while client.runs.get(thread["thread_id"], run["run_id"])["status"] == "pending":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    client.runs.cancel(thread["thread_id"], run["run_id"], wait=True)
    assert time.monotonic() - t0 < 10
    cancelled = client.runs.get(thread["thread_id"], run["run_id"])
    assert cancelled["status"] == "interrupted" and cancelled["error"] == "cancelled"
    calls = api_server.services.store.calls(run["run_id"])
    assert calls == []  # stopped before its 48-token call finished
    # The engine is free: the next run completes.
    done = client.runs.wait(
        thread["thread_id"], "story", input={"topic": "a pond"}, config={"configurable": {"run_seed": 3}}
    )
    assert done["summary"]


def test_runs_the_queue_will_never_finish_do_not_block_their_thread(client, api_server):
    """A run whose server stopped between recording it and queueing it, and one the queue failed
    (every worker that claimed it died), are settled on the next read of their thread."""
    from elesium.state.threads import RunRow, now_ms

    svc = api_server.services
    tid = client.threads.create()["thread_id"]
    svc.store.create_run(RunRow(run_id="never-queued", thread_id=tid, tenant="tenant-a", assistant_id="x",
                                workflow="summary", workflow_version="v", status="pending",
                                created_ms=now_ms() - 60_000))
    svc.store.update_thread(tid, status="busy")
    assert client.threads.get(tid)["status"] != "busy"
    orphan = client.runs.get(tid, "never-queued")
    assert orphan["status"] == "error" and "never queued" in orphan["error"]

    # A fresh pending run that is not queued yet (its server is between the two writes) is left alone.
    svc.store.create_run(RunRow(run_id="being-queued", thread_id=tid, tenant="tenant-a", assistant_id="x",
                                workflow="summary", workflow_version="v", status="pending"))
    svc.store.update_thread(tid, status="busy")
    assert client.threads.get(tid)["status"] == "busy"
    assert client.runs.get(tid, "being-queued")["status"] == "pending"

    # The queue failed it (max attempts; written here as the claim script leaves it): the row follows.
    svc.queue.client.hset(svc.queue.runs_key, "being-queued", tid)
    svc.queue.client.hset(svc.queue.run_keys(tid, "being-queued").job,
                          mapping={"status": "failed", "error": "run killed 5 workers"})
    assert client.threads.get(tid)["status"] == "error"
    assert client.runs.get(tid, "being-queued")["error"] == "run killed 5 workers"
    assert client.runs.wait(tid, "summary", input={"topic": "dust"})["summary"]


def test_stateless_wait_and_seeded_runs_repeat(client):
    one = client.runs.wait(
        None, "summary", input={"topic": "snow"}, config={"configurable": {"run_seed": 11}}
    )
    two = client.runs.wait(
        None, "summary", input={"topic": "snow"}, config={"configurable": {"run_seed": 11}}
    )
    assert one["summary"] and one["summary"] == two["summary"]


async def test_async_client(api_server):
    client = get_client(url=api_server.url, api_key=KEY_A)
    assistants = await client.assistants.search(graph_id="summary")
    assert len(assistants) == 1
    thread = await client.threads.create()
    parts = [
        p
        async for p in client.runs.stream(
            thread["thread_id"], assistants[0]["assistant_id"], input={"topic": "wind"}, stream_mode="updates"
        )
    ]
    updates = [p.data for p in parts if p.event == "updates"]
    assert updates and "summarize" in updates[-1]
    run = await client.runs.create(thread["thread_id"], "summary", input={"topic": "fog"})
    joined = await client.runs.join(thread["thread_id"], run["run_id"])
    assert joined["topic"] == "fog"
    runs = await client.runs.list(thread["thread_id"])
    assert len(runs) == 2 and all(r["status"] == "success" for r in runs)
    history = await client.threads.get_history(thread["thread_id"])
    assert history and history[0]["values"]["topic"] == "fog"
