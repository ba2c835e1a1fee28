"""The README, run as a new user runs it: ``./dev demo``, a plain ``elesium serve``, and every Python snippet,
on the engine ``Engine.load()`` gives with every setting at its default (on a CPU: the 4-bit compiled path).

The "Write your own workflow" snippet is ``test_graphs_readme.py``; the other four run here. The snippets
run exactly as written, with two substitutions a reader makes too: the SDK and OpenAI snippets talk to a
server this test starts (its URL for ``http://127.0.0.1:8123``, and ``key1`` is one of its keys), and
``Engine.load()`` returns the session's default engine instead of loading it a second time.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from elesium.inference.engine import Engine

pytest_plugins = ["state_fixtures"]

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SNIPPET_URL = "http://127.0.0.1:8123"


def python_snippets() -> dict[str, str]:
    """Every ```python block of the README, keyed by the heading it sits under (plus its order there)."""
    found: dict[str, str] = {}
    heading, count, block = "", 0, None
    for line in README.read_text().splitlines(keepends=True):
        if block is not None:
            if line.startswith("```"):
                found[f"{heading} #{count}"], block = "".join(block), None
            else:
                block.append(line)
        elif line.startswith("```python"):
            count, block = count + 1, []
        elif line.startswith("#"):
            heading, count = line.lstrip("#").strip(), 0
    return found


def run_snippet(code: str, namespace: dict[str, Any]) -> str:
    """Executes a README snippet in ``namespace``; returns what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # dont_inherit: the snippet runs as a reader runs it, without this module's `from __future__` imports.
        exec(compile(code, str(README), "exec", dont_inherit=True), namespace)  # noqa: S102 - the snippet itself
    return out.getvalue()


def test_the_readme_snippets_are_all_run_by_the_suite() -> None:
    """A new snippet fails here until a test runs it."""
    assert sorted(python_snippets()) == sorted(
        ["Python API #1", "Python API #2", "API #1", "API #2", "Write your own workflow #1"])


@pytest.fixture
def as_loaded(default_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """``Engine.load()`` answers the session's default engine (loaded by exactly that call)."""
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: default_engine))
    return default_engine


def test_the_python_api_snippets_run_on_the_default_engine(as_loaded: Engine) -> None:
    namespace: dict[str, Any] = {"__name__": "readme_python_api"}
    printed = run_snippet(python_snippets()["Python API #1"], namespace)
    result, stream = namespace["result"], namespace["stream"]
    assert namespace["engine"] is as_loaded and as_loaded.forward_path == "compiled"
    assert 0 < len(result.token_ids) <= 128 and result.text == as_loaded.tokenizer.decode(result.token_ids)
    assert result.steps and result.finish_reason in ("eos", "stop", "length")
    # The stream printed its chunks as they came, and they add up to its result; on_step printed each step.
    steps = re.findall(r"StepRecord\(step=\d+.*?calibration=[-\d.e]+\)\n", printed)
    assert len(steps) == len(stream.result.steps)
    chunks = printed
    for step in steps:
        chunks = chunks.replace(step, "", 1)
    assert stream.result.text and chunks == stream.result.text

    printed = run_snippet(python_snippets()["Python API #2"], namespace)
    ticket = namespace["Ticket"].model_validate_json(namespace["out"].text)
    assert ticket.category in ("billing", "bug", "access")


@pytest.fixture
def snippet_server(as_loaded: Engine, state_server: Any) -> Any:
    """The API served on a free port with the snippets' key, on the default engine and the test Valkey."""
    from elesium.api.app import create_app
    from elesium.api.server import BackgroundServer
    from elesium.api.settings import ApiSettings

    # Its own queue: the session's other live servers share this Valkey, and their workers (other engines
    # and registries) must not take the snippets' runs, nor this server's workers theirs.
    settings = ApiSettings(api_keys={"key1": "readme"}, redis_url=state_server.url,
                           queue_name=f"readme-{uuid.uuid4().hex[:8]}")
    app = create_app(settings, engine=as_loaded)
    with BackgroundServer(app) as url:
        yield url


@pytest.mark.slow
def test_the_sdk_and_openai_snippets_run_against_a_server(snippet_server: str, as_loaded: Engine) -> None:
    snippets = python_snippets()
    namespace: dict[str, Any] = {"__name__": "readme_api"}
    printed = run_snippet(snippets["API #1"].replace(SNIPPET_URL, snippet_server), namespace)
    result = namespace["result"]
    # The snippet prints the streamed tokens (no newline after them), then the outcome and tau, then the
    # replay's verdict.
    lines = printed.strip().splitlines()
    assert lines[-1] == "identical", printed
    done = re.search(rf"{re.escape(result['outcome'])} ([0-9.]+)$", lines[-2])
    assert done and float(done.group(1)) > 0, printed
    assert printed[: printed.index(done.group(0))].strip(), "the streamed tokens were not printed"
    assert result["category"] and result["final_reply"]

    run_snippet(snippets["API #2"].replace(SNIPPET_URL, snippet_server), namespace)
    oai = namespace["oai"]
    again = oai.chat.completions.create(model="elesium", messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=32, seed=1, extra_body={"mode": "speculative"})
    assert again.choices[0].message.content and again.usage.completion_tokens <= 32


