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
    # The probes' answers for this ticket (HTTP 502 at log-in for 40 agents) are the ones a lead gives.
    assert state["category"] in ("outage", "access") and state["category_scores"][state["category"]] > 0.3
    assert abs(sum(state["category_scores"].values()) - 1.0) < 1e-3
    assert state["priority"] in ("P1", "P2")  # the rules' floor: HTTP 502, none of 40 agents can log in
    assert state["team"] == ticket_triage.TEAMS[state["category"]]
    assert state["escalated"] == (state["priority"] == "P1")
    assert ("escalation" in state) == state["escalated"]
    assert state["references"]["http_status"] == ["502"] and state["references"]["orders"] == ["88412"]
    ticket = f"{TICKET['subject']}\n{TICKET['body']}"
    for key in ("product", "problem"):  # copied from the ticket under the span grammar, or None
        assert state[key] is None or (state[key] and state[key] in ticket)
    assert state["problem"] is not None
    assert state["draft"].startswith("Hello Acme Corp,") and all(state["checks"].values())
    assert '"Login page returns HTTP 502"' in state["draft"] and "88412" in state["draft"]
    (interrupt,) = started.interrupt
    assert interrupt["value"]["draft"] == state["draft"] and interrupt["value"]["checks"] == state["checks"]
    assert interrupt["value"]["priority"] == state["priority"]
    assert state["opening"] in ticket_triage.OPENINGS[state["category"]]
    assert state["opening"] in state["draft"]
    assert state["llm_calls"] == {"choose_opening": 1}


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
    assert [(e.node_id, e.call_index) for e in calls] == [("choose_opening", 0)]
    for e in calls:
        assert e.call_seed == derive_seed(5, e.node_id, 0) and e.tokens
        steps = [s for s in runner.log.read(started.run_id) if s.kind == "step" and s.node_id == e.node_id]
        # The call entry's tokens are exactly what the prefill and the steps committed (stop-trimmed).
        committed = [e.record.tokens[0], *[t for s in steps for t in s.record.tokens]]
        assert list(e.tokens) == committed[: len(e.tokens)]
        assert all(s.call_index == 0 and s.call_seed == e.call_seed for s in steps)
    assert started.acceptance["calls"] == 1 and started.acceptance["nodes"]["choose_opening"]["calls"] == 1


def test_triage_resume_finishes_and_cannot_repeat(triage: dict[str, Any]) -> None:
    runner, finished = triage["runner"], triage["finished"]
    assert finished.status == "succeeded" and finished.interrupt is None
    assert finished.state["outcome"] == "sent" and finished.state["final_reply"] == "We are on it. -- Support"
    assert finished.state["approval"]["approved"] is True
    assert finished.acceptance["calls"] == 1  # resuming re-ran no LLM call
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
            "exceeds the limit for meals (75 USD)",
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
        assert state["rules"] == ["alcohol", "limit"] and "alcohol is not reimbursable" in state["rationale"]
        assert all(expense_approval.cites(state["rationale"], r) for r in state["rules"])
    else:
        assert state["rules"] == [] and not any(expense_approval.cites(state["rationale"], r)
                                                for r in expense_approval.RULES)
    # The purpose is copied from the description (span grammar) and quoted in the explanation.
    assert state["purpose"] is None or state["purpose"] in claim["description"]
    assert f'"{state["purpose"] or claim["description"]}"' in state["rationale"]
    assert state["llm_calls"] == {"purpose": 1} and "\n" not in state["rationale"]
    assert result.acceptance["nodes"]["purpose"]["calls"] == 1


def test_expense_policy_rules() -> None:
    usd, limit, violations = expense_approval.check_policy(
        {"amount": 10, "currency": "XYZ", "category": "yachts", "description": "boat"}
    )
    assert usd is None and limit is None
    assert [r for r, _ in violations] == ["currency", "category", "description"]
    usd, _, violations = expense_approval.check_policy(
        {"amount": 6000, "currency": "GBP", "category": "equipment", "description": "a new server rack"}
    )
    assert usd == 7620.0 and violations == [
        ("cap", "7620.00 USD is above the cap for this flow (5000 USD); finance must approve it")
    ]
    _, _, violations = expense_approval.check_policy(
        {"amount": 75.0, "currency": "USD", "category": " Meals ", "description": "Working dinner, no wine"}
    )
    assert [r for r, _ in violations] == ["alcohol"]  # exactly at the limit is within it
    _, _, violations = expense_approval.check_policy(
        {"amount": 75.01, "currency": "USD", "category": "meals", "description": "Dinner with the team"}
    )
    assert [r for r, _ in violations] == ["limit"]


