"""The README's "Write your own workflow" example, run exactly as written (real model and Redis)."""

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
    engine, redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The example calls Engine.load(); the suite loads the model once per session, so hand it that engine.
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: engine))
    monkeypatch.setenv("REDIS_URL", redis_url)
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(example_code(), str(README), "exec"), namespace)  # noqa: S102 - the documented example itself

    result = namespace["result"]
    assert result.status == "succeeded" and len(result.workflow_version) == 16
    assert result.state["sentiment"] in ("positive", "negative") and result.state["reply"].strip()
    # The streamed graph run used the same run seed, so it printed the same tokens the runner decoded.
    streamed = capsys.readouterr().out
    assert streamed.startswith(result.state["sentiment"] + result.state["reply"])
    record = RunRegistry.from_url(redis_url).get(result.run_id)
    assert record.status == RunStatus.SUCCEEDED and record.workflow == "review-reply"
    assert record.input == {"product": "kettle", "text": "Boils fast and looks great."}