def _environment(tmp_path: Path) -> dict[str, str]:
    """A new user's environment: no REDIS_URL (the embedded Valkey starts in a fresh data dir), the
    session's cache directory (the default engine's packed weights and compiled graphs, as a second run
    of ``./dev demo`` finds its own)."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "ELESIUM_API_KEYS")}
    env["ELESIUM_DATA_DIR"] = str(tmp_path / "data")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _valkey_pid(data_dir: Path) -> int:
    state = next(data_dir.rglob("server.json"), None)
    assert state is not None, f"no embedded Valkey state under {data_dir}"
    return int(json.loads(state.read_text())["pid"])


def _servers_under(data_dir: Path) -> list[int]:
    """Processes whose command line names a file under ``data_dir`` (the embedded Valkey runs with its
    config file there)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if str(data_dir) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(proc.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_dev_demo_runs_the_main_job_end_to_end(default_engine: Engine, tmp_path: Path) -> None:
    """The README's first command, exactly: set-up (already done: quick), the embedded Valkey, the server,
    ticket-triage streamed, approved, its acceptance and an identical replay; exit 0; the Valkey it started
    stops with it."""
    venv = Path(sys.executable).parent.parent
    env = _environment(tmp_path) | {"ELESIUM_VENV": str(venv)}
    started = time.monotonic()
    done = subprocess.run(["./dev", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    took = time.monotonic() - started
    out = done.stdout
    assert done.returncode == 0, f"./dev demo exited {done.returncode}:\n{done.stderr[-3000:]}\n{out[-3000:]}"
    assert "approval requested:" in out and "approved by: demo/" in out
    assert re.search(r"^  category: \"\w+\"$", out, flags=re.MULTILINE), out
    assert re.search(r"acceptance \(run \w+\): \d+ LLM calls, \d+ tokens in \d+ steps", out), out
    assert "replay (re-execute both runs): IDENTICAL" in out, out
    assert "server stopped" in done.stderr
    assert not _servers_under(tmp_path / "data"), "the demo left its embedded Valkey running"
    print(f"./dev demo took {took:.0f} s")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_plain_serve_starts_answers_and_stops_with_its_valkey(default_engine: Engine, tmp_path: Path,
                                                                 sig: signal.Signals) -> None:
    """``elesium serve`` as the README starts it (keys from the environment, every other setting its
    default): ready within its start-up, a run through the SDK, and on SIGTERM (what a service manager
    sends) or Ctrl-C it exits 0 and takes its embedded Valkey down with it."""
    from elesium.api.server import free_port

    port = free_port("127.0.0.1")
    env = _environment(tmp_path) | {"ELESIUM_API_KEYS": "key1=readme"}
    elesium = Path(sys.executable).parent / "elesium"
    proc = subprocess.Popen([str(elesium), "serve", "--port", str(port)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"serve exited {proc.returncode}: {proc.stdout.read()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "serve did not become ready in 600 s"
            time.sleep(0.5)
        answer = httpx.post(f"{url}/v1/chat/completions", headers={"x-api-key": "key1"}, timeout=120,
                            json={"model": "elesium", "max_tokens": 8,
                                  "messages": [{"role": "user", "content": "Say hello."}]})
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
        valkey = _valkey_pid(tmp_path / "data")
        assert _alive(valkey) and _servers_under(tmp_path / "data") == [valkey]
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0, proc.stdout.read()[-3000:]
        assert _gone_within(valkey, 15), f"{sig.name} left the embedded Valkey (pid {valkey}) running"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bench_state_writes_its_figures(tmp_path: Path) -> None:
    """``elesium bench-state`` as the CLI table lists it (a short run): both savers timed, JSON written."""
    elesium = Path(sys.executable).parent / "elesium"
    done = subprocess.run([str(elesium), "bench-state", "--steps", "30", "--out", str(tmp_path / "out")],
                          cwd=tmp_path, env=_environment(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RedisSaver/sync" in done.stdout and "InMemorySaver/sync" in done.stdout
    figures = json.loads((tmp_path / "out" / "state_bench.json").read_text())
    assert figures and not _servers_under(tmp_path / "data"), "bench-state left its Valkey running"
