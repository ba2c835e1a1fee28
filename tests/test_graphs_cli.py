"""``elesium run`` / ``resume`` / ``workflows``: bad requests are one line, exit 1, and write nothing.

The commands run in-process through ``elesium.cli.main`` against the session's Valkey (``REDIS_URL``);
every key on the server is listed before and after, so "nothing written" covers any prefix. The
happy path through a fresh process is in test_graphs_determinism.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import redis

from elesium.cli import main
from elesium.state import RunRecord, RunRegistry, RunStatus

pytest_plugins = ["state_fixtures"]


@pytest.fixture
def cli_env(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[redis.Redis]:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("ELESIUM_DEVICE", "cpu")
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def all_keys(client: redis.Redis) -> set[bytes]:
    return set(client.scan_iter(count=1000))


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["run", "nope", "--input", "{}"],
            "unknown workflow 'nope' (registered: expense-approval, incident-summary, ticket-triage)",
        ),
        (
            ["run", "ticket-triage", "--input", '{"subject": "x",'],
            "--input is not valid JSON: Expecting property name "
            "enclosed in double quotes at line 1 column 17",
        ),
        (
            ["run", "ticket-triage", "--input", '{"subject": "x"}'],
            "invalid input for workflow 'ticket-triage': field 'body': Field required",
        ),
        (
            [
                "run",
                "expense-approval",
                "--input",
                json.dumps(
                    {
                        "employee": "a",
                        "amount": "lots",
                        "currency": "USD",
                        "category": "meals",
                        "description": "a b c",
                    }
                ),
            ],
            "invalid input for workflow 'expense-approval': field 'amount': Input should be a valid number",
        ),
        (
            ["run", "incident-summary", "--input", "[1, 2]"],
            "invalid input for workflow 'incident-summary': must be a JSON object, got list",
        ),
        (
            ["run", "ticket-triage", "--input", "@/nonexistent/ticket.json"],
            "--input: cannot read /nonexistent/ticket.json: No such file",
        ),
        (
            ["run", "ticket-triage", "--input", "{}", "--version", "0000000000000000"],
            "workflow 'ticket-triage' has no version '0000000000000000'",
        ),
        (["resume", "no-such-run", "--value", '{"approved": true}'], "no run 'no-such-run' in the registry"),
        (["resume", "no-such-run", "--value", "yes"], "--value is not valid JSON"),
    ],
)
def test_bad_requests_fail_in_one_line_and_write_nothing(
    cli_env: redis.Redis, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    before = all_keys(cli_env)
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("elesium: error: ")
    assert message in err
    assert all_keys(cli_env) == before


def test_resume_refuses_runs_that_are_not_interrupted(
    cli_env: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    registry = RunRegistry(cli_env)
    registry.create(
        RunRecord(run_id="cli-done", workflow="ticket-triage", workflow_version="x", input_hash="h")
    )
    registry.update_status("cli-done", RunStatus.RUNNING)
    registry.update_status("cli-done", RunStatus.SUCCEEDED)
    before = all_keys(cli_env)
    assert main(["resume", "cli-done", "--value", '{"approved": true}']) == 1
    err = capsys.readouterr().err
    assert err == "elesium: error: run 'cli-done' is succeeded; only an interrupted run can be resumed\n"
    assert all_keys(cli_env) == before


def test_resume_validates_the_value_before_loading_anything(
    cli_env: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    from elesium.graphs import default_registry

    version = default_registry().get("ticket-triage").version
    registry = RunRegistry(cli_env)
    registry.create(
        RunRecord(run_id="cli-waiting", workflow="ticket-triage", workflow_version=version, input_hash="h")
    )
    registry.update_status("cli-waiting", RunStatus.RUNNING)
    registry.update_status("cli-waiting", RunStatus.INTERRUPTED)
    before = all_keys(cli_env)
    assert main(["resume", "cli-waiting", "--value", '{"approved": "maybe"}']) == 1
    err = capsys.readouterr().err
    assert (
        "invalid resume value for workflow 'ticket-triage': field 'approved'" in err and err.count("\n") == 1
    )
    assert all_keys(cli_env) == before and registry.get("cli-waiting").status == RunStatus.INTERRUPTED


def test_workflows_lists_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    from elesium.graphs import default_registry

    assert main(["workflows"]) == 0
    out = capsys.readouterr().out
    for w in default_registry().list():
        assert f"{w.name}  {w.version}" in out
    assert "input: subject: string, body: string, customer: string?" in out
    assert main(["workflows", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [w["name"] for w in listed] == ["expense-approval", "incident-summary", "ticket-triage"]
    assert listed[0]["schema"]["required"] == ["employee", "amount", "currency", "category", "description"]
