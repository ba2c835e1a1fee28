"""Elesium's routes on a live server: acceptance log and audit replay.

Replay must say ``identical`` for untouched runs (in both modes, across an interrupt, a resume,
a state edit and a fork) and must name the first divergence after each injected change: a
recorded token, a recorded checkpoint value, a workflow version that is no longer deployed, and
(recorded mode) an LLM call missing from the record.
"""

from __future__ import annotations

import json

import pytest
from langgraph_sdk import get_sync_client
from langgraph_sdk.errors import NotFoundError

from api_server import KEY_A, KEY_B

pytest_plugins = ["state_fixtures", "api_server"]


@pytest.fixture(scope="module")
def client(api_server):
    return get_sync_client(url=api_server.url, api_key=KEY_A)


@pytest.fixture(scope="module")
def http(api_server):
    with api_server.http(KEY_A) as h:
        yield h


@pytest.fixture(scope="module")
def approval_thread(client):
    """An approval run interrupted, resumed, then edited and forked: four runs and a state update."""
    tid = client.threads.create()["thread_id"]
    # Speculative decoding where heads are loaded (the replay must reproduce the tree's tokens too);
    # the later runs name no mode and inherit the thread's.
    client.runs.wait(
        tid,
        "approval",
        input={"topic": "bread"},
        config={"configurable": {"run_seed": 5, "mode": "speculative"}},
    )
    client.runs.wait(tid, "approval", command={"resume": {"approved": True}})
    history = client.threads.get_history(tid, limit=20)
    at_approval = next(h for h in history if h["next"] == ["approve"])
    edit = client.threads.update_state(
        tid, {"draft": "hand edit"}, as_node="draft", checkpoint_id=at_approval["checkpoint"]["checkpoint_id"]
    )
    client.runs.wait(tid, "approval", checkpoint_id=edit["checkpoint"]["checkpoint_id"])
    client.runs.wait(tid, "approval", command={"resume": {"approved": False}})
    runs = list(reversed(client.runs.list(tid, limit=10)))  # oldest first
    assert [r["status"] for r in runs] == ["interrupted", "success", "interrupted", "success"]
    assert len({r["kwargs"]["mode"] for r in runs}) == 1 and runs[0]["kwargs"]["mode"] in (
        "speculative",
        "medusa",
    )
    return tid, runs


def replay(http, tid, rid, mode="reexecute"):
    r = http.post(f"/threads/{tid}/runs/{rid}/replay", json={"mode": mode})
    assert r.status_code == 200, r.text
    return r.json()


def test_acceptance_log_paged_with_summary(http, approval_thread):
    tid, runs = approval_thread
    first = runs[0]["run_id"]
    body = http.get(f"/threads/{tid}/runs/{first}/acceptance", params={"limit": 2}).json()
    assert len(body["entries"]) == 2 and body["next_cursor"]
    assert body["entries"][0]["node_id"] == "draft"
    rest = http.get(
        f"/threads/{tid}/runs/{first}/acceptance", params={"limit": 1000, "cursor": body["next_cursor"]}
    ).json()
    ids = [e["entry_id"] for e in body["entries"] + rest["entries"]]
    assert len(ids) == len(set(ids)) and rest["next_cursor"] is None
    summary = body["summary"]
    assert summary["steps"] >= 1 and summary["tau"] >= 1.0
    assert set(body["per_node"]) == {"draft"} and body["per_node"]["draft"]["steps"] == summary["steps"]
    assert body["calls"][0]["node"] == "draft" and body["calls"][0]["tokens"] >= 1
    bad = http.get(f"/threads/{tid}/runs/{first}/acceptance", params={"cursor": "nope"})
    assert bad.status_code == 422


def test_replay_identical_in_both_modes_then_listed(http, approval_thread, api_server):
    tid, runs = approval_thread
    written = sum(len(api_server.services.store.get_run_any(r["run_id"]).checkpoints) for r in runs)
    last = runs[-1]["run_id"]
    report = replay(http, tid, last)
    assert report["verdict"] == "identical", report["divergence"]
    assert report["runs_replayed"] == [r["run_id"] for r in runs]
    assert report["calls_compared"] == 1 and report["tokens_compared"] >= 2  # the fork resumes after draft
    assert written >= 6 and report["checkpoints_compared"] == written and report["fingerprint_match"]
    recorded = replay(http, tid, last, mode="recorded")
    assert recorded["verdict"] == "identical", recorded["divergence"]
    listed = http.get(f"/threads/{tid}/runs/{last}/replays").json()
    assert [r["mode"] for r in listed][-2:] == ["reexecute", "recorded"]
    assert listed[-1]["by"].startswith("tenant-a/") and listed[-1]["verdict"] == "identical"
    # Another tenant cannot see it.
    with pytest.raises(NotFoundError):
        get_sync_client(url=str(http.base_url), api_key=KEY_B).runs.get(tid, last)


