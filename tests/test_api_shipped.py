"""The three shipped workflows through the SDK (elesium.api.client), each replayed to ``identical``.

ticket-triage goes through its approval interrupt (resumed with the reviewer's answer); the replay
of the resume run re-executes both runs. Also the SDK's own additions: whoami, acceptance pages,
replays, and its error type.
"""

from __future__ import annotations

import pytest

from api_server import KEY_A, KEY_B

pytest_plugins = ["state_fixtures", "api_server"]

TICKET = {
    "subject": "Login page returns HTTP 502",
    "body": "Nobody on our team can log in since 09:10, the page shows HTTP 502.",
    "customer": "Ana",
}
EXPENSE = {
    "employee": "Dana",
    "amount": 42.5,
    "currency": "EUR",
    "category": "meals",
    "description": "Team lunch with a client after the quarterly review",
}
INCIDENT = {
    "service": "checkout-api",
    "logs": "2026-11-30T09:10:02Z ERROR db connection refused\n"
    "2026-11-30T09:10:05Z FATAL payment worker crashed",
}


@pytest.fixture(scope="module")
def sdk(api_server):
    from elesium.api.client import ElesiumClient

    with ElesiumClient(api_server.url, api_key=KEY_A) as client:
        yield client


def test_ticket_triage_interrupt_resume_and_replay(sdk):
    assert sdk.whoami()["tenant"] == "tenant-a"
    tid = sdk.threads.create()["thread_id"]
    first = sdk.runs.wait(tid, "ticket-triage", input=TICKET, config={"configurable": {"run_seed": 5}})
    assert first["__interrupt__"][0]["value"]["question"] == "Send this reply?"
    final = sdk.runs.wait(tid, "ticket-triage", command={"resume": {"approved": True, "reviewer": "qa"}})
    assert final["outcome"] == "sent" and final["final_reply"] == first["draft"]
    runs = sdk.runs.list(tid)
    entries = list(sdk.acceptance_entries(tid, runs[-1]["run_id"], page=7))
    nodes = {e["node_id"] for e in entries}
    assert nodes == {"choose_opening"}  # the one decoding call; probes and pointers decode nothing
    report = sdk.replay(tid, runs[0]["run_id"])
    assert report["verdict"] == "identical", report["divergence"]
    assert len(report["runs_replayed"]) == 2 and report["calls_compared"] == 1
    assert sdk.replay(tid, runs[0]["run_id"], mode="recorded")["verdict"] == "identical"
    assert [r["mode"] for r in sdk.replays(tid, runs[0]["run_id"])] == ["reexecute", "recorded"]


@pytest.mark.parametrize("name,payload", [("expense-approval", EXPENSE), ("incident-summary", INCIDENT)])
def test_other_shipped_workflows_replay_identical(sdk, name, payload):
    tid = sdk.threads.create()["thread_id"]
    values = sdk.runs.wait(tid, name, input=payload)
    assert "__error__" not in values and values["llm_calls"]
    run = sdk.runs.list(tid)[0]
    assert run["status"] == "success"
    report = sdk.replay(tid, run["run_id"])
    assert report["verdict"] == "identical", report["divergence"]
    assert report["calls_compared"] == sum(values["llm_calls"].values())


async def test_async_sdk_and_errors(api_server):
    from elesium.api.client import AsyncElesiumClient, ElesiumAPIError

    async with AsyncElesiumClient(api_server.url, api_key=KEY_B) as client:
        assert (await client.whoami())["tenant"] == "tenant-b"
        tid = (await client.threads.create())["thread_id"]
        await client.runs.wait(tid, "summary", input={"topic": "frost"})
        run = (await client.runs.list(tid))[0]
        page = await client.acceptance(tid, run["run_id"])
        assert page["summary"]["steps"] >= 1
        report = await client.replay(tid, run["run_id"])
        assert report["verdict"] == "identical" and report["by"].startswith("tenant-b/")
        with pytest.raises(ElesiumAPIError) as err:
            await client.replay(tid, "nope")
        assert err.value.status == 404 and "not found" in err.value.detail
