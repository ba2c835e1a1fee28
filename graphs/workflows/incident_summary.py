"""``incident-summary``: log signals -> one-sentence summary -> severity -> action items.

Counting is code: how many FATAL/ERROR/WARN lines, how many 5xx responses, the most frequent error.
Those counts go into the prompts, so the model summarises evidence instead of raw noise, and they
set a severity floor (fatal errors or many 5xx are never below SEV2) that the model's choice, from
a fixed list under a grammar, cannot undercut. Action items are the model's short list, parsed into
lines, plus the rule-based ones every serious incident gets.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel, ConfigDict, Field

from elesium.graphs.llm import WorkflowState, llm_node
from elesium.graphs.registry import Workflow

SEVERITIES = ("SEV1", "SEV2", "SEV3", "SEV4")
EXCERPT_CHARS = 700
MAX_ITEMS = 4
_LEVEL = re.compile(r"\b(FATAL|CRITICAL|ERROR|WARN(?:ING)?)\b")
_STATUS_5XX = re.compile(r"\b5\d\d\b")
_NOISE = re.compile(r"^\S*\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?\S*\s*|\b\d+(?:\.\d+)?(?:ms|s)?\b")


class IncidentInput(BaseModel):
    """Logs from one service."""

    model_config = ConfigDict(extra="forbid")

    service: str = Field(min_length=1, max_length=100)
    logs: str = Field(min_length=1, max_length=20000)


class IncidentState(WorkflowState, total=False):
    service: str
    logs: str
    signals: dict[str, Any]
    excerpt: str
    summary: str
    model_severity: str
    severity: str
    raw_actions: str
    action_items: list[str]


def log_signals(logs: str) -> dict[str, Any]:
    """Counts by level, 5xx responses and the most frequent error line (timestamps and numbers dropped)."""
    levels: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    status_5xx = 0
    lines = [line for line in logs.splitlines() if line.strip()]
    for line in lines:
        m = _LEVEL.search(line)
        level = m.group(1).replace("WARNING", "WARN").replace("CRITICAL", "FATAL") if m else "INFO"
        levels[level] += 1
        status_5xx += len(_STATUS_5XX.findall(line)) if level != "INFO" or "HTTP" in line.upper() else 0
        if level in ("ERROR", "FATAL"):
            errors[_NOISE.sub("", line[m.end() :] if m else line).strip(" :-")[:80]] += 1
    top = errors.most_common(1)[0][0] if errors else ""
    return {
        "lines": len(lines),
        "fatal": levels["FATAL"],
        "error": levels["ERROR"],
        "warn": levels["WARN"],
        "status_5xx": status_5xx,
        "top_error": top,
    }


def severity_floor(signals: dict[str, Any]) -> str:
    """The least severe level the evidence allows."""
    if signals["fatal"] or signals["status_5xx"] >= 5:
        return "SEV2"
    if signals["error"]:
        return "SEV3"
    return "SEV4"


def gather(state: IncidentState) -> dict[str, Any]:
    """Signals and a bounded excerpt (the last lines: where incidents usually show)."""
    logs = state["logs"]
    excerpt = logs[-EXCERPT_CHARS:]
    if len(logs) > EXCERPT_CHARS and "\n" in excerpt:
        excerpt = excerpt.split("\n", 1)[1]
    return {"signals": log_signals(logs), "excerpt": excerpt}


EVIDENCE = (
    "Logs from {service} ({signals[fatal]} fatal, {signals[error]} errors, {signals[warn]} warnings, "
    "{signals[status_5xx]} HTTP 5xx):\n{excerpt}\n\n"
)
summarise = llm_node(
    "summarise",
    output_key="summary",
    params={"max_tokens": 40, "stop": ["\n"]},
    prompt=EVIDENCE + "Summarise the problem in one sentence.",
)
classify_severity = llm_node(
    "classify_severity",
    output_key="model_severity",
    output=list(SEVERITIES),
    params={"max_tokens": 8},
    prompt="Incident on {service}: {summary}\n"
    "Severity: SEV1 total outage, SEV2 major, SEV3 minor, SEV4 none?",
)
propose_actions = llm_node(
    "propose_actions",
    output_key="raw_actions",
    params={"max_tokens": 40},
    prompt="Incident on {service}: {summary}\nWhat should the engineers do next? Answer in one sentence.",
)


def assess(state: IncidentState) -> dict[str, Any]:
    """The final severity: the model's choice, never below the evidence's floor."""
    floor = severity_floor(state["signals"])
    return {"severity": min(state["model_severity"], floor, key=SEVERITIES.index)}


def parse_items(text: str) -> list[str]:
    """Lines of a list answer without their bullets or numbers; degenerate repetition is dropped."""
    items = []
    for line in text.splitlines():
        item = re.sub(r"^\s*(?:[-*•]|\d+[.)]|step\s*\d+:?)\s*", "", line, flags=re.IGNORECASE).strip()
        words = re.findall(r"[a-zA-Z]{2,}", item)
        if len(words) >= 3 and len(set(words)) >= len(words) / 2:  # a small model can loop ("1. 1. 1.")
            items.append(item)
    return items


def action_items(state: IncidentState) -> dict[str, Any]:
    """Rule-based items first (they are certain), then the model's, deduplicated and capped."""
    signals, service = state["signals"], state["service"]
    items: list[str] = []
    if state["severity"] in ("SEV1", "SEV2"):
        items.append(f"Page the {service} on-call and open an incident channel")
    if signals["top_error"]:
        items.append(f"Investigate the most frequent error: {signals['top_error']}")
    for item in parse_items(state.get("raw_actions", "")):
        if item not in items:
            items.append(item)
    return {"action_items": items[:MAX_ITEMS] or [f"Review the {service} logs; no errors were found"]}


def build() -> StateGraph:
    builder = StateGraph(IncidentState)
    builder.add_node("gather", gather)
    builder.add_node(summarise)
    builder.add_node(classify_severity)
    builder.add_node("assess", assess)
    builder.add_node(propose_actions)
    builder.add_node("action_items", action_items)
    builder.add_edge(START, "gather")
    builder.add_edge("gather", "summarise")
    builder.add_edge("summarise", "classify_severity")
    builder.add_edge("classify_severity", "assess")
    builder.add_edge("assess", "propose_actions")
    builder.add_edge("propose_actions", "action_items")
    builder.add_edge("action_items", END)
    return builder


def workflow() -> Workflow:
    return Workflow.define(
        "incident-summary",
        build,
        IncidentInput,
        description="Summarise a service's logs, rate the severity and list action items.",
    )
