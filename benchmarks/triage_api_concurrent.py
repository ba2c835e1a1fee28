"""ticket-triage over the REST API: N background runs started together against the same N one by one.

Why: the engine used to serve one generation at a time, so N workflow runs started together took as
long as the same N run one after another (plus queueing). With continuous batching the LLM calls of
concurrent runs share decode steps, and the together phase should finish well before the sequential
one. This measures it end to end through the real service: the API server as ``elesium serve`` starts
it (uvicorn, the embedded Valkey in a temporary data dir, the bundled model), real HTTP, real Redis.

Each run is a ``POST /threads/{id}/runs`` (a background run, on a thread of its own) of the shipped
``ticket-triage`` workflow on one of the repo's hand-written evaluation tickets
(``graphs/workflows/evals/ticket_triage.jsonl``, in file order, cycled), waited for with
``GET .../join`` and then read back (``GET /threads/{id}/runs/{run_id}``, polled until its status is
final). The workflow stops at its approval interrupt, so a run that reached ``interrupted`` (or
``success``) reached its end; any other final status, or an HTTP error, is an error.

* together: all N runs POSTed at once, then all waited for; wall time from the first POST to the
  last run's end.
* sequential: N tickets (same seeds), each started and waited for before the next.

The two phases run **different tickets**: phase k of the order takes tickets k, k + 2, k + 4, … of the
file (interleaved, so both get the same mix). With the same tickets, the second phase was served the
first one's answers by the engine's caches: on 2026-12-06 every ``hidden_states`` question of the
sequential phase was a memo hit (128 of 128) and its prompts hit the prefix cache, which made
"sequential" look 1.5-2x cheaper than the work it stands for.

Threads are created before each phase's clock starts. Warm-up runs (one alone, then two together)
go first, untimed. The server runs ``--workers`` queued runs at once (default: ``--runs``), so the
queue itself does not serialise the together phase; ``--url`` measures a server you started instead.

    .venv/bin/python benchmarks/triage_api_concurrent.py --runs 32
    .venv/bin/python benchmarks/triage_api_concurrent.py --runs 2 --out /tmp/triage-smoke/triage_api.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
TICKETS = ROOT / "graphs" / "workflows" / "evals" / "ticket_triage.jsonl"
DEFAULT_OUT = ROOT / "benchmarks" / "serving" / "triage_api.json"
WORKFLOW = "ticket-triage"
KEY = "triage-bench-key"
REACHED_END = ("interrupted", "success")
FINAL = ("interrupted", "success", "error", "timeout")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(data_dir: Path, workers: int, device: str | None) -> tuple[subprocess.Popen[bytes], str]:
    """``elesium serve`` on a free port with one API key and the embedded Valkey under ``data_dir``."""
    port = _free_port()
    env = dict(os.environ, ELESIUM_API_KEYS=f"{KEY}=default", ELESIUM_DATA_DIR=str(data_dir))
    env.pop("REDIS_URL", None)
    cmd = [sys.executable, "-m", "elesium.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--workers", str(workers)]
    if device:
        cmd += ["--device", device]
    log = open(data_dir / "server.log", "ab")  # noqa: SIM115 - the child writes it for its lifetime
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {(data_dir / 'server.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become ready within 300 s")


def stop_server(proc: subprocess.Popen[bytes], data_dir: Path) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    # The embedded Valkey runs in its own session and may outlive the server (as in load_test.py).
    from elesium.state.embedded import EmbeddedValkey

    leftover = EmbeddedValkey(data_dir)
    if leftover._attach():
        leftover.stop()


def load_tickets(path: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    tickets = [row["input"] for row in rows if isinstance(row.get("input"), dict)]
    if not tickets:
        raise SystemExit(f"no tickets in {path}")
    return tickets


KEEP_LABELS = ("elesium_engine_loop_seconds", "elesium_engine_steps", "elesium_hidden_states_memo")
"""Metrics whose labels are kept (where the step loop's time went); every other one is folded."""


def metric_sums(text: str) -> dict[str, float]:
    """Sum of every sample per metric name in a Prometheus exposition (labels folded, except
    ``KEEP_LABELS``', which also appear per label set as ``name{labels}``)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFNa]+)", line)
        if match and not line.startswith("#"):
            try:
                value = float(match.group(3))
            except ValueError:
                continue
            sums[match.group(1)] = sums.get(match.group(1), 0.0) + value
            if match.group(1) in KEEP_LABELS and match.group(2):
                sums[match.group(1) + match.group(2)] = value
    return sums


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    try:
        resp = await client.get("/metrics")
        return metric_sums(resp.text) if resp.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


async def new_thread(client: httpx.AsyncClient) -> str:
    resp = await client.post("/threads", json={"metadata": {"benchmark": "triage_api_concurrent"}})
    resp.raise_for_status()
    return str(resp.json()["thread_id"])


async def start_run(client: httpx.AsyncClient, thread_id: str, ticket: dict[str, Any], seed: int,
                    rec: dict[str, Any]) -> None:
    """POST the background run; fills ``rec`` (run id, or the error)."""
    rec["posted_at"] = time.perf_counter()
    try:
        resp = await client.post(f"/threads/{thread_id}/runs",
                                 json={"assistant_id": WORKFLOW, "input": ticket, "seed": seed})
        rec["post_status"] = resp.status_code
        if resp.status_code != 200:
            rec["error"] = f"POST answered {resp.status_code}: {resp.text[:300]}"
            return
        rec["run_id"] = resp.json()["run_id"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        rec["error"] = f"POST failed: {type(exc).__name__}: {exc}"


async def wait_run(client: httpx.AsyncClient, thread_id: str, rec: dict[str, Any], poll_s: float,
                   timeout_s: float) -> None:
    """Wait for the run's end (``join``), then poll its row until the status is final."""
    if "run_id" not in rec:
        rec["ended_at"] = time.perf_counter()
        return
    base = f"/threads/{thread_id}/runs/{rec['run_id']}"
    deadline = time.perf_counter() + timeout_s
    try:
        joined = await client.get(f"{base}/join", timeout=timeout_s)
        if joined.status_code != 200:
            rec["join_status"] = joined.status_code
        status = "pending"
        while True:
            row = (await client.get(base)).json()
            status = row.get("status", "unknown")
            if status in FINAL or time.perf_counter() > deadline:
                break
            await asyncio.sleep(poll_s)
        rec["ended_at"] = time.perf_counter()
        rec["status"] = status
        if status not in REACHED_END:
            rec["error"] = f"run ended {status}: {row.get('error')}"
    except (httpx.HTTPError, ValueError) as exc:
        rec["ended_at"] = time.perf_counter()
        rec["error"] = f"waiting failed: {type(exc).__name__}: {exc}"


async def one_run(client: httpx.AsyncClient, thread_id: str, ticket: dict[str, Any], seed: int,
                  poll_s: float, timeout_s: float) -> dict[str, Any]:
    rec: dict[str, Any] = {"thread_id": thread_id, "seed": seed}
    await start_run(client, thread_id, ticket, seed, rec)
    await wait_run(client, thread_id, rec, poll_s, timeout_s)
    return rec


async def phase(client: httpx.AsyncClient, name: str, tickets: list[dict[str, Any]], seeds: list[int],
                poll_s: float, timeout_s: float) -> dict[str, Any]:
    """Run every ticket, all at once (``together``) or one after another (``sequential``)."""
    threads = [await new_thread(client) for _ in tickets]
    before = await metrics(client)
    start, start_mono = time.perf_counter(), time.monotonic()
    if name == "together":
        records: list[dict[str, Any]] = await asyncio.gather(
            *(one_run(client, tid, t, s, poll_s, timeout_s) for tid, t, s in zip(threads, tickets, seeds,
                                                                                   strict=True)))
    else:
        records = []
        for tid, t, s in zip(threads, tickets, seeds, strict=True):
            records.append(await one_run(client, tid, t, s, poll_s, timeout_s))
    wall = time.perf_counter() - start
    window = [start_mono, time.monotonic()]  # CLOCK_MONOTONIC: to cut a profile (perf --clockid) to the phase
    after = await metrics(client)
    for i, rec in enumerate(records):
        rec["index"] = i
        rec["latency_s"] = rec.pop("ended_at") - rec.pop("posted_at")
    latencies = sorted(r["latency_s"] for r in records if "error" not in r)
    deltas = {k: round(after[k] - before.get(k, 0.0), 4) for k in after
              if after[k] != before.get(k, 0.0) and not k.endswith("_created")}
    return {
        "phase": name, "runs": len(records), "wall_s": wall, "monotonic_window_s": window,
        "errors": sum(1 for r in records if "error" in r),
        "error_samples": [r["error"] for r in records if "error" in r][:5],
        "statuses": {s: sum(1 for r in records if r.get("status") == s)
                     for s in sorted({str(r.get("status")) for r in records})},
        "runs_per_s": len(latencies) / wall if wall > 0 else 0.0,
        "latency_s": {"p50": statistics.median(latencies) if latencies else None,
                      "max": latencies[-1] if latencies else None,
                      "mean": sum(latencies) / len(latencies) if latencies else None},
        "generated_tokens": deltas.get("elesium_generation_tokens_total"),
        "server_metric_deltas": deltas,
        "per_run": records,
    }


async def bench(url: str, runs: int, warmup: bool, poll_s: float, timeout_s: float,
                order: list[str]) -> dict[str, Any]:
    all_tickets = load_tickets(TICKETS)
    # Disjoint, interleaved ticket sets per phase (see the module docstring), cycled if too few.
    per_phase = {name: [all_tickets[(k + 2 * i) % len(all_tickets)] for i in range(runs)]
                 for k, name in enumerate(order)}
    seeds = [1000 + i for i in range(runs)]
    limits = httpx.Limits(max_connections=2 * runs + 8, max_keepalive_connections=2 * runs + 8)
    async with httpx.AsyncClient(base_url=url, headers={"x-api-key": KEY}, timeout=timeout_s,
                                 limits=limits) as client:
        warm: list[dict[str, Any]] = []
        if warmup:  # one alone (first call: compile), then two together (a batched engine's second graph)
            for name, n in (("sequential", 1), ("together", 2)):
                res = await phase(client, name, all_tickets[-n:], [1] * n, poll_s, timeout_s)
                print(f"warm-up ({n} {name}): {res['wall_s']:.1f} s, {res['errors']} errors", file=sys.stderr)
                warm.append({"runs": n, "phase": name, "wall_s": res["wall_s"],
                             "errors": res["error_samples"]})
        info: Any = None
        try:
            info = (await client.get("/info")).json()
        except (httpx.HTTPError, ValueError):
            pass
        phases: dict[str, Any] = {}
        for name in order:
            phases[name] = await phase(client, name, per_phase[name], seeds, poll_s, timeout_s)
            p = phases[name]
            print(f"{name}: {runs} runs in {p['wall_s']:.2f} s, {p['errors']} errors, "
                  f"statuses {p['statuses']}", file=sys.stderr)
    return {"warmup": warm, "server_info": info, "phases": phases}


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(),
                            "processor": platform.processor() or platform.machine(),
                            "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads_client"] = torch.get_num_threads()  # the server's own may differ
    except ImportError:
        pass
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=32, help="runs per phase (default 32)")
    parser.add_argument("--workers", type=int, default=None,
                        help="the started server's --workers, runs it executes at once (default: --runs)")
    parser.add_argument("--device", default=None, help="the started server's --device (default: its own)")
    parser.add_argument("--url", help="a running server to measure instead (its key must be " + KEY + ")")
    parser.add_argument("--order", default="together,sequential",
                        help="phases in the order they run (default together,sequential)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up runs")
    parser.add_argument("--poll", type=float, default=0.25, help="seconds between status reads after join")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    order = [p.strip() for p in args.order.split(",") if p.strip()]
    if sorted(order) != ["sequential", "together"]:
        parser.error("--order must name together and sequential once each")
    workers = args.workers if args.workers is not None else args.runs
    started = dt.datetime.now(dt.timezone.utc)
    proc = None
    with tempfile.TemporaryDirectory(prefix="elesium-triage-bench-") as tmp:
        url = args.url
        t0 = time.perf_counter()
        if url is None:
            proc, url = start_server(Path(tmp), workers, args.device)
            print(f"server ready in {time.perf_counter() - t0:.1f} s at {url}", file=sys.stderr)
        try:
            result = asyncio.run(bench(url, args.runs, not args.no_warmup, args.poll, args.timeout, order))
        finally:
            if proc is not None:
                stop_server(proc, Path(tmp))
    together, sequential = result["phases"]["together"], result["phases"]["sequential"]
    report: dict[str, Any] = {
        "benchmark": "triage_api_concurrent",
        "date_utc": started.isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": machine(),
        "config": {"runs": args.runs, "workflow": WORKFLOW, "tickets": str(TICKETS.relative_to(ROOT)),
                   "server": "started (elesium serve, embedded Valkey)" if args.url is None else args.url,
                   "workers": workers if args.url is None else None, "device": args.device, "order": order,
                   "warmup": not args.no_warmup, "reached_end": list(REACHED_END)},
        "together_wall_s": together["wall_s"],
        "sequential_wall_s": sequential["wall_s"],
        "sequential_over_together": (sequential["wall_s"] / together["wall_s"] if together["wall_s"]
                                     else None),
        "errors": together["errors"] + sequential["errors"],
        **result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'phase':<11} {'runs':>4} {'errors':>6} {'wall s':>8} {'runs/s':>7} {'p50 run s':>9}")
    for p in (together, sequential):
        p50 = p["latency_s"]["p50"]
        print(f"{p['phase']:<11} {p['runs']:>4} {p['errors']:>6} {p['wall_s']:>8.2f} {p['runs_per_s']:>7.3f} "
              f"{'-' if p50 is None else f'{p50:.2f}':>9}")
    ratio = report["sequential_over_together"]
    print(f"sequential / together: {'-' if ratio is None else f'{ratio:.2f}x'}; wrote {args.out}")
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
