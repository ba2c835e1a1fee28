"""``elesium demo``: the whole service on one machine, end to end, in a minute or two.

Starts (or reuses) the embedded Valkey, loads the bundled model, serves the API on a free loopback
port (uvicorn on a background thread, with a one-off demo key), and then acts as a client would,
through the SDK only: it streams a ``ticket-triage`` run (node updates and the reply's tokens as
they decode), answers the approval interrupt, prints the outcome, the run's acceptance summary
(tau, per node) and the verdict of an audit replay that re-executes both runs and compares every
token and checkpoint with the record. Then it stops the server. Exit code 0 when the replay says
``identical``.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from typing import Any

from elesium.cli.commands.common import add_model_args, add_state_args, load_engine, settings_from_args

SAMPLE_TICKET = {
    "subject": "Nobody can log in to the helpdesk",
    "body": "Since 09:10 UTC none of our 40 agents can log in to the helpdesk; "
    "the login page returns HTTP 502. "
    "Customers are waiting. Order ORD-48213.",
    "customer": "Dana at Northwind",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="serve the API locally and run ticket-triage through the SDK: stream, approve, "
        "acceptance, replay",
    )
    p.add_argument(
        "--ticket", default=None, help="ticket JSON ({subject, body, customer}); default: a sample"
    )
    p.add_argument("--seed", type=int, default=7, help="run seed (the replay reproduces it)")
    p.add_argument("--reject", action="store_true", help="answer the approval with a rejection")
    p.add_argument(
        "--mode",
        choices=["vanilla", "speculative", "typical"],
        default=None,
        help="decode mode of the LLM nodes (default: the engine's own choice on this device: speculative "
        "where its tuned profile says speculation pays, as on the H200; vanilla on a CPU where it does not)",
    )
    add_model_args(p)
    add_state_args(p)
    p.set_defaults(handler=run)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from elesium.api.app import create_app
    from elesium.api.client import ElesiumClient
    from elesium.api.server import BackgroundServer
    from elesium.api.settings import ApiSettings
    from elesium.cli.errors import CliError
    from elesium.state import default_url

    ticket = SAMPLE_TICKET
    if args.ticket:
        try:
            ticket = json.loads(args.ticket)
        except json.JSONDecodeError as exc:
            raise CliError(f"--ticket is not valid JSON: {exc.msg}") from None
    started = time.perf_counter()
    url = default_url(settings_from_args(args))
    _say(f"state: {url}")
    engine = load_engine(args)
    mode = args.mode or engine.default_mode
    why = "" if args.mode else f"; {engine.mode_reason}"
    _say(f"model: {engine.weights_info.source.name} on {engine.model.device} (decode mode {mode}{why})")
    key = "demo-" + secrets.token_hex(8)
    app = create_app(ApiSettings(api_keys={key: "demo"}, redis_url=url), engine=engine)
    with BackgroundServer(app) as base, ElesiumClient(base, api_key=key) as client:
        _say(f"server: {base} (tenant {client.whoami()['tenant']})\n")
        assistant = next(a for a in client.assistants.search(graph_id="ticket-triage"))
        thread = client.threads.create(metadata={"demo": True})
        tid = thread["thread_id"]
        print(f"ticket: {ticket['subject']}")
        interrupt: dict[str, Any] | None = None
        streaming_node = None
        for part in client.runs.stream(
            tid,
            assistant["assistant_id"],
            input=ticket,
            config={"configurable": {"run_seed": args.seed, "mode": mode}},
            stream_mode=["updates", "messages-tuple"],
        ):
            if part.event == "messages":
                message, meta = part.data
                node = meta.get("langgraph_node")
                if node != streaming_node:
                    streaming_node = node
                    sys.stdout.write(f"  {node}: ")
                sys.stdout.write(message.get("content", ""))
                sys.stdout.flush()
            elif part.event == "updates":
                for node, update in part.data.items():
                    if node == "__interrupt__":
                        interrupt = update[0]["value"]
                        continue
                    if streaming_node is not None:
                        sys.stdout.write("\n")
                        streaming_node = None
                    shown = {k: v for k, v in (update or {}).items() if k not in ("llm_calls", "draft")}
                    print(f"  [{node}] {json.dumps(shown, ensure_ascii=False)}")
            elif part.event == "error":
                raise CliError(f"the run failed: {part.data.get('message')}")
        if interrupt is None:
            raise CliError("the triage run ended without asking for approval")
        print(
            f"\napproval requested: {interrupt.get('question')} (category {interrupt.get('category')}, "
            f"priority {interrupt.get('priority')}, team {interrupt.get('team')})"
        )
        draft = str(interrupt.get("draft", ""))
        print("\ndraft reply:\n" + "\n".join(f"  | {line}" for line in draft.splitlines()))
        checks = interrupt.get("checks") or {}
        failed = [name for name, ok in checks.items() if not ok]
        print(f"reviewer's checks: {len(checks) - len(failed)}/{len(checks)} passed"
              + (f" (failed: {', '.join(failed)})" if failed else ""))
        # The demo's reviewer sends only a draft that passes every check (and never with --reject).
        decision = {"approved": not args.reject and bool(checks) and not failed, "reviewer": "demo reviewer"}
        print(f"answering: {json.dumps(decision)}")
        result = client.runs.wait(tid, assistant["assistant_id"], command={"resume": decision})
        runs = client.runs.list(tid)  # newest first: the resume, then the first run
        first, last = runs[-1], runs[0]
        print("\nresult:")
        for field in ("category", "priority", "team", "references", "escalation", "outcome", "final_reply"):
            if field in result:
                print(f"  {field}: {json.dumps(result[field], ensure_ascii=False)}")
        print(f"  approved by: {last['approver']}")

        acc = client.acceptance(tid, first["run_id"], limit=1)
        summary = acc["summary"]
        print(
            f"\nacceptance (run {first['run_id'][:8]}): {len(acc['calls'])} LLM calls, "
            f"{summary['total_tokens']} tokens in {summary['steps']} steps, tau {summary['tau']:.2f}"
        )
        for node, s in acc["per_node"].items():
            depth = ", ".join(f"{x:.2f}" for x in s["acceptance_by_depth"][:4]) or "-"
            print(f"  {node}: {s['steps']} steps, tau {s['tau']:.2f}, acceptance by depth [{depth}]")

        report = client.replay(tid, last["run_id"], mode="reexecute")
        print(
            f"\nreplay (re-execute both runs): {report['verdict'].upper()} - "
            f"{report['calls_compared']} LLM calls, "
            f"{report['tokens_compared']} tokens, {report['checkpoints_compared']} checkpoints compared "
            f"in {report['elapsed_s']:.1f} s"
        )
        for note in report["notes"]:
            print(f"  note: {note}")
        if report["divergence"]:
            d = report["divergence"]
            print(
                f"  first divergence: node {d['node']} call {d['call']} step {d['step']} field {d['field']}: "
                f"recorded {d['recorded']!r}, replayed {d['replayed']!r}"
            )
    _say(f"\nserver stopped; demo took {time.perf_counter() - started:.0f} s")
    return 0 if report["verdict"] == "identical" else 1
