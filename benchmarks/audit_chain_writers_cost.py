"""What chaining costs inside the writers: a real run's writes replayed with and without the chain.

Usage: .venv/bin/python benchmarks/audit_chain_writers_cost.py [--reps N] [--out FILE]

Issue 43's goal is the chain's cost per checkpointed super-step under 5 % of the checkpoint write.
Since the writers chain what they write (``state/audit_chain.ChainCursor``: a checkpoint's entry and
those of the pending writes stored since the previous one pushed by the checkpointer's own script;
a call's and its acceptance entries' right after their append), that cost is the difference between
a write with a cursor attached and the same write without, plus what ``RunAudit.sync`` still does
per super-step (nothing to read when every writer chains).

So: one shipped ticket-triage run (to its approval interrupt, the float32 CPU engine, embedded
Valkey, through ``graphs/execution.drive`` as an API run is) records every checkpointer call, call
record and acceptance batch it makes. Then those exact calls are replayed ``--reps`` times into fresh
threads, alternating chained and plain replays (a cursor attached to the saver, the store and the
log, or none), each call timed. A super-step is a ``put`` and the ``put_writes`` before it; an LLM
call is its call record and its acceptance batch. Medians of per-super-step and per-call ratios
(chained / plain - 1), and of the absolute added microseconds, are printed as JSON. The replays
verify: a chained replay's every checkpoint and write digest is checked by ``verify_run``.
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

from elesium.graphs.audit import calls_key
from elesium.graphs.audit_chain import RunSources, verify_run
from elesium.graphs.execution import RunEngine, drive, run_config
from elesium.graphs.workflows import ticket_triage
from elesium.state import AcceptanceLog, EmbeddedValkey, RedisSaver, Retention, connect
from elesium.state.acceptance_log import AcceptanceEntry
from elesium.state.audit_chain import AuditChain, ChainCursor, HmacSigner
from elesium.state.threads import RunRow, ThreadRow, ThreadStore

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT / "graphs" / "workflows" / "evals" / "ticket_triage.jsonl"


class Recorder:
    """Records the calls a run makes to the saver, the store's ``add_call`` and the log's batches."""

    def __init__(self, saver: RedisSaver, store: ThreadStore, log: AcceptanceLog) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        for obj, name in ((saver, "put"), (saver, "put_writes"), (store, "add_call"), (log, "append_many")):
            self._wrap(obj, name)

    def _wrap(self, obj: Any, name: str) -> None:
        fn = getattr(obj, name)

        def record(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, dict(kwargs)))  # langgraph passes fresh objects per call
            return fn(*args, **kwargs)
        setattr(obj, name, record)


Calls = list[tuple[str, tuple[Any, ...], dict[str, Any]]]


def record_run(engine: Any, client: Any) -> tuple[Calls, tuple[str, str]]:
    """Every writer call of one ticket-triage run, and its (thread id, run id)."""
    wf = ticket_triage.workflow()
    case = json.loads(EVAL.read_text().splitlines()[0])
    store, saver = ThreadStore(client), RedisSaver(client)
    log = AcceptanceLog(client, retention=Retention(maxlen=None))
    tid, rid = f"rec-{uuid.uuid4().hex}", str(uuid.uuid4())
    store.create_thread(ThreadRow(thread_id=tid, tenant="bench"))
    store.create_run(RunRow(run_id=rid, thread_id=tid, tenant="bench", assistant_id="bench", workflow=wf.name,
                            workflow_version=wf.version, request={"input": case["input"]}, seed=7))
    rec = Recorder(saver, store, log)
    tap = RunEngine(engine, on_call=lambda call: store.add_call(rid, call.model_dump()))
    graph = wf.build(saver)
    outcome = drive(graph, case["input"], run_config(tap, run_id=rid, thread_id=tid, seed=7, log=log,
                                                     workflow=wf.name))
    assert outcome.status == "interrupted", outcome
    return rec.calls, (tid, rid)


def _retarget(value: Any, old: tuple[str, str], new: tuple[str, str]) -> Any:
    """The recorded argument with the recorded thread and run ids replaced by the replay's."""
    if isinstance(value, AcceptanceEntry):
        return value.model_copy(update={"run_id": new[1]})
    if isinstance(value, str):
        return new[0] if value == old[0] else new[1] if value == old[1] else value
    if isinstance(value, dict):
        return {k: _retarget(v, old, new) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_retarget(v, old, new) for v in value)
    return value


