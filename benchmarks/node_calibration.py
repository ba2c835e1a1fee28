"""Per-node calibrations against the global tree policy, on the shipped workflows (BENCHMARKS.md).

For each shipped workflow: ``--learn`` runs with online self-tuning on (each succeeded run folds its
acceptance into its nodes' counters; where the estimate moves materially a new version goes on trial
against the current one, runs alternate between the two, and the trial version is promoted only if
it wins on the profile's cost curve), then ``--measure`` held-out inputs (never learnt from), each
run twice back to back in one process, once
with the global policy and once with the per-node calibrations (frozen), the order alternating. Per
node we report the median over the measured runs of tau (tokens per tree step) and of decode
tokens/s (tokens committed by tree steps over their summed wall time, from the acceptance log), and
the whole run's wall time. Interleaving in one process is what keeps the comparison fair on a
shared, loaded machine: both arms see the same load, moment by moment. The load average is printed.

Usage: ``.venv/bin/python benchmarks/node_calibration.py [--learn 6] [--measure 4] [--out DIR]``
(speculative mode on the bundled model, CPU float32, an embedded Valkey in a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from elesium.graphs import WorkflowRunner
from elesium.inference.engine import Engine
from elesium.inference.tuning.node_calibration import stats_by_node
from elesium.state.embedded import EmbeddedValkey

TICKETS = [
    (
        "Login page returns HTTP 502",
        "Since 09:10 UTC none of our 40 agents can log in; the login page returns HTTP 502. Order 88412.",
        "Acme Corp",
    ),
    (
        "Invoice charged twice",
        "We were billed twice for invoice INV-2231 this month. Please refund one charge.",
        "Globex",
    ),
    (
        "Export to CSV is slow",
        "Exporting the monthly report to CSV takes over ten minutes since the update.",
        "Initech",
    ),
    (
        "Cannot reset password",
        "The reset email never arrives for user maria@example.com; checked spam too.",
        None,
    ),
    (
        "API rate limit too low",
        "Our integration hits 429 errors at 50 requests per minute. Can we get more?",
        "Hooli",
    ),
    (
        "Dashboard shows wrong totals",
        "The sales dashboard total differs from the CSV export by 3 percent.",
        "Umbrella",
    ),
    ("Feature request: dark mode", "Several of our staff asked for a dark theme in the web app.", None),
    (
        "Data deletion request",
        "Under GDPR please delete all data about our former employee J. Smith.",
        "Stark Ltd",
    ),
    (
        "Mobile app crashes on start",
        "The Android app version 4.2 crashes right after the splash screen.",
        "Wayne Co",
    ),
    (
        "Webhook deliveries failing",
        "Webhooks to https://hooks.example.com return timeout since Monday.",
        "Acme Corp",
    ),
]
EXPENSES = [
    ("Ana Ruiz", 42.5, "EUR", "meals", "Team lunch with a client after the quarterly review."),
    ("Ben Okafor", 1800.0, "USD", "travel", "Flight to the Berlin conference, economy class."),
    ("Chen Wei", 129.99, "USD", "software", "Annual licence for a diagram editor."),
    ("Dana Levi", 12.0, "GBP", "transport", "Taxi from the station to the customer site."),
    ("Eva Novak", 5400.0, "EUR", "equipment", "Three laptops for the new hires."),
    ("Farid Haddad", 75.0, "USD", "meals", "Dinner while travelling for the audit."),
    ("Gita Rao", 300.0, "USD", "training", "Online course on cloud security."),
    ("Hugo Martin", 950.0, "EUR", "travel", "Hotel, four nights, for the Paris trade fair."),
    ("Ines Costa", 19.9, "EUR", "office", "Printer paper and pens."),
    ("Jon Berg", 2500.0, "USD", "entertainment", "Concert tickets for the sales team."),
]
INCIDENTS = [
    (
        "payments-api",
        "ERROR timeout calling bank gateway after 30s\nERROR timeout calling bank gateway after 30s\n"
        "WARN retry queue length 1200",
    ),
    (
        "auth-service",
        "ERROR invalid signature on token\nERROR invalid signature on token\nINFO key rotation at 02:00",
    ),
    (
        "search",
        "WARN slow query 4.2s index=products\nWARN slow query 5.1s index=products\nINFO gc pause 800ms",
    ),
    (
        "checkout",
        "ERROR 500 on POST /cart/checkout NullPointerException in PriceService\nERROR 500 on POST "
        "/cart/checkout",
    ),
    (
        "email-worker",
        "WARN smtp 421 too many connections\nWARN smtp 421 too many connections\nINFO backoff 60s",
    ),
    ("inventory", "ERROR disk full on /var/lib/db\nERROR write failed: no space left on device"),
    ("cdn", "WARN cache hit ratio dropped to 42%\nINFO origin requests doubled"),
    ("billing", "ERROR duplicate invoice id INV-993\nERROR constraint violation on invoices_pkey"),
    ("notifications", "INFO push sent 10000\nWARN apns feedback 300 invalid tokens"),
    ("reports", "ERROR job monthly-report failed: out of memory\nINFO retry scheduled"),
]


# Held-out inputs: measured only, never folded into a calibration.
HELDOUT_TICKETS = [
    ("SSO login loops back to the start page", "After the IdP change our users are redirected in a loop.",
     "Acme Corp"),
    ("Refund not received", "The refund for order 55120 promised two weeks ago has not arrived.", None),
    ("Search returns no results", "Searching for any product name returns an empty list since this morning.",
     "Globex"),
    ("Add a second admin", "How do we give admin rights to a second person on our account?", "Initech"),
]
HELDOUT_EXPENSES = [
    ("Kira Sato", 64.0, "EUR", "meals", "Working dinner with the vendor's engineers."),
    ("Liam Byrne", 3200.0, "USD", "travel", "Business-class flight to the Tokyo customer visit."),
    ("Mona Aziz", 15.5, "GBP", "office", "USB cables for the meeting room."),
    ("Nils Holm", 780.0, "EUR", "training", "Two-day workshop on incident management."),
]
HELDOUT_INCIDENTS = [
    ("queue-broker", "ERROR consumer lag 250000 messages on topic orders\nWARN broker disk 91%"),
    ("login-web", "ERROR 503 from upstream auth\nERROR 503 from upstream auth\nINFO autoscaler added 2 pods"),
    ("scheduler", "WARN job nightly-sync missed its window\nERROR lock held by dead worker"),
    ("image-resizer", "ERROR out of memory resizing 12000x9000 image\nINFO worker restarted"),
]


def inputs(workflow: str, held_out: bool = False) -> list[dict[str, Any]]:
    if workflow == "ticket-triage":
        rows = HELDOUT_TICKETS if held_out else TICKETS
        return [{"subject": s, "body": b, **({"customer": c} if c else {})} for s, b, c in rows]
    if workflow == "expense-approval":
        rows = HELDOUT_EXPENSES if held_out else EXPENSES
        return [dict(zip(("employee", "amount", "currency", "category", "description"), e)) for e in rows]
    return [{"service": s, "logs": lg} for s, lg in (HELDOUT_INCIDENTS if held_out else INCIDENTS)]


def run_once(runner: WorkflowRunner, workflow: str, payload: dict[str, Any], seed: int) -> tuple[Any, float]:
    """Start (and, for triage, approve) one run; returns (RunResult, wall seconds)."""
    start = time.perf_counter()
    result = runner.start(workflow, payload, seed=seed)
    if result.status == "interrupted":
        result = runner.resume(result.run_id, {"approved": True})
    return result, time.perf_counter() - start


def node_figures(runner: WorkflowRunner, run_id: str) -> dict[str, dict[str, float]]:
    out = {}
    for node, s in stats_by_node(runner.log.iter_entries(run_id)).items():
        if s.steps:
            out[node] = {"tau": s.tau, "tokens_per_s": s.tokens_per_s, "steps": s.steps, "tokens": s.tokens}
    return out


def modeled_ms(records: list[Any], cost: Any) -> float:
    """Forward time the profile's cost curve predicts for these steps (load-independent)."""
    return sum(cost(r.tree_size) for r in records)


