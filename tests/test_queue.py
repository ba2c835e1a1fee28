"""The durable run queue on a real Valkey: idempotent enqueue, fencing, reclaim, cancel, timeouts.

No model here (the crash tests with the engine are in test_queue_crash.py): executors are small
LangGraph graphs or plain functions, so each test takes well under a second of CPU.
"""

from __future__ import annotations

import operator
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
import redis.exceptions
from langgraph.graph import END, START, StateGraph

from elesium.graphs.background import GraphExecutor, drive_leased
from elesium.inference.records import StepRecord
from elesium.state.acceptance_log import AcceptanceEntry, AcceptanceLog
from elesium.state.checkpointer import RedisSaver
from elesium.state.errors import WrongTypeError
from elesium.state.fenced import entry_attempts
from elesium.state.queue import (
    Delivery,
    IdempotencyConflictError,
    Lease,
    LeaseLostError,
    RunQueue,
)
from elesium.state.queue_worker import QueueWorker

pytest_plugins = ["state_fixtures"]


@pytest.fixture
def queue(redis_url: str, key_prefix: str) -> RunQueue:
    return RunQueue.from_url(redis_url, prefix=f"{key_prefix}:q", lease_ttl_ms=600)


class _S(TypedDict, total=False):
    n: int
    trail: Annotated[list[str], operator.add]


def _graph(saver: Any, slow: threading.Event | None = None, lease: Lease | None = None) -> Any:
    """a -> b -> c; b waits on ``slow`` (checking the lease) when given, to hold a run mid-step."""

    def b(state: _S) -> dict[str, Any]:
        while slow is not None and not slow.is_set():
            if lease is not None:
                lease.check()
            time.sleep(0.01)
        return {"n": state["n"] * 10, "trail": ["b"]}

    g = StateGraph(_S)
    g.add_node("a", lambda s: {"n": s["n"] + 1, "trail": ["a"]})
    g.add_node("b", b)
    g.add_node("c", lambda s: {"n": s["n"] + 2, "trail": ["c"]})
    g.add_edge(START, "a")
    g.add_edge("a", "b")
    g.add_edge("b", "c")
    g.add_edge("c", END)
    return g.compile(checkpointer=saver)


def _history(client: Any, prefix: str, thread: str) -> list[tuple[int, list[str]]]:
    saver = RedisSaver(client, prefix=prefix)
    rows = list(saver.list({"configurable": {"thread_id": thread}}))
    return sorted((t.metadata["step"], list(t.checkpoint["channel_values"].get("trail", []))) for t in rows)


def test_enqueue_is_idempotent_by_key(queue: RunQueue) -> None:
    first = queue.enqueue("r1", {"x": 1}, idempotency_key="k1")
    again = queue.enqueue("r2", {"x": 1}, idempotency_key="k1")
    assert first.created and not again.created and again.run_id == "r1"
    with pytest.raises(IdempotencyConflictError, match="different payload"):
        queue.enqueue("r3", {"x": 2}, idempotency_key="k1")
    with pytest.raises(IdempotencyConflictError, match="already queued"):
        queue.enqueue("r1", {"x": 1}, idempotency_key="other")
    assert queue.status("r2") is None and queue.status("r1").status == "queued"

    results: list[Any] = []
    barrier = threading.Barrier(8)

    def racer(i: int) -> None:
        barrier.wait()
        results.append(queue.enqueue(f"race-{i}", {"y": 1}, idempotency_key="same"))

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.created for r in results) == 1
    assert len({r.run_id for r in results}) == 1
    assert queue.client.xlen(queue.stream_key) == 2  # r1 and the race winner, nothing else


def test_enqueue_rejects_bad_input(queue: RunQueue) -> None:
    with pytest.raises(ValueError, match="run_id"):
        queue.enqueue("", {})
    with pytest.raises(ValueError, match="timeout_s"):
        queue.enqueue("r", {}, timeout_s=-1)
    assert queue.status("r") is None


def test_a_superseded_worker_cannot_write(queue: RunQueue, key_prefix: str) -> None:
    queue.enqueue("run-f", {"input": {"n": 1}})
    (delivery,) = queue.read_new("w1", 1, 100)
    first = queue.claim(delivery, "w1")
    assert isinstance(first, Lease) and first.token == 1
    assert queue.claim(delivery, "w2") == "busy"
    time.sleep(0.7)  # w1 stops heartbeating: its lease expires
    second = queue.claim(delivery, "w2")
    assert isinstance(second, Lease) and second.token == 2
    assert queue.renew(first) == (False, False)

    cp = f"{key_prefix}:cp"
    with pytest.raises(LeaseLostError):
        _graph(first.saver(prefix=cp)).invoke({"n": 1, "trail": []}, {"configurable": {"thread_id": "run-f"}})
    assert _history(queue.client, cp, "run-f") == []  # not even the input checkpoint got through
    config = {"configurable": {"thread_id": "run-f"}}
    out = _graph(second.saver(prefix=cp)).invoke({"n": 1, "trail": []}, config)
    assert out["n"] == 22
    assert not queue.finish(first, "succeeded")  # the old owner cannot record an outcome either
    assert queue.finish(second, "succeeded")
    assert queue.status("run-f").status == "succeeded" and queue.pending_count() == 0


