"""Scoring a workflow against a labelled dataset: what ``elesium eval`` measures, without the CLI.

A dataset is JSONL, one example a line::

    {"id": "tt-001", "split": "test", "input": {...}, "expected": {"category": "billing", ...},
     "resume": {"approved": true}}

``resume`` (optional) answers every interrupt of the run, up to :data:`MAX_INTERRUPTS`; without it a
run that stops at an interrupt is scored on the state it stopped with. An :class:`EvalSpec` says how
each expected key is compared with the run's final state, by kind:

* ``choice`` (a closed label set): accuracy, the confusion matrix, per-label precision/recall/F1.
* ``span`` (text the workflow should copy out of its input, or null): ``verbatim`` (null or a
  substring of the input's strings: nothing invented), ``presence`` (null exactly when expected
  null), normalised ``exact`` match and SQuAD-style token ``f1``.
* ``set`` (e.g. the rule ids that fired): exact-set accuracy and micro precision/recall/F1.
* ``text``: normalised exact match with digit runs masked, so "timeout after 3012ms" matches
  "timeout after 3000ms" (log-derived text differs in numbers run to run, not in meaning).
* ``check``: a predicate over (state, expected); its pass rate.

A run that failed predicted nothing: it scores zero on every field (not "verbatim", not "present",
its choice the label ``<error>``), so no metric can rise because runs fail.

Everything here is pure: the runs come in as :class:`ExampleRun` (what the executor saw), the
results go out as a JSON document, and :func:`compare` sets two documents side by side.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, get_args

from elesium.errors import UserError

FieldKind = Literal["choice", "span", "set", "text", "check"]
"""How an expected value is compared with the run's state (module docstring)."""
FIELD_KINDS: tuple[FieldKind, ...] = get_args(FieldKind)
Split = Literal["dev", "test"]
SPLITS: tuple[Split, ...] = get_args(Split)
RunStatus = Literal["succeeded", "interrupted", "stuck", "error"]
"""``interrupted``: stopped at an interrupt the dataset gave no answer for; ``stuck``: still
interrupted after :data:`MAX_INTERRUPTS` answers."""
MAX_INTERRUPTS = 5
NONE_LABEL = "<none>"  # a null choice (expected or predicted)
ERROR_LABEL = "<error>"  # the "prediction" of a run that failed: a label of its own, never a match


class _Failed:
    """What a failed run predicted: nothing, on every field. It scores zero on every metric (a
    span is not "verbatim", a null is not "present"), so no metric rises when runs fail."""

    def __repr__(self) -> str:
        return "FAILED"


FAILED = _Failed()

State = Mapping[str, Any]
Check = Callable[[State, Mapping[str, Any]], bool | None]
"""A predicate over (final state, expected); None when it does not apply to the example."""


class DatasetError(UserError, ValueError):
    """The dataset file is malformed (one line, naming the file line)."""


class CheckUnavailable(Exception):
    """A check cannot run in this installation (e.g. the helper it needs is not there yet)."""


@dataclass(frozen=True)
class EvalField:
    """One scored field: ``name`` is the expected key, ``path`` a dotted path into the final state."""

    name: str
    kind: FieldKind
    path: str | None = None

    @property
    def state_path(self) -> str:
        return self.path or self.name


@dataclass(frozen=True)
class EvalSpec:
    """How one workflow is scored: its fields and the named checks its ``check`` fields run."""

    workflow: str
    fields: tuple[EvalField, ...]
    checks: Mapping[str, Check] = field(default_factory=dict)

    def with_fields(self, expected_keys: Iterable[str], overrides: Mapping[str, FieldKind]) -> EvalSpec:
        """The spec a run uses: a workflow without a shipped spec scores every expected key as text;
        ``overrides`` (``--field name:kind``) change a field's kind or add one.

        Raises:
            ValueError: a ``check`` field that names no check of this spec.
        """
        fields = {f.name: f for f in self.fields}
        if not fields:
            fields = {key: EvalField(key, "text") for key in expected_keys}
        for name, kind in overrides.items():
            fields[name] = replace(fields[name], kind=kind) if name in fields else EvalField(name, kind)
        for f in fields.values():
            if f.kind == "check" and f.name not in self.checks:
                known = ", ".join(sorted(self.checks)) or "none"
                raise ValueError(f"workflow {self.workflow!r} has no check {f.name!r} (checks: {known})")
        return replace(self, fields=tuple(fields.values()))


