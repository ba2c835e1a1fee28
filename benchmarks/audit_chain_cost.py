"""What the audit hash chain costs, against what it chains: per super-step and per decode step.

Usage: .venv/bin/python benchmarks/audit_chain_cost.py [--runs N] [--baseline GIT_REF]

The shipped ticket-triage workflow runs N times with the chain on and N times with it off,
alternating, on the embedded Valkey and the float32 CPU engine, through ``graphs/execution.drive``
as an API run is (run row, LLM call records, acceptance stream, Redis checkpointer). In the same
process, side by side, it times:

- per super-step: the checkpointer's own work (the saver's ``put`` and ``put_writes``, wrapped with
  timers, summed between two ``RunAudit.sync`` calls) and the chain's (``RunAudit.sync``: read the
  new records, hash them, one compare-and-append), and their ratio (issue 43's goal: under 5 %);
- per decode step: the chain's work over the run divided by the run's decode steps, against the
  decode step's own time (the interval between two ``on_step`` calls of one generation);
- per run: the seal and ``verify_run`` (HMAC-signed; every chained run must verify).

``--baseline REF`` also runs, alternating with the others, the ``RunAudit`` of
``graphs/audit_chain.py`` as committed at REF (e.g. ``HEAD``), so a change is compared on the same
machine at the same moment (the 2-core box is shared: quote these ratios, not figures from another
time). Prints JSON with medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
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


def baseline_module(ref: str) -> Any:
    """``graphs/audit_chain.py`` as committed at ``ref``, loaded as a module of its own."""
    source = subprocess.run(["git", "show", f"{ref}:graphs/audit_chain.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("elesium.graphs._audit_chain_baseline")
    sys.modules[module.__name__] = module
    exec(compile(source, f"{ref}:graphs/audit_chain.py", "exec"), module.__dict__)
    return module


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


def one_run(engine, wf, client, *, chain: Any, case: dict) -> dict:
    """One run; ``chain``: the module whose ``open_run_audit`` chains it, or None (chain off)."""
    store, saver = ThreadStore(client), RedisSaver(client)
    put, put_writes = Timed(saver.put), Timed(saver.put_writes)
    saver.put, saver.put_writes = put, put_writes  # type: ignore[method-assign]
    log = AcceptanceLog(client, retention=Retention(maxlen=None))
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
    settings = Settings(audit_key="bench-key", audit_chain="off" if chain is None else "on")
    audit = None if chain is None else chain.open_run_audit(
        client, thread_id=tid, run_id=rid, store=store, cp_prefix=saver.prefix, acceptance=log,
        settings=settings)
    cp_at_sync: list[float] = []
    if audit is not None:
        sync, seal = audit.sync, audit.seal
        seal_s: list[float] = []

        def timed_sync() -> int:
            cp_at_sync.append(put.seconds + put_writes.seconds)
            return sync()

        def timed_seal(status: str) -> Any:
            t = time.perf_counter()
            try:
                return seal(status)
            finally:
                seal_s.append(time.perf_counter() - t)
        audit.sync, audit.seal = timed_sync, timed_seal
    t0 = time.perf_counter()
    outcome = drive(graph, case["input"], config, audit=audit)
    out: dict[str, Any] = {"run_s": time.perf_counter() - t0, "status": outcome.status,
                           "cp_ms_run": (put.seconds + put_writes.seconds) * 1000,
                           "decode_steps": steps[0],
                           "decode_step_ms": [s * 1000 for s in intervals]}
    if audit is not None:
        syncs = [s * 1000 for s in audit.sync_seconds]
        steps = len(syncs) - 1  # the last sync is the seal's
        cps = [b - a for a, b in zip([0.0, *cp_at_sync], cp_at_sync)][:steps]
        out.update(syncs_ms=syncs, step_sync_ms=syncs[:steps], step_cp_ms=[c * 1000 for c in cps],
                   seal_ms=seal_s[0] * 1000, chain_ms_run=seal_s[0] * 1000 + sum(syncs[:steps]))
        t1 = time.perf_counter()
        verdict = verify_run(client, rid, store=store, cp_prefix=saver.prefix, acceptance=log,
                             signer=HmacSigner("bench-key"))
        out["verify_ms"] = (time.perf_counter() - t1) * 1000
        out["ok"], out["entries"] = verdict.ok, verdict.entries_checked
    return out


def summary(runs: list[dict]) -> dict:
    med = statistics.median
    sync = [ms for r in runs for ms in r["step_sync_ms"]]
    cp = [ms for r in runs for ms in r["step_cp_ms"]]
    ratios = [s / c for r in runs for s, c in zip(r["step_sync_ms"], r["step_cp_ms"]) if c > 0]
    step_ms = med(ms for r in runs for ms in r["decode_step_ms"])
    chain_per_step = med(r["chain_ms_run"] / r["decode_steps"] for r in runs)
    return {
        "super_steps_per_run": med(len(r["step_sync_ms"]) for r in runs),
        "chain_entries_per_run": med(r["entries"] for r in runs),
        "per_super_step": {
            "checkpointer_ms_median": round(med(cp), 3),
            "chain_sync_ms_median": round(med(sync), 3),
            "chain_sync_ms_p90": round(sorted(sync)[int(0.9 * (len(sync) - 1))], 3),
            "ratio_of_medians": round(med(sync) / med(cp), 3),
            "ratio_median_of_steps": round(med(ratios), 3),
            "ratio_of_run_totals_median": round(med(sum(r["step_sync_ms"]) / sum(r["step_cp_ms"])
                                                    for r in runs), 3),
        },
        "per_decode_step": {
            "decode_steps_per_run": med(r["decode_steps"] for r in runs),
            "decode_step_ms_median": round(step_ms, 3),
            "chain_ms_per_decode_step": round(chain_per_step, 4),
            "ratio": round(chain_per_step / step_ms, 5),
        },
        "seal_ms_median": round(med(r["seal_ms"] for r in runs), 3),
        "chain_ms_per_run_median": round(med(r["chain_ms_run"] for r in runs), 3),
        "checkpointer_ms_per_run_median": round(med(r["cp_ms_run"] for r in runs), 3),
        "verify_ms_per_run_median": round(med(r["verify_ms"] for r in runs), 3),
        "run_s_median": round(med(r["run_s"] for r in runs), 3),
        "all_verified_ok": all(r["ok"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--baseline", metavar="GIT_REF", default=None,
                        help="also run graphs/audit_chain.py's RunAudit as committed at this ref")
    args = parser.parse_args()
    from elesium.inference.engine import Engine

    engine = Engine.load(device="cpu", dtype="float32", max_len=2048)
    wf = ticket_triage.workflow()
    case = json.loads(EVAL.read_text().splitlines()[0])
    variants: dict[str, Any] = {"chain": audit_chain}
    if args.baseline:
        variants[f"baseline@{args.baseline}"] = baseline_module(args.baseline)
    with tempfile.TemporaryDirectory() as data:
        server = EmbeddedValkey(Path(data)).start()
        try:
            client = connect(server.url)
            for module in variants.values():  # warm-up (compiles, caches)
                one_run(engine, wf, client, chain=module, case=case)
            on: dict[str, list[dict]] = {name: [] for name in variants}
            off = []
            for _ in range(args.runs):
                for name, module in variants.items():
                    on[name].append(one_run(engine, wf, client, chain=module, case=case))
                off.append(one_run(engine, wf, client, chain=None, case=case))
        finally:
            server.stop()
    med = statistics.median
    report: dict[str, Any] = {
        "workflow": wf.name, "runs_each": args.runs,
        "status": sorted({r["status"] for rs in [*on.values(), off] for r in rs}),
        **{name: summary(runs) for name, runs in on.items()},
        "chain_off": {"run_s_median": round(med(r["run_s"] for r in off), 3),
                      "checkpointer_ms_per_run_median": round(med(r["cp_ms_run"] for r in off), 3)},
    }
    if args.baseline:
        base, new = report[f"baseline@{args.baseline}"], report["chain"]
        report["chain_sync_speedup_vs_baseline"] = round(
            base["per_super_step"]["chain_sync_ms_median"] / new["per_super_step"]["chain_sync_ms_median"], 2)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