def test_begin_call_keeps_one_attempt_per_call(queue: RunQueue, key_prefix: str) -> None:
    queue.enqueue("run-a", {})
    (delivery,) = queue.read_new("w1", 1, 100)
    one = queue.claim(delivery, "w1")
    log_prefix = f"{key_prefix}:acc"
    rec = StepRecord(
        step=0, mode="vanilla", tree_size=1, tree_depth=0, accepted_length=1, accepted_nodes=(0,), tokens=(5,)
    )
    entry = AcceptanceEntry(run_id="run-a", node_id="llm", step_id=0, record=rec, call_index=0)
    log1 = one.acceptance_log(prefix=log_prefix)
    log1.append_many([entry, entry])  # a partial call: the worker "dies" here
    queue.release(one)
    two = queue.claim(delivery, "w2")
    log2 = two.acceptance_log(prefix=log_prefix)
    with pytest.raises(LeaseLostError):
        log1.append(entry)
    assert log2.begin_call("run-a", "llm", 0) == 2
    log2.append_many([entry, entry, entry])
    plain = AcceptanceLog(queue.client, prefix=log_prefix)
    assert [a for _, a in entry_attempts(plain, "run-a")] == [2, 2, 2]
    assert len(plain.read("run-a")) == 3


def test_a_call_is_recorded_once_and_never_marked_without_its_entries(
    queue: RunQueue, key_prefix: str
) -> None:
    """graphs/audit.record_call: the "recorded" marker and the call's entries are one fenced script, so
    a superseded worker leaves neither, the owner records the call once, and a re-run is skipped."""
    from elesium.graphs.audit import calls_key, record_call
    from elesium.inference.records import Generation

    gen = Generation(
        text="hi",
        token_ids=(5, 6, 7),
        prompt_tokens=3,
        finish_reason="length",
        mode="vanilla",
        seed=9,
        elapsed_s=0.0,
        steps=(
            StepRecord(
                step=1,
                mode="vanilla",
                tree_size=1,
                tree_depth=0,
                accepted_length=1,
                accepted_nodes=(0,),
                tokens=(6,),
            ),
        ),
    )
    queue.enqueue("run-o", {})
    (delivery,) = queue.read_new("w1", 1, 100)
    old = queue.claim(delivery, "w1")
    queue.release(old)
    new = queue.claim(delivery, "w2")
    log_prefix = f"{key_prefix}:acc"
    stale, owner = old.acceptance_log(prefix=log_prefix), new.acceptance_log(prefix=log_prefix)
    with pytest.raises(LeaseLostError):
        record_call(stale, "run-o", "llm", 0, 9, gen)
    assert not queue.client.exists(calls_key(owner, "run-o")) and owner.length("run-o") == 0
    assert record_call(owner, "run-o", "llm", 0, 9, gen)
    assert not record_call(owner, "run-o", "llm", 0, 9, gen)  # the node re-ran after an interrupt
    plain = AcceptanceLog(queue.client, prefix=log_prefix)
    entries = plain.read("run-o")
    assert [(e.kind, e.step_id) for e in entries] == [("call", 0), ("step", 1)]
    assert entries[0].tokens == (5, 6, 7) and {a for _, a in entry_attempts(plain, "run-o")} == {new.token}


def test_exited_workers_consumer_names_are_pruned(queue: RunQueue) -> None:
    queue.enqueue("run-p", {})
    assert queue.read_new("busy", 1, 100)  # "busy" holds a pending entry
    queue.client.xgroup_createconsumer(queue.stream_key, "workers", "gone")  # registered, nothing pending
    time.sleep(0.05)
    assert queue.prune_consumers(idle_ms=40) == ["gone"]
    names = {i["name"] for i in queue.client.xinfo_consumers(queue.stream_key, "workers")}
    assert names == {b"busy"} or names == {"busy"}


def _worker(queue: RunQueue, execute: Any, **kw: Any) -> QueueWorker:
    return QueueWorker(queue, execute, block_ms=100, **kw).start()


