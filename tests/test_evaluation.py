"""``elesium eval``: every metric on hand-made states, the run driver on a scripted API, bad input,
and one run of the real command (real model, real API path, embedded Valkey).

The metric tests state their expected numbers worked out by hand in the comments beside them. The
driver tests answer the API's routes from a script (httpx's MockTransport), so the interrupt policy
(resume until done, at most five answers, then "stuck") is checked without a model. The end-to-end
test scores expense-approval on three rows, one deliberately mislabelled, so accuracy and the
confusion matrix have a known non-trivial value, and its tau is checked against the acceptance log.
"""

from __future__ import annotations

import hashlib
import json
import sys
import types
from pathlib import Path
from typing import Any

import httpx
import pytest

from elesium.cli import CliError, main
from elesium.graphs import evaluation as ev

pytest_plugins = ["state_fixtures"]


def example(ident: str = "e1", expected: dict[str, Any] | None = None, inp: dict[str, Any] | None = None,
            **kw: Any) -> ev.Example:
    return ev.Example(ident, inp or {"subject": "x", "body": "y"}, expected or {}, 1, **kw)


def ran(ex: ev.Example, state: dict[str, Any], status: ev.RunStatus = "succeeded", latency: float = 1.0,
        tokens: int = 0, steps: int = 0) -> ev.ExampleRun:
    return ev.ExampleRun(ex, status, state, latency, tokens=tokens, steps=steps)


# ---------------------------------------------------------------- per-value comparisons
def test_normalise_and_text_key():
    assert ev.normalise("  Timeout\tafter   3012ms. ") == "timeout after 3012ms"
    assert ev.normalise("«Sync Agent 4.2»!") == "«sync agent 4.2»"  # only ASCII punctuation is stripped
    assert ev.text_key("Timeout after 3012ms.") == ev.text_key("timeout after 3000ms") == "timeout after #ms"
    assert ev.text_key("timeout after 30ms") == "timeout after #ms"  # a run of digits is one '#'
    assert ev.text_key("timeout before 3000ms") != ev.text_key("timeout after 3000ms")
    assert ev.text_key(None) is None and ev.text_key(502) == "#"


def test_token_f1_squad_style():
    # "the" is dropped and "4.2" loses its dot: [sync, agent, 42] against [sync, agent]:
    # 2 common, precision 2/3, recall 1, F1 0.8.
    assert ev.token_f1("the Sync Agent 4.2", "Sync Agent") == pytest.approx(0.8)
    assert ev.token_f1("crashes on start", "crashes on start") == 1.0
    assert ev.token_f1("billing portal", "sync agent") == 0.0
    assert ev.token_f1(None, None) == 1.0
    assert ev.token_f1(None, "Sync Agent") == 0.0 and ev.token_f1("Sync Agent", None) == 0.0
    assert ev.token_f1("the", "a") == 1.0  # both empty after normalisation: equal


def test_span_scores_null_and_verbatim():
    source = ev.input_text({"subject": "Sync Agent 4.2 crashes", "body": "It crashes on start.",
                            "customer": None, "tags": ["urgent", {"note": "Since Monday"}], "n": 3})
    assert source == "Sync Agent 4.2 crashes\nIt crashes on start.\nurgent\nSince Monday\n"
    assert ev.span_scores("Sync Agent 4.2", "sync agent 4.2.", source) == {
        "verbatim": True, "presence": True, "exact": True, "f1": 1.0}
    # invented: not in the input, yet present and half right
    invented = ev.span_scores("Sync Agent 5", "Sync Agent 4.2", source)
    assert invented["verbatim"] is False and invented["presence"] is True and invented["exact"] is False
    assert invented["f1"] == pytest.approx(2 / 3)  # 2 common of 3 and 3 tokens
    # null where null was expected; a blank string counts as null
    perfect = {"verbatim": True, "presence": True, "exact": True, "f1": 1.0}
    assert ev.span_scores(None, None, source) == perfect and ev.span_scores("  ", None, source) == perfect
    # null where a span was expected, and a span where null was expected
    assert ev.span_scores(None, "Sync Agent", source) == {
        "verbatim": True, "presence": False, "exact": False, "f1": 0.0}
    assert ev.span_scores("Since Monday", None, source) == {
        "verbatim": True, "presence": False, "exact": False, "f1": 0.0}
    assert ev.span_scores(ev.FAILED, None, source) == {
        "verbatim": False, "presence": False, "exact": False, "f1": 0.0}


