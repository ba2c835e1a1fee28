"""``elesium run WORKFLOW --input JSON``: run a workflow locally, on the embedded Redis by default.

Everything that can be wrong with the request (malformed JSON, unknown workflow, input that does not
match the workflow's schema) is checked before the model loads or anything is written, and ends in
one line on stderr with exit code 1. A run that stops at an interrupt says so and how to resume it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from elesium.cli.commands.common import add_model_args, load_engine
from elesium.cli.errors import CliError
from elesium.cli.projects import add_config_args, registry_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a workflow (see `elesium workflows`) on the local state server")
    p.add_argument("workflow", help="workflow name")
    p.add_argument(
        "--input", required=True, help="the input as a JSON object, or @FILE to read it from a file"
    )
    p.add_argument("--seed", type=int, default=None, help="run seed (default: random, recorded with the run)")
    p.add_argument("--version", default=None, help="a registered version of the workflow (default: latest)")
    p.add_argument(
        "--mode",
        choices=["vanilla", "speculative", "medusa", "typical"],
        default=None,
        help="decode mode for LLM nodes that do not pin one (default: the engine's)",
    )
    p.add_argument(
        "--record-trees",
        action="store_true",
        help="record every drafted tree of every decode step in the acceptance log (the audit console's "
        "step-by-step tree view; about 14 bytes per drafted node, no token changes)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: final state, run id, version, acceptance summary",
    )
    remote = p.add_argument_group("remote server")
    remote.add_argument(
        "--server",
        default=None,
        metavar="URL",
        help="run on an Elesium server (`elesium serve`) instead of locally, through the SDK",
    )
    remote.add_argument("--api-key", default=None, help="the server's API key (default: $ELESIUM_API_KEY)")
    add_config_args(p)
    add_model_args(p)
    p.set_defaults(handler=run)


def parse_json_arg(text: str, flag: str) -> Any:
    """The JSON value of a flag (``@path`` reads a file); one-line CliError when it does not parse."""
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise CliError(f"{flag}: cannot read {text[1:]}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(
            f"{flag} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None


def print_result(result: Any, as_json: bool) -> int:
    """Report a RunResult; exit code 0 unless the run failed."""
    if as_json:
        print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False, default=str))
    else:
        print(
            f"\nrun {result.run_id}: {result.workflow} {result.workflow_version} {result.status}",
            file=sys.stderr,
        )
        for key, value in result.state.items():
            if key != "llm_calls":
                print(f"{key}: {json.dumps(value, ensure_ascii=False)}")
        acc = result.acceptance
        print(
            f"acceptance: {acc.get('calls', 0)} LLM calls, {acc.get('tokens', 0)} tokens, "
            f"{acc.get('steps', 0)} steps, tau {acc.get('tau', 0.0)}",
            file=sys.stderr,
        )
    if result.status == "interrupted":
        payload = json.dumps([i["value"] for i in result.interrupt or []], ensure_ascii=False, default=str)
        print(
            f"run {result.run_id} stopped at an interrupt, waiting for: {payload}\n"
            f"continue it with: elesium resume {result.run_id} --value JSON",
            file=sys.stderr,
        )
    if result.status == "failed":
        print(f"elesium: error: run {result.run_id} failed: {result.error}", file=sys.stderr)
        return 1
    return 0


def token_printer(as_json: bool) -> Any:
    """Streams LLM tokens to stderr as they decode (nothing in --json mode: stdout stays one document)."""
    if as_json:
        return None
    last: list[str] = []

    def on_event(mode: str, payload: Any) -> None:
        if mode != "custom" or not isinstance(payload, dict) or "text" not in payload:
            return
        node = f"{payload.get('node')}#{payload.get('call_index')}"
        if last != [node]:
            sys.stderr.write(f"\n[{node}] ")
            last[:] = [node]
        sys.stderr.write(payload["text"])
        sys.stderr.flush()

    return on_event


def run_remote(args: argparse.Namespace, payload: Any) -> int:
    """Run through the server's LangGraph-protocol routes; the server validates, runs and records.

    Nothing is checked locally beyond the JSON itself: the server holds the registry the run will use,
    and answers a bad request with a 4xx whose message becomes the one error line here.
    """
    import os

    import httpx

    from elesium.api.client import ElesiumAPIError, ElesiumClient

    key = args.api_key or os.environ.get("ELESIUM_API_KEY") or None
    assistant = args.workflow if args.version is None else f"{args.workflow}:{args.version}"
    configurable = {k: v for k, v in (("run_seed", args.seed), ("mode", args.mode)) if v is not None}
    if args.record_trees:
        configurable["record_trees"] = True
    printer = token_printer(args.json)
    try:
        with ElesiumClient(args.server, api_key=key) as client:
            thread_id = client.threads.create()["thread_id"]
            run_id, state, interrupts, error = "", {}, [], None
            for part in client.runs.stream(
                thread_id,
                assistant,
                input=payload,
                config={"configurable": configurable},
                stream_mode=["values", "updates", "messages-tuple"],
            ):
                if part.event == "metadata":
                    run_id = part.data.get("run_id", run_id)
                elif part.event == "values":
                    state = part.data
                elif part.event == "updates":
                    interrupts += (part.data or {}).get("__interrupt__", [])
                elif part.event == "messages" and printer is not None:
                    message, meta = part.data
                    printer(
                        "custom",
                        {
                            "node": meta.get("langgraph_node"),
                            "call_index": "",
                            "text": message.get("content", ""),
                        },
                    )
                elif part.event == "error":
                    error = (part.data or {}).get("message") or str(part.data)
            run = client.runs.get(thread_id, run_id) if run_id else {}
            summary = client.acceptance(thread_id, run_id, limit=1)["summary"] if run_id else {}
    except (httpx.HTTPStatusError, ElesiumAPIError) as exc:
        response = getattr(exc, "response", None)
        detail = getattr(exc, "detail", None)
        if detail is None and response is not None:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
        raise CliError(f"the server refused the run: {detail or exc}") from None
    except httpx.TransportError as exc:
        raise CliError(f"cannot reach {args.server}: {exc}") from None
    status = "failed" if error else "interrupted" if interrupts else "succeeded"
    doc = {
        "run_id": run_id,
        "thread_id": thread_id,
        "workflow": args.workflow,
        "status": status,
        "state": state,
        "interrupts": [i.get("value") for i in interrupts],
        "acceptance": summary,
        "run": run,
    }
    if args.json:
        print(json.dumps(doc, indent=2, ensure_ascii=False, default=str))
    else:
        print(f"\nrun {run_id} (thread {thread_id}): {args.workflow} {status}", file=sys.stderr)
        for key_, value in state.items():
            if key_ != "llm_calls":
                print(f"{key_}: {json.dumps(value, ensure_ascii=False)}")
    if status == "interrupted":
        print(
            f"run {run_id} stopped at an interrupt, waiting for: "
            f"{json.dumps(doc['interrupts'], ensure_ascii=False, default=str)}\n"
            f"answer it through the API: runs.create(thread {thread_id}, command={{'resume': ...}})",
            file=sys.stderr,
        )
    if error:
        print(f"elesium: error: run {run_id} failed: {error}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    from elesium.graphs.registry import UnknownWorkflowError
    from elesium.graphs.runner import WorkflowRunner, validate
    payload = parse_json_arg(args.input, "--input")
    if args.server:
        return run_remote(args, payload)
    registry = registry_from_args(args)
    try:
        workflow = registry.get(args.workflow, args.version)
    except UnknownWorkflowError as exc:
        raise CliError(str(exc)) from None
    validate(
        workflow.input_model, payload, f"invalid input for workflow {workflow.name!r}"
    )  # before any write
    engine = load_engine(args)
    runner = WorkflowRunner(engine, mode=args.mode, registry=registry, record_trees=args.record_trees)
    result = runner.start(workflow, payload, seed=args.seed, on_event=token_printer(args.json))
    return print_result(result, args.json)
