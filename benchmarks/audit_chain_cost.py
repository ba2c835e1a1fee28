"""What the audit hash chain costs inside real runs, against what it chains: per super-step and per
decode step.

Usage: .venv/bin/python benchmarks/audit_chain_cost.py [--runs N] [--out FILE]

The shipped ticket-triage workflow runs N times with the chain on and N times with it off,
alternating, on the embedded Valkey and the float32 CPU engine, through ``graphs/execution.drive``
as an API run is (run row, LLM call records, acceptance stream, Redis checkpointer). The writers
chain what they write (``state/audit_chain.ChainCursor``: a checkpoint and the pending writes before
it in the checkpointer's own script, a call's record and acceptance entries right after their
append), so the chain's cost sits inside the writers' calls. Timed, side by side:

- per super-step (delimited by ``drive``'s ``between_steps``): the checkpointer's ``put`` and
  ``put_writes`` with the chain on (their own work and the chain's) and off (their own work), by
  super-step index, plus ``RunAudit.sync`` (on); the chain's share is on + sync - off, against off
  (issue 43's goal: under 5 %);
- per decode step: the chain's work over the run (the added writer time, the syncs, the call and
  acceptance appends' added time, the seal) divided by the run's decode steps, against the decode
  step's own time (the interval between two ``on_step`` calls of one generation);
- per run: the seal and ``verify_run`` (HMAC-signed; every chained run must verify).

The 2-core box is shared: quote these ratios, measured in one process at one time, not figures from
another run. ``benchmarks/audit_chain_writers_cost.py`` replays one run's writes without the engine
running, which isolates the writers' added microseconds. Prints (and with ``--out`` writes) JSON
with medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from elesium.config import Settings
from elesium.graphs import audit_chain
from elesium.graphs.audit_chain import verify_run
from elesium.graphs.execution import RunEngine, drive, run_config
from elesium.graphs.workflows import ticket_triage
from elesium.state import AcceptanceLog, EmbeddedValkey, RedisSaver, Retention, connect
from elesium.state.audit_chain import HmacSigner
from elesium.state.threads import RunRow, ThreadRow, ThreadStore

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT / "graphs" / "workflows" / "evals" / "ticket_triage.jsonl"


class Timed:
    """Wraps a callable and sums the seconds spent in it."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def one_run(engine, wf, client, *, chain: bool, case: dict) -> dict:
    """One run with the chain on or off: writer seconds per super-step, syncs, decode steps, seal."""
    store, saver = ThreadStore(client), RedisSaver(client)
    put, put_writes = Timed(saver.put), Timed(saver.put_writes)
    saver.put, saver.put_writes = put, put_writes  # type: ignore[method-assign]
    log = AcceptanceLog(client, retention=Retention(maxlen=None))
    append_many, add_call = Timed(log.append_many), Timed(store.add_call)
    log.append_many, store.add_call = append_many, add_call  # type: ignore[method-assign]
    tid, rid = f"bench-{uuid.uuid4().hex}", str(uuid.uuid4())
    store.create_thread(ThreadRow(thread_id=tid, tenant="bench"))
    store.create_run(RunRow(run_id=rid, thread_id=tid, tenant="bench", assistant_id="bench", workflow=wf.name,
                            workflow_version=wf.version, request={"input": case["input"]}, seed=7))
    tap = RunEngine(engine, on_call=lambda call: store.add_call(rid, call.model_dump()))
    intervals: list[float] = []
    steps = [0]
    start = tap.start

    def timed_start(request, *, on_step=None):
        last: list[float] = []

        def hook(record):
            now = time.perf_counter()
            steps[0] += 1
            if last:
                intervals.append(now - last[0])
            last[:] = [now]
            if on_step is not None:
                on_step(record)
        return start(request, on_step=hook)
    tap.start = timed_start  # type: ignore[method-assign]
    graph = wf.build(saver)
    config = run_config(tap, run_id=rid, thread_id=tid, seed=7, log=log, workflow=wf.name)
    settings = Settings(audit_key="bench-key", audit_chain="on" if chain else "off")
    audit = audit_chain.open_run_audit(client, thread_id=tid, run_id=rid, store=store, cp_prefix=saver.prefix,
                                       acceptance=log, settings=settings)
    cp_marks: list[float] = []
    seal_s: list[float] = []
    if audit is not None:
        seal = audit.seal

        def timed_seal(status: str) -> Any:
            t = time.perf_counter()
            try:
                return seal(status)
            finally:
                seal_s.append(time.perf_counter() - t)
        audit.seal = timed_seal  # type: ignore[method-assign]
    t0 = time.perf_counter()
    outcome = drive(graph, case["input"], config, audit=audit,
                    between_steps=lambda: cp_marks.append(put.seconds + put_writes.seconds))
    cps = [b - a for a, b in zip([0.0, *cp_marks], cp_marks)]
    out: dict[str, Any] = {"run_s": time.perf_counter() - t0, "status": outcome.status,
                           "step_cp_ms": [c * 1000 for c in cps],
                           "cp_ms_run": (put.seconds + put_writes.seconds) * 1000,
                           "llm_writes_ms_run": (append_many.seconds + add_call.seconds) * 1000,
                           "decode_steps": steps[0], "decode_step_ms": [s * 1000 for s in intervals]}
    if audit is not None:
        out.update(step_sync_ms=[s * 1000 for s in audit.sync_seconds], seal_ms=seal_s[0] * 1000)
        t1 = time.perf_counter()
        verdict = verify_run(client, rid, store=store, cp_prefix=saver.prefix, acceptance=log,
                             signer=HmacSigner("bench-key"))
        out["verify_ms"] = (time.perf_counter() - t1) * 1000
        out["ok"], out["entries"] = verdict.ok, verdict.entries_checked
    return out


