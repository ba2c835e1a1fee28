"""``elesium eval WORKFLOW``: score a workflow on a labelled JSONL dataset, through the API's run path.

Every example runs the way a user's run does: ``POST /runs/wait`` with the example's input (a
stateless run, so a refused request writes nothing; the thread it creates is kept), then, while the
run stops at an interrupt and the row gives a ``resume`` answer, ``POST /threads/{id}/runs/wait``
with ``command: {"resume": ...}`` (at most five times; still interrupted after that is ``stuck``),
and ``GET .../acceptance`` for each run's tokens and decode steps. So the queue, the run executor,
the checkpointer and the acceptance log are all in what is measured. By default the routes are those
of an app that ``create_app`` builds in this process around the local engine and state server (the
in-process ASGI client of Starlette, one private queue, tenant ``eval``); with ``--server URL`` they
are a running ``elesium serve``'s. The workflow is one of the project's graphs with ``--config
langgraph.json`` (or ``./langgraph.json``), else a built-in one, as for ``run`` and ``serve``.

Everything that can be wrong with the request (the dataset file, a malformed line, the split, the
workflow, an input or resume value that fails the workflow's schema, ``--field``, ``--out``'s
folder) is one line on stderr and exit code 1, before the model loads or anything is written.
Scoring, the results document and the comparison are :mod:`elesium.graphs.evaluation`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elesium.cli.commands.common import add_model_args, add_state_args, load_engine, settings_from_args
from elesium.cli.errors import CliError
from elesium.cli.projects import add_config_args, load_project_env, registry_from_args
from elesium.graphs import evaluation as ev

MODES = ["vanilla", "speculative", "medusa", "typical"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="score a workflow on a labelled dataset (accuracy, F1, latency, tau)")
    p.add_argument("workflow", nargs="?", help="workflow name (see `elesium workflows`)")
    p.add_argument("--dataset", metavar="FILE", help="JSONL rows {id, split, input, expected, resume} "
                   "(default: the workflow's shipped set, graphs/workflows/evals/<name>.jsonl)")
    p.add_argument("--split", default="test", help="dev, test or all (default: test)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="only the split's first N examples")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="each example's run seed is derived from S and its id (default: 0)")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="decode mode of the runs (default: the engine's)")
    p.add_argument("--out", metavar="FILE", help="results file (default: eval-<workflow>-<split>.json)")
    p.add_argument("--field", action="append", default=[], metavar="NAME:KIND",
                   help=f"score expected key NAME as KIND ({', '.join(ev.FIELD_KINDS)}); repeatable")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="set two results files side by side (no model, no runs)")
    p.add_argument("--json", action="store_true", help="print the results document instead of the table")
    remote = p.add_argument_group("remote server")
    remote.add_argument("--server", metavar="URL", help="run the examples on an `elesium serve`")
    remote.add_argument("--api-key", default=None, help="the server's API key (default: $ELESIUM_API_KEY)")
    add_model_args(p)
    add_state_args(p)
    add_config_args(p)
    p.set_defaults(handler=run)


@dataclass
class Plan:
    """A checked eval request: everything decided before any run."""

    workflow: str
    spec: ev.EvalSpec
    dataset: Path
    examples: list[ev.Example]
    out: Path


def run(args: argparse.Namespace) -> int:
    """Check the request, load the engine, run every example through the in-process API, report.

    The checks come first so a typo costs a second, not a model load; exit code 0 once the results
    are written, however many examples failed (their errors are in the results).
    """
    if args.compare:
        return compare_files(args.compare[0], args.compare[1], as_json=args.json)
    if not args.workflow:
        raise CliError("name the WORKFLOW to evaluate (or give --compare A B)")
    if args.split not in (*ev.SPLITS, "all"):
        raise CliError(f"unknown split {args.split!r}; use {', '.join(ev.SPLITS)} or all")
    if args.limit is not None and args.limit < 1:
        raise CliError(f"--limit must be at least 1, got {args.limit}")
    if args.seed < 0:
        raise CliError(f"--seed must be >= 0, got {args.seed}")
    if args.server:
        return _run_remote(args)
    load_project_env(args)
    registry = registry_from_args(args)  # the project's graphs (--config, ./langgraph.json) or the built-ins
    workflow = registry.get(args.workflow)  # UnknownWorkflowError: one line
    plan = make_plan(args)
    validate_examples(plan, workflow)
    engine = load_engine(args)
    mode = _engine_mode(engine, args.mode)
    url = _state_url(args)
    with in_process_api(engine, registry, url) as http:
        runs = run_examples(http, plan, args.seed, args.mode)
    return _report(args, plan, runs, workflow.version, engine.describe(), mode)


def make_plan(args: argparse.Namespace) -> Plan:
    """The dataset, the examples of the split, the scoring spec and the results path, all checked."""
    dataset = Path(args.dataset) if args.dataset else ev.shipped_dataset(args.workflow)
    if not dataset.is_file():
        why = "" if args.dataset else f" (no --dataset given, and {args.workflow!r} has no shipped set)"
        raise CliError(f"dataset {dataset} not found{why}")
    examples = ev.select(ev.read_dataset(dataset), args.split, args.limit)
    keys = list(dict.fromkeys(k for e in examples for k in e.expected))
    try:
        spec = ev.spec_for(args.workflow).with_fields(keys, parse_fields(args.field))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    out = Path(args.out or f"eval-{args.workflow}-{args.split}.json")
    if out.is_dir() or not out.resolve().parent.is_dir():
        raise CliError(f"--out {out}: {'is a folder' if out.is_dir() else 'its folder does not exist'}")
    return Plan(args.workflow, spec, dataset, examples, out)


def parse_fields(values: list[str]) -> dict[str, ev.FieldKind]:
    """``--field NAME:KIND`` flags as {name: kind}."""
    fields: dict[str, ev.FieldKind] = {}
    for value in values:
        name, sep, kind = value.rpartition(":")
        if not sep or not name or kind not in ev.FIELD_KINDS:
            raise CliError(f"--field {value!r}: use NAME:KIND, KIND one of {', '.join(ev.FIELD_KINDS)}")
        fields[name] = kind  # type: ignore[assignment]  # checked against FIELD_KINDS above
    return fields


def validate_examples(plan: Plan, workflow: Any) -> None:
    """Each input (and resume answer) against the workflow's schemas; the first bad one names its line."""
    from elesium.graphs.runner import validate

    for e in plan.examples:
        where = f"{plan.dataset}: line {e.line} (id {e.id!r})"
        validate(workflow.input_model, e.input, f"{where}: invalid input for workflow {workflow.name!r}")
        if e.has_resume and workflow.resume_model is not None:
            validate(workflow.resume_model, e.resume,
                     f"{where}: invalid resume value for workflow {workflow.name!r}")


