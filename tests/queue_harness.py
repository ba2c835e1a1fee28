"""Helpers of the queue's crash tests: worker subprocesses, kill points, run snapshots to compare.

A run's snapshot is what must be identical between a crashed-and-resumed run and the same run made
without a crash: its checkpoint history (step, source and every channel value, in step order; ids
and timestamps differ by nature), its final state (which holds the LLM calls' token ids), and its
acceptance log without stream ids and step timings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from elesium.state.acceptance_log import AcceptanceLog
from elesium.state.checkpointer import RedisSaver
from elesium.state.fenced import dumps_fields, entry_attempts
from elesium.state.queue import RunQueue

TESTS = Path(__file__).resolve().parent
T = TypeVar("T")

LLM_AFTER_STEP = {1: "draft", 2: "refine"}  # the node a run executes after its checkpoint of that step


@dataclass
class WorkerProc:
    worker_id: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def kill9_if(self, predicate: Callable[[], T | None], settle_s: float = 0.05) -> T | None:
        """SIGKILL the worker only if ``predicate`` holds *at the moment of the kill*.

        A check made while the worker runs can be stale by the time the kill lands: a run seen inside
        its last LLM call may finish in between (a cluster's slower checks widen that window). So the
        worker is frozen first (SIGSTOP), writes already sent get ``settle_s`` to reach the server,
        and then nothing the worker does can change what the predicate sees. If it does not hold,
        the worker is thawed (SIGCONT) and None is returned."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(settle_s)
            found = predicate()
        except BaseException:
            os.kill(self.proc.pid, signal.SIGCONT)
            raise
        if not found:
            os.kill(self.proc.pid, signal.SIGCONT)
            return None
        self.kill9()
        return found

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (graceful: finish or hand back), then wait; SIGKILL only if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def spawn_worker(url: str, root: str, worker_id: str, log_dir: Path, *, concurrency: int = 2,
                 lease_ttl_s: float = 2.0, env: dict[str, str] | None = None) -> WorkerProc:
    """``elesium worker`` running tests/queue_workflow.py's executor, in its own session."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), full_env.get("PYTHONPATH", "")) if p)
    # No thread-count override: the engine picks its tuned profile (and so its decode mode and tree)
    # by the machine it sees, and the workers must run the engine the baseline ran.
    full_env.update(env or {})
    cmd = [str(Path(sys.executable).parent / "elesium"), "worker", "--redis-url", url, "--prefix", root,
           "--executor", "queue_workflow:make_executor", "--lease-ttl", str(lease_ttl_s),
           "--concurrency", str(concurrency), "--worker-id", worker_id, "--grace", "10"]
    log_path = log_dir / f"{worker_id}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return WorkerProc(worker_id, proc, log_path)


def history(client: Any, root: str, run_id: str) -> list[tuple[int, str, dict[str, Any]]]:
    """(step, source, channel values) of every checkpoint of the run's thread, by step."""
    saver = RedisSaver(client, prefix=f"{root}:cp")
    rows = [(t.metadata["step"], t.metadata["source"], dict(t.checkpoint["channel_values"]))
            for t in saver.list({"configurable": {"thread_id": run_id}})]
    return sorted(rows, key=lambda r: r[0])


def snapshot(client: Any, root: str, run_id: str) -> dict[str, Any]:
    hist = history(client, root, run_id)
    log = AcceptanceLog(client, prefix=f"{root}:acc")
    return {
        "steps": [step for step, _, _ in hist],
        "history": hist,
        "final": hist[-1][2] if hist else None,
        "acceptance": [dumps_fields(e) for e in log.read(run_id)],
    }


def mid_call_run(queue: RunQueue, root: str, run_ids: list[str], worker_id: str) -> tuple[str, int] | None:
    """A run that ``worker_id`` is executing *inside an LLM call* right now: its latest checkpoint
    says an LLM node runs next and the acceptance stream already holds entries of the current
    attempt. Returns (run id, partial entries), or None."""
    log = AcceptanceLog(queue.client, prefix=f"{root}:acc")
    saver = RedisSaver(queue.client, prefix=f"{root}:cp")
    for run_id in run_ids:
        state = queue.status(run_id)
        if state is None or state.status != "running" or state.worker != worker_id:
            continue
        latest = saver.get_tuple({"configurable": {"thread_id": run_id}})
        if latest is None or latest.metadata["step"] not in LLM_AFTER_STEP:
            continue
        mine = [a for _, a in entry_attempts(log, run_id) if a == state.token]
        if mine:
            return run_id, len(mine)
    return None


def wait_all(queue: RunQueue, run_ids: list[str], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    states = {}
    for run_id in run_ids:
        states[run_id] = queue.wait(run_id, timeout_s=max(1.0, deadline - time.monotonic()), poll_s=0.2)
    return states