def test_resolve_dotted_paths():
    state = {"fields": {"product": "Sync", "tags": ["a", "b"]}, "top": 1}
    assert ev.resolve(state, "fields.product") == "Sync"
    assert ev.resolve(state, "fields.tags.1") == "b"
    assert ev.resolve(state, "fields.tags.7") is None
    assert ev.resolve(state, "top.deeper") is None and ev.resolve(state, "absent") is None


# ---------------------------------------------------------------- aggregate metrics
def test_choice_metrics_confusion_and_per_label():
    pairs = [("billing", "billing"), ("billing", "access"), ("access", "access"), ("outage", "billing"),
             ("bug", None), ("bug", ev.FAILED)]
    m = ev.choice_metrics(pairs)
    assert m["labels"] == ["<error>", "<none>", "access", "billing", "bug", "outage"]
    assert m["confusion"] == [
        [0, 0, 0, 0, 0, 0],   # <error> expected: never
        [0, 0, 0, 0, 0, 0],   # <none>
        [0, 0, 1, 0, 0, 0],   # access -> access
        [0, 0, 1, 1, 0, 0],   # billing -> access, billing
        [1, 1, 0, 0, 0, 0],   # bug -> <error>, <none>
        [0, 0, 0, 1, 0, 0],   # outage -> billing
    ]
    assert m["n"] == 6 and m["accuracy"] == pytest.approx(2 / 6)
    # billing: tp 1, expected 2, predicted 2 -> P .5 R .5 F1 .5; access: tp 1, expected 1, predicted 2.
    assert m["per_label"]["billing"] == {"precision": 0.5, "recall": 0.5, "f1": 0.5, "support": 2}
    assert m["per_label"]["access"]["precision"] == 0.5 and m["per_label"]["access"]["recall"] == 1.0
    assert m["per_label"]["access"]["f1"] == pytest.approx(2 / 3)
    assert m["per_label"]["outage"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}
    # macro over the expected labels (access, billing, bug, outage)
    assert m["macro_f1"] == pytest.approx((2 / 3 + 0.5 + 0 + 0) / 4)


def test_set_metrics_exact_and_micro_f1():
    pairs = [(["limit"], ["limit"]), (["currency", "description"], ["currency"]), ([], []),
             (["alcohol"], None), ([], ["cap"])]
    m = ev.set_metrics(pairs)
    # exact: rows 1 and 3 -> 2/5. tp = 1 + 1 = 2, fp = 1 (cap), fn = 1 (description) + 1 (alcohol) = 2.
    assert m["exact"] == pytest.approx(2 / 5)
    assert m["micro_precision"] == pytest.approx(2 / 3) and m["micro_recall"] == pytest.approx(2 / 4)
    assert m["micro_f1"] == pytest.approx(4 / 7)
    assert ev.set_metrics([([], [])])["micro_f1"] == 1.0  # nothing expected, nothing predicted


def test_percentile_is_linear_between_ranks():
    assert ev.percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert ev.percentile([1.0, 2.0, 3.0, 4.0], 0.9) == pytest.approx(3.7)
    assert ev.percentile([5.0], 0.9) == 5.0 and ev.percentile([], 0.5) is None