def _engine_mode(engine: Any, requested: str | None) -> str:
    """The decode mode the runs will use; a mode this engine lacks is the user's error, found now."""
    from elesium.inference.records import normalize_mode

    mode = normalize_mode(requested) if requested else engine.default_mode
    if mode not in engine.modes:
        raise CliError(f"decode mode {requested!r} is not available on this engine "
                       f"(available: {', '.join(engine.modes)}); its draft heads did not load")
    return mode


def _state_url(args: argparse.Namespace) -> str:
    from elesium.state.connection import default_url

    return default_url(settings_from_args(args))


@contextlib.contextmanager
def in_process_api(engine: Any, registry: Any, redis_url: str) -> Iterator[Any]:
    """An HTTP client on the API app built around this engine, served in this process.

    The app's lifespan runs (its queue worker executes the runs, as under ``elesium serve``); its
    queue is private, so no other server's workers take these runs, and its one key is tenant
    ``eval``, so the eval's threads stay out of every other tenant's listings.
    """
    import logging

    from starlette.testclient import TestClient

    from elesium.api.app import create_app
    from elesium.api.settings import ApiSettings

    key = secrets.token_hex(16)
    settings = ApiSettings(api_keys={key: "eval"}, redis_url=redis_url, workers=1, shutdown_grace_s=5.0,
                           queue_name=f"eval-{secrets.token_hex(6)}")
    app = create_app(settings, engine=engine, registry=registry)
    # A failed run is one line of the eval's progress and its results; the queue worker's traceback
    # of it shows with -v only.
    worker_log = logging.getLogger("elesium.worker")
    quiet, level = not logging.getLogger("elesium").isEnabledFor(logging.INFO), worker_log.level
    if quiet:
        worker_log.setLevel(logging.CRITICAL)
    try:
        with TestClient(app, headers={"x-api-key": key}) as client:
            yield client
    finally:
        worker_log.setLevel(level)


