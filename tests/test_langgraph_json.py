"""A project's ``langgraph.json``: loaded by the CLI's loader, served by the API, run and listed by the CLI.

The example project (``examples/review-reply``: the README's workflow as a module, and a plain LangGraph
graph calling ChatElesium) is copied into a temporary directory, so the probe it fits on first load is
written there, never into the repository. The model is the session's float32 engine throughout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langgraph_sdk import get_sync_client

from api_server import KEY_A, live_server, server_settings
from elesium.cli import main
from elesium.graphs.project import GraphWorkflow, find_config, load_project, read_config
from elesium.graphs.registry import Workflow

pytest_plugins = ["state_fixtures"]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "review-reply"
REVIEW = {"product": "kettle", "text": "I love it, best kettle ever!"}


@pytest.fixture(scope="module")
def project(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The example project copied to a temporary directory; the examples' ``Engine.load()`` (the probe
    fit) gets the session engine, as the README test does."""
    from elesium.inference.engine import Engine

    root = tmp_path_factory.mktemp("project") / "review-reply"
    shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns("review-sentiment.json", "__pycache__"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "load", classmethod(lambda cls, *a, **k: engine))
        mp.delenv("REVIEW_SUMMARY_MAX_TOKENS", raising=False)
        yield root / "langgraph.json"
    os.environ.pop("REVIEW_SUMMARY_MAX_TOKENS", None)


def test_the_loader_registers_each_graph_kind(project: Path) -> None:
    loaded = load_project(project)
    assert loaded.names == ["review-reply", "review-summary"]
    assert (project.parent / "review-sentiment.json").exists()  # fitted on first load, in the copy
    assert os.environ["REVIEW_SUMMARY_MAX_TOKENS"] == "16"  # "env" was applied before the import
    reply, summary = loaded.registry.get("review-reply"), loaded.registry.get("review-summary")
    assert type(reply) is Workflow and reply.input_model.__name__ == "Review"
    assert isinstance(summary, GraphWorkflow) and summary.compiled is not None
    assert sorted(summary.input_model.model_fields) == ["product", "summary", "text", "words"]
    assert summary.input_model.model_validate({"text": "x"}).model_dump() == {"text": "x"}  # sent keys only
    assert load_project(project).registry.get("review-summary").version == summary.version  # stable
    from langgraph.checkpoint.memory import InMemorySaver

    saver = InMemorySaver()
    assert summary.build(None).checkpointer is None and summary.build(saver).checkpointer is saver
    assert find_config(project.parent) == project


def test_the_server_runs_both_graphs_with_acceptance_and_identical_replays(
    project: Path, engine: Any, state_server: Any
) -> None:
    registry = load_project(project).registry
    # Its own queue: the session's other live servers share this Redis, and their workers (with other
    # registries) must not take this project's runs.
    queue = f"project-{uuid.uuid4().hex[:8]}"
    with live_server(server_settings(state_server.url, queue_name=queue), engine, registry) as server:
        client = get_sync_client(url=server.url, api_key=KEY_A)
        assert {a["graph_id"] for a in client.assistants.search()} == {"review-reply", "review-summary"}
        http = server.http()
        for graph in ("review-reply", "review-summary"):
            thread = client.threads.create()["thread_id"]
            state = client.runs.wait(thread, graph, input=REVIEW, config={"configurable": {"run_seed": 7}})
            run = client.runs.list(thread)[0]
            assert run["status"] == "success", run
            if graph == "review-reply":
                module = __import__("review_reply")
                assert state["reply"] in module.REPLIES[state["sentiment"]]
            else:
                assert state["summary"] and state["words"] == len(state["summary"].split())
            acc = http.get(f"/threads/{thread}/runs/{run['run_id']}/acceptance").json()
            assert acc["entries"] and acc["summary"]["tau"] > 0, acc  # every LLM call logged its steps
            report = http.post(f"/threads/{thread}/runs/{run['run_id']}/replay", json={"mode": "reexecute"},
                               timeout=300).json()
            assert report["verdict"] == "identical", report
            assert report["calls_compared"] >= 1
        bad = http.post("/runs/wait", json={"assistant_id": "review-summary", "input": {"nope": 1}})
        assert bad.status_code == 422 and "nope" in bad.text


@pytest.fixture
def cli_env(redis_url: str, monkeypatch: pytest.MonkeyPatch, engine: Any) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setattr("elesium.cli.commands.run.load_engine", lambda args, **k: engine)


