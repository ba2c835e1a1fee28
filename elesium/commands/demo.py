"""``elesium demo``: the main job until the workflow service lands.

Starts (or reuses) the embedded Valkey server, loads the bundled model with its Medusa heads, runs
one sample triage prompt with speculative decoding, and records the run: its metadata in the run
registry and every decoding step's acceptance record in the run's Redis Stream. Then it reads the
audit trail back and checks it reproduces the output token for token.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid

from elesium.commands.common import add_model_args, load_engine

SAMPLE_TICKET = (
    "Triage this support ticket. Reply with the category (billing, outage, access, other), the priority "
    "(P1-P4) and one sentence of justification.\n\nTicket: Since 09:10 UTC none of our 40 agents can log "
    "in to the helpdesk; the login page returns HTTP 502. Customers are waiting."
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run a sample triage generation, audited in the embedded Valkey")
    p.add_argument("--prompt", default=SAMPLE_TICKET)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=7)
    add_model_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from elesium.inference.sampling import SamplingParams
    from elesium.state import AcceptanceEntry, AcceptanceLog, RunRecord, RunRegistry, RunStatus, default_url, hash_input

    url = default_url()
    print(f"state: {url}", file=sys.stderr)
    registry, log = RunRegistry.from_url(url), AcceptanceLog.from_url(url)
    engine = load_engine(args)
    # The demo shows the speculative engine's audit trail even where vanilla is the faster default.
    mode = "medusa" if "medusa" in engine.modes else "vanilla"
    params = SamplingParams(max_tokens=args.max_tokens, seed=args.seed)
    run_id = f"demo-{uuid.uuid4().hex[:12]}"
    registry.create(RunRecord(run_id=run_id, workflow="demo-triage", workflow_version="1",
                              input_hash=hash_input({"prompt": args.prompt, "max_tokens": args.max_tokens}),
                              seeds={"sampling": args.seed}))
    registry.update_status(run_id, RunStatus.RUNNING)
    steps: list[AcceptanceEntry] = []

    def audit(record) -> None:
        steps.append(AcceptanceEntry(run_id=run_id, node_id="triage", step_id=len(steps), record=record))

    print(f"model: {engine.weights_info.source.name} on {engine.model.device} ({mode})\n", file=sys.stderr)
    try:
        stream = engine.stream(args.prompt, params, mode=mode, on_step=audit)
        for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        result = stream.result
        log.append_many(steps)
    except BaseException as exc:
        registry.update_status(run_id, RunStatus.FAILED, error=str(exc) or type(exc).__name__)
        raise
    registry.update_status(run_id, RunStatus.SUCCEEDED)
    summary = log.summary(run_id)
    stored = [t for e in log.read(run_id) for t in e.record.tokens]
    replayed = [result.token_ids[0], *stored][: result.new_tokens]
    print("\n")
    print(json.dumps({
        "run_id": run_id,
        "status": registry.get(run_id).status.value,
        "new_tokens": result.new_tokens,
        "tokens_per_s": round(result.tokens_per_s, 1),
        "steps": summary.steps,
        "tau": round(summary.tau, 2),
        "acceptance_by_depth": [round(x, 2) for x in summary.acceptance_by_depth],
        "audit_trail_matches_output": replayed == list(result.token_ids),
    }, indent=1))
    return 0 if replayed == list(result.token_ids) else 1