# ---------------------------------------------------------------- running the examples
class Refused(Exception):
    """The API answered a run request with a 4xx/5xx (recorded as the example's error)."""


def _request(http: Any, method: str, url: str, **kwargs: Any) -> Any:
    """One API call; an unreachable server or a refused key ends the eval (one line)."""
    import httpx

    try:
        response = http.request(method, url, **kwargs)
    except httpx.TransportError as exc:
        raise CliError(f"cannot reach {http.base_url}: {exc}") from None
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        if response.status_code in (401, 403):
            raise CliError(f"the server refused the eval: {detail}")
        raise Refused(f"HTTP {response.status_code}: {detail}")
    return response


def _wait(http: Any, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], str, str]:
    """(thread values, run id, thread id) of a ``runs/wait`` call."""
    response = _request(http, "POST", path, json=body)
    location = response.headers.get("content-location", "")  # /threads/{tid}/runs/{rid}
    parts = location.strip("/").split("/")
    if len(parts) != 4:
        raise Refused(f"the server's answer names no run (Content-Location {location!r})")
    return response.json() or {}, parts[3], parts[1]


def run_example(http: Any, workflow: str, example: ev.Example, seed: int, mode: str | None) -> ev.ExampleRun:
    """One example through the API: its run, its interrupts answered, then its acceptance figures."""
    configurable: dict[str, Any] = {"run_seed": seed, **({"mode": mode} if mode else {})}
    common = {"assistant_id": workflow, "config": {"configurable": configurable},
              "metadata": {"eval": {"example": example.id}}}
    start = time.perf_counter()
    run_ids: list[str] = []
    thread_id, values, interrupts = None, {}, 0
    try:
        values, run_id, thread_id = _wait(http, "/runs/wait", {**common, "input": example.input})
        run_ids.append(run_id)
        while "__interrupt__" in values and example.has_resume and interrupts < ev.MAX_INTERRUPTS:
            interrupts += 1
            values, run_id, _ = _wait(http, f"/threads/{thread_id}/runs/wait",
                                      {**common, "command": {"resume": example.resume}})
            run_ids.append(run_id)
    except Refused as exc:
        return ev.ExampleRun(example, "error", {}, time.perf_counter() - start, interrupts=interrupts,
                             error=str(exc), seed=seed, thread_id=thread_id, run_ids=run_ids)
    latency = time.perf_counter() - start
    error = values.pop("__error__", None)
    stopped = values.pop("__interrupt__", None)
    status: ev.RunStatus = ("error" if error else "stuck" if stopped and example.has_resume
                            else "interrupted" if stopped else "succeeded")
    tokens = steps = 0
    for rid in run_ids:
        summary = _request(http, "GET", f"/threads/{thread_id}/runs/{rid}/acceptance",
                           params={"limit": 1}).json()["summary"]
        tokens, steps = tokens + summary["total_tokens"], steps + summary["steps"]
    recorded = _request(http, "GET", f"/threads/{thread_id}/runs/{run_ids[0]}").json()
    message = (error.get("message") or error.get("error")) if isinstance(error, dict) else error
    return ev.ExampleRun(example, status, values, latency, tokens=tokens, steps=steps, interrupts=interrupts,
                         error=None if message is None else str(message), seed=seed, thread_id=thread_id,
                         run_ids=run_ids, mode=(recorded.get("kwargs") or {}).get("mode"))