def test_the_cli_lists_and_runs_the_projects_graphs(
    project: Path, cli_env: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["workflows", "--config", str(project), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [w["name"] for w in listed] == ["review-reply", "review-summary"]
    assert listed[1]["schema"]["additionalProperties"] is False

    code = main(["run", "review-summary", "--config", str(project), "--input", json.dumps(REVIEW),
                 "--seed", "3", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    doc = json.loads(out.out)
    assert doc["status"] == "succeeded" and doc["state"]["summary"] and doc["acceptance"]["calls"] == 1

    # ./langgraph.json is the default where it exists; --no-config keeps the built-in workflows.
    monkeypatch.chdir(project.parent)
    assert main(["workflows", "--json"]) == 0
    out = capsys.readouterr()
    assert [w["name"] for w in json.loads(out.out)] == ["review-reply", "review-summary"]
    assert "graphs from" in out.err
    assert main(["workflows", "--json", "--no-config"]) == 0
    assert "ticket-triage" in {w["name"] for w in json.loads(capsys.readouterr().out)}
    assert main(["run", "review-reply", "--no-config", "--input", "{}"]) == 1
    assert "unknown workflow 'review-reply'" in capsys.readouterr().err


GRAPH = "from langgraph.graph import StateGraph\nfrom typing import TypedDict\n" \
        "class S(TypedDict):\n    x: int\nb = StateGraph(S)\nb.add_node('n', lambda s: s)\n" \
        "b.set_entry_point('n')\ngraph = b.compile()\nnot_a_graph = 3\n" \
        "def factory(config):\n    return b\nasync def afactory():\n    return b\n"


@pytest.mark.parametrize("doc,message", [
    (None, "no such file"),
    ("{\"graphs\": ", "not valid JSON: Expecting value at line 1 column 12"),
    ({"graphs": {"g": "./g.py:graph"}, "graph": {}}, "unknown key 'graph'"),
    ({"graphs": ["./g.py:graph"]}, "'graphs' must be a non-empty object"),
    ({"graphs": {"g": "./g.py"}}, "graph 'g': expected \"./file.py:attr\""),
    ({"graphs": {"g": "./g.py:graph"}, "env": 3}, "'env' must be a file path or an object"),
    ({"graphs": {"g": "./g.py:graph"}, "env": ".env.missing"}, "env file '.env.missing' not found"),
    ({"graphs": {"g": "./g.py:graph"}, "dependencies": "."}, "'dependencies' must be a list"),
    ({"graphs": {"g": "./missing.py:graph"}}, "graph 'g' (./missing.py:graph): no file"),
    ({"graphs": {"g": "./broken.py:graph"}}, "graph 'g' (./broken.py:graph): import failed: "
                                             "ModuleNotFoundError: No module named 'no_such_module'"),
    ({"graphs": {"g": "no_such_pkg.mod:graph"}}, "graph 'g' (no_such_pkg.mod:graph): import failed"),
    ({"graphs": {"g": "./g.py:nope"}}, "graph 'g' (./g.py:nope): "),
    ({"graphs": {"g": "./g.py:not_a_graph"}}, "graph 'g' (./g.py:not_a_graph): not a graph: got int"),
    ({"graphs": {"g": "./g.py:afactory"}}, "async graph factories are not supported"),
])
def test_a_bad_project_is_one_line_naming_the_entry(
    doc: Any, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "g.py").write_text(GRAPH)
    (tmp_path / "broken.py").write_text("import no_such_module\n")
    config = tmp_path / "langgraph.json"
    if doc is not None:
        config.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    assert main(["workflows", "--config", str(config)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("elesium: error: ") and message in err[0], err
    if "nope" in str(doc):
        assert "has no attribute 'nope'" in err[0]


def test_factories_with_a_config_and_graphs_by_module_load(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "proj_pkg_lgjson"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "g.py").write_text(GRAPH)
    (tmp_path / ".env").write_text("# comment\nexport LGJSON_TEST_VAR='from file'\n")
    monkeypatch.delenv("LGJSON_TEST_VAR", raising=False)
    config = tmp_path / "langgraph.json"
    graphs = {"a": "proj_pkg_lgjson.g:factory",
              "b": {"path": "./proj_pkg_lgjson/g.py:graph", "description": "B"}}
    config.write_text(json.dumps({"dependencies": ["."], "env": ".env", "python_version": "3.11",
                                  "graphs": graphs}))
    loaded = load_project(config)
    assert loaded.names == ["a", "b"] and os.environ["LGJSON_TEST_VAR"] == "from file"
    assert loaded.registry.get("b").description == "B"
    assert loaded.registry.get("a").version == loaded.registry.get("b").version  # same builder
    assert read_config(config).ignored == ["python_version"]


def test_dev_hands_its_options_to_serve_and_watches_the_project(capsys: pytest.CaptureFixture[str]) -> None:
    from elesium.cli.commands import dev, serve

    project = EXAMPLE / "langgraph.json"  # read, not imported

    parser = argparse.ArgumentParser()
    serve.add_serve_args(parser)
    args = parser.parse_args(["--no-auth", "--port", "9000", "--workers", "2"])
    argv = dev.serve_argv(parser._actions, args, project)
    assert argv[3:] == ["serve", "--config", str(project), "--port", "9000", "--no-auth", "--workers", "2"]
    watched = read_config(project).watched_files()
    assert project in watched and project.parent / "summary_graph.py" in watched
    assert main(["dev", "--config", str(project.parent / "missing.json")]) == 1
    assert "no such file" in capsys.readouterr().err


SEED = 11


def _server_env(tmp_path: Path) -> dict[str, str]:
    """A fresh user's environment for ``elesium serve``: no REDIS_URL (the embedded Valkey starts in a
    new data dir), one key, the project's own ``env`` left to the project, and the session's cache
    directory (its tuning profile is the one the session engine loaded)."""
    drop = ("REDIS_URL", "ELESIUM_API_KEYS", "ELESIUM_API_KEYS_FILE", "REVIEW_SUMMARY_MAX_TOKENS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return env | {"ELESIUM_DATA_DIR": str(tmp_path / "data"), "ELESIUM_API_KEYS": "k=t",
                  "PYTHONUNBUFFERED": "1"}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _final_values(parts: list[Any]) -> dict[str, Any]:
    values = [p.data for p in parts if p.event == "values"]
    assert values, [p.event for p in parts]
    return values[-1]


def _calls(entries: Any) -> list[tuple[str, int, int, tuple[int, ...]]]:
    """(node, call index, call seed, tokens) of each LLM call, from the API's acceptance entries."""
    return [(e["node_id"], e["call_index"] or 0, e["call_seed"] or 0, tuple(e["tokens"] or ()))
            for e in entries if e["kind"] == "call"]


@pytest.mark.slow
def test_serve_config_answers_as_the_project_runs_in_process(
    project: Path, engine: Any, state_server: Any, key_prefix: str, tmp_path: Path
) -> None:
    """Issue 39: ``elesium serve --config examples/review-reply/langgraph.json`` (a subprocess, its own
    embedded Valkey), each graph run through langgraph-sdk (streamed, and waited on another thread,
    same input and run seed), replayed identically, and the same answer and LLM tokens as the same
    graph run in-process through the same loader; SIGTERM then stops it with its Valkey."""
    import subprocess
    import sys
    import time

    import httpx

    from elesium.api.client import ElesiumClient
    from elesium.api.server import free_port
    from elesium.graphs import WorkflowRunner
    from elesium.graphs.audit import call_tokens

    registry = load_project(project).registry  # fits the probe into the copy, before the server reads it
    assert (project.parent / "review-sentiment.json").exists()
    port = free_port()
    elesium = Path(sys.executable).parent / "elesium"
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [str(elesium), "serve", "--config", str(project), "--port", str(port), "--device", "cpu",
             "--dtype", "float32"],
            cwd=tmp_path, env=_server_env(tmp_path), stdout=log_file, stderr=subprocess.STDOUT)
    try:
        # In-process while the server starts: the loader's registry on the session's float32 CPU engine.
        runner = WorkflowRunner(engine, state_server.url, registry=registry, prefix=key_prefix)
        local = {}
        for graph in ("review-reply", "review-summary"):
            done = runner.start(graph, REVIEW, seed=SEED)
            assert done.status == "succeeded", done.error
            local[graph] = (json.loads(json.dumps(done.state)), call_tokens(runner.log, done.run_id))
            assert local[graph][1] and all(tokens for *_, tokens in local[graph][1])

        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"serve exited {proc.returncode}: {log_path.read_text()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"serve not ready in 300 s: {log_path.read_text()[-3000:]}"
            time.sleep(0.25)

        config = {"configurable": {"run_seed": SEED}}
        with ElesiumClient(url, api_key="k", timeout=300) as client:
            assert {a["graph_id"] for a in client.assistants.search()} == {"review-reply", "review-summary"}
            for graph, (state, calls) in local.items():
                thread = client.threads.create()["thread_id"]
                parts = list(client.runs.stream(thread, graph, input=REVIEW, config=config,
                                                stream_mode=["values", "messages-tuple"]))
                streamed = _final_values(parts)
                run = client.runs.list(thread)[0]
                assert run["status"] == "success", run
                other = client.threads.create()["thread_id"]
                waited = client.runs.wait(other, graph, input=REVIEW, config=config)
                other_run = client.runs.list(other)[0]
                assert streamed == waited == state, (graph, streamed, waited, state)
                served = _calls(client.acceptance_entries(thread, run["run_id"]))
                assert served == _calls(client.acceptance_entries(other, other_run["run_id"])) == calls
                if graph == "review-summary":  # ChatElesium's tokens came through the messages stream
                    chunks = [p.data[0]["content"] for p in parts if p.event == "messages"]
                    assert chunks and "".join(chunks).strip() == streamed["summary"]
                report = client.replay(thread, run["run_id"], "reexecute")
                assert report["verdict"] == "identical", report
                assert report["calls_compared"] >= 1

        valkey = int(json.loads(next((tmp_path / "data").rglob("server.json")).read_text())["pid"])
        assert _alive(valkey)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
        deadline = time.monotonic() + 15
        while _alive(valkey):
            assert time.monotonic() < deadline, f"SIGTERM left the embedded Valkey (pid {valkey}) running"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:  # a failure above: SIGTERM still stops its Valkey, SIGKILL would not
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_worker_and_resume_see_the_projects_graphs(
    project: Path, redis_url: str, engine: Any, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    """A queue worker must run what the servers queue: ``elesium worker --config`` executes the project's
    graphs (API runs and background runs alike), and ``elesium resume --config`` finds its runs' workflows
    there, not among the built-ins."""
    import redis

    from elesium.cli.commands.worker import make_executor
    from elesium.state import RunRecord, RunRegistry, RunStatus

    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setattr("elesium.cli.commands.common.load_engine", lambda args, **k: engine)
    args = argparse.Namespace(redis_url=redis_url, self_tuning=False, config=str(project), no_config=False)
    dispatcher = make_executor(args, None)
    assert [w.name for w in dispatcher.api.svc.registry.list()] == ["review-reply", "review-summary"]
    assert [w.name for w in dispatcher.workflows.runner.registry.list()] == ["review-reply", "review-summary"]
    builtin = make_executor(argparse.Namespace(redis_url=redis_url, self_tuning=False, config=None,
                                               no_config=True), None)
    assert "ticket-triage" in {w.name for w in builtin.workflows.runner.registry.list()}

    from elesium.graphs import default_registry

    registry = RunRegistry(redis.Redis.from_url(redis_url))
    rid = f"proj-{uuid.uuid4().hex[:8]}"
    version = default_registry().get("ticket-triage").version
    registry.create(RunRecord(run_id=rid, workflow="ticket-triage", workflow_version=version, input_hash="h"))
    registry.update_status(rid, RunStatus.RUNNING)
    registry.update_status(rid, RunStatus.INTERRUPTED)
    assert main(["resume", rid, "--config", str(project), "--value", '{"approved": "maybe"}']) == 1
    assert "unknown workflow 'ticket-triage'" in capsys.readouterr().err
    assert main(["resume", rid, "--no-config", "--value", '{"approved": "maybe"}']) == 1
    assert "invalid resume value for workflow 'ticket-triage'" in capsys.readouterr().err


def test_eval_scores_a_projects_graph_on_the_authors_dataset(
    project: Path, redis_url: str, engine: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str]
) -> None:
    """``elesium eval --config`` runs one of the project's graphs on the author's own labelled rows, through
    the API's run path like a built-in workflow; without the project the name is unknown (one line, exit 1,
    nothing written)."""
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setattr("elesium.cli.commands.eval.load_engine", lambda args, **k: engine)
    data = tmp_path / "reviews.jsonl"
    rows = [{"id": "kettle", "split": "test", "input": REVIEW, "expected": {"words": "3"}},
            {"id": "lamp", "split": "test", "input": {"product": "lamp", "text": "It broke after a day."},
             "expected": {"words": "4"}}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "results.json"
    code = main(["eval", "review-summary", "--config", str(project), "--dataset", str(data),
                 "--out", str(out), "--json"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    doc = json.loads(out.read_text())
    assert doc["workflow"] == "review-summary" and doc["summary"]["status"] == {"succeeded": 2}
    for example in doc["examples"]:  # the project's rule counted the words the model wrote
        assert isinstance(example["prediction"]["words"], int) and example["prediction"]["words"] > 0
        assert example["tokens"] > 0 and example["run_ids"], example
    assert doc["fields"]["words"]["n"] == 2
    missing = tmp_path / "none.json"
    assert main(["eval", "review-summary", "--no-config", "--dataset", str(data), "--out", str(missing)]) == 1
    assert "unknown workflow 'review-summary'" in capsys.readouterr().err
    assert not missing.exists()