# ---------------------------------------------------------------- specs and checks
def test_specs_and_field_overrides():
    triage = ev.spec_for("ticket-triage")
    assert [(f.name, f.kind) for f in triage.fields] == [
        ("category", "choice"), ("priority", "choice"), ("product", "span"), ("problem", "span")]
    expense = ev.spec_for("expense-approval")
    assert [(f.name, f.kind) for f in expense.fields] == [
        ("decision", "choice"), ("rules", "set"), ("rationale_cites_rules", "check")]
    incident = ev.spec_for("incident-summary")
    assert {f.name: f.kind for f in incident.fields} == {
        "top_error": "text", "affected_service": "text", "severity": "choice"}
    other = ev.spec_for("my-flow").with_fields(["answer", "label", "fields.x"], {"label": "choice"})
    assert [(f.name, f.kind, f.state_path) for f in other.fields] == [
        ("answer", "text", "answer"), ("label", "choice", "label"), ("fields.x", "text", "fields.x")]
    assert [f.kind for f in triage.with_fields([], {"product": "text"}).fields] == [
        "choice", "choice", "text", "span"]
    with pytest.raises(ValueError, match="workflow 'my-flow' has no check 'ok' \\(checks: none\\)"):
        ev.spec_for("my-flow").with_fields(["a"], {"ok": "check"})