# ---------------------------------------------------------------- the shipped specs
def _expense_approval() -> Any:
    """The expense-approval module, imported when a check first needs it (sys.modules first)."""
    import importlib

    return importlib.import_module("elesium.graphs.workflows.expense_approval")


def _rule_ids(module: Any) -> list[str] | None:
    """Every rule id the workflow knows (its ``RULE_IDS``, or ``RULES``' keys), if it says."""
    ids = getattr(module, "RULE_IDS", None) or getattr(module, "RULES", None)
    return [str(k) for k in ids] if isinstance(ids, (Mapping, list, tuple, set, frozenset)) else None


def rationale_cites_rules(state: State, expected: Mapping[str, Any]) -> bool | None:
    """Every expected rule id is cited by ``state["rationale"]``; an approval (no expected rules)
    cites none of the workflow's rule ids (not scored when the workflow lists none)."""
    if "rules" not in expected:
        return None
    module = _expense_approval()
    cites = getattr(module, "cites", None)
    if not callable(cites):
        raise CheckUnavailable("expense_approval has no cites(rationale, rule_id) yet")
    rationale = state.get("rationale")
    if not isinstance(rationale, str):
        return False
    def cited(rule: str) -> bool:
        try:
            return bool(cites(rationale, rule))
        except KeyError:  # an id the workflow does not know is cited by nothing
            return False

    wanted = [str(r) for r in expected["rules"] or []]
    if wanted:
        return all(cited(rule) for rule in wanted)
    universe = _rule_ids(module)
    return None if universe is None else not any(cited(rule) for rule in universe)


SHIPPED_SPECS: dict[str, EvalSpec] = {
    "ticket-triage": EvalSpec("ticket-triage", (
        EvalField("category", "choice"), EvalField("priority", "choice"),
        EvalField("product", "span"), EvalField("problem", "span"))),
    "expense-approval": EvalSpec("expense-approval", (
        EvalField("decision", "choice"), EvalField("rules", "set"),
        EvalField("rationale_cites_rules", "check")),
        checks={"rationale_cites_rules": rationale_cites_rules}),
    "incident-summary": EvalSpec("incident-summary", (
        EvalField("top_error", "text"), EvalField("affected_service", "text"),
        EvalField("severity", "choice"))),
}


def spec_for(workflow_name: str) -> EvalSpec:
    """The shipped spec of a workflow; an empty one (every expected key as text) for any other."""
    return SHIPPED_SPECS.get(workflow_name) or EvalSpec(workflow_name, ())


# ---------------------------------------------------------------- the dataset
@dataclass(frozen=True)
class Example:
    """One dataset row. ``has_resume`` tells a ``"resume": null`` answer from no answer."""

    id: str
    input: dict[str, Any]
    expected: dict[str, Any]
    line: int
    split: Split | None = None
    resume: Any = None
    has_resume: bool = False


def read_dataset(path: str | Path) -> list[Example]:
    """Every example of a JSONL dataset, checked row by row (blank lines skipped).

    Raises:
        DatasetError: the first malformed line, by number; FileNotFoundError for a missing file.
    """
    path = Path(path)
    examples: list[Example] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{path}: line {number}"
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not valid JSON: {exc.msg} at column {exc.colno}") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: must be a JSON object, got {type(row).__name__}")
        ident = row.get("id")
        if not isinstance(ident, str) or not ident:
            raise DatasetError(f"{where}: 'id' must be a non-empty string")
        if ident in first_line:
            raise DatasetError(f"{where}: duplicate id {ident!r} (first on line {first_line[ident]})")
        for key in ("input", "expected"):
            if not isinstance(row.get(key), dict):
                raise DatasetError(f"{where}: {key!r} must be a JSON object")
        split = row.get("split")
        if split is not None and split not in SPLITS:
            raise DatasetError(f"{where}: 'split' must be one of {', '.join(SPLITS)}, got {split!r}")
        first_line[ident] = number
        examples.append(Example(ident, row["input"], row["expected"], number, split, row.get("resume"),
                                "resume" in row))
    return examples