def _fresh_summary_run(client):
    tid = client.threads.create()["thread_id"]
    client.runs.wait(tid, "summary", input={"topic": "clouds"}, config={"configurable": {"run_seed": 9}})
    return tid, client.runs.list(tid)[0]["run_id"]


def test_replay_names_a_tampered_token(client, http, api_server):
    tid, rid = _fresh_summary_run(client)
    assert replay(http, tid, rid)["verdict"] == "identical"
    r = api_server.redis()
    key = api_server.services.store._r(rid, "calls")  # noqa: SLF001 - the test tampers with the record
    call = json.loads(r.lindex(key, 0))
    original = call["token_ids"][2]
    call["token_ids"][2] = original + 1
    r.lset(key, 0, json.dumps(call))
    report = replay(http, tid, rid)
    assert report["verdict"] == "diverged"
    # The edit breaks the run's audit chain, which is the first finding; the replay's own is kept beside it.
    assert report["divergence"]["field"].startswith("audit.")
    d = report["replay_divergence"]
    assert (d["node"], d["call"], d["step"], d["field"]) == ("summarize", 0, 2, "token_ids")
    assert (d["recorded"], d["replayed"]) == (original + 1, original)


def test_replay_names_a_tampered_checkpoint_value(client, http, api_server):
    from elesium.state import _keys as K

    tid, rid = _fresh_summary_run(client)
    saver = api_server.services.saver
    last = saver.get_tuple({"configurable": {"thread_id": tid, "checkpoint_ns": ""}})
    version = last.checkpoint["channel_versions"]["summary"]
    keys = K.ThreadKeys.of(saver.prefix, tid)
    api_server.redis().hset(
        keys.blobs(K.encode_ns("")),
        K.blob_field("summary", str(version)),
        K.pack_typed(saver.serde.dumps_typed("forged summary")),
    )
    report = replay(http, tid, rid)
    assert report["verdict"] == "diverged"
    # The edit breaks the run's audit chain, which is the first finding; the replay's own is kept beside it.
    assert report["divergence"]["field"].startswith("audit.")
    d = report["replay_divergence"]
    assert d["field"] == "checkpoint.summary" and d["recorded"] == "forged summary"
    assert d["replayed"] and d["replayed"] != "forged summary" and d["node"] == "summarize"


def test_replay_reports_a_changed_workflow_version(client, http, api_server):
    from api_workflows import approval

    tid = client.threads.create()["thread_id"]
    client.runs.wait(tid, "approval-versioned", input={"topic": "ink"})
    rid = client.runs.list(tid)[0]["run_id"]
    old = api_server.registry.get("approval-versioned")
    new = api_server.registry.register(approval("Name one colour of {topic}.", name="approval-versioned"))
    assert new.version != old.version
    api_server.registry.drop("approval-versioned", old.version)  # the old code is no longer deployed
    report = replay(http, tid, rid)
    assert report["verdict"] == "diverged"
    d = report["divergence"]
    assert (d["field"], d["recorded"], d["replayed"]) == ("workflow_version", old.version, new.version)
    assert any("not the one replayed" in n for n in report["notes"])


def test_recorded_mode_fails_when_the_path_differs(client, http, api_server):
    tid, rid = _fresh_summary_run(client)
    api_server.redis().delete(api_server.services.store._r(rid, "calls"))  # noqa: SLF001
    report = replay(http, tid, rid, mode="recorded")
    assert report["verdict"] == "diverged"
    # The edit breaks the run's audit chain, which is the first finding; the replay's own is kept beside it.
    assert report["divergence"]["field"].startswith("audit.")
    d = report["replay_divergence"]
    assert (d["node"], d["call"], d["field"]) == ("summarize", 0, "path")


def test_replay_unknown_run_and_bad_mode(http, approval_thread):
    tid, runs = approval_thread
    assert http.post(f"/threads/{tid}/runs/nope/replay", json={"mode": "reexecute"}).status_code == 404
    bad = http.post(f"/threads/{tid}/runs/{runs[0]['run_id']}/replay", json={"mode": "guess"})
    assert bad.status_code == 422 and "mode" in bad.json()["detail"]
