"""``incident-summary``: log signals -> summary -> severity -> action items.

Reading logs is code, because counting is what rules do right and a 135M model does not: each line's
level, emitting service and message are parsed from the formats SREs paste (JSON lines, logfmt,
bracketed tags, syslog); errors that differ only in numbers and ids are one kind; the top error is
the most frequent kind, quoted as it appears, and the affected service is the one that emits the
most errors. The summary states those counts. The severity is a linear probe on the engine's hidden
states of the evidence (fitted on the dev split of ``evals/incident_summary.jsonl``), never below a
floor the evidence sets (fatal lines or many 5xx are at least SEV2). The model picks the first
runbook step from a fixed list, under a grammar.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel, ConfigDict, Field

from elesium.graphs.classifier import classifier_node
from elesium.graphs.llm import WorkflowState, llm_node
from elesium.graphs.registry import Workflow
from elesium.graphs.workflows.log_reading import (  # noqa: F401 (re-exported: callers read them from here)
    LogLine,
    error_kind,
    log_signals,
    parse_line,
)

SEVERITIES = ("SEV1", "SEV2", "SEV3", "SEV4")
PROBES = Path(__file__).resolve().parent / "probes"
EXCERPT_CHARS = 700
MAX_ITEMS = 4


class IncidentInput(BaseModel):
    """Logs from one service."""

    model_config = ConfigDict(extra="forbid")

    service: str = Field(min_length=1, max_length=100)
    logs: str = Field(min_length=1, max_length=20000)


class IncidentState(WorkflowState, total=False):
    service: str
    logs: str
    signals: dict[str, Any]
    top_error: str
    affected_service: str
    excerpt: str
    summary: str
    model_severity: str
    severity_scores: dict[str, float]
    severity: str
    action: str
    action_items: list[str]


def severity_floor(signals: dict[str, Any]) -> str:
    """The least severe level the evidence allows."""
    if signals["fatal"] or signals["status_5xx"] >= 5:
        return "SEV2"
    if signals["error"]:
        return "SEV3"
    return "SEV4"


def excerpt_of(logs: str) -> str:
    """The last ``EXCERPT_CHARS`` of the logs, from a line start: where incidents usually show."""
    excerpt = logs[-EXCERPT_CHARS:]
    if len(logs) > EXCERPT_CHARS and "\n" in excerpt:
        excerpt = excerpt.split("\n", 1)[1]
    return excerpt


def gather(state: IncidentState) -> dict[str, Any]:
    """Signals, the top error, the affected service and a bounded excerpt."""
    signals = log_signals(state["logs"])
    affected = signals["emitter"] or state["service"]
    return {"signals": signals, "excerpt": excerpt_of(state["logs"]), "top_error": signals["top_error"],
            "affected_service": affected}


def summarise(state: IncidentState) -> dict[str, Any]:
    """One sentence of evidence: counts are code, so the summary cannot misstate them."""
    sig, affected = state["signals"], state["affected_service"]
    counts = f"{sig['error']} error and {sig['fatal']} fatal lines, {sig['status_5xx']} HTTP 5xx"
    if not sig["top_error"]:
        return {"summary": f"{affected}: no errors in {sig['lines']} log lines ({sig['warn']} warnings)."}
    return {"summary": f"{affected}: {counts}; most frequent error ({sig['top_error_count']}x): "
            f"\"{sig['top_error']}\"."}


def evidence(state: Mapping[str, Any]) -> str:
    """What the severity probe reads: the counts and the excerpt (from the input alone, so the
    probe is fitted on evaluation rows exactly as it runs)."""
    sig = log_signals(state["logs"])
    return (f"Logs from {state['service']} ({sig['fatal']} fatal, {sig['error']} errors, {sig['warn']} "
            f"warnings, {sig['status_5xx']} HTTP 5xx):\n{excerpt_of(state['logs'])}")


SEVERITY_LEXICON = {
    "crash": r"fatal|panic|crash|oomkilled|out of memory|segfault|crashloop|back-off|killed",
    "unavailable": r"unavailable|refused|unreachable|no healthy|all requests|every request|\b5\d\d\b",
    "errors": r"error|exception|failed|failure",
    "recovered": r"recovered|succeeded after|retry succeeded|resolved|back to normal|reconnected",
    "warnings": r"warn|slow|degraded|latency",
}
"""Counts of what SREs read severity from; they join the hidden states as probe features."""

classify_severity = classifier_node(
    "classify_severity",
    prompt=evidence,
    output_key="model_severity",
    label_key="severity",
    labels=SEVERITIES,
    lexicon=SEVERITY_LEXICON,
    scores_key="severity_scores",
    probe=PROBES / "incident_summary_severity.json",
)

RUNBOOK = (
    "roll back the most recent deploy",
    "restart the failing pods and watch for crash loops",
    "scale up the database connection pool",
    "check the health of the upstream dependency",
    "renew the expired certificate",
    "free disk space on the affected hosts",
    "raise the memory limit and look for a leak",
    "fail over to the standby database",
    "rate-limit the noisy client",
    "keep monitoring; no action needed",
)
choose_action = llm_node(
    "choose_action",
    output_key="action",
    output=list(RUNBOOK),
    params={"max_tokens": 16},
    prompt="Incident on {affected_service}. Most frequent error: {top_error}\n"
    "Pick the first thing the on-call engineer should do.",
)


def assess(state: IncidentState) -> dict[str, Any]:
    """The final severity: the probe's choice, never below the evidence's floor."""
    floor = severity_floor(state["signals"])
    return {"severity": min(state["model_severity"], floor, key=SEVERITIES.index)}


def action_items(state: IncidentState) -> dict[str, Any]:
    """Rule-based items first (they are certain), then the model's runbook step."""
    signals, affected = state["signals"], state["affected_service"]
    items: list[str] = []
    if state["severity"] in ("SEV1", "SEV2"):
        items.append(f"Page the {affected} on-call and open an incident channel")
    if signals["top_error"]:
        items.append(f"Investigate the most frequent error: {signals['top_error']}")
    if state.get("action"):
        items.append(state["action"][0].upper() + state["action"][1:])
    return {"action_items": items[:MAX_ITEMS] or [f"Review the {affected} logs; no errors were found"]}


def next_after_assess(state: IncidentState) -> str:
    """Only incidents with errors get a runbook step from the model."""
    return "choose_action" if state["signals"]["top_error"] else "action_items"


def build() -> StateGraph:
    builder = StateGraph(IncidentState)
    builder.add_node("gather", gather)
    builder.add_node("summarise", summarise)
    builder.add_node(classify_severity)
    builder.add_node("assess", assess)
    builder.add_node(choose_action)
    builder.add_node("action_items", action_items)
    builder.add_edge(START, "gather")
    builder.add_edge("gather", "summarise")
    builder.add_edge("summarise", "classify_severity")
    builder.add_edge("classify_severity", "assess")
    builder.add_conditional_edges("assess", next_after_assess, ["choose_action", "action_items"])
    builder.add_edge("choose_action", "action_items")
    builder.add_edge("action_items", END)
    return builder


def workflow() -> Workflow:
    return Workflow.define(
        "incident-summary",
        build,
        IncidentInput,
        description="Find a service's top error and the failing service in its logs, rate the "
        "severity and list action items.",
    )
