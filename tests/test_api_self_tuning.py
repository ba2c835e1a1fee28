"""Self-tuning over the API (``serve --self-tuning``): API runs use, record and feed per-node tree
calibrations, and a replay decodes each run with the versions it recorded.

Real model, real server, a sampled (T > 0) free-text node, so a run's tokens depend on its trees:
a replay that ignored the recorded version would not reproduce them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel

from api_server import KEY_A, LiveServer, live_server, server_settings
from api_workflows import build_registry
from elesium.graphs import Workflow, llm_node
from elesium.graphs.llm import WorkflowState
from elesium.inference.tuning.node_calibration import CalibrationBounds

pytest_plugins = ["state_fixtures", "api_server"]
WORKFLOW = "tuned-writer"


class TopicIn(BaseModel):
    topic: str


class WriterState(WorkflowState, total=False):
    topic: str
    text: str


def _writer() -> StateGraph:
    builder = StateGraph(WriterState)
    builder.add_node(llm_node("write", prompt="Write one sentence about {topic}.", output_key="text",
                              params={"max_tokens": 32, "temperature": 0.9}))
    builder.add_edge(START, "write")
    builder.add_edge("write", END)
    return builder


@pytest.fixture(scope="module")
def tuned(engine: Any, state_server: Any) -> Iterator[LiveServer]:
    registry = build_registry()
    registry.register(Workflow.define(WORKFLOW, _writer, TopicIn, description="one sampled LLM call"))
    # Its own queue: the session's other server (self-tuning off) must not execute these runs.
    settings = server_settings(state_server.url, self_tuning=True, queue_name="self-tuning")
    with live_server(settings, engine, registry) as server:
        yield server


def _run(server: LiveServer, topic: str, seed: int) -> tuple[str, str, dict[str, Any]]:
    with server.http(KEY_A) as http:
        tid = http.post("/threads", json={}).json()["thread_id"]
        r = http.post(f"/threads/{tid}/runs/wait", json={
            "assistant_id": WORKFLOW, "input": {"topic": topic},
            "config": {"configurable": {"run_seed": seed, "mode": "speculative"}}})
        assert r.status_code == 200, r.text
        rid = http.get(f"/threads/{tid}/runs").json()[0]["run_id"]
    return tid, rid, r.json()


def test_api_runs_use_record_and_feed_node_calibrations(tuned: LiveServer) -> None:
    svc = tuned.services
    store = svc.calibrator.store
    _, first, _ = _run(tuned, "rivers", 11)
    assert svc.runs_registry.get(first).calibrations == {"write": "global"}
    steps = sum(1 for e in svc.acceptance.iter_entries(first) if e.kind == "step")
    assert steps >= CalibrationBounds().min_steps
    # The succeeded run was folded; its estimate went on trial (the global policy stays current).
    assert store.counters(WORKFLOW, "write")["steps"] == steps
    trial = store.trial(WORKFLOW, "write")
    assert trial == "v1" and store.current(WORKFLOW, "write") == "global"

    tid, second, answer = _run(tuned, "mountains", 12)
    assert svc.runs_registry.get(second).calibrations == {"write": trial}  # the trial's arm
    first_step = next(e.record for e in svc.acceptance.iter_entries(second) if e.kind == "step")
    policy = store.get(WORKFLOW, "write", trial)["policy"]
    assert first_step.calibration == pytest.approx(policy["calibration"]) and policy["calibration"] != 1.0

    # Replay decodes with the recorded version, so the sampled tokens come out the same.
    with tuned.http(KEY_A) as http:
        r = http.post(f"/threads/{tid}/runs/{second}/replay", json={"mode": "reexecute"})
    assert r.status_code == 200, r.text
    assert r.json()["verdict"] == "identical", r.json()
    assert answer["text"]