def run_examples(http: Any, plan: Plan, seed: int, mode: str | None) -> list[ev.ExampleRun]:
    """The examples one after another (the engine decodes one sequence at a time), with progress."""
    runs = []
    for i, example in enumerate(plan.examples, 1):
        result = run_example(http, plan.workflow, example, ev.example_seed(seed, example.id), mode)
        tau = f"{result.tokens / result.steps:.2f}" if result.steps else "-"
        print(f"[{i}/{len(plan.examples)}] {example.id} {result.status} {result.latency_s:.2f} s tau {tau}"
              + (f": {result.error}" if result.error else ""), file=sys.stderr)
        runs.append(result)
    return runs


# ---------------------------------------------------------------- a remote server
def _run_remote(args: argparse.Namespace) -> int:
    """The same runs on ``elesium serve``: its registry, engine and state; nothing loads here."""
    import os

    import httpx

    key = args.api_key or os.environ.get("ELESIUM_API_KEY") or None
    plan = make_plan(args)
    headers = {"x-api-key": key} if key else {}
    with httpx.Client(base_url=args.server.rstrip("/"), headers=headers, timeout=3600.0) as http:
        try:
            assistant = _request(http, "GET", f"/assistants/{args.workflow}").json()
        except Refused as exc:
            raise CliError(f"workflow {args.workflow!r} on {args.server}: {exc}") from None
        version = str((assistant.get("metadata") or {}).get("workflow_version", ""))
        local = _local_workflow(args.workflow, version)
        if local is not None:  # the same version here: its schemas check the inputs before any run
            validate_examples(plan, local)
        runs = run_examples(http, plan, args.seed, args.mode)
    modes = sorted({r.mode for r in runs if r.mode})
    return _report(args, plan, runs, version, {"server": args.server}, ",".join(modes) or args.mode)


def _local_workflow(name: str, version: str) -> Any | None:
    from elesium.graphs.registry import UnknownWorkflowError
    from elesium.graphs.workflows import default_registry

    try:
        return default_registry().get(name, version or None)
    except UnknownWorkflowError:
        return None


# ---------------------------------------------------------------- results
def _report(args: argparse.Namespace, plan: Plan, runs: list[ev.ExampleRun], version: str,
            engine: dict[str, Any], mode: str | None) -> int:
    doc = ev.results_document(plan.spec, runs, workflow_version=version, dataset=plan.dataset,
                              dataset_sha256=ev.file_sha256(plan.dataset), split=args.split, engine=engine,
                              mode=mode, seed=args.seed)
    plan.out.write_text(json.dumps(doc, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    print(json.dumps(doc, indent=2, ensure_ascii=False, default=str) if args.json else ev.render(doc))
    print(f"results: {plan.out}", file=sys.stderr)
    return 0


def _load_results(path: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise CliError(f"--compare: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise CliError(f"--compare: {path} is not JSON: {exc.msg} at line {exc.lineno}") from None
    keys = ("workflow", "fields", "examples", "summary", "dataset")
    missing = [k for k in keys if not isinstance(doc, dict) or k not in doc]
    if missing:
        raise CliError(f"--compare: {path} is not an `elesium eval` results file (no {missing[0]!r})")
    return doc


def compare_files(a: str, b: str, *, as_json: bool) -> int:
    """``--compare A B``: the two results documents side by side (no model, no state server)."""
    first, second = _load_results(a), _load_results(b)
    if as_json:
        print(json.dumps(ev.compare_rows(first, second), indent=2, ensure_ascii=False, default=str))
    else:
        print(ev.compare(first, second))
    return 0