def test_handed_back_run_resumes_from_its_checkpoint(queue: RunQueue, key_prefix: str) -> None:
    cp = f"{key_prefix}:cp"
    gate = threading.Event()
    calls: list[str] = []

    def build(lease: Lease, saver: Any) -> Any:
        calls.append(lease.worker_id)
        return _graph(saver, slow=None if lease.worker_id == "B" else gate, lease=lease)

    execute = GraphExecutor(build, saver_options={"prefix": cp})
    a = _worker(queue, execute, worker_id="A")
    queue.enqueue("run-h", {"input": {"n": 1, "trail": []}})
    deadline = time.monotonic() + 10
    while len(_history(queue.client, cp, "run-h")) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # wait until A has checkpointed "a" and is stuck in "b"
    assert a.stop(grace_s=0.1) == ["run-h"]
    b = _worker(queue, execute, worker_id="B")
    try:
        state = queue.wait("run-h", timeout_s=15)
    finally:
        b.stop(1)
    assert state.status == "succeeded" and state.attempts == 2 and state.worker == "B"
    assert calls == ["A", "B"]
    steps = _history(queue.client, cp, "run-h")
    assert [s for s, _ in steps] == [-1, 0, 1, 2, 3]  # no step lost, none repeated
    assert steps[-1][1] == ["a", "b", "c"]


