"""Crash recovery of background runs, with the real engine and real servers (issue 16's "must show").

* Worker crash: N runs (50 by default) across two ``elesium worker`` processes; one is killed with
  SIGKILL while it is inside an LLM call; every run completes, no checkpoint step is lost or
  repeated, and final states, token ids and acceptance logs equal those of the same runs made
  without a crash (the baseline, computed once in-process).
* Redis crash: with ``appendfsync always`` the server is killed with SIGKILL and restarted during
  runs; every checkpoint a worker saw acknowledged is still there, and every run finishes
  identically to the baseline.
* Cluster: the worker-crash flow on a 3-master local cluster (smaller N).
* Paused worker: SIGSTOP instead of SIGKILL; after SIGCONT its writes bounce off the fence. A cancel
  reaches a run in another process.

``ELESIUM_CRASH_RUNS`` / ``ELESIUM_CRASH_TIMEOUT`` shrink or stretch the runs on a busy machine.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import queue_workflow as qw
from elesium.state.checkpointer import RedisSaver
from elesium.state.connection import connect
from elesium.state.embedded import EmbeddedValkey
from elesium.state.queue import RunQueue
from elesium.state.queue_worker import QueueWorker
from queue_harness import mid_call_run, snapshot, spawn_worker, wait_all

pytest_plugins = ["state_fixtures", "cluster_fixtures"]
pytestmark = pytest.mark.slow

N_RUNS = int(os.environ.get("ELESIUM_CRASH_RUNS", "50"))
N_RESTART = min(N_RUNS, 10)
N_CLUSTER = min(N_RUNS, 8)
TIMEOUT_S = float(os.environ.get("ELESIUM_CRASH_TIMEOUT", "600"))
STEPS = [-1, 0, 1, 2, 3, 4]  # input, then one checkpoint per super-step of the 4-node workflow


def run_id(i: int) -> str:
    return f"run-{i:03d}"


@pytest.fixture(scope="module")
def baseline(engine: Any, state_server: EmbeddedValkey) -> dict[str, dict[str, Any]]:
    """Every run made once, in-process, without a crash: the reference snapshots."""
    root = f"base-{uuid.uuid4().hex[:8]}"
    queue = RunQueue.from_url(state_server.url, prefix=root)
    worker = QueueWorker(queue, qw.executor(engine, root), block_ms=100).start()
    t0 = time.monotonic()
    try:
        ids = [queue.enqueue(run_id(i), {"input": qw.run_input(i)}).run_id for i in range(N_RUNS)]
        states = wait_all(queue, ids, TIMEOUT_S)
    finally:
        worker.stop(5)
    assert all(s.status == "succeeded" for s in states.values()), states
    print(f"\nbaseline: {N_RUNS} runs in {time.monotonic() - t0:.1f} s")
    return {"__engine__": engine.fingerprint(), **{r: snapshot(queue.client, root, r) for r in ids}}


def _crash_flow(url: str, baseline: dict[str, dict[str, Any]], n: int, log_dir: Path) -> None:
    """Two workers; SIGKILL one inside an LLM call; all runs finish identical to the baseline."""
    root = f"crash-{uuid.uuid4().hex[:8]}"
    queue = RunQueue.from_url(url, prefix=root)
    queue.ensure_group()
    # A is slowed down per decode step (not in anything recorded) so the kill lands mid-call.
    a = spawn_worker(url, root, "A", log_dir, env={"ELESIUM_TEST_STEP_DELAY": "0.05"})
    b = spawn_worker(url, root, "B", log_dir)
    t0 = time.monotonic()
    ids = [queue.enqueue(run_id(i), {"input": qw.run_input(i)}).run_id for i in range(n)]
    try:
        victim = None
        deadline = time.monotonic() + TIMEOUT_S
        while not all(queue.client.exists(qw.engine_key(root, w)) for w in ("A", "B")):
            assert a.proc.poll() is None and b.proc.poll() is None, a.log() + b.log()
            assert time.monotonic() < deadline, a.log() + b.log()
            time.sleep(0.1)
        for w in ("A", "B"):  # the workers decode with the baseline's engine, or nothing below can match
            assert json.loads(queue.client.get(qw.engine_key(root, w))) == baseline["__engine__"]
        while victim is None:
            assert a.proc.poll() is None, f"worker A exited early:\n{a.log()}"
            assert time.monotonic() < deadline, f"worker A never got inside an LLM call:\n{a.log()}"
            if sum(1 for r in ids if queue.status(r).finished) >= n // 5:
                victim = a.kill9_if(lambda: mid_call_run(queue, root, ids, "A"))
            time.sleep(0.05)
        killed_at = time.monotonic() - t0
        states = wait_all(queue, ids, TIMEOUT_S)
        # A may have died between recording a run's outcome and acknowledging its entry (two calls:
        # the entry and the run's keys live in different cluster slots); B's XAUTOCLAIM finds such
        # an entry after the reclaim idle time, sees the run finished and acknowledges it.
        drained = time.monotonic() + 30
        while queue.pending_count() or queue.client.xlen(queue.stream_key):
            assert time.monotonic() < drained, (queue.pending_count(), b.log()[-3000:])
            time.sleep(0.2)
        assert b.terminate() == 0, b.log()
    finally:
        for w in (a, b):
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    print(f"\n{n} runs: A killed at {killed_at:.1f} s inside run {victim[0]} ({victim[1]} partial entries); "
          f"all done at {time.monotonic() - t0:.1f} s")
    assert {s.status for s in states.values()} == {"succeeded"}, {r: s for r, s in states.items()
                                                                   if s.status != "succeeded"}
    assert states[victim[0]].attempts >= 2 and states[victim[0]].worker == "B"
    assert queue.pending_count() == 0 and queue.client.xlen(queue.stream_key) == 0
    for r in ids:
        got = snapshot(queue.client, root, r)
        # No step lost, none repeated (on failure: who ran it, how often, and the workers' logs).
        assert got["steps"] == STEPS, (r, got["steps"], states[r], a.log()[-1500:], b.log()[-1500:])
        assert got["history"] == baseline[r]["history"], r
        assert got["final"]["draft_ids"] == baseline[r]["final"]["draft_ids"], r
        assert got["final"]["refine_ids"] == baseline[r]["final"]["refine_ids"], r
        assert got["acceptance"] == baseline[r]["acceptance"], r  # partial entries of the kill are gone
        assert len(got["acceptance"]) == got["final"]["steps"]


def test_worker_killed_mid_run(baseline: dict[str, dict[str, Any]], state_server: EmbeddedValkey,
                               tmp_path: Path) -> None:
    _crash_flow(state_server.url, baseline, N_RUNS, tmp_path)


def test_worker_killed_on_a_cluster(baseline: dict[str, dict[str, Any]], local_cluster: Any,
                                    tmp_path: Path) -> None:
    client = connect(local_cluster.url)
    owners = {client.get_node_from_key(f"x:{{{run_id(i)}}}").port for i in range(N_CLUSTER)}
    assert len(owners) > 1, "the runs should spread over several masters"
    _crash_flow(local_cluster.url, baseline, N_CLUSTER, tmp_path)


@pytest.fixture
def always_server(tmp_path: Path) -> Iterator[EmbeddedValkey]:
    server = EmbeddedValkey(tmp_path / "data", appendfsync="always").start()
    yield server
    server.stop()


def test_redis_killed_and_restarted(baseline: dict[str, dict[str, Any]], always_server: EmbeddedValkey,
                                    tmp_path: Path) -> None:
    url, root = always_server.url, f"restart-{uuid.uuid4().hex[:8]}"
    queue = RunQueue.from_url(url, prefix=root)
    queue.ensure_group()
    ack_logs = {w: tmp_path / f"acks-{w}.txt" for w in ("A", "B")}
    workers = [spawn_worker(url, root, w, tmp_path, concurrency=1, env={"ELESIUM_TEST_ACK_LOG": str(p)})
               for w, p in ack_logs.items()]
    ids = [queue.enqueue(run_id(i), {"input": qw.run_input(i)}).run_id for i in range(N_RESTART)]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while sum(1 for r in ids if queue.status(r).finished) < max(1, N_RESTART // 4):
            assert time.monotonic() < deadline, [w.log() for w in workers]
            time.sleep(0.1)
        acked_before = sum(len(p.read_text().splitlines()) for p in ack_logs.values() if p.exists())
        os.kill(always_server.pid, 9)
        assert always_server._wait_exit(10)
        time.sleep(1.0)  # the workers see a dead server for a while
        restarted = EmbeddedValkey(tmp_path / "data", appendfsync="always").start()
        assert restarted.url == url and restarted.pid != always_server.pid
        always_server._proc, always_server._pid = restarted._proc, restarted._pid  # stopped by the fixture
        queue = RunQueue.from_url(url, prefix=root)
        states = wait_all(queue, ids, TIMEOUT_S)
        for w in workers:
            assert w.terminate() == 0, w.log()
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    assert {s.status for s in states.values()} == {"succeeded"}
    saver = RedisSaver(queue.client, prefix=f"{root}:cp")
    acked = [line.split() for p in ack_logs.values() for line in p.read_text().splitlines()]
    # A write the server applied just before the kill may have lost its reply: durable but never
    # acknowledged, and not re-written on resume. At most one per worker (concurrency 1).
    assert acked_before > 0 and len(acked) >= len(ids) * len(STEPS) - len(workers)
    for thread, checkpoint_id, _step in acked:
        cfg = {"configurable": {"thread_id": thread, "checkpoint_ns": "", "checkpoint_id": checkpoint_id}}
        assert saver.get_tuple(cfg) is not None, f"acknowledged checkpoint {checkpoint_id} of {thread} lost"
    for r in ids:
        got = snapshot(queue.client, root, r)
        assert got["steps"] == STEPS, (r, got["steps"])
        assert got["history"] == baseline[r]["history"] and got["acceptance"] == baseline[r]["acceptance"], r


def test_paused_worker_is_fenced_and_cancel_crosses_processes(
        baseline: dict[str, dict[str, Any]], state_server: EmbeddedValkey, tmp_path: Path) -> None:
    """SIGSTOP (not kill) a worker inside an LLM call: its run is reclaimed and finished elsewhere; on
    SIGCONT the stale worker's writes are refused by the fence, so the run still equals the baseline.
    Before that, a cancel issued here stops a run executing in a worker process."""
    n = min(N_RUNS, 4)
    url, root = state_server.url, f"pause-{uuid.uuid4().hex[:8]}"
    queue = RunQueue.from_url(url, prefix=root)
    queue.ensure_group()
    slow = {"ELESIUM_TEST_STEP_DELAY": "0.1"}
    a = spawn_worker(url, root, "A", tmp_path, env=slow)
    b = spawn_worker(url, root, "B", tmp_path, env=slow)
    try:
        queue.enqueue("cancel-me", {"input": qw.run_input(n)})
        deadline = time.monotonic() + TIMEOUT_S
        while queue.status("cancel-me").status != "running":
            assert time.monotonic() < deadline, a.log() + b.log()
            time.sleep(0.05)
        assert queue.cancel("cancel-me") == "cancelling"
        cancelled = queue.wait("cancel-me", timeout_s=30)
        assert cancelled.status == "cancelled"
        saver = RedisSaver(queue.client, prefix=f"{root}:cp")
        latest = saver.get_tuple({"configurable": {"thread_id": "cancel-me"}})
        assert latest is None or latest.metadata["step"] < STEPS[-1]  # stopped before the end

        ids = [queue.enqueue(run_id(i), {"input": qw.run_input(i)}).run_id for i in range(n)]
        victim = None
        while victim is None:
            assert time.monotonic() < deadline, a.log()
            victim = mid_call_run(queue, root, ids, "A")
            time.sleep(0.02)
        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            taken = queue.wait(victim[0], timeout_s=TIMEOUT_S)
            assert taken.worker == "B" and taken.attempts >= 2
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        states = wait_all(queue, ids, TIMEOUT_S)
        time.sleep(1.0)  # A's heartbeat runs at least once after waking
        assert a.terminate() == 0 and b.terminate() == 0, a.log() + b.log()
    finally:
        for w in (a, b):
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    assert "lease lost" in a.log(), a.log()
    assert {s.status for s in states.values()} == {"succeeded"}
    for r in ids:
        got = snapshot(queue.client, root, r)
        assert got["steps"] == STEPS, (r, got["steps"])
        assert got["history"] == baseline[r]["history"] and got["acceptance"] == baseline[r]["acceptance"], r
