"""Determinism: same workflow version, input and seed -> same states, tokens and acceptance records.

Twice in this process, then once more in a fresh ``elesium`` process (``run`` then ``resume``), on the
default CPU configuration. ``ticket-triage`` is the subject: it has classifier probes and span
pointers on the engine's hidden states, a sampled choice under a grammar (the reply's opening, at
temperature 0.7, so the derived seeds matter) and an interrupt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from elesium.graphs import WorkflowRunner
from elesium.graphs.audit import call_tokens, comparable_entries
from elesium.state import AcceptanceLog, Retention, RunRegistry

pytest_plugins = ["state_fixtures"]

TICKET = {
    "subject": "Charged twice for my subscription",
    "body": "My card was charged twice for order 55120 this month. Please refund the duplicate payment.",
}
APPROVAL = {"approved": True}
SEED = 41


def run_in_process(runner: WorkflowRunner) -> dict[str, Any]:
    started = runner.start("ticket-triage", TICKET, seed=SEED)
    assert started.status == "interrupted", started.error
    finished = runner.resume(started.run_id, APPROVAL)
    assert finished.status == "succeeded", finished.error
    return {
        "at_interrupt": started.state,
        "final": finished.state,
        "interrupt": [i["value"] for i in started.interrupt],
        "calls": call_tokens(runner.log, started.run_id),
        "entries": comparable_entries(runner.log, started.run_id),
        "engine": runner.runs.get(started.run_id).engine,
        "version": finished.workflow_version,
    }


def elesium(*args: str, redis_url: str) -> dict[str, Any]:
    env = {**os.environ, "REDIS_URL": redis_url, "ELESIUM_DEVICE": "cpu", "ELESIUM_DTYPE": "float32"}
    proc = subprocess.run(
        [sys.executable, "-m", "elesium.cli", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_same_seed_same_run_here_and_in_a_fresh_process(engine, redis_url: str, key_prefix: str) -> None:
    runner = WorkflowRunner(engine, redis_url, prefix=key_prefix)
    first = run_in_process(runner)
    second = run_in_process(runner)
    assert first == second
    assert len(first["calls"]) == 1 and all(tokens for *_, tokens in first["calls"])
    assert (
        first["final"]["outcome"] == "sent"
        and first["final"]["final_reply"] == first["at_interrupt"]["draft"]
    )

    started = elesium(
        "run", "ticket-triage", "--input", json.dumps(TICKET), "--seed", str(SEED), redis_url=redis_url
    )
    assert started["status"] == "interrupted" and started["workflow_version"] == first["version"]
    assert started["state"] == first["at_interrupt"]
    assert [i["value"] for i in started["interrupt"]] == first["interrupt"]
    finished = elesium("resume", started["run_id"], "--value", json.dumps(APPROVAL), redis_url=redis_url)
    assert finished["status"] == "succeeded" and finished["state"] == first["final"]

    log = AcceptanceLog.from_url(redis_url, retention=Retention(maxlen=None))  # the CLI's default keys
    assert call_tokens(log, started["run_id"]) == first["calls"]
    assert comparable_entries(log, started["run_id"]) == first["entries"]
    assert RunRegistry.from_url(redis_url).get(started["run_id"]).engine == first["engine"]
