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

import json
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel, ConfigDict, Field

from elesium.graphs.classifier import classifier_node
from elesium.graphs.llm import WorkflowState, llm_node
from elesium.graphs.registry import Workflow

SEVERITIES = ("SEV1", "SEV2", "SEV3", "SEV4")
PROBES = Path(__file__).resolve().parent / "probes"
EXCERPT_CHARS = 700
MAX_ITEMS = 4
_LEVEL = re.compile(r"(?i)(?<![\w-])(FATAL|CRITICAL|CRIT|PANIC|EMERG|ERROR|ERR|E|WARN(?:ING)?|W)(?![\w-])")
_LEVEL_WORDS = {"fatal": "FATAL", "critical": "FATAL", "crit": "FATAL", "panic": "FATAL", "emerg": "FATAL",
                "error": "ERROR", "err": "ERROR", "e": "ERROR", "warn": "WARN", "warning": "WARN",
                "w": "WARN"}
_TIMESTAMP = re.compile(
    r"^\s*(?:\[?\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?\]?"
    r"|[A-Z][a-z]{2}\s+\d{1,2}\s+\d{2}:\d{2}:\d{2}|\d{2}:\d{2}:\d{2}(?:[.,]\d+)?)\s*"
)
_LOGFMT = re.compile(r'(\w[\w.]*)=("(?:[^"\\]|\\.)*"|\S*)')
_SYSLOG_APP = re.compile(r"^(?:\S+\s+)?([A-Za-z][\w.-]*)(?:\[\d+\])?:\s")
_TAG = re.compile(r"^(?:\[([A-Za-z][\w.-]*)\]|([a-z][\w.-]*(?:-[\w.]+)+|[a-z][\w.]*):)\s+")
_HTTP_5XX = re.compile(r'"\s(5\d\d)\s|\b(?:HTTP|status|code)[=: /]*\s*(5\d\d)\b|\b(5\d\d)\s+(?:Bad Gateway|'
                       r"Service Unavailable|Gateway Time-?out|Internal Server Error)", re.IGNORECASE)
_VARYING = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b|\b0x[0-9a-f]+\b"
                      r"|\b(?=[a-z]*\d)[0-9a-z]{6,}\b|\d+", re.IGNORECASE)
_SERVICE_KEYS = ("service", "svc", "app", "component", "logger", "source", "container")
_MESSAGE_KEYS = ("msg", "message", "error", "err", "event")
_LEVEL_KEYS = ("level", "lvl", "severity", "loglevel")


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


class LogLine(NamedTuple):
    level: str  # FATAL, ERROR, WARN or INFO
    service: str | None
    message: str


def parse_line(line: str) -> LogLine:
    """Level, emitting service and message of one log line, in the formats SREs paste: JSON lines,
    logfmt, ``<time> LEVEL [service] message``, ``LEVEL service: message`` and syslog."""
    text = line.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            return _from_fields({str(k).lower(): v for k, v in obj.items()}, text)
    pairs = dict((k.lower(), v.strip('"')) for k, v in _LOGFMT.findall(text))
    if len(pairs) >= 2 and any(k in pairs for k in _LEVEL_KEYS) and any(k in pairs for k in _MESSAGE_KEYS):
        return _from_fields(pairs, text)
    rest = _TIMESTAMP.sub("", text, count=1)
    service = None
    app = _SYSLOG_APP.match(rest) if not _LEVEL.match(rest) else None
    if app is not None:  # syslog: "host app[pid]: message"
        service, rest = app.group(1), rest[app.end():]
    m = _LEVEL.match(rest) or _LEVEL.search(rest[:40])
    level = _LEVEL_WORDS[m.group(1).lower()] if m else "INFO"
    if m and (len(m.group(1)) > 1 or m.start() == 0):
        rest = rest[m.end():].lstrip(" :|-")
    else:
        level = "INFO" if m and len(m.group(1)) == 1 else level
    tag = _TAG.match(rest)
    if tag is not None:
        service, rest = tag.group(1) or tag.group(2), rest[tag.end():]
    return LogLine(level, service, rest.strip())


def _from_fields(fields: dict[str, Any], text: str) -> LogLine:
    level_value = next((str(fields[k]) for k in _LEVEL_KEYS if k in fields), "info").lower()
    level = _LEVEL_WORDS.get(level_value, "INFO")
    service = next((str(fields[k]) for k in _SERVICE_KEYS if fields.get(k)), None)
    message = next((str(fields[k]) for k in _MESSAGE_KEYS if fields.get(k)), text)
    return LogLine(level, service, message)


def error_kind(message: str) -> str:
    """Messages that differ only in numbers, ids and durations are one kind of error."""
    return _VARYING.sub("#", message).strip(" .:;-").lower()


def log_signals(logs: str) -> dict[str, Any]:
    """Counts by level, 5xx responses, the most frequent kind of error (quoted as it appears in its
    first line) and the service that emits the most errors."""
    levels: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    first: dict[str, str] = {}
    emitters: Counter[str] = Counter()
    status_5xx = 0
    lines = [line for line in logs.splitlines() if line.strip()]
    for line in lines:
        if line[:1].isspace() and line.strip().startswith(("at ", "...", "Caused by", "File ")):
            continue  # a stack trace's continuation belongs to the error above it
        parsed = parse_line(line)
        levels[parsed.level] += 1
        status_5xx += sum(1 for m in _HTTP_5XX.finditer(line))
        if parsed.level in ("ERROR", "FATAL") and parsed.message:
            kind = error_kind(parsed.message)
            kinds[kind] += 1
            first.setdefault(kind, parsed.message)
            if parsed.service:
                emitters[parsed.service] += 1
    top = first[kinds.most_common(1)[0][0]] if kinds else ""
    return {
        "lines": len(lines),
        "fatal": levels["FATAL"],
        "error": levels["ERROR"],
        "warn": levels["WARN"],
        "status_5xx": status_5xx,
        "top_error": top,
        "top_error_count": kinds.most_common(1)[0][1] if kinds else 0,
        "emitter": emitters.most_common(1)[0][0] if emitters else "",
    }


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


classify_severity = classifier_node(
    "classify_severity",
    prompt=evidence,
    output_key="model_severity",
    label_key="severity",
    labels=SEVERITIES,
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
