"""``ticket-triage``: classify -> extract -> route -> draft a reply -> human approval -> finalise.

The model picks the category and the priority from fixed lists (grammar-constrained) and names the
product and the problem (a small JSON object under its schema). Everything a support lead would hold
to a rule is code: references (order numbers, error codes, HTTP statuses) come from regular
expressions, outages and "nobody can log in" are never below P2, the team follows the category, and
P1 tickets go through the escalation node before a reply is drafted. No reply leaves without a
person approving it (a LangGraph ``interrupt``; resume with ``{"approved": true}``, optionally with an
edited ``reply``).
"""

from __future__ import annotations

import re
from typing import Any

from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt
from pydantic import BaseModel, ConfigDict, Field

from elesium.graphs.llm import WorkflowState, llm_node
from elesium.graphs.registry import Workflow

CATEGORIES = ("billing", "outage", "access", "bug", "other")
PRIORITIES = ("P1", "P2", "P3", "P4")
TEAMS = {
    "billing": "billing",
    "outage": "on-call SRE",
    "access": "identity",
    "bug": "engineering",
    "other": "customer support",
}
URGENT_WORDS = (
    "down",
    "outage",
    "502",
    "503",
    "500",
    "cannot log in",
    "can't log in",
    "nobody can",
    "all users",
    "urgent",
    "data loss",
)


class TicketInput(BaseModel):
    """A support ticket."""

    model_config = ConfigDict(extra="forbid")

    subject: str = Field(min_length=1, max_length=200)
    body: str = Field(min_length=1, max_length=4000)
    customer: str | None = Field(default=None, max_length=100)


class TicketFields(BaseModel):
    """What the model extracts: bounded lengths, so a known token budget always holds the whole object."""

    product: str = Field(max_length=24)
    problem: str = Field(max_length=60)


EXTRACT_BUDGET = 3 * (24 + 60) + 32


class Approval(BaseModel):
    """A reviewer's answer to the approval interrupt."""

    model_config = ConfigDict(extra="forbid")

    approved: bool
    reply: str | None = Field(default=None, max_length=2000)
    reviewer: str | None = Field(default=None, max_length=100)


class TriageState(WorkflowState, total=False):
    subject: str
    body: str
    customer: str | None
    category: str
    model_priority: str
    priority: str
    fields: dict[str, Any]
    references: dict[str, list[str]]
    team: str
    escalated: bool
    escalation: str | None
    greeting: str
    draft: str
    approval: dict[str, Any]
    outcome: str
    final_reply: str | None


TICKET = "Support ticket\nSubject: {subject}\n{body}\n\n"

classify_category = llm_node(
    "classify_category",
    output_key="category",
    output=list(CATEGORIES),
    params={"max_tokens": 8},
    prompt=TICKET + "Category: billing, outage, access, bug or other?",
)
classify_priority = llm_node(
    "classify_priority",
    output_key="model_priority",
    output=list(PRIORITIES),
    params={"max_tokens": 8},
    prompt=TICKET + "Priority: P1 service down, P2 broken feature, P3 question, P4 feedback?",
)
extract = llm_node(
    "extract",
    output_key="fields",
    output=TicketFields,
    # The grammar bounds the object (24 + 60 characters plus the JSON around them); this budget covers it
    # even when every character costs 3 byte-level tokens (CJK), so an answer is never cut off unparsable.
    # Greedy answers stop far sooner, when the grammar closes the object.
    params={"max_tokens": EXTRACT_BUDGET},
    prompt=TICKET + "Name the product and the problem.",
)
draft_reply = llm_node(
    "draft_reply",
    output_key="draft",
    params={"max_tokens": 40, "temperature": 0.6, "top_p": 0.9},
    prompt='Write a short polite reply to {greeting} about the ticket "{subject}". '
    "Say that our {team} team is working on it.",
)


def references(text: str) -> dict[str, list[str]]:
    """Identifiers a reply or an engineer needs, found by pattern (never guessed by the model)."""
    found = {
        "orders": re.findall(r"(?i)\border\s*(?:#|no\.?|number)?\s*([A-Z0-9-]{3,20}\d)", text),
        "error_codes": re.findall(r"\b[A-Z]{1,4}-\d{1,5}\b", text),
        "http_status": re.findall(r"\b(?:HTTP\s*)?([45]\d\d)\b", text),
        "emails": re.findall(r"[\w.+-]+@[\w-]+\.[\w.-]+", text),
    }
    return {k: sorted(set(v)) for k, v in found.items()}


def priority_floor(category: str, text: str) -> str:
    """The lowest priority the rules allow: outages and mass log-in failures are P2 or above."""
    lowered = text.lower()
    if category == "outage" or any(w in lowered for w in URGENT_WORDS):
        return "P2"
    return "P4"


def route(state: TriageState) -> dict[str, Any]:
    """Apply the rules: references, the priority floor, the team, escalation."""
    text = f"{state['subject']}\n{state['body']}"
    floor = priority_floor(state["category"], text)
    priority = min(state["model_priority"], floor, key=PRIORITIES.index)
    return {
        "references": references(text),
        "priority": priority,
        "team": TEAMS[state["category"]],
        "escalated": priority == "P1",
    }


def next_after_route(state: TriageState) -> str:
    """Conditional edge: P1 tickets are escalated before anyone writes back."""
    return "escalate" if state["escalated"] else "greeting"


def escalate(state: TriageState) -> dict[str, Any]:
    """Page the on-call team for P1 tickets (the page itself is the integrator's hook)."""
    return {"escalation": f"paged {state['team']} on-call for a P1 {state['category']} ticket"}


def prepare_greeting(state: TriageState) -> dict[str, Any]:
    """The name the reply addresses: the customer when given, else a neutral greeting."""
    return {"greeting": state.get("customer") or "the customer"}


def approval(state: TriageState) -> dict[str, Any]:
    """Stop for a human: the draft only goes out once someone approves (or edits) it."""
    answer = interrupt(
        {
            "question": "Send this reply?",
            "draft": state["draft"],
            "category": state["category"],
            "priority": state["priority"],
            "team": state["team"],
        }
    )
    return {"approval": Approval.model_validate(answer).model_dump(mode="json")}


def finalise(state: TriageState) -> dict[str, Any]:
    decision = state["approval"]
    if not decision["approved"]:
        return {"outcome": "held", "final_reply": None}
    return {"outcome": "sent", "final_reply": decision.get("reply") or state["draft"]}


def build() -> StateGraph:
    builder = StateGraph(TriageState)
    for node in (classify_category, classify_priority, extract, draft_reply):
        builder.add_node(node)
    builder.add_node("route", route)
    builder.add_node("escalate", escalate)
    builder.add_node("greeting", prepare_greeting)
    builder.add_node("approval", approval)
    builder.add_node("finalise", finalise)
    builder.add_edge(START, "classify_category")
    builder.add_edge("classify_category", "classify_priority")
    builder.add_edge("classify_priority", "extract")
    builder.add_edge("extract", "route")
    builder.add_conditional_edges("route", next_after_route, ["escalate", "greeting"])
    builder.add_edge("escalate", "greeting")
    builder.add_edge("greeting", "draft_reply")
    builder.add_edge("draft_reply", "approval")
    builder.add_edge("approval", "finalise")
    builder.add_edge("finalise", END)
    return builder


def workflow() -> Workflow:
    return Workflow.define(
        "ticket-triage",
        build,
        TicketInput,
        resume_model=Approval,
        description="Classify a support ticket, extract its fields, route it, draft a reply "
        "and hold it for human approval.",
    )