def analyse(data_dir: Path, out: Path | None) -> int:
    """Re-read a finished benchmark's runs from its Valkey data dir and add the modeled throughput.

    Measured runs have seeds >= 5000; of each (workflow, seed) pair, the run that recorded a node
    version is the per-node arm (when neither did, both arms decoded with the same global policy and
    the first run of the pair is taken as the global one, as the benchmark's alternation had it).
    Modeled tokens/s = tokens / (sum over steps of the cpu-2t profile's cost(tree size)): what the
    policies would give on an unloaded copy of the machine the profile was measured on.
    """
    from elesium.inference.tuning.profile import SHIPPED, TuneProfile
    from elesium.state.acceptance_log import AcceptanceLog, Retention
    from elesium.state.runs import RunRegistry, RunStatus

    cost = TuneProfile.load(SHIPPED / "cpu-2t.json").cost_curve()
    server = EmbeddedValkey(data_dir).start()
    try:
        client = redis.Redis.from_url(server.url)
        key = next(iter(client.scan_iter(match="bench-*:runs:{registry}:run:*", count=1000))).decode()
        prefix = key.split(":runs:")[0]
        runs = RunRegistry.from_url(server.url, prefix=f"{prefix}:runs")
        log = AcceptanceLog.from_url(server.url, prefix=f"{prefix}:acc", retention=Retention(maxlen=None))
        records = sorted(runs.list_by_status(RunStatus.SUCCEEDED, limit=100_000), key=lambda r: r.created_at)
        pairs: dict[tuple[str, int], list[Any]] = {}
        for r in records:
            if r.seeds["run"] >= 5000:
                pairs.setdefault((r.workflow, r.seeds["run"]), []).append(r)
        table: dict[str, Any] = {}
        for (workflow, seed), pair in sorted(pairs.items()):
            tagged = [any(v != "global" for v in r.calibrations.values()) for r in pair]
            if any(tagged):
                arms = {"node" if t else "global": r for t, r in zip(tagged, pair)}
            else:
                first = "global" if (seed - 5000) % 2 == 0 else "node"
                arms = {first: pair[0], ("node" if first == "global" else "global"): pair[1]}
            for arm, r in arms.items():
                by_node: dict[str, list[Any]] = {}
                for e in log.iter_entries(r.run_id):
                    if e.kind == "step":
                        by_node.setdefault(e.node_id, []).append(e.record)
                for node, recs in by_node.items():
                    row = table.setdefault(workflow, {}).setdefault(node, {"global": [], "node": []})
                    tokens = sum(x.accepted_length for x in recs)
                    row[arm].append({"tau": tokens / len(recs),
                                     "tokens_per_s": tokens / sum(x.elapsed_s for x in recs),
                                     "modeled_tokens_per_s": 1000 * tokens / modeled_ms(recs, cost),
                                     "version": r.calibrations.get(node, "global")})
        summary = {}
        for workflow, nodes in table.items():
            for node, row in sorted(nodes.items()):
                med = {arm: {k: statistics.median(v[k] for v in vals)
                             for k in ("tau", "tokens_per_s", "modeled_tokens_per_s")}
                       for arm, vals in row.items() if vals}
                med["version"] = sorted({v["version"] for v in row["node"]})
                med["runs"] = min(len(v) for v in row.values() if isinstance(v, list))
                summary[f"{workflow}/{node}"] = med
                g, n = med["global"], med["node"]
                print(f"{workflow}/{node} {med['version']} n={med['runs']}: "
                      f"tau {g['tau']:.3f} -> {n['tau']:.3f}; "
                      f"tokens/s {g['tokens_per_s']:.2f} -> {n['tokens_per_s']:.2f}; modeled "
                      f"{g['modeled_tokens_per_s']:.2f} -> {n['modeled_tokens_per_s']:.2f}")
        if out is not None:
            (out / "analysis.json").write_text(json.dumps(summary, indent=1))
    finally:
        server.stop()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learn", type=int, default=6, help="online-tuning runs per workflow")
    ap.add_argument(
        "--measure", type=int, default=4, help="held-out inputs per workflow, each run in both arms"
    )
    ap.add_argument("--workflows", default="expense-approval,incident-summary,ticket-triage")
    ap.add_argument("--out", type=Path, default=None, help="write results.json here")
    ap.add_argument("--analyse", type=Path, default=None,
                    help="re-read a finished run's Valkey data dir (printed at the start) instead of running")
    args = ap.parse_args()
    if args.analyse is not None:
        return analyse(args.analyse, args.out)
    load = [os.getloadavg()]
    engine = Engine.load(device="cpu", dtype="float32", max_len=2048)
    print(
        f"engine: {engine.describe()['profile_id']} policy {engine.policy.kind} <= {engine.policy.max_nodes} "
        f"nodes; load average {load[0]}",
        flush=True,
    )
    data_dir = Path(tempfile.mkdtemp(prefix="bench-calib-"))
    print(f"state: embedded Valkey in {data_dir} (kept: --analyse reads it again)", flush=True)
    server = EmbeddedValkey(data_dir).start()
    results: dict[str, Any] = {"learn": args.learn, "measure": args.measure, "workflows": {}}
    try:
        runner = WorkflowRunner(
            engine, server.url, mode="speculative", prefix=f"bench-{uuid.uuid4().hex[:8]}"
        )
        for workflow in args.workflows.split(","):
            data = inputs(workflow)
            runner.calibrator.use = runner.calibrator.learn = True
            for i in range(args.learn):
                result, wall = run_once(runner, workflow, data[i % len(data)], seed=1000 + i)
                print(
                    f"[{workflow}] learn {i + 1}/{args.learn}: {result.status} in {wall:.0f} s; calibrations "
                    f"{runner.runs.get(result.run_id).calibrations}",
                    flush=True,
                )
            store = runner.calibrator.store
            published = {n: runner.calibrator.current(workflow, n) for n in store.nodes(workflow)}
            verdicts = {n: store.decisions(workflow, n) for n in store.nodes(workflow)}
            open_trials = {n: t for n in store.nodes(workflow) if (t := store.trial(workflow, n))}
            print(f"[{workflow}] current {({n: v[0] for n, v in published.items()})}; verdicts "
                  f"{({n: [(d['trial'], d['verdict']) for d in v] for n, v in verdicts.items()})}; "
                  f"trials still open {open_trials}", flush=True)
            # Frozen while measuring: both arms see fixed policies, and the per-node arm runs each
            # node's current version (an undecided trial is not measured as if adopted).
            runner.calibrator.learn = False
            rule, runner.calibrator.rule = runner.calibrator.rule, None
            held_out = inputs(workflow, held_out=True)
            arms: dict[str, list[dict[str, Any]]] = {"global": [], "node": []}
            for j in range(args.measure):
                payload = held_out[j % len(held_out)]
                order = ["global", "node"] if j % 2 == 0 else ["node", "global"]
                for arm in order:
                    runner.calibrator.use = arm == "node"
                    result, wall = run_once(runner, workflow, payload, seed=5000 + j)
                    arms[arm].append(
                        {
                            "wall_s": wall,
                            "nodes": node_figures(runner, result.run_id),
                            "status": result.status,
                        }
                    )
                print(
                    f"[{workflow}] measure {j + 1}/{args.measure}: "
                    f"global {arms['global'][-1]['wall_s']:.0f} s, "
                    f"per-node {arms['node'][-1]['wall_s']:.0f} s",
                    flush=True,
                )
                load.append(os.getloadavg())
            table = {}
            for node in sorted({n for runs in arms.values() for r in runs for n in r["nodes"]}):
                row = {}
                for arm, runs in arms.items():
                    vals = [r["nodes"][node] for r in runs if node in r["nodes"]]
                    row[arm] = {
                        "tau": statistics.median(v["tau"] for v in vals),
                        "tokens_per_s": statistics.median(v["tokens_per_s"] for v in vals),
                        "runs": len(vals),
                    }
                label, calib = published.get(node, ("global", None))
                row["calibration"] = {"version": label, **(calib.to_dict() if calib else {})}
                row["verdicts"] = verdicts.get(node, [])
                row["open_trial"] = open_trials.get(node)
                table[node] = row
            runner.calibrator.rule = rule
            results["workflows"][workflow] = {
                "nodes": table,
                "wall_s": {arm: statistics.median(r["wall_s"] for r in runs) for arm, runs in arms.items()},
                "raw": arms,
            }
            for node, row in table.items():
                g, n = row["global"], row["node"]
                print(
                    f"  {workflow}/{node} [{row['calibration']}]: tau {g['tau']:.2f} -> {n['tau']:.2f}, "
                    f"tokens/s "
                    f"{g['tokens_per_s']:.2f} -> {n['tokens_per_s']:.2f}",
                    flush=True,
                )
    finally:
        server.stop()
    results["load_average"] = load
    print(f"load average (1, 5, 15 min) at start and after each measured pair: {load}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