def summary(on: list[dict], off: list[dict]) -> dict:
    """Chain on against chain off, super-step by super-step index (medians over the runs)."""
    med = statistics.median
    n = min([len(r["step_cp_ms"]) for r in [*on, *off]] + [len(r["step_sync_ms"]) for r in on])
    off_step = [med(r["step_cp_ms"][i] for r in off) for i in range(n)]
    on_step = [med(r["step_cp_ms"][i] + r["step_sync_ms"][i] for r in on) for i in range(n)]
    sync_step = [med(r["step_sync_ms"][i] for r in on) for i in range(n)]
    ratios = [a / b - 1 for a, b in zip(on_step, off_step) if b > 0]  # a step with no write: not a ratio
    added_run = [r["cp_ms_run"] + sum(r["step_sync_ms"]) + r["llm_writes_ms_run"] + r["seal_ms"] for r in on]
    base_run = med(r["cp_ms_run"] + r["llm_writes_ms_run"] for r in off)
    chain_run = med(added_run) - base_run  # the chain's work of a run: what chaining added to the writers
    step_ms = med(ms for r in [*on, *off] for ms in r["decode_step_ms"])
    decode_steps = med(r["decode_steps"] for r in on)
    return {
        "super_steps_per_run": n,
        "chain_entries_per_run": med(r["entries"] for r in on),
        "per_super_step": {
            "checkpointer_off_ms_by_step": [round(x, 3) for x in off_step],
            "checkpointer_on_plus_sync_ms_by_step": [round(x, 3) for x in on_step],
            "sync_ms_by_step": [round(x, 4) for x in sync_step],
            "checkpointer_off_ms_median": round(med(off_step), 3),
            "added_ms_median": round(med(a - b for a, b in zip(on_step, off_step)), 3),
            "ratio_median_of_steps": round(med(ratios), 3),
            "ratio_of_run_totals": round(sum(on_step) / sum(off_step) - 1, 3),
        },
        "per_decode_step": {
            "decode_steps_per_run": decode_steps,
            "decode_step_ms_median": round(step_ms, 3),
            "chain_ms_per_decode_step": round(chain_run / decode_steps, 4),
            "ratio": round(chain_run / decode_steps / step_ms, 5),
        },
        "chain_ms_per_run_median": round(chain_run, 3),
        "seal_ms_median": round(med(r["seal_ms"] for r in on), 3),
        "verify_ms_per_run_median": round(med(r["verify_ms"] for r in on), 3),
        "run_s_median": {"on": round(med(r["run_s"] for r in on), 3),
                         "off": round(med(r["run_s"] for r in off), 3)},
        "all_verified_ok": all(r["ok"] for r in on),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--raw", type=Path, default=None, help="also write every run's timings here")
    args = parser.parse_args()
    from elesium.inference.engine import Engine

    engine = Engine.load(device="cpu", dtype="float32", max_len=2048)
    wf = ticket_triage.workflow()
    case = json.loads(EVAL.read_text().splitlines()[0])
    with tempfile.TemporaryDirectory() as data:
        server = EmbeddedValkey(Path(data)).start()
        try:
            client = connect(server.url)
            for chain in (True, False):  # warm-up (compiles, caches, scripts)
                one_run(engine, wf, client, chain=chain, case=case)
            on: list[dict] = []
            off: list[dict] = []
            for _ in range(args.runs):
                on.append(one_run(engine, wf, client, chain=True, case=case))
                off.append(one_run(engine, wf, client, chain=False, case=case))
        finally:
            server.stop()
    if args.raw:
        args.raw.write_text(json.dumps({"on": on, "off": off}))
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "workflow": wf.name,
              "runs_each": args.runs, "status": sorted({r["status"] for r in [*on, *off]}),
              **summary(on, off)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