@pytest.fixture
def fake_expense(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in expense_approval with the helpers the check uses (the real one changes under us)."""
    module = types.ModuleType("elesium.graphs.workflows.expense_approval")
    module.RULES = {"limit": "exceeds the limit", "alcohol": "alcohol is not reimbursable"}
    module.cites = lambda rationale, rule: module.RULES[rule] in rationale
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_rationale_cites_rules(fake_expense):
    check = ev.rationale_cites_rules
    both = "Rejected: 90 USD exceeds the limit; alcohol is not reimbursable."
    assert check({"rationale": both}, {"rules": ["limit", "alcohol"]}) is True
    one = "Rejected: 90 USD exceeds the limit."
    assert check({"rationale": one}, {"rules": ["limit", "alcohol"]}) is False
    assert check({"rationale": "Approved: within budget."}, {"rules": []}) is True
    assert check({"rationale": both}, {"rules": []}) is False  # an approval citing a rule
    assert check({"rationale": both}, {"rules": ["no-such-rule"]}) is False
    assert check({}, {"rules": ["limit"]}) is False
    assert check({"rationale": both}, {"decision": "reject"}) is None  # nothing to check it against
    del fake_expense.RULES
    fake_expense.cites = lambda rationale, rule: rule in rationale
    assert check({"rationale": "fine"}, {"rules": []}) is None  # no rule ids to look for
    assert check({"rationale": "limit"}, {"rules": ["limit"]}) is True


def test_check_without_its_helper_is_unavailable(fake_expense):
    del fake_expense.cites
    spec = ev.spec_for("expense-approval")
    runs = [ran(example("a", {"decision": "approve", "rules": []}),
                {"decision": "approve", "rules": [], "rationale": "ok"})]
    records, fields = ev.score(spec, runs)
    assert fields["rationale_cites_rules"] == {
        "kind": "check", "available": False, "n": 0, "pass_rate": None,
        "reason": "expense_approval has no cites(rationale, rule_id) yet"}
    assert records[0]["correct"] == {"decision": True, "rules": True, "rationale_cites_rules": None}
    assert "rationale_cites_rules  check   0  unavailable: expense_approval has no cites" in ev.render(
        ev.results_document(spec, runs, workflow_version="v", dataset="d.jsonl", dataset_sha256="0",
                            split="test", engine={}, mode=None, seed=0))


# ---------------------------------------------------------------- scoring runs and documents
def triage_runs() -> list[ev.ExampleRun]:
    ticket = {"subject": "Sync Agent 4.2 crashes", "body": "It crashes on start since Monday."}
    return [
        ran(example("t1", {"category": "bug", "priority": "P3", "product": "Sync Agent 4.2",
                           "problem": "crashes on start"}, ticket),
            {"category": "bug", "priority": "P2", "product": "Sync Agent 4.2",
             "problem": "It crashes on start"},
            latency=1.0, tokens=30, steps=20),
        ran(example("t2", {"category": "billing", "priority": "P3", "product": None,
                           "problem": "charged twice"},
                    {"subject": "Invoice", "body": "I was charged twice."}),
            {"category": "billing", "priority": "P3", "product": "Invoice Pro", "problem": "charged twice"},
            latency=2.0, tokens=10, steps=10),
        ran(example("t3", {"category": "outage", "priority": "P1"}), {}, status="error", latency=4.0),
    ]


def test_score_records_and_field_metrics():
    records, fields = ev.score(ev.spec_for("ticket-triage"), triage_runs())
    assert [r["correct"] for r in records] == [
        {"category": True, "priority": False, "product": True, "problem": False},
        {"category": True, "priority": True, "product": False, "problem": True},
        {"category": False, "priority": False},  # t3 expects no spans; its run failed
    ]
    assert records[0]["prediction"]["problem"] == "It crashes on start"
    assert records[2]["prediction"] == {"category": None, "priority": None}
    assert records[0]["tau"] == 1.5 and records[2]["tau"] is None
    assert fields["category"]["accuracy"] == pytest.approx(2 / 3)
    assert fields["category"]["labels"] == ["<error>", "billing", "bug", "outage"]
    assert fields["category"]["confusion"][3] == [1, 0, 0, 0]  # outage -> <error>
    # product: t1 exact and verbatim; t2 "Invoice Pro" invented where null was expected
    assert fields["product"] == {"kind": "span", "n": 2, "verbatim": 0.5, "presence": 0.5, "exact": 0.5,
                                 "f1": 0.5}
    # problem: t1 "It crashes on start" vs "crashes on start": P 3/4 R 1 -> F1 6/7; t2 exact
    assert fields["problem"]["f1"] == pytest.approx((6 / 7 + 1) / 2)
    assert fields["problem"]["verbatim"] == 1.0 and fields["problem"]["exact"] == 0.5


def test_text_fields_and_summary():
    runs = [ran(example("i1", {"top_error": "timeout after 3000ms", "severity": "SEV2"}),
                {"top_error": "Timeout after 3012ms.", "severity": "SEV2"}, latency=1.0, tokens=8, steps=4),
            ran(example("i2", {"top_error": None, "affected_service": "checkout-api"}),
                {"top_error": None, "affected_service": "payments"}, status="interrupted", latency=3.0,
                tokens=2, steps=2)]
    records, fields = ev.score(ev.spec_for("incident-summary"), runs)
    assert fields["top_error"] == {"kind": "text", "n": 2, "accuracy": 1.0}
    assert fields["affected_service"] == {"kind": "text", "n": 1, "accuracy": 0.0}
    assert fields["severity"]["n"] == 1 and fields["severity"]["accuracy"] == 1.0
    s = ev.summary(runs)
    assert s["tau"] == 10 / 6 and s["tokens"] == 10 and s["steps"] == 6
    assert s["latency_p50_s"] == 2.0 and s["latency_mean_s"] == 2.0
    assert s["latency_p90_s"] == pytest.approx(2.8)
    assert s["status"] == {"succeeded": 1, "interrupted": 1} and s["errors"] == 0


def doc_of(runs: list[ev.ExampleRun], mode: str) -> dict[str, Any]:
    return ev.results_document(ev.spec_for("ticket-triage"), runs, workflow_version="abc", dataset="tt.jsonl",
                               dataset_sha256="f" * 64, split="test", engine={"device": "cpu"}, mode=mode,
                               seed=0, created="2026-01-01T00:00:00+00:00")


def test_results_document_render_and_compare():
    a = doc_of(triage_runs(), "vanilla")
    assert a["summary"]["tau"] == 40 / 30 and a["summary"]["errors"] == 1
    assert a["dataset"] == {"path": "tt.jsonl", "sha256": "f" * 64} and a["mode"] == "vanilla"
    json.dumps(a)  # the document is plain JSON
    text = ev.render(a)
    assert text.splitlines()[0] == ("ticket-triage abc  split test  3 examples (1 error, 2 succeeded)  "
                                    "mode vanilla  seed 0")
    assert "category  choice  3  accuracy 0.667  macro_f1 0.667" in text
    assert "outage   1        0        0    0" in text  # its row of the confusion matrix
    assert text.splitlines()[-1] == ("latency p50 2.000 s  p90 3.600 s  mean 2.333 s  "
                                     "tau 1.33 (40 tokens / 30 steps)  errors 1")

    fixed = triage_runs()
    fixed[0].state["priority"] = "P3"          # t1 priority becomes right
    fixed[1].state["category"] = "access"      # t2 category becomes wrong
    fixed[2] = ran(fixed[2].example, {"category": "outage", "priority": "P1"}, latency=1.0, tokens=6, steps=3)
    b = doc_of(fixed, "speculative")
    table = ev.compare(a, b)
    lines = table.splitlines()
    assert lines[0].startswith("A: ticket-triage abc  split test  3 examples  mode vanilla")
    assert lines[1].startswith("B: ticket-triage abc  split test  3 examples  mode speculative")
    assert lines[3:8] == [
        "field     metric          A      B      delta",
        "category  accuracy        0.667  0.667  +0.000",
        "category  macro_f1        0.667  0.667  +0.000",
        "priority  accuracy        0.333  1.000  +0.667",
        "priority  macro_f1        0.333  1.000  +0.667",
    ]
    assert "(run)     tau             1.333  1.394  +0.061" in lines   # 46 tokens / 33 steps
    assert "(run)     errors          1      0      -1" in lines
    assert "(run)     latency_p50_s   2.000  1.000  -1.000" in lines
    assert lines[-6:] == [
        "4 example field(s) changed correctness:",
        "id  field     A  B  A predicted  B predicted",
        't1  priority  ✗  ✓  "P2"         "P3"',
        't2  category  ✓  ✗  "billing"    "access"',
        't3  category  ✗  ✓  null         "outage"',
        't3  priority  ✗  ✓  null         "P1"',
    ]
    assert ev.compare(a, a).splitlines()[-1] == "no example changed correctness"
    changed = ev.compare_rows(a, b)["changed"]
    assert {(c["id"], c["field"]) for c in changed} == {("t1", "priority"), ("t2", "category"),
                                                        ("t3", "category"), ("t3", "priority")}


# ---------------------------------------------------------------- the dataset file
def write_rows(path: Path, rows: list[Any]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_read_dataset_and_select(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", [
        {"id": "a", "split": "dev", "input": {}, "expected": {"x": 1}},
        "",
        {"id": "b", "split": "test", "input": {}, "expected": {}, "resume": None},
        {"id": "c", "input": {}, "expected": {}, "resume": {"approved": True}},
    ])
    rows = ev.read_dataset(path)
    assert [(r.id, r.split, r.line, r.has_resume, r.resume) for r in rows] == [
        ("a", "dev", 1, False, None), ("b", "test", 3, True, None), ("c", None, 4, True, {"approved": True})]
    assert [r.id for r in ev.select(rows, "test")] == ["b"]
    assert [r.id for r in ev.select(rows, "all", limit=2)] == ["a", "b"]
    with pytest.raises(ev.DatasetError, match=r"no examples in split 'test' \(dev 1\); pick another"):
        ev.select(rows[:1], "test")
    with pytest.raises(ev.DatasetError, match="unknown split 'train'"):
        ev.select(rows, "train")


@pytest.mark.parametrize("row,message", [
    ('{"id": "a", "input": {}', "line 2: not valid JSON: Expecting ',' delimiter at column 24"),
    ('["a"]', "line 2: must be a JSON object, got list"),
    ('{"input": {}, "expected": {}}', "line 2: 'id' must be a non-empty string"),
    ('{"id": "ok", "input": {}, "expected": {}}', "line 2: duplicate id 'ok' (first on line 1)"),
    ('{"id": "b", "input": "text", "expected": {}}', "line 2: 'input' must be a JSON object"),
    ('{"id": "b", "input": {}, "expected": {}, "split": "train"}',
     "line 2: 'split' must be one of dev, test, got 'train'"),
])
def test_read_dataset_errors_name_the_line(tmp_path, row, message):
    path = write_rows(tmp_path / "d.jsonl", [{"id": "ok", "input": {}, "expected": {}}, row])
    with pytest.raises(ev.DatasetError) as err:
        ev.read_dataset(path)
    assert str(err.value) == f"{path}: {message}"


def test_example_seed_is_stable_and_per_example():
    assert ev.example_seed(0, "tt-001") == ev.example_seed(0, "tt-001")
    seeds = {ev.example_seed(0, "tt-001"), ev.example_seed(0, "tt-002"), ev.example_seed(1, "tt-001")}
    assert len(seeds) == 3 and 0 <= ev.example_seed(123, "x") < 2**63
    digest = hashlib.sha256(b"0\x1ftt-001").digest()
    assert ev.example_seed(0, "tt-001") == int.from_bytes(digest[:8], "big") & (2**63 - 1)


# ---------------------------------------------------------------- the run driver on a scripted API
class ScriptedAPI:
    """The routes ``run_example`` calls, answering runs from a list of thread values."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = list(answers)
        self.requests: list[tuple[str, str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        path = request.url.path
        if path.endswith("/acceptance"):
            return httpx.Response(200, json={"summary": {"total_tokens": 6, "steps": 4}})
        if request.method == "GET":
            return httpx.Response(200, json={"kwargs": {"mode": "vanilla"}})
        answer = self.answers.pop(0)
        if isinstance(answer, int):
            return httpx.Response(answer, json={"detail": "invalid input for workflow 'w': field 'x'"})
        run = f"r{sum(1 for m, p, _ in self.requests if m == 'POST')}"
        return httpx.Response(200, json=answer, headers={"content-location": f"/threads/t1/runs/{run}"})


def drive(answers: list[Any], ex: ev.Example) -> tuple[ev.ExampleRun, ScriptedAPI]:
    from elesium.cli.commands.eval import run_example

    api = ScriptedAPI(answers)
    with httpx.Client(transport=httpx.MockTransport(api), base_url="http://api") as http:
        return run_example(http, "w", ex, 42, None), api


PAUSED = {"draft": "Hi", "__interrupt__": [{"value": {"question": "Send?"}, "id": "i"}]}


def test_driver_resumes_until_the_run_finishes():
    result, api = drive([PAUSED, PAUSED, {"draft": "Hi", "outcome": "sent"}],
                        example(resume={"approved": True}, has_resume=True))
    assert result.status == "succeeded" and result.interrupts == 2 and result.run_ids == ["r1", "r2", "r3"]
    assert result.state == {"draft": "Hi", "outcome": "sent"} and result.thread_id == "t1"
    assert (result.tokens, result.steps, result.mode) == (18, 12, "vanilla")  # 3 runs of 6 tokens / 4 steps
    posts = [(p, b) for m, p, b in api.requests if m == "POST"]
    assert posts[0] == ("/runs/wait", {"assistant_id": "w", "input": {"subject": "x", "body": "y"},
                                       "config": {"configurable": {"run_seed": 42}},
                                       "metadata": {"eval": {"example": "e1"}}})
    assert posts[1][0] == "/threads/t1/runs/wait" and posts[1][1]["command"] == {"resume": {"approved": True}}
    assert posts[2][1]["config"] == {"configurable": {"run_seed": 42}}


def test_driver_stuck_after_five_answers_and_interrupted_without_policy():
    result, api = drive([PAUSED] * 6, example(resume={"approved": False}, has_resume=True))
    assert result.status == "stuck" and result.interrupts == ev.MAX_INTERRUPTS and len(result.run_ids) == 6
    assert result.state == {"draft": "Hi"}  # scored on the state it stopped with
    result, api = drive([PAUSED], example())
    assert result.status == "interrupted" and result.interrupts == 0 and result.run_ids == ["r1"]
    assert [m for m, _, _ in api.requests] == ["POST", "GET", "GET"]


def test_driver_records_failed_and_refused_runs():
    failed = {"__error__": {"error": "ProbeError", "message": "ProbeError: no probe"}}
    result, _ = drive([failed], example())
    assert (result.status, result.error, result.state) == ("error", "ProbeError: no probe", {})
    result, _ = drive([422], example())
    assert result.status == "error" and result.run_ids == []
    assert result.error == "HTTP 422: invalid input for workflow 'w': field 'x'"
    with pytest.raises(CliError, match="the server refused the eval: invalid input"):
        drive([401], example())


# ---------------------------------------------------------------- the command: bad input
EXPENSE = {"employee": "Li", "amount": 30.0, "currency": "USD", "category": "meals",
           "description": "Lunch with a supplier about the renewal"}


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The command in an empty folder, on an unreachable state server, with loading the model a failure."""
    def refuse(*_: Any, **__: Any) -> None:
        pytest.fail("the model was loaded for a request that should have been refused")

    monkeypatch.setattr("elesium.cli.commands.eval.load_engine", refuse)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def good_row(ident: str = "a", **over: Any) -> dict[str, Any]:
    return {"id": ident, "split": "test", "input": dict(EXPENSE), "expected": {"decision": "approve"}, **over}


@pytest.mark.parametrize("rows,argv,message", [
    (None, ["--dataset", "missing.jsonl"], "dataset missing.jsonl not found"),
    ([good_row(), '{"id": "b",'], [], "d.jsonl: line 2: not valid JSON: Expecting property name enclosed in "
     "double quotes at column 12"),
    ([good_row()], ["--split", "train"], "unknown split 'train'; use dev, test or all"),
    ([good_row(split="dev")], [], "no examples in split 'test' (dev 1); pick another with --split"),
    ([good_row(), good_row("b", input={**EXPENSE, "amount": "lots"})], [],
     "d.jsonl: line 2 (id 'b'): invalid input for workflow 'expense-approval': field 'amount': "
     "Input should be a valid number"),
    ([good_row()], ["--field", "decision"], "--field 'decision': use NAME:KIND, KIND one of choice, span, "
     "set, text, check"),
    ([good_row()], ["--field", "nope:check"], "workflow 'expense-approval' has no check 'nope' "
     "(checks: rationale_cites_rules)"),
    ([good_row()], ["--out", "no/such/dir/r.json"], "--out no/such/dir/r.json: its folder does not exist"),
    ([good_row()], ["--limit", "0"], "--limit must be at least 1, got 0"),
])
def test_bad_input_is_one_line_before_the_model(no_model, capsys, rows, argv, message):
    if rows is not None:
        write_rows(no_model / "d.jsonl", rows)
        argv = ["--dataset", "d.jsonl", *argv]
    before = sorted(no_model.iterdir())
    assert main(["eval", "expense-approval", *argv]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"elesium: error: {message}"] and captured.out == ""
    assert sorted(no_model.iterdir()) == before  # no results file, nothing else


def test_unknown_workflow_and_bad_compare_files(no_model, capsys):
    write_rows(no_model / "d.jsonl", [good_row(), good_row("b")])
    assert main(["eval", "nope", "--dataset", "d.jsonl"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "elesium: error: unknown workflow 'nope' "
        "(registered: expense-approval, incident-summary, ticket-triage)"]
    (no_model / "x.json").write_text('{"workflow": "w"}')
    for argv, message in [
        (["--compare", "gone.json", "x.json"], "--compare: cannot read gone.json: No such file or directory"),
        (["--compare", "d.jsonl", "x.json"], "--compare: d.jsonl is not JSON: Extra data at line 2"),
        (["--compare", "x.json", "x.json"], "--compare: x.json is not an `elesium eval` results file "
         "(no 'fields')"),
    ]:
        assert main(["eval", *argv]) == 1
        assert capsys.readouterr().err.splitlines() == [f"elesium: error: {message}"]
    assert main(["eval"]) == 1
    assert capsys.readouterr().err.splitlines() == ["elesium: error: name the WORKFLOW to evaluate "
                                                    "(or give --compare A B)"]


# ---------------------------------------------------------------- the command, end to end
def test_eval_expense_approval_end_to_end(engine, state_server, tmp_path, monkeypatch, capsys):
    """Three claims through the in-process API on the session's model: one approved, two rejected by
    rule, the third labelled "approve" on purpose, so decision accuracy is 2/3."""
    from elesium.graphs.workflows import default_registry
    from elesium.state import AcceptanceLog, connect

    monkeypatch.setattr("elesium.cli.commands.eval.load_engine", lambda args: engine)
    monkeypatch.setenv("REDIS_URL", state_server.url)
    rows = [
        {"id": "ok-1", "split": "test", "input": EXPENSE, "expected": {"decision": "approve", "rules": []}},
        {"id": "wine-2", "split": "test", "input": {**EXPENSE, "amount": 40.0,
                                                    "description": "Wine and beer with the client team"},
         "expected": {"decision": "reject", "rules": ["alcohol"]}},
        {"id": "sek-3", "split": "dev", "input": {**EXPENSE, "currency": "SEK", "amount": 95.0},
         "expected": {"decision": "approve", "rules": ["currency"]}},
    ]
    dataset = write_rows(tmp_path / "claims.jsonl", rows)
    out = tmp_path / "results.json"
    argv = ["eval", "expense-approval", "--dataset", str(dataset), "--split", "all", "--seed", "7",
            "--out", str(out), "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == doc

    assert doc["workflow_version"] == default_registry().get("expense-approval").version
    sha = hashlib.sha256(dataset.read_bytes()).hexdigest()
    assert doc["dataset"] == {"path": str(dataset), "sha256": sha}
    assert doc["engine"]["model_sha256"] == engine.describe()["model_sha256"]
    assert doc["mode"] == engine.default_mode and doc["split"] == "all" and doc["seed"] == 7
    examples = doc["examples"]
    assert [(e["id"], e["status"], e["seed"]) for e in examples] == [
        (r["id"], "succeeded", ev.example_seed(7, r["id"])) for r in rows]
    assert [e["prediction"]["decision"] for e in examples] == ["approve", "reject", "reject"]
    assert [e["prediction"]["rules"] for e in examples] == [[], ["alcohol"], ["currency"]]
    assert [e["correct"] for e in examples] == [
        {"decision": True, "rules": True, "rationale_cites_rules": True},
        {"decision": True, "rules": True, "rationale_cites_rules": True},
        {"decision": False, "rules": True, "rationale_cites_rules": True}]
    decision = doc["fields"]["decision"]
    assert decision["accuracy"] == pytest.approx(2 / 3)
    assert decision["labels"] == ["approve", "reject"] and decision["confusion"] == [[1, 1], [0, 1]]
    assert doc["fields"]["rules"]["exact"] == 1.0 and doc["fields"]["rules"]["micro_f1"] == 1.0
    assert doc["fields"]["rationale_cites_rules"] == {"kind": "check", "available": True, "n": 3,
                                                      "pass_rate": 1.0}

    # tau and tokens are the acceptance log's, per run and pooled
    log = AcceptanceLog(connect(state_server.url))
    for e in examples:
        (run_id,) = e["run_ids"]
        recorded = log.summary(run_id)
        assert e["tokens"] == recorded.total_tokens > 0 and e["steps"] == recorded.steps > 0
        assert e["tau"] == pytest.approx(recorded.tau)
    s = doc["summary"]
    assert s["tokens"] == sum(e["tokens"] for e in examples)
    assert s["steps"] == sum(e["steps"] for e in examples)
    assert s["tau"] == pytest.approx(s["tokens"] / s["steps"]) and s["errors"] == 0
    assert s["latency_p50_s"] == pytest.approx(sorted(e["latency_s"] for e in examples)[1], abs=1e-4)

    assert main(["eval", "--compare", str(out), str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "no example changed correctness"
