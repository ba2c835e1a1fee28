"""What the audit hash chain costs: append time per super-step and verify time per run.

Usage: .venv/bin/python benchmarks/audit_chain_cost.py [--runs N]

The shipped ticket-triage workflow runs N times with the chain on and N times with it off,
alternating, on the embedded Valkey and the float32 CPU engine, through ``graphs/execution.drive``
as an API run is (run row, LLM call records, acceptance stream, Redis checkpointer). With the chain
on, each ``RunAudit.sync`` (one per super-step, plus the one before the seal) is timed, the seal
too, and the finished run is verified (``verify_run``, HMAC-signed). Prints JSON with medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from elesium.config import Settings
from elesium.graphs.audit_chain import open_run_audit, verify_run
from elesium.graphs.execution import RunEngine, drive, run_config
from elesium.graphs.workflows import ticket_triage
from elesium.state import AcceptanceLog, EmbeddedValkey, RedisSaver, Retention, connect
from elesium.state.audit_chain import HmacSigner
from elesium.state.threads import RunRow, ThreadRow, ThreadStore

EVAL = Path(__file__).resolve().parents[1] / "graphs" / "workflows" / "evals" / "ticket_triage.jsonl"


def one_run(engine, wf, client, *, chained: bool, case: dict) -> dict:
    store, saver = ThreadStore(client), RedisSaver(client)
    log = AcceptanceLog(client, retention=Retention(maxlen=None))
    tid, rid = f"bench-{uuid.uuid4().hex}", str(uuid.uuid4())
    store.create_thread(ThreadRow(thread_id=tid, tenant="bench"))
    store.create_run(RunRow(run_id=rid, thread_id=tid, tenant="bench", assistant_id="bench", workflow=wf.name,
                            workflow_version=wf.version, request={"input": case["input"]}, seed=7))
    tap = RunEngine(engine, on_call=lambda call: store.add_call(rid, call.model_dump()))
    graph = wf.build(saver)
    config = run_config(tap, run_id=rid, thread_id=tid, seed=7, log=log, workflow=wf.name)
    settings = Settings(audit_key="bench-key", audit_chain="on" if chained else "off")
    audit = open_run_audit(client, thread_id=tid, run_id=rid, store=store, cp_prefix=saver.prefix,
                           acceptance=log, settings=settings)
    t0 = time.perf_counter()
    outcome = drive(graph, case["input"], config, audit=audit)
    out = {"run_s": time.perf_counter() - t0, "status": outcome.status}
    if audit is not None:
        out["syncs_ms"] = [s * 1000 for s in audit.sync_seconds]
        t1 = time.perf_counter()
        verdict = verify_run(client, rid, store=store, cp_prefix=saver.prefix, acceptance=log,
                             signer=HmacSigner("bench-key"))
        out["verify_ms"] = (time.perf_counter() - t1) * 1000
        out["ok"], out["entries"] = verdict.ok, verdict.entries_checked
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    from elesium.inference.engine import Engine

    engine = Engine.load(device="cpu", dtype="float32", max_len=2048)
    wf = ticket_triage.workflow()
    case = json.loads(EVAL.read_text().splitlines()[0])
    with tempfile.TemporaryDirectory() as data:
        server = EmbeddedValkey(Path(data)).start()
        try:
            client = connect(server.url)
            one_run(engine, wf, client, chained=True, case=case)  # warm-up (compiles, caches)
            on, off = [], []
            for _ in range(args.runs):
                on.append(one_run(engine, wf, client, chained=True, case=case))
                off.append(one_run(engine, wf, client, chained=False, case=case))
        finally:
            server.stop()
    per_step = [ms for r in on for ms in r["syncs_ms"][:-1]]
    med = statistics.median
    print(json.dumps({
        "workflow": wf.name, "runs_each": args.runs, "status": sorted({r["status"] for r in on + off}),
        "super_steps_per_run": med(len(r["syncs_ms"]) - 1 for r in on),
        "chain_entries_per_run": med(r["entries"] for r in on),
        "append_ms_per_super_step_median": round(med(per_step), 3),
        "append_ms_per_super_step_p90": round(sorted(per_step)[int(0.9 * (len(per_step) - 1))], 3),
        "final_sync_ms_median": round(med(r["syncs_ms"][-1] for r in on), 3),
        "chain_ms_per_run_median": round(med(sum(r["syncs_ms"]) for r in on), 3),
        "run_s_median_chain_on": round(med(r["run_s"] for r in on), 3),
        "run_s_median_chain_off": round(med(r["run_s"] for r in off), 3),
        "verify_ms_per_run_median": round(med(r["verify_ms"] for r in on), 3),
        "all_verified_ok": all(r["ok"] for r in on),
    }, indent=1))


if __name__ == "__main__":
    main()