class _LostCheckpoint(RedisSaver):
    """Loses the connection on the checkpoint of super-step ``lose_step``, after that step's tasks
    have saved their writes: the window a Redis crash left open in the restart test."""

    def __init__(self, *args: Any, lose_step: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lose_step = lose_step

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        if metadata.get("step") == self.lose_step:
            raise ConnectionError("lost the server before the checkpoint was written")
        return super().put(config, checkpoint, metadata, new_versions)


class _OpenLease:
    """``drive_leased`` only asks a lease whether it still holds; this one always does."""

    def check(self) -> None:
        return None


@pytest.mark.parametrize("lose_step", [0, 1, 2])
def test_a_step_whose_checkpoint_was_lost_is_resumed_not_taken_as_finished(
        queue: RunQueue, key_prefix: str, lose_step: int) -> None:
    """The finished-run check must see the saved-but-uncheckpointed tasks as work left to do."""
    cp, thread = f"{key_prefix}:cp{lose_step}", f"run-lost-{lose_step}"
    config = {"configurable": {"thread_id": thread, "run_id": thread}, "metadata": {"run_id": thread}}
    lease = _OpenLease()
    first = _graph(_LostCheckpoint(queue.client, prefix=cp, lose_step=lose_step))
    with pytest.raises(ConnectionError):
        drive_leased(first, lease, {"n": 1, "trail": []}, config)  # type: ignore[arg-type]
    saved = _history(queue.client, cp, thread)
    assert [s for s, _ in saved] == list(range(-1, lose_step))
    assert drive_leased(_graph(RedisSaver(queue.client, prefix=cp)), lease, None,  # type: ignore[arg-type]
                        config) == "succeeded"  # type: ignore[arg-type]
    steps = _history(queue.client, cp, thread)
    assert [s for s, _ in steps] == [-1, 0, 1, 2, 3]
    assert steps[-1][1] == ["a", "b", "c"]


def test_cancel_reaches_a_running_run(queue: RunQueue) -> None:
    started = threading.Event()

    def execute(run_id: str, lease: Lease) -> None:
        started.set()
        while True:
            lease.check()
            time.sleep(0.01)

    w = _worker(queue, execute)
    try:
        queue.enqueue("run-c", {})
        assert started.wait(5)
        assert queue.cancel("run-c") == "cancelling"
        state = queue.wait("run-c", timeout_s=5)
    finally:
        w.stop(1)
    assert state.status == "cancelled" and queue.pending_count() == 0


def test_cancel_before_start_never_executes(queue: RunQueue) -> None:
    ran: list[str] = []
    queue.enqueue("run-q", {})
    assert queue.cancel("run-q") == "cancelled"
    w = _worker(queue, lambda run_id, lease: ran.append(run_id))
    try:
        deadline = time.monotonic() + 5
        while queue.pending_count() or queue.client.xlen(queue.stream_key):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        w.stop(1)
    assert ran == [] and queue.status("run-q").status == "cancelled"
    with pytest.raises(KeyError):
        queue.cancel("no-such-run")


def test_timeout_and_failure_end_the_run(queue: RunQueue) -> None:
    def execute(run_id: str, lease: Lease) -> None:
        if run_id == "boom":
            raise ValueError("bad thing\nsecond line")
        while True:
            lease.check()
            time.sleep(0.01)

    w = _worker(queue, execute, concurrency=2)
    try:
        queue.enqueue("slow", {}, timeout_s=0.4)
        queue.enqueue("boom", {})
        slow, boom = queue.wait("slow", 10), queue.wait("boom", 10)
    finally:
        w.stop(1)
    assert slow.status == "failed" and "time limit" in slow.error
    assert boom.status == "failed" and boom.error == "bad thing"


def test_a_raw_redis_outage_in_the_executor_retries_the_run_instead_of_failing_it(queue: RunQueue) -> None:
    """redis-py's own ConnectionError (a saver that does not translate it) is a lost server, not a
    failed run: the worker hands the run back and a retry finishes it; before, the catch-all recorded
    it as failed with the connection error as its message."""
    attempts: list[int] = []

    def execute(run_id: str, lease: Lease) -> None:
        attempts.append(lease.attempt)
        if len(attempts) == 1:
            raise redis.exceptions.ConnectionError("Connection closed by server.")

    w = _worker(queue, execute)
    try:
        queue.enqueue("run-o", {})
        state = queue.wait("run-o", 10)
    finally:
        w.stop(1)
    assert state.status == "succeeded" and state.attempts == 2 and attempts == [1, 2]


def test_ensure_group_creates_the_group_once_without_reading_error_text(
        redis_url: str, key_prefix: str) -> None:
    """Many queues (workers) starting at once on an empty stream: one creates the group, none fails;
    a stream that exists with other groups (or none) gets ours added, and entries already there are
    delivered (the group reads from the first entry)."""
    prefix = f"{key_prefix}:g"
    queues = [RunQueue.from_url(redis_url, prefix=prefix) for _ in range(8)]
    start, results, errors = threading.Barrier(len(queues)), [], []

    def ensure(q: RunQueue) -> None:
        start.wait()
        try:
            results.append(q.ensure_group())
        except Exception as exc:  # the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=ensure, args=(q,)) for q in queues]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == [] and sorted(results) == [False] * 7 + [True]
    groups = queues[0].client.xinfo_groups(queues[0].stream_key)
    assert [g["name"] for g in groups] in (["workers"], [b"workers"])
    assert queues[0].ensure_group() is False  # cached: no round trip

    other = RunQueue.from_url(redis_url, prefix=f"{key_prefix}:h")
    other.client.xadd(other.stream_key, {"run_id": "early", "thread_id": "early", "payload": "{}"})
    other.client.xgroup_create(other.stream_key, "someone-else", id="0")
    assert other.ensure_group() is True
    names = {g["name"] for g in other.client.xinfo_groups(other.stream_key)}
    assert names in ({"workers", "someone-else"}, {b"workers", b"someone-else"})
    assert len(other.read_new("w", 10, 100)) == 1  # the entry written before the group existed


def test_ensure_group_surfaces_a_foreign_value_on_the_stream_key(redis_url: str, key_prefix: str) -> None:
    q = RunQueue.from_url(redis_url, prefix=f"{key_prefix}:s")
    q.client.set(q.stream_key, "not a stream")
    with pytest.raises(WrongTypeError):
        q.ensure_group()


def test_a_dead_workers_entry_is_reclaimed(queue: RunQueue) -> None:
    """A claim whose worker vanished (no heartbeat, no ack) is taken over after the lease TTL."""
    queue.enqueue("run-d", {"v": 1})
    (delivery,) = queue.read_new("ghost", 1, 100)
    ghost = queue.claim(delivery, "ghost")
    assert isinstance(ghost, Lease)
    seen: list[tuple[str, int]] = []
    w = _worker(queue, lambda run_id, lease: seen.append((run_id, lease.token)))
    try:
        state = queue.wait("run-d", 10)
    finally:
        w.stop(1)
    assert seen == [("run-d", 2)] and state.status == "succeeded" and state.attempts == 2


def test_gives_up_after_max_attempts(redis_url: str, key_prefix: str) -> None:
    queue = RunQueue.from_url(redis_url, prefix=f"{key_prefix}:q", lease_ttl_ms=200, max_attempts=2)
    queue.enqueue("run-x", {})
    for worker in ("w1", "w2"):
        time.sleep(0.25)
        got = queue.reclaim(worker, 1) or queue.read_new(worker, 1, 100)
        assert isinstance(queue.claim(got[0], worker), Lease)
    time.sleep(0.25)
    (last,) = queue.reclaim("w3", 1)
    assert queue.claim(last, "w3") == "done:failed"
    assert "gave up after 2 attempts" in queue.status("run-x").error


def test_delivery_payload_roundtrip(queue: RunQueue) -> None:
    queue.enqueue("run-p", {"input": {"text": "héllo {x}"}, "n": [1, 2]}, thread_id="thr:{odd}", timeout_s=3)
    (d,) = queue.read_new("w", 1, 100)
    payload = {"input": {"text": "héllo {x}"}, "n": [1, 2]}
    assert d == Delivery(d.entry_id, "run-p", "thr:{odd}", payload, 3000)


def test_worker_cli_rejects_bad_flags() -> None:
    elesium = str(Path(sys.executable).parent / "elesium")
    proc = subprocess.run(
        [
            elesium,
            "worker",
            "--concurrency",
            "0",
            "--redis-url",
            f"redis://127.0.0.1:1/{uuid.uuid4().int % 10}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == "elesium: error: --concurrency must be >= 1, got 0"
