"""``elesium serve`` refuses to run keyless without --no-auth; ``elesium replay`` replays an API run."""

from __future__ import annotations

import json
import subprocess
import sys

from langgraph_sdk import get_sync_client

from api_server import KEY_A

pytest_plugins = ["state_fixtures", "api_server"]


def test_serve_refuses_without_keys():
    env = {"PATH": "/usr/bin:/bin", "ELESIUM_API_KEYS": ""}
    out = subprocess.run(
        [sys.executable, "-m", "elesium.cli", "serve", "--port", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "elesium: error: no API keys: set ELESIUM_API_KEYS=key=tenant,... or "
        "ELESIUM_API_KEYS_FILE, or pass --no-auth for local use"
    ]


def test_replay_command(api_server, monkeypatch, capsys):
    from elesium.cli import main

    client = get_sync_client(url=api_server.url, api_key=KEY_A)
    tid = client.threads.create()["thread_id"]
    # The CLI replays against the shipped registry, so the run is of a shipped workflow.
    client.runs.wait(
        tid,
        "expense-approval",
        input={
            "employee": "Li",
            "amount": 30.0,
            "currency": "USD",
            "category": "meals",
            "description": "Lunch with a supplier",
        },
    )
    rid = client.runs.list(tid)[0]["run_id"]
    monkeypatch.setenv("REDIS_URL", api_server.redis_url)
    assert main(["replay", rid, "--json", "--device", "cpu", "--dtype", "float32"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "identical", (report["divergence"], report["notes"])
    assert report["by"].startswith("cli/") and report["calls_compared"] == 1
    assert client.runs.get(tid, rid)["status"] == "success"
    assert main(["replay", "no-such-run"]) == 1
    assert "no API run 'no-such-run'" in capsys.readouterr().err


EXPENSE = {
    "employee": "Li",
    "amount": 30.0,
    "currency": "USD",
    "category": "meals",
    "description": "Lunch with a supplier",
}


def test_run_on_a_server(api_server, monkeypatch, capsys):
    """``elesium run --server`` runs through the SDK: the server records it, and its answer is ours."""
    from elesium.cli import main

    monkeypatch.setenv("ELESIUM_API_KEY", KEY_A)
    argv = ["run", "expense-approval", "--input", json.dumps(EXPENSE), "--seed", "11", "--json"]
    assert main([*argv, "--server", api_server.url]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "succeeded" and doc["state"]["decision"] in ("approve", "reject")
    client = get_sync_client(url=api_server.url, api_key=KEY_A)
    run = client.runs.get(doc["thread_id"], doc["run_id"])
    assert run["status"] == "success"
    assert client.threads.get_state(doc["thread_id"])["values"]["decision"] == doc["state"]["decision"]

    # Bad input is the server's 4xx message on one line, exit 1; a wrong key likewise.
    bad = ["run", "expense-approval", "--input", '{"employee": "Li"}', "--server", api_server.url]
    assert main(bad) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("elesium: error: the server refused the run:")
    monkeypatch.setenv("ELESIUM_API_KEY", "wrong-key")
    assert main([*argv, "--server", api_server.url]) == 1
    assert "the server refused the run" in capsys.readouterr().err
