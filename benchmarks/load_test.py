"""Load test: N concurrent workflow runs over the REST API; errors, p50/p99 latency, throughput.

Starts the API server (``uvicorn elesium.api.app:create_app --factory`` on a free port, with an API
key and the embedded Valkey in a temporary data dir) unless ``--url`` names a running one, then fires
``--runs`` ``POST /runs/wait`` requests with at most ``--concurrency`` in flight (all of them by
default), each a run of ``--workflow`` with its own seed. Every run is one request, so a request's
latency is the run's end-to-end time: queueing for the engine plus its own decoding.

"Where the time goes" comes from the server itself: ``/metrics`` (Prometheus) before and after, for
the engine's busy time against the wall time, plus each response's own timing fields when present.

Usage::

    .venv/bin/python benchmarks/load_test.py --runs 100 --out benchmarks/load-$(date +%F)
"""

from __future__ import annotations

import argparse
import asyncio
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

EXPENSE = {"employee": "Ada", "amount": 42.5, "currency": "EUR", "category": "meals",
           "description": "team lunch with the new hires"}
INPUTS: dict[str, dict[str, Any]] = {"expense-approval": EXPENSE}
KEY = "load-test-key"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = dict(os.environ, ELESIUM_API_KEYS=f"{KEY}=default", ELESIUM_DATA_DIR=str(data_dir))
    env.pop("REDIS_URL", None)
    log = open(data_dir / "server.log", "ab")  # noqa: SIM115 - the child writes it for its lifetime
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "elesium.api.app:create_app", "--factory",
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
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


def metric_sums(text: str) -> dict[str, float]:
    """Sum of every sample per metric name in a Prometheus exposition (labels folded)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFNa]+)", line)
        if match:
            try:
                sums[match.group(1)] = sums.get(match.group(1), 0.0) + float(match.group(3))
            except ValueError:
                continue
    return sums


async def one_run(client: httpx.AsyncClient, sem: asyncio.Semaphore, workflow: str, i: int) -> dict[str, Any]:
    body = {"assistant_id": workflow, "input": INPUTS[workflow], "seed": 1000 + i}
    async with sem:
        t0 = time.perf_counter()
        try:
            resp = await client.post("/runs/wait", json=body)
            status = resp.status_code
            # /runs/wait answers 200 with an "__error__" object when the run itself failed.
            ok = status == 200 and "__error__" not in resp.json()
            detail = "" if ok else resp.text[:300]
        except (httpx.HTTPError, ValueError) as exc:
            ok, detail, status = False, f"{type(exc).__name__}: {exc}", 0
        return {"i": i, "ok": ok, "status": status, "latency_s": time.perf_counter() - t0, "error": detail}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = max(0, min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[k]


async def run_load(url: str, runs: int, concurrency: int, workflow: str) -> dict[str, Any]:
    headers = {"x-api-key": KEY}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=3600, limits=limits) as client:
        before = metric_sums((await client.get("/metrics")).text)
        sem = asyncio.Semaphore(concurrency)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_run(client, sem, workflow, i) for i in range(runs)))
        wall = time.perf_counter() - t0
        after = metric_sums((await client.get("/metrics")).text)
    lat = [r["latency_s"] for r in results if r["ok"]]
    delta = {k: round(after[k] - before.get(k, 0.0), 4) for k in after
             if after[k] != before.get(k, 0.0) and not k.endswith("_created")}
    done = max(1, len(lat))
    # The engine runs one generation at a time, so each run's latency is mostly waiting its turn; the
    # service time per run (wall / runs) is what one run really costs the machine.
    where = {
        "service_time_per_run_s": round(wall / done, 3),
        "queueing_share_of_mean_latency": (round(1 - (wall / done) / statistics.fmean(lat), 3)
                                           if lat else None),
        "checkpoint_write_s_per_run": round(delta.get("elesium_checkpoint_write_seconds_sum", 0.0) / done,
                                            4),
        "checkpoint_writes_per_run": round(delta.get("elesium_checkpoint_write_seconds_count", 0.0) / done,
                                           2),
        "generated_tokens_per_run": round(delta.get("elesium_generation_tokens_total", 0.0) / done, 1),
        "prompt_tokens_per_run": round(delta.get("elesium_prompt_tokens_total", 0.0) / done, 1),
    }
    return {
        "runs": runs, "concurrency": concurrency, "workflow": workflow,
        "errors": sum(1 for r in results if not r["ok"]),
        "error_samples": [r for r in results if not r["ok"]][:5],
        "wall_s": round(wall, 3), "throughput_runs_per_s": round(len(lat) / wall, 4) if wall else 0.0,
        "latency_s": {"p50": round(percentile(lat, 50), 3), "p90": round(percentile(lat, 90), 3),
                      "p99": round(percentile(lat, 99), 3), "min": round(min(lat), 3) if lat else None,
                      "max": round(max(lat), 3) if lat else None,
                      "mean": round(statistics.fmean(lat), 3) if lat else None},
        "where_the_time_goes": where,
        "server_metric_deltas": delta,
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight (default: --runs)")
    parser.add_argument("--workflow", default="expense-approval", choices=sorted(INPUTS))
    parser.add_argument("--out", type=Path, help="directory for load_test.json")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    proc = None
    with tempfile.TemporaryDirectory(prefix="elesium-load-") as tmp:
        url = args.url
        if url is None:
            proc, url = start_server(Path(tmp))
        try:
            report = asyncio.run(run_load(url, args.runs, args.concurrency or args.runs, args.workflow))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
                # The server's embedded Valkey runs in its own session and outlives a SIGTERM'd uvicorn.
                from elesium.state.embedded import EmbeddedValkey

                leftover = EmbeddedValkey(Path(tmp))
                if leftover._attach():
                    leftover.stop()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "load_test.json").write_text(text + "\n")
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