def replay(calls: list, client: Any, ids: tuple[str, str], *, chained: bool) -> dict[str, list[float]]:
    """Replay ``calls`` into a fresh thread; seconds per super-step and per LLM call."""
    tid, rid = f"rep-{uuid.uuid4().hex}", str(uuid.uuid4())
    store, saver = ThreadStore(client), RedisSaver(client)
    log = AcceptanceLog(client, retention=Retention(maxlen=None))
    store.create_thread(ThreadRow(thread_id=tid, tenant="bench"))
    store.create_run(RunRow(run_id=rid, thread_id=tid, tenant="bench", assistant_id="bench", workflow="w",
                            workflow_version="1", request={}, seed=7))
    chain = AuditChain(client)
    src = RunSources(client, thread_id=tid, run_id=rid, store=store, acceptance=log)
    if chained:
        cursor = ChainCursor(chain, tid, rid, None)
        cursor.append(src.row())  # as RunAudit.begin does, before the run writes
        saver.chains.attach(tid, cursor)
        store.chains.attach(rid, cursor)
        log.chains.attach(rid, cursor)
    targets = {"put": saver.put, "put_writes": saver.put_writes, "add_call": store.add_call,
               "append_many": log.append_many}
    steps: list[float] = []
    llm: list[float] = []
    pending_step = pending_llm = 0.0
    for name, args, kwargs in calls:
        args = tuple(_retarget(a, ids, (tid, rid)) for a in args)
        kwargs = {k: _retarget(v, ids, (tid, rid)) for k, v in kwargs.items()}
        if name == "append_many" and kwargs.get("once"):
            kwargs["once"] = (calls_key(log, rid), kwargs["once"][1])
        t0 = time.perf_counter()
        targets[name](*args, **kwargs)
        dt = time.perf_counter() - t0
        if name in ("put", "put_writes"):
            pending_step += dt
            if name == "put":
                steps.append(pending_step)
                pending_step = 0.0
        else:
            pending_llm += dt
            if name == "add_call":  # a call's record comes after its acceptance batch
                llm.append(pending_llm)
                pending_llm = 0.0
    out: dict[str, Any] = {"step_s": steps, "llm_call_s": llm, "thread": tid, "run": rid}
    if chained:
        t0 = time.perf_counter()
        cursor.append()  # the writes deferred after the last checkpoint, as RunAudit.seal chains them
        out["seal_append_s"] = time.perf_counter() - t0
        chain.seal(tid, rid, "interrupted", HmacSigner("bench-key"))
        verdict = verify_run(client, rid, store=store, acceptance=log, chain=chain,
                             signer=HmacSigner("bench-key"))
        out["verified"] = verdict.ok if verdict.ok else verdict.model_dump(mode="json")
        out["entries"] = verdict.entries_checked
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from elesium.inference.engine import Engine

    engine = Engine.load(device="cpu", dtype="float32", max_len=2048)
    with tempfile.TemporaryDirectory() as data:
        server = EmbeddedValkey(Path(data)).start()
        try:
            client = connect(server.url)
            calls, ids = record_run(engine, client)
            for chained in (False, True):  # warm-up: scripts loaded, connections open
                replay(calls, client, ids, chained=chained)
            plain: list[dict] = []
            chained_runs: list[dict] = []
            for i in range(2 * args.reps):
                (chained_runs if i % 2 else plain).append(replay(calls, client, ids, chained=bool(i % 2)))
        finally:
            server.stop()
    med = statistics.median

    def pairs(key: str) -> tuple[list[float], list[float]]:
        ratios, added = [], []
        for p, c in zip(plain, chained_runs):
            for a, b in zip(p[key], c[key]):
                ratios.append(b / a - 1)
                added.append((b - a) * 1e6)
        return ratios, added

    step_r, step_us = pairs("step_s")
    call_r, call_us = pairs("llm_call_s")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "reps_each": args.reps,
        "recorded": {"super_steps": len(plain[0]["step_s"]), "llm_calls": len(plain[0]["llm_call_s"]),
                     "writer_calls": len(calls)},
        "per_super_step": {
            "plain_us_median": round(med(s for r in plain for s in r["step_s"]) * 1e6, 1),
            "chained_us_median": round(med(s for r in chained_runs for s in r["step_s"]) * 1e6, 1),
            "added_us_median_of_pairs": round(med(step_us), 1),
            "ratio_median_of_pairs": round(med(step_r), 4),
            "ratio_of_medians": round(med(s for r in chained_runs for s in r["step_s"])
                                      / med(s for r in plain for s in r["step_s"]) - 1, 4),
        },
        "per_llm_call": {
            "plain_us_median": round(med(s for r in plain for s in r["llm_call_s"]) * 1e6, 1),
            "chained_us_median": round(med(s for r in chained_runs for s in r["llm_call_s"]) * 1e6, 1),
            "added_us_median_of_pairs": round(med(call_us), 1),
        },
        "seal_append_us_median": round(med(r["seal_append_s"] for r in chained_runs) * 1e6, 1),
        "chained_replays_verified": all(r["verified"] is True for r in chained_runs),
        "first_failed_verdict": next((r["verified"] for r in chained_runs if r["verified"] is not True),
                                     None),
        "entries_per_replay": chained_runs[0]["entries"],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