def test_incident_summary(engine, redis_url: str, key_prefix: str) -> None:
    logs = (
        "2026-11-30T09:10:01Z INFO request ok\n"
        "2026-11-30T09:10:02Z ERROR db connection pool exhausted (5/5)\n"
        "2026-11-30T09:10:03Z ERROR db connection pool exhausted (5/5)\n"
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
        "status_5xx": 0,
        "top_error": "db connection pool exhausted (5/5)",
        "top_error_count": 2,
        "emitter": "",
    }
    assert state["top_error"] == "db connection pool exhausted (5/5)"
    assert state["affected_service"] == "checkout-api"  # no service tag in the lines: the input's
    assert state["summary"] == ('checkout-api: 2 error and 1 fatal lines, 0 HTTP 5xx; most frequent error '
                                '(2x): "db connection pool exhausted (5/5)".')
    assert state["model_severity"] in incident_summary.SEVERITIES
    assert state["severity"] in ("SEV1", "SEV2")  # a FATAL line: never below SEV2
    assert state["action"] in incident_summary.RUNBOOK
    items = state["action_items"]
    assert items[0] == "Page the checkout-api on-call and open an incident channel"
    assert items[1] == "Investigate the most frequent error: db connection pool exhausted (5/5)"
    assert len(items) == 3 and items[2].lower() == state["action"]
    assert result.acceptance["calls"] == 1


@pytest.mark.parametrize(
    "line,level,service,message",
    [
        ("2026-11-02T10:14:03Z ERROR [payments-api] upstream payments-db timed out after 3000ms",
         "ERROR", "payments-api", "upstream payments-db timed out after 3000ms"),
        ('ts=2026-11-02T10:14:03Z level=error service=checkout msg="pool exhausted waiting for db-primary"',
         "ERROR", "checkout", "pool exhausted waiting for db-primary"),
        ('{"ts":"2026-11-02T10:14:03Z","level":"error","service":"auth","msg":"token expired for user 123"}',
         "ERROR", "auth", "token expired for user 123"),
        ("Nov  2 10:14:03 web-3 nginx[1234]: upstream timed out (110: Connection timed out)",
         "INFO", "nginx", "upstream timed out (110: Connection timed out)"),
        ("2026-11-02 10:14:03,123 CRITICAL worker: out of memory", "FATAL", "worker", "out of memory"),
        ("WARN retrying in 5s", "WARN", None, "retrying in 5s"),
    ],
)
def test_incident_log_lines_in_the_formats_sres_paste(line: str, level: str, service: str | None,
                                                       message: str) -> None:
    assert incident_summary.parse_line(line) == (level, service, message)


def test_incident_top_error_is_the_most_frequent_kind_quoted_as_it_appears() -> None:
    logs = "\n".join([
        "10:00:01 ERROR [api] timeout after 3012ms calling db-primary (req 7f3a9c21)",
        "10:00:02 ERROR [api] timeout after 2950ms calling db-primary (req 0b1c2d3e)",
        "10:00:03 ERROR [db-proxy] connection reset by peer",
        "10:00:04 ERROR [api] timeout after 3100ms calling db-primary (req 99aa88bb)",
        "java.lang.IllegalStateException: boom",
        "    at com.example.Foo.bar(Foo.java:12)",
    ])
    signals = incident_summary.log_signals(logs)
    assert signals["top_error"] == "timeout after 3012ms calling db-primary (req 7f3a9c21)"
    assert signals["top_error_count"] == 3 and signals["emitter"] == "api" and signals["error"] == 4
    # The old rule stripped numbers from the quoted error ("db connection pool exhausted (/)").
    assert incident_summary.log_signals("ERROR db connection pool exhausted (5/5)")["top_error"] == (
        "db connection pool exhausted (5/5)")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Order ORD-48213 was charged $499 twice; 404 seats",
         {"orders": ["ORD-48213"], "error_codes": [], "http_status": [], "emails": []}),
        ("The API returns 503 Service Unavailable, then HTTP 502; error E-4012 in the log",
         {"orders": [], "error_codes": ["E-4012"], "http_status": ["502", "503"], "emails": []}),
        ("order #A-991 and invoice INV-2231 - write to ops@acme.example.com; we see 500 errors",
         {"orders": ["A-991"], "error_codes": [], "http_status": ["500"],
          "emails": ["ops@acme.example.com"]}),
        ("We have 450 users and paid 5000 EUR",
         {"orders": [], "error_codes": [], "http_status": [], "emails": []}),
    ],
)
def test_triage_references_rules(text: str, expected: dict[str, list[str]]) -> None:
    assert ticket_triage.references(text) == expected


def test_triage_reply_states_only_what_the_ticket_says() -> None:
    state: dict[str, Any] = {
        "subject": "Refund for double charge", "body": "I was charged twice for order 1234.",
        "customer": None, "category": "billing", "priority": "P3", "product": None,
        "problem": "charged twice for order 1234", "references": ticket_triage.references("order 1234"),
    }
    reply = ticket_triage.compose_reply(state)
    assert reply.startswith("Hello,\n") and reply.endswith(ticket_triage.SIGN_OFF)
    assert '"Refund for double charge"' in reply and '"charged twice for order 1234"' in reply
    assert "1234" in reply and ticket_triage.NEXT_STEPS["billing"] in reply
    assert all(ticket_triage.reply_checks(state, reply).values())
    # An invented quote, or a reply without the sign-off, fails its check.
    checks = ticket_triage.reply_checks(state, reply.replace("charged twice", "Axelon broke"))
    assert not checks["quotes_only_the_ticket"]
    assert not ticket_triage.reply_checks(state, reply[: -len(ticket_triage.SIGN_OFF)])["signed"]


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