def select(examples: Sequence[Example], split: str, limit: int | None = None) -> list[Example]:
    """The examples of ``split`` (``all``: every row, with or without one), the first ``limit``."""
    if split not in (*SPLITS, "all"):
        raise DatasetError(f"unknown split {split!r}; use {', '.join(SPLITS)} or all")
    chosen = [e for e in examples if split == "all" or e.split == split]
    if not chosen:
        counts = Counter(e.split or "none" for e in examples)
        have = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "no rows"
        raise DatasetError(f"no examples in split {split!r} ({have}); pick another with --split")
    return chosen[:limit] if limit is not None else chosen


def shipped_dataset(workflow_name: str) -> Path:
    """Where a workflow's own evaluation set lives: ``graphs/workflows/evals/<name with _>.jsonl``."""
    evals = Path(__file__).resolve().parent / "workflows" / "evals"
    return evals / f"{workflow_name.replace('-', '_')}.jsonl"


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def example_seed(seed: int, example_id: str) -> int:
    """A run seed from the eval seed and the example id: the same example decodes the same way
    whatever else the dataset holds, or in whatever order it runs."""
    digest = hashlib.sha256(f"{seed}\x1f{example_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


# ---------------------------------------------------------------- per-value comparisons
def normalise(text: str) -> str:
    """Case-folded, whitespace collapsed, surrounding punctuation stripped."""
    return " ".join(text.casefold().split()).strip(string.punctuation + string.whitespace)


def text_key(value: Any) -> str | None:
    """What ``text`` fields compare: the normalised text with each run of digits as ``#``."""
    if value is None or value is FAILED:
        return None
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
    return re.sub(r"\d+", "#", normalise(text))


def _as_span(value: Any) -> str | None:
    """A span value: null and blank strings are both "nothing extracted"."""
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    return text if text.strip() else None


def squad_tokens(text: str) -> list[str]:
    """SQuAD's answer normalisation: lower case, no punctuation or articles, split on whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def token_f1(predicted: str | None, expected: str | None) -> float:
    """SQuAD token F1; both null is a perfect answer, one null none at all."""
    if predicted is None or expected is None:
        return float(predicted is None and expected is None)
    pred, gold = squad_tokens(predicted), squad_tokens(expected)
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def input_text(value: Any) -> str:
    """Every string inside the input, in order, joined by newlines: what a span may be copied from."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return "\n".join(input_text(v) for v in value.values() if v is not None)
    if isinstance(value, (list, tuple)):
        return "\n".join(input_text(v) for v in value)
    return ""


def span_scores(predicted: Any, expected: Any, source: str) -> dict[str, Any]:
    """verbatim, presence, exact and f1 of one span prediction (all zero for a failed run)."""
    if predicted is FAILED:
        return {"verbatim": False, "presence": False, "exact": False, "f1": 0.0}
    pred, gold = _as_span(predicted), _as_span(expected)
    exact = (pred is None and gold is None) or (
        pred is not None and gold is not None and normalise(pred) == normalise(gold))
    return {"verbatim": pred is None or pred.strip() in source, "presence": (pred is None) == (gold is None),
            "exact": exact, "f1": token_f1(pred, gold)}


def _label(value: Any) -> str:
    if value is FAILED:
        return ERROR_LABEL
    if value is None:
        return NONE_LABEL
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _as_set(value: Any) -> set[str] | None:
    if value is None or value is FAILED:
        return None
    items = value if isinstance(value, (list, tuple, set, frozenset)) else [value]
    return {_label(v) for v in items}


def resolve(state: State, path: str) -> Any:
    """The value at a dotted path of the state (list items by index); None where it is missing."""
    value: Any = state
    for part in path.split("."):
        if isinstance(value, Mapping):
            value = value.get(part)
        elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


# ---------------------------------------------------------------- aggregate metrics
def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def choice_metrics(pairs: Sequence[tuple[Any, Any]]) -> dict[str, Any]:
    """Accuracy, confusion matrix (rows expected, columns predicted, labels sorted) and per-label
    precision/recall/F1 of (expected, predicted) pairs; null is the label ``<none>``, a failed run's
    prediction ``<error>``. Macro F1 averages the labels that were expected."""
    labelled = [(_label(e), _label(p)) for e, p in pairs]
    labels = sorted({x for pair in labelled for x in pair})
    index = {label: i for i, label in enumerate(labels)}
    matrix = [[0] * len(labels) for _ in labels]
    for gold, pred in labelled:
        matrix[index[gold]][index[pred]] += 1
    per_label: dict[str, dict[str, float | int]] = {}
    for label, i in index.items():
        tp = matrix[i][i]
        support, predicted = sum(matrix[i]), sum(row[i] for row in matrix)
        precision, recall = _ratio(tp, predicted), _ratio(tp, support)
        per_label[label] = {"precision": precision, "recall": recall,
                            "f1": _ratio(2 * precision * recall, precision + recall), "support": support}
    gold_labels = [lab for lab in labels if per_label[lab]["support"]]
    return {"kind": "choice", "n": len(labelled),
            "accuracy": _ratio(sum(g == p for g, p in labelled), len(labelled)),
            "macro_f1": _mean([float(per_label[lab]["f1"]) for lab in gold_labels]),
            "labels": labels, "confusion": matrix, "per_label": per_label}


def set_metrics(pairs: Sequence[tuple[Any, Any]]) -> dict[str, Any]:
    """Exact-set accuracy and micro precision/recall/F1 of (expected, predicted) collections; a
    missing prediction is never an exact match and contributes no items."""
    tp = fp = fn = exact = 0
    for expected, predicted in pairs:
        gold, pred = _as_set(expected) or set(), _as_set(predicted)
        exact += pred is not None and pred == gold
        pred = pred or set()
        tp, fp, fn = tp + len(gold & pred), fp + len(pred - gold), fn + len(gold - pred)
    return {"kind": "set", "n": len(pairs), "exact": _ratio(exact, len(pairs)),
            "micro_precision": _ratio(tp, tp + fp) if tp + fp else 1.0,
            "micro_recall": _ratio(tp, tp + fn) if tp + fn else 1.0,
            "micro_f1": _ratio(2 * tp, 2 * tp + fp + fn) if tp + fp + fn else 1.0}


# ---------------------------------------------------------------- scoring runs
@dataclass
class ExampleRun:
    """What the executor observed for one example: how the run ended, its final state, its cost."""

    example: Example
    status: RunStatus
    state: dict[str, Any]
    latency_s: float
    tokens: int = 0
    steps: int = 0
    interrupts: int = 0
    error: str | None = None
    seed: int | None = None
    thread_id: str | None = None
    run_ids: list[str] = field(default_factory=list)
    mode: str | None = None


def score(spec: EvalSpec, runs: Sequence[ExampleRun]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(per-example records, per-field metrics). An example is scored on a field when its
    ``expected`` has that key (a check: when the check applies to it)."""
    records = [_example_record(run) for run in runs]
    metrics: dict[str, Any] = {}
    for f in spec.fields:
        if f.kind == "check":
            metrics[f.name] = _check_metrics(spec.checks[f.name], f.name, runs, records)
            continue
        scored = [(run, rec) for run, rec in zip(runs, records) if f.name in run.example.expected]
        pairs = [(run.example.expected[f.name],
                  FAILED if run.status == "error" else resolve(run.state, f.state_path)) for run, _ in scored]
        if f.kind == "choice":
            metrics[f.name] = choice_metrics(pairs)
            correct = [_label(gold) == _label(pred) for gold, pred in pairs]
        elif f.kind == "set":
            metrics[f.name] = set_metrics(pairs)
            correct = [_as_set(pred) is not None and _as_set(pred) == (_as_set(gold) or set())
                       for gold, pred in pairs]
        elif f.kind == "text":
            correct = [pred is not FAILED and text_key(gold) == text_key(pred) for gold, pred in pairs]
            accuracy = _mean([float(c) for c in correct])
            metrics[f.name] = {"kind": "text", "n": len(correct), "accuracy": accuracy}
        else:
            details = [span_scores(pred, gold, input_text(run.example.input))
                       for (run, _), (gold, pred) in zip(scored, pairs)]
            metrics[f.name] = {"kind": "span", "n": len(details)}
            for key in HEADLINE["span"]:
                metrics[f.name][key] = _mean([float(d[key]) for d in details])
            correct = [bool(d["exact"]) for d in details]
            for (_, rec), detail in zip(scored, details):
                rec["span"][f.name] = detail
        for (_, rec), (_, pred), ok in zip(scored, pairs, correct):
            rec["prediction"][f.name] = None if pred is FAILED else pred
            rec["correct"][f.name] = ok
    return records, metrics


def _check_metrics(check: Check, name: str, runs: Sequence[ExampleRun],
                   records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A check's pass rate over the examples it applies to; unavailable as a whole if it cannot run."""
    def outcome(run: ExampleRun) -> bool | None:
        verdict = check(run.state, run.example.expected)
        return verdict if run.status != "error" or verdict is None else False

    try:
        outcomes = [outcome(run) for run in runs]
    except CheckUnavailable as exc:
        outcomes, reason = [None] * len(runs), str(exc)
    else:
        reason = None
    for rec, outcome in zip(records, outcomes):
        rec["correct"][name] = None if outcome is None else bool(outcome)
    passed = [float(bool(o)) for o in outcomes if o is not None]
    if reason is not None:
        return {"kind": "check", "available": False, "reason": reason, "n": 0, "pass_rate": None}
    return {"kind": "check", "available": True, "n": len(passed), "pass_rate": _mean(passed)}


def _example_record(run: ExampleRun) -> dict[str, Any]:
    return {"id": run.example.id, "split": run.example.split, "status": run.status,
            "latency_s": round(run.latency_s, 4), "tau": run.tokens / run.steps if run.steps else None,
            "tokens": run.tokens, "steps": run.steps, "interrupts": run.interrupts, "seed": run.seed,
            "mode": run.mode, "thread_id": run.thread_id, "run_ids": list(run.run_ids),
            "expected": run.example.expected, "prediction": {}, "correct": {}, "span": {}, "error": run.error}


def summary(runs: Sequence[ExampleRun]) -> dict[str, Any]:
    """Latency percentiles, pooled tau (all tokens over all steps, so long answers weigh more),
    statuses and errors."""
    latencies = [r.latency_s for r in runs]
    tokens, steps = sum(r.tokens for r in runs), sum(r.steps for r in runs)
    return {"examples": len(runs), "status": dict(Counter(r.status for r in runs)),
            "errors": sum(r.status == "error" for r in runs),
            "latency_p50_s": percentile(latencies, 0.5), "latency_p90_s": percentile(latencies, 0.9),
            "latency_mean_s": _mean(latencies), "tokens": tokens, "steps": steps,
            "tau": tokens / steps if steps else None}


def results_document(spec: EvalSpec, runs: Sequence[ExampleRun], *, workflow_version: str,
                     dataset: str | Path, dataset_sha256: str, split: str, engine: Mapping[str, Any],
                     mode: str | None, seed: int, created: str | None = None) -> dict[str, Any]:
    """The results file: enough to read on its own and to compare with another run of the eval."""
    examples, fields = score(spec, runs)
    return {"workflow": spec.workflow, "workflow_version": workflow_version,
            "dataset": {"path": str(dataset), "sha256": dataset_sha256}, "split": split,
            "engine": dict(engine), "mode": mode, "seed": seed,
            "created": created or datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "fields_spec": [{"name": f.name, "kind": f.kind, "path": f.state_path} for f in spec.fields],
            "examples": examples, "fields": fields, "summary": summary(runs)}


# ---------------------------------------------------------------- reading the results
HEADLINE: dict[str, tuple[str, ...]] = {
    "choice": ("accuracy", "macro_f1"), "span": ("verbatim", "presence", "exact", "f1"),
    "set": ("exact", "micro_f1"), "text": ("accuracy",), "check": ("pass_rate",)}
SUMMARY_KEYS = ("latency_p50_s", "latency_p90_s", "latency_mean_s", "tau", "errors")


def _fmt(value: Any, signed: bool = False) -> str:
    """A cell: floats to 3 places (deltas with their sign), None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:+.3f}" if signed else f"{value:.3f}"
    if isinstance(value, int) and not isinstance(value, bool) and signed:
        return f"{value:+d}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned text columns, two spaces apart."""
    cells = [[str(h) for h in headers]]
    cells += [[c if isinstance(c, str) else _fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def render(doc: Mapping[str, Any]) -> str:
    """The compact human report of a results document (what ``elesium eval`` prints)."""
    s = doc["summary"]
    statuses = ", ".join(f"{v} {k}" for k, v in sorted(s["status"].items()))
    lines = [f"{doc['workflow']} {doc['workflow_version']}  split {doc['split']}  {s['examples']} examples "
             f"({statuses})  mode {doc.get('mode') or 'default'}  seed {doc['seed']}", ""]
    rows = []
    for name, m in doc["fields"].items():
        if m["kind"] == "check" and not m.get("available", True):
            rows.append([name, "check", 0, f"unavailable: {m['reason']}"])
            continue
        shown = "  ".join(f"{k} {_fmt(m.get(k))}" for k in HEADLINE[m["kind"]])
        rows.append([name, m["kind"], m["n"], shown])
    lines.append(table(["field", "kind", "n", "metrics"], rows))
    for name, m in doc["fields"].items():
        if m["kind"] == "choice" and m["labels"]:
            matrix = [[label, *row] for label, row in zip(m["labels"], m["confusion"])]
            lines += ["", f"{name}: expected (rows) x predicted (columns)", table(["", *m["labels"]], matrix)]
    tau = "-" if s["tau"] is None else f"{s['tau']:.2f} ({s['tokens']} tokens / {s['steps']} steps)"
    lines += ["", f"latency p50 {_fmt(s['latency_p50_s'])} s  p90 {_fmt(s['latency_p90_s'])} s  "
              f"mean {_fmt(s['latency_mean_s'])} s  tau {tau}  errors {s['errors']}"]
    return "\n".join(lines)


def compare_rows(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """The comparison as data: metric rows (field, metric, A, B, B - A) and the examples whose
    correctness on some field differs between A and B."""
    rows: list[list[Any]] = []
    for name in list(dict.fromkeys([*a["fields"], *b["fields"]])):
        fa, fb = a["fields"].get(name, {}), b["fields"].get(name, {})
        kind = fa.get("kind") or fb.get("kind")
        for metric in HEADLINE.get(kind, ()):
            va, vb = fa.get(metric), fb.get(metric)
            rows.append([name, metric, va, vb, vb - va if va is not None and vb is not None else None])
    for key in SUMMARY_KEYS:
        va, vb = a["summary"].get(key), b["summary"].get(key)
        rows.append(["(run)", key, va, vb, vb - va if va is not None and vb is not None else None])
    by_id = {e["id"]: e for e in a["examples"]}
    changed = []
    for eb in b["examples"]:
        ea = by_id.get(eb["id"])
        if ea is None:
            continue
        for name in dict.fromkeys([*ea["correct"], *eb["correct"]]):
            ca, cb = ea["correct"].get(name), eb["correct"].get(name)
            if ca != cb:
                changed.append({"id": eb["id"], "field": name, "a": ca, "b": cb,
                                "a_prediction": ea["prediction"].get(name),
                                "b_prediction": eb["prediction"].get(name)})
    return {"rows": rows, "changed": changed}


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """Two results documents side by side: metrics with deltas, then the examples that changed."""
    data = compare_rows(a, b)
    mark = {True: "✓", False: "✗", None: "-"}
    lines = []
    for tag, doc in (("A", a), ("B", b)):
        lines.append(f"{tag}: {doc['workflow']} {doc['workflow_version']}  split {doc['split']}  "
                     f"{doc['summary']['examples']} examples  mode {doc.get('mode') or 'default'}  "
                     f"created {doc.get('created', '?')}")
    if a["dataset"]["sha256"] != b["dataset"]["sha256"]:
        lines.append("note: A and B were scored on different dataset files")
    rows = [[*row[:4], _fmt(row[4], signed=True)] for row in data["rows"]]
    lines += ["", table(["field", "metric", "A", "B", "delta"], rows), ""]
    if not data["changed"]:
        lines.append("no example changed correctness")
    else:
        lines.append(f"{len(data['changed'])} example field(s) changed correctness:")
        shown = [[c["id"], c["field"], mark[c["a"]], mark[c["b"]],
                  json.dumps(c["a_prediction"], ensure_ascii=False),
                  json.dumps(c["b_prediction"], ensure_ascii=False)] for c in data["changed"]]
        lines.append(table(["id", "field", "A", "B", "A predicted", "B predicted"], shown))
    return "\n".join(lines)
