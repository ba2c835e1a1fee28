"""The README's "Write your own workflow" example, run as written on the default `Engine.load()`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from elesium.inference.engine import Engine
from elesium.state import RunRegistry, RunStatus

pytest_plugins = ["state_fixtures"]

README = Path(__file__).resolve().parent.parent / "README.md"


def example_code() -> str:
    section = README.read_text().split("## Write your own workflow", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert blocks, "the README section lost its example"
    return blocks[0]


def test_readme_workflow_example_runs(
    default_engine, redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    # The example calls Engine.load(); the suite loads that default engine once per session: hand it over.
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: default_engine))
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.chdir(tmp_path)  # the example fits its probe into the working directory
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(example_code(), str(README), "exec"), namespace)  # noqa: S102 - the documented example itself

    results = namespace["results"]
    assert (tmp_path / "review-sentiment.json").exists()
    assert all(r.status == "succeeded" and len(r.workflow_version) == 16 for r in results)
    # The example's own reviews, classified as a reader would.
    assert [r.state["sentiment"] for r in results] == ["positive", "positive", "negative", "negative"]
    for r in results:
        assert r.state["reply"] in namespace["REPLIES"][r.state["sentiment"]]
    # The streamed graph run used the same run seed, so it printed the tokens the runner decoded.
    streamed = capsys.readouterr().out
    assert streamed.startswith(results[0].state["reply"])
    record = RunRegistry.from_url(redis_url).get(results[0].run_id)
    assert record.status == RunStatus.SUCCEEDED and record.workflow == "review-reply"
    assert record.input == {"product": "kettle", "text": "I love it, best kettle ever!"}
