"""Background runs of a shipped workflow through the queue: submit, execute on a worker, same result.

The real engine and the real ``expense-approval`` workflow (one LLM call), a real Valkey, and a real
3-master Valkey cluster.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from elesium.graphs.audit import call_tokens
from elesium.graphs.background import WorkflowExecutor, submit
from elesium.graphs.runner import InputValidationError, WorkflowRunner
from elesium.state.queue import IdempotencyConflictError, RunQueue
from elesium.state.queue_worker import QueueWorker
from elesium.state.runs import RunStatus

pytest_plugins = ["state_fixtures", "cluster_fixtures"]

CLAIM = {"employee": "Ada", "amount": 42.5, "currency": "EUR", "category": "meals",
         "description": "team lunch with the new hires"}


@pytest.fixture
def setup(engine: Any, state_server: Any) -> tuple[WorkflowRunner, RunQueue, str]:
    prefix = f"bg-{uuid.uuid4().hex[:8]}"
    runner = WorkflowRunner(engine, state_server.url, prefix=prefix)
    return runner, RunQueue.from_url(state_server.url, prefix=f"{prefix}:q"), prefix


def test_bad_input_writes_nothing(setup: tuple[WorkflowRunner, RunQueue, str]) -> None:
    runner, queue, _ = setup
    with pytest.raises(InputValidationError, match="amount"):
        submit(runner, queue, "expense-approval", {**CLAIM, "amount": -1})
    queue.ensure_group()
    assert queue.client.xlen(queue.stream_key) == 0
    assert runner.runs.list_by_tenant("default") == []


@pytest.fixture(params=["single", "cluster"])
def any_setup(request: pytest.FixtureRequest, engine: Any) -> tuple[WorkflowRunner, RunQueue, str]:
    """The whole service (queue, run registry, checkpoints, acceptance logs) on one server, then on a
    3-master cluster."""
    server = request.getfixturevalue("state_server").url if request.param == "single" \
        else request.getfixturevalue("local_cluster").url
    prefix = f"bg-{uuid.uuid4().hex[:8]}"
    runner = WorkflowRunner(engine, server, prefix=prefix)
    return runner, RunQueue.from_url(server, prefix=f"{prefix}:q"), prefix


def test_queued_run_equals_a_direct_run(any_setup: tuple[WorkflowRunner, RunQueue, str]) -> None:
    runner, queue, prefix = any_setup
    first = submit(runner, queue, "expense-approval", CLAIM, seed=7, idempotency_key="req-1")
    again = submit(runner, queue, "expense-approval", CLAIM, seed=7, idempotency_key="req-1")
    assert first.created and not again.created and again.run_id == first.run_id
    with pytest.raises(IdempotencyConflictError):
        submit(runner, queue, "expense-approval", {**CLAIM, "amount": 43.0}, seed=7, idempotency_key="req-1")
    assert runner.runs.get(first.run_id).status == RunStatus.PENDING

    worker = QueueWorker(queue, WorkflowExecutor(runner, prefix=prefix), block_ms=100).start()
    try:
        state = queue.wait(first.run_id, timeout_s=300)
    finally:
        worker.stop(5)
    assert state.status == "succeeded", state.error
    assert runner.runs.get(first.run_id).status == RunStatus.SUCCEEDED

    direct = runner.start("expense-approval", CLAIM, seed=7)
    latest = runner.saver.get_tuple({"configurable": {"thread_id": first.run_id}})
    queued_state = latest.checkpoint["channel_values"]
    assert queued_state["rationale"] == direct.state["rationale"] and queued_state["decision"] == "approve"
    queued_calls = [c[1:] for c in call_tokens(runner.log, first.run_id)]
    assert queued_calls and queued_calls == [c[1:] for c in call_tokens(runner.log, direct.run_id)]


class _SlowEngine:
    """The real engine, 0.2 s slower per decode step, so a cancel surely lands inside the LLM call."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.decoding = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def start(self, request: Any, *, on_step: Any = None) -> Any:
        def slow_step(record: Any) -> None:
            self.decoding.set()
            time.sleep(0.2)
            if on_step is not None:
                on_step(record)

        return self._engine.start(request, on_step=slow_step)


def test_cancel_stops_the_llm_call(engine: Any, state_server: Any) -> None:
    prefix = f"bg-{uuid.uuid4().hex[:8]}"
    slow = _SlowEngine(engine)
    runner = WorkflowRunner(slow, state_server.url, prefix=prefix)
    queue = RunQueue.from_url(state_server.url, prefix=f"{prefix}:q", lease_ttl_ms=1000)
    worker = QueueWorker(queue, WorkflowExecutor(runner, prefix=prefix), block_ms=100).start()
    try:
        run = submit(runner, queue, "expense-approval", CLAIM, seed=11)
        assert slow.decoding.wait(120)
        assert queue.cancel(run.run_id) == "cancelling"
        state = queue.wait(run.run_id, timeout_s=120)
    finally:
        worker.stop(5)
    assert state.status == "cancelled", state
    assert runner.runs.get(run.run_id).status == RunStatus.CANCELLED
    latest = runner.saver.get_tuple({"configurable": {"thread_id": run.run_id}})
    assert "rationale" not in latest.checkpoint["channel_values"]  # the call never completed
