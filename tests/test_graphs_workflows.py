"""The shipped workflows end to end: real model, real Redis checkpointer, run records and audit trail.

``ticket-triage`` runs once through its approval interrupt and ``Command(resume=...)`` (module
fixture, shared by the checks below); determinism (twice in-process, once in a fresh ``elesium``
process) lives in test_graphs_determinism.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel

from elesium.graphs import (
    InputValidationError,
    Registry,
    UnknownWorkflowError,
    Workflow,
    WorkflowRunner,
    derive_seed,
)
from elesium.graphs.llm import WorkflowState
from elesium.graphs.runner import RunStateError
from elesium.graphs.workflows import expense_approval, incident_summary, ticket_triage
from elesium.state import RunRegistry, RunStatus

pytest_plugins = ["state_fixtures"]

TICKET = {
    "subject": "Login page returns HTTP 502",
    "body": "Since 09:10 UTC none of our 40 agents can log in; the login page returns HTTP 502. Order 88412.",
    "customer": "Acme Corp",
}


def keys_under(runner: WorkflowRunner, prefix: str) -> list[bytes]:
    return list(runner.runs.client.scan_iter(match=f"{prefix}*", count=1000))


@pytest.fixture(scope="module")
def triage(engine, redis_url: str) -> dict[str, Any]:
    """One triage run: started, stopped at the approval interrupt, resumed with an edited reply."""
    prefix = "test-graphs-triage"
    runner = WorkflowRunner(engine, redis_url, prefix=prefix)
    started = runner.start("ticket-triage", TICKET, seed=5)
    at_interrupt = runner.runs.get(started.run_id)
    checkpoint = runner.saver.get_tuple({"configurable": {"thread_id": started.thread_id}})
    with pytest.raises(InputValidationError, match="approved"):
        runner.resume(started.run_id, {"reply": "no decision"})
    still = runner.runs.get(started.run_id)
    finished = runner.resume(started.run_id, {"approved": True, "reply": "We are on it. -- Support"})
    return {
        "runner": runner,
        "started": started,
        "record": at_interrupt,
        "checkpoint": checkpoint,
        "after_bad_resume": still,
        "finished": finished,
    }


def test_triage_stops_for_approval_with_a_routed_draft(triage: dict[str, Any]) -> None:
    started = triage["started"]
    state = started.state
    assert started.status == "interrupted" and triage["checkpoint"] is not None
    assert state["category"] in ticket_triage.CATEGORIES
    assert state["priority"] in ("P1", "P2")  # the rules' floor: HTTP 502, nobody can log in
    assert state["team"] == ticket_triage.TEAMS[state["category"]]
    assert state["escalated"] == (state["priority"] == "P1")
    assert ("escalation" in state) == state["escalated"]
    assert state["references"]["http_status"] == ["502"] and state["references"]["orders"] == ["88412"]
    fields = ticket_triage.TicketFields.model_validate(state["fields"])
    assert fields.product and fields.problem
    assert state["draft"].strip() and state["greeting"] == "Acme Corp"
    (interrupt,) = started.interrupt
    assert (
        interrupt["value"]["draft"] == state["draft"] and interrupt["value"]["priority"] == state["priority"]
    )
    assert state["llm_calls"] == {
        "classify_category": 1,
        "classify_priority": 1,
        "extract": 1,
        "draft_reply": 1,
    }


def test_triage_run_record_and_audit_trail(triage: dict[str, Any], engine) -> None:
    runner, started = triage["runner"], triage["started"]
    record = triage["record"]
    assert (
        record.status == RunStatus.INTERRUPTED and triage["after_bad_resume"].status == RunStatus.INTERRUPTED
    )
    assert (
        record.workflow == "ticket-triage"
        and record.workflow_version == runner.registry.get("ticket-triage").version
    )
    assert record.input == TICKET and record.seeds == {"run": 5} and record.tenant == "default"
    assert record.engine["model_sha256"] == engine.weights_info.sha256
    assert record.engine["device"] == "cpu" and record.engine["dtype"] == "float32"
    calls = [e for e in runner.log.read(started.run_id) if e.kind == "call"]
    assert [(e.node_id, e.call_index) for e in calls] == [
        ("classify_category", 0),
        ("classify_priority", 0),
        ("extract", 0),
        ("draft_reply", 0),
    ]
    for e in calls:
        assert e.call_seed == derive_seed(5, e.node_id, 0) and e.tokens
        steps = [s for s in runner.log.read(started.run_id) if s.kind == "step" and s.node_id == e.node_id]
        # The call entry's tokens are exactly what the prefill and the steps committed (stop-trimmed).
        committed = [e.record.tokens[0], *[t for s in steps for t in s.record.tokens]]
        assert list(e.tokens) == committed[: len(e.tokens)]
        assert all(s.call_index == 0 and s.call_seed == e.call_seed for s in steps)
    assert started.acceptance["calls"] == 4 and started.acceptance["nodes"]["extract"]["calls"] == 1


def test_triage_resume_finishes_and_cannot_repeat(triage: dict[str, Any]) -> None:
    runner, finished = triage["runner"], triage["finished"]
    assert finished.status == "succeeded" and finished.interrupt is None
    assert finished.state["outcome"] == "sent" and finished.state["final_reply"] == "We are on it. -- Support"
    assert finished.state["approval"]["approved"] is True
    assert finished.acceptance["calls"] == 4  # resuming re-ran no LLM call
    assert runner.runs.get(finished.run_id).status == RunStatus.SUCCEEDED
    with pytest.raises(RunStateError, match="succeeded"):
        runner.resume(finished.run_id, {"approved": True})


def test_triage_finalise_holds_a_rejected_reply() -> None:
    assert ticket_triage.finalise({"draft": "d", "approval": {"approved": False, "reply": None}}) == {
        "outcome": "held",
        "final_reply": None,
    }


@pytest.mark.parametrize(
    "claim,decision,reason",
    [
        (
            {
                "employee": "Dana",
                "amount": 42.5,
                "currency": "EUR",
                "category": "meals",
                "description": "Team lunch with a client after the quarterly review",
            },
            "approve",
            "within the meals limit",
        ),
        (
            {
                "employee": "Sam",
                "amount": 950,
                "currency": "USD",
                "category": "meals",
                "description": "Dinner and wine for the team",
            },
            "reject",
            "exceeds the meals limit of 75 USD",
        ),
    ],
)
def test_expense_approval(
    engine, redis_url: str, key_prefix: str, claim: dict[str, Any], decision: str, reason: str
) -> None:
    runner = WorkflowRunner(engine, redis_url, prefix=key_prefix)
    result = runner.start("expense-approval", claim, seed=3)
    state = result.state
    assert result.status == "succeeded" and state["decision"] == decision
    assert any(reason in r for r in state["reasons"])
    if decision == "reject":
        assert "alcohol is not reimbursable" in state["reasons"]
    node = "explain_approval" if decision == "approve" else "explain_rejection"
    assert state["llm_calls"] == {node: 1} and len(state["rationale"].split()) >= 3
    assert "\n" not in state["rationale"]
    assert result.acceptance["nodes"][node]["calls"] == 1


def test_expense_policy_rules() -> None:
    usd, limit, violations = expense_approval.check_policy(
        {"amount": 10, "currency": "XYZ", "category": "yachts", "description": "boat"}
    )
    assert usd is None and limit is None and len(violations) == 3
    usd, _, violations = expense_approval.check_policy(
        {"amount": 6000, "currency": "GBP", "category": "equipment", "description": "a new server rack"}
    )
    assert usd == 7620.0 and violations == [
        "7620.00 USD is above the 5000 USD cap for this flow; finance must approve it"
    ]


def test_incident_summary(engine, redis_url: str, key_prefix: str) -> None:
    logs = (
        "2026-11-30T09:10:01Z INFO request ok\n"
        "2026-11-30T09:10:02Z ERROR db connection refused (pool exhausted)\n"
        "2026-11-30T09:10:03Z ERROR db connection refused (pool exhausted)\n"
        "2026-11-30T09:10:04Z WARN retrying payment, upstream returned 503\n"
        "2026-11-30T09:10:05Z FATAL payment worker crashed"
    )
    runner = WorkflowRunner(engine, redis_url, prefix=key_prefix)
    result = runner.start("incident-summary", {"service": "checkout-api", "logs": logs}, seed=1)
    state = result.state
    assert result.status == "succeeded"
    assert state["signals"] == {
        "lines": 5,
        "fatal": 1,
        "error": 2,
        "warn": 1,
        "status_5xx": 1,
        "top_error": "db connection refused (pool exhausted)",
    }
    assert state["summary"].strip() and "\n" not in state["summary"]
    assert state["model_severity"] in incident_summary.SEVERITIES
    assert state["severity"] in ("SEV1", "SEV2")  # a FATAL line: never below SEV2
    items = state["action_items"]
    assert items[0] == "Page the checkout-api on-call and open an incident channel"
    assert items[1] == "Investigate the most frequent error: db connection refused (pool exhausted)"
    assert 2 <= len(items) <= incident_summary.MAX_ITEMS
    assert result.acceptance["calls"] == 3


def test_incident_parse_items_drops_degenerate_lists() -> None:
    assert incident_summary.parse_items(
        "1. Restart the payment worker\n2) 1. 1. 1. 1.\n- check the db pool size"
    ) == ["Restart the payment worker", "check the db pool size"]


# ---------------------------------------------------------------- bad input: nothing written
@pytest.mark.parametrize(
    "workflow,payload,message",
    [
        ("ticket-triage", {"subject": "x"}, "field 'body': Field required"),
        ("ticket-triage", {"subject": "x", "body": 3}, "field 'body': Input should be a valid string"),
        ("ticket-triage", {"subject": "x", "body": "y", "priority": "P1"}, "field 'priority': Extra inputs"),
        (
            "expense-approval",
            {"employee": "a", "amount": "12", "currency": "USD", "category": "meals", "description": "a b c"},
            "field 'amount': Input should be a valid number",
        ),
        ("incident-summary", ["service", "logs"], "must be a JSON object"),
    ],
)
def test_bad_input_writes_nothing(
    engine, redis_url: str, key_prefix: str, workflow: str, payload: Any, message: str
) -> None:
    runner = WorkflowRunner(engine, redis_url, prefix=key_prefix)
    with pytest.raises(InputValidationError) as err:
        runner.start(workflow, payload, run_id="bad-run")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert keys_under(runner, key_prefix) == []
    assert runner.runs.get("bad-run") is None and runner.log.length("bad-run") == 0


def test_unknown_workflow_writes_nothing(engine, redis_url: str, key_prefix: str) -> None:
    runner = WorkflowRunner(engine, redis_url, prefix=key_prefix)
    with pytest.raises(UnknownWorkflowError, match="unknown workflow 'nope'"):
        runner.start("nope", {}, run_id="bad-run")
    assert keys_under(runner, key_prefix) == []


def test_a_failing_node_marks_the_run_failed(engine, redis_url: str, key_prefix: str) -> None:
    class In(BaseModel):
        x: int

    class S(WorkflowState, total=False):
        x: int

    def boom(state: S) -> dict[str, Any]:
        raise RuntimeError(f"no good: {state['x']}")

    def build() -> StateGraph:
        b = StateGraph(S)
        b.add_node("boom", boom)
        b.add_edge(START, "boom")
        b.add_edge("boom", END)
        return b

    registry = Registry()
    registry.register(Workflow.define("boom", build, In, description=""))
    runner = WorkflowRunner(engine, redis_url, registry=registry, prefix=key_prefix)
    result = runner.start("boom", {"x": 4}, seed=1)
    assert result.status == "failed" and result.error == "no good: 4"
    record = RunRegistry.from_url(redis_url, prefix=f"{key_prefix}:runs").get(result.run_id)
    assert record.status == RunStatus.FAILED and record.error == "RuntimeError: no good: 4"
