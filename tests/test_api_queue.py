"""API runs on the durable run queue (issue 16), with the real engine and real processes.

* A run created on a server that executes nothing itself (``workers=0``) is executed by an
  ``elesium worker`` process; its SSE events reach the client through Redis, and its result equals
  the same seeded run executed in the server's own worker.
* That worker is killed with SIGKILL inside the run's second LLM call; another worker resumes the run
  from its last checkpoint, and the run's final state, LLM calls, checkpoints and acceptance log equal
  the uninterrupted run's.
* A cancel sent to one server stops a run executing in another process.
* Concurrent duplicates: one ``Idempotency-Key`` sent many times at once creates one run; the same
  resume sent to two servers at once starts one run; the other gets 409.
* The bad-input matrix: each bad request gets its 4xx with a message and writes nothing to Redis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from langgraph_sdk import get_sync_client

from api_server import KEY_A, KEY_B, LiveServer, live_server, server_settings
from api_workflows import build_registry
from elesium.state.acceptance_log import AcceptanceLog
from elesium.state.fenced import dumps_fields
from queue_harness import TESTS, WorkerProc

pytest_plugins = ["state_fixtures", "api_server", "cluster_fixtures"]
TIMEOUT_S = float(os.environ.get("ELESIUM_CRASH_TIMEOUT", "300"))


# ---------------------------------------------------------------- a server whose runs run elsewhere
class Remote:
    def __init__(self, server: LiveServer, queue: str, log_dir: Path) -> None:
        self.server, self.queue, self.log_dir = server, queue, log_dir
        self.workers: list[WorkerProc] = []

    def spawn(self, name: str) -> WorkerProc:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
        cmd = [
            str(Path(sys.executable).parent / "elesium"),
            "worker",
            "--redis-url",
            self.server.redis_url,
            "--queue",
            self.queue,
            "--executor",
            "api_workflows:make_worker_executor",
            "--lease-ttl",
            "2",
            "--worker-id",
            name,
            "--grace",
            "5",
        ]
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        worker = WorkerProc(name, proc, log_path)
        self.workers.append(worker)
        return worker

    def ready(self, worker: WorkerProc) -> None:
        """Wait until the worker has loaded its engine and takes runs (it says so on stderr)."""
        _wait(lambda: f"queue {self.queue!r}" in worker.log(), f"worker {worker.worker_id} to start", self)

    def logs(self) -> str:
        return "\n".join(f"--- {w.worker_id}\n{w.log()}" for w in self.workers)


@pytest.fixture(scope="module")
def remote(engine: Any, state_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Remote]:
    queue = f"remote-{uuid.uuid4().hex[:8]}"
    settings = server_settings(state_server.url, workers=0, queue_name=queue)
    with live_server(settings, engine, build_registry()) as server:
        remote = Remote(server, queue, tmp_path_factory.mktemp("workers"))
        try:
            yield remote
        finally:
            for w in remote.workers:
                if w.proc.poll() is None:
                    w.proc.kill()
                    w.proc.wait()


def _wait(predicate: Any, what: str, remote: Remote, timeout_s: float = TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{remote.logs()}"
        time.sleep(0.01)
    return value


def _acceptance(server: LiveServer, run_id: str) -> list[dict[str, Any]]:
    """The run's acceptance entries without what differs between two runs by nature (run id, attempt)."""
    out = []
    for entry in AcceptanceLog.from_url(server.redis_url).read(run_id):
        data = json.loads(dumps_fields(entry))
        for key in ("run_id", "attempt"):
            data.pop(key, None)
        out.append(data)
    return out


def _steps(server: LiveServer, thread_id: str) -> list[int]:
    svc = server.services
    graph = svc.thread_graph(svc.store.get_thread(thread_id, "tenant-a"))
    tuples = graph.checkpointer.list({"configurable": {"thread_id": thread_id}})
    return sorted(t.metadata["step"] for t in tuples)


@pytest.mark.slow
def test_a_worker_process_executes_streams_and_survives_a_crash(
    remote: Remote, api_server: LiveServer
) -> None:
    here = get_sync_client(url=api_server.url, api_key=KEY_A)
    there = get_sync_client(url=remote.server.url, api_key=KEY_A)
    a = remote.spawn("A")

    # Executed by process A; streamed through Redis to this server's client.
    thread = there.threads.create()
    parts = list(
        there.runs.stream(
            thread["thread_id"],
            "relay",
            input={"topic": "rivers"},
            stream_mode=["values", "messages-tuple"],
            config={"configurable": {"run_seed": 5}},
        )
    )
    events = [p.event for p in parts]
    assert events[0] == "metadata" and "values" in events, remote.logs()
    tokens = "".join(p.data[0]["content"] for p in parts if p.event == "messages")
    final = [p.data for p in parts if p.event == "values"][-1]
    assert final["text"] and final["outline"].strip() in tokens and final["text"].strip() in tokens
    same = here.runs.wait(
        here.threads.create()["thread_id"],
        "relay",
        input={"topic": "rivers"},
        config={"configurable": {"run_seed": 5}},
    )
    assert {k: final[k] for k in ("outline", "text")} == {k: same[k] for k in ("outline", "text")}

    # Baseline of the crash: the same seeded run, uninterrupted, on this server's own worker.
    base_thread = here.threads.create()["thread_id"]
    base = here.runs.create(
        base_thread, "relay", input={"topic": "glaciers"}, config={"configurable": {"run_seed": 7}}
    )
    base_values = here.runs.join(base_thread, base["run_id"])

    # A is killed inside the second LLM call (the first one's call is stored, the run is not done).
    tid = there.threads.create()["thread_id"]
    run = there.runs.create(
        tid, "relay", input={"topic": "glaciers"}, config={"configurable": {"run_seed": 7}}
    )
    store = remote.server.services.store
    _wait(lambda: len(store.calls(run["run_id"])) >= 1, "the first LLM call", remote)
    assert store.get_run_any(run["run_id"]).status == "running"
    a.kill9()
    b = remote.spawn("B")
    values = there.runs.join(tid, run["run_id"])
    row = there.runs.get(tid, run["run_id"])
    assert row["status"] == "success", remote.logs()
    job = remote.server.services.queue.status(run["run_id"])
    assert job.status == "succeeded" and job.attempts >= 2 and job.worker == "B", job

    assert {k: values[k] for k in ("outline", "text")} == {k: base_values[k] for k in ("outline", "text")}
    calls = [(c["node"], c["call"], c["token_ids"]) for c in store.calls(run["run_id"])]
    assert calls == [(c["node"], c["call"], c["token_ids"]) for c in store.calls(base["run_id"])]
    steps = _steps(remote.server, tid)
    assert steps == sorted(set(steps)) == _steps(api_server, base_thread)  # none lost, none repeated
    assert _acceptance(remote.server, run["run_id"]) == _acceptance(api_server, base["run_id"])

    # A cancel sent to this server reaches the run in process B.
    tid = there.threads.create()["thread_id"]
    run = there.runs.create(tid, "story", input={"topic": "a lighthouse"})
    _wait(lambda: store.get_run_any(run["run_id"]).status == "running", "the run to start", remote)
    there.runs.cancel(tid, run["run_id"])
    _wait(lambda: store.get_run_any(run["run_id"]).status != "running", "the cancel", remote, 60)
    row = there.runs.get(tid, run["run_id"])
    assert (row["status"], row["error"]) == ("interrupted", "cancelled"), remote.logs()
    assert remote.server.services.queue.status(run["run_id"]).status == "cancelled"
    assert there.threads.get(tid)["status"] == "idle"
    assert b.terminate() == 0, remote.logs()


@pytest.mark.slow
def test_a_worker_killed_inside_a_two_call_node_resumes_with_the_checkpointed_call_index(
    remote: Remote, api_server: LiveServer
) -> None:
    """Issue 42: one call counter, in the checkpointed state. The node ``draft`` is visited twice and
    calls the model twice per visit (indices 0, 1, then 2, 3). Worker A is killed inside the second
    visit, after call 2 is stored; worker B re-runs that visit. A process-local counter would number
    B's calls 0 and 1 again, overwrite the first visit's records and make replay report a false
    divergence; the state's count numbers them 2 and 3."""
    here = get_sync_client(url=api_server.url, api_key=KEY_A)
    there = get_sync_client(url=remote.server.url, api_key=KEY_A)
    base_thread = here.threads.create()["thread_id"]
    seeded = {"configurable": {"run_seed": 11}}
    base = here.runs.create(base_thread, "loop", input={"topic": "tides"}, config=seeded)
    base_values = here.runs.join(base_thread, base["run_id"])
    base_calls = [(c["node"], c["call"], c["token_ids"])
                  for c in api_server.services.store.calls(base["run_id"])]
    assert [(n, i) for n, i, _ in base_calls] == [("draft", i) for i in range(4)]

    a = remote.spawn("A2")
    tid = there.threads.create()["thread_id"]
    run = there.runs.create(tid, "loop", input={"topic": "tides"}, config=seeded)
    store = remote.server.services.store
    _wait(lambda: len(store.calls(run["run_id"])) >= 3, "the second visit's first call", remote)
    assert store.get_run_any(run["run_id"]).status == "running", "the run finished before the kill"
    a.kill9()
    b = remote.spawn("B2")
    values = there.runs.join(tid, run["run_id"])
    assert there.runs.get(tid, run["run_id"])["status"] == "success", remote.logs()
    assert remote.server.services.queue.status(run["run_id"]).attempts >= 2

    assert values["notes"] == base_values["notes"]
    assert values["llm_calls"] == {"draft": 4}
    calls = [(c["node"], c["call"], c["token_ids"]) for c in store.calls(run["run_id"])]
    assert calls == base_calls
    http = httpx.Client(base_url=remote.server.url, headers={"x-api-key": KEY_A}, timeout=TIMEOUT_S)
    for mode in ("reexecute", "recorded"):
        report = http.post(f"/threads/{tid}/runs/{run['run_id']}/replay", json={"mode": mode})
        assert report.status_code == 200, report.text
        assert report.json()["verdict"] == "identical", report.json()
        assert report.json()["calls_compared"] == 4
    assert b.terminate() == 0, remote.logs()


def test_the_service_on_a_redis_cluster(engine: Any, local_cluster: Any, api_server: LiveServer) -> None:
    """Threads, runs through the queue, streaming, an interrupt and its resume, an idempotent retry and a
    replay, with every key of the service on a 3-master cluster; results equal the single server's."""
    import redis

    with live_server(server_settings(local_cluster.url), engine, build_registry()) as server:
        client = get_sync_client(url=server.url, api_key=KEY_A)
        single = get_sync_client(url=api_server.url, api_key=KEY_A)
        seeded = {"configurable": {"run_seed": 3}}
        tid = client.threads.create()["thread_id"]
        first = client.runs.wait(tid, "approval", input={"topic": "maps"}, config=seeded)
        assert "__interrupt__" in first
        reference = single.runs.wait(
            single.threads.create()["thread_id"], "approval", input={"topic": "maps"}, config=seeded
        )
        assert first["draft"] == reference["draft"]
        done = client.runs.wait(tid, "approval", command={"resume": {"approved": True, "note": "fine"}})
        assert done["final"] == f"APPROVED: {first['draft']}"

        parts = list(
            client.runs.stream(
                None,
                "summary",
                input={"topic": "moss"},
                stream_mode=["values", "messages-tuple"],
                config=seeded,
            )
        )
        assert [p.event for p in parts][0] == "metadata" and "messages" in [p.event for p in parts]

        http = server.http()
        body = {"assistant_id": "summary", "input": {"topic": "salt"}}
        one = http.post("/runs/wait", json=body, headers={"Idempotency-Key": "cluster-1"})
        two = http.post("/runs/wait", json=body, headers={"Idempotency-Key": "cluster-1"})
        assert one.status_code == two.status_code == 200 and one.json() == two.json()
        assert one.headers["content-location"] == two.headers["content-location"]

        runs = client.runs.list(tid)
        report = http.post(f"/threads/{tid}/runs/{runs[-1]['run_id']}/replay", json={"mode": "reexecute"})
        assert report.status_code == 200 and report.json()["verdict"] == "identical", report.text

        # The keys really are spread over the masters (not one node doing all the work).
        counts = []
        for port in local_cluster.ports:
            counts.append(redis.Redis(port=port).dbsize())
        assert sum(1 for c in counts if c) >= 2, counts


# ---------------------------------------------------------------- concurrent duplicates
def _post_many(url: str, path: str, body: dict[str, Any], n: int, key: str | None) -> list[httpx.Response]:
    headers = {"x-api-key": KEY_A, **({"Idempotency-Key": key} if key else {})}

    def one(_: int) -> httpx.Response:
        with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
            return http.post(path, json=body)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_one_idempotency_key_sent_many_times_at_once_creates_one_run(api_server: LiveServer) -> None:
    http = api_server.http()
    tid = http.post("/threads", json={}).json()["thread_id"]
    key = uuid.uuid4().hex
    body = {"assistant_id": "summary", "input": {"topic": "fog"}}
    replies = _post_many(api_server.url, f"/threads/{tid}/runs", body, 8, key)
    assert {r.status_code for r in replies} == {200}, [r.text for r in replies]
    assert len({r.json()["run_id"] for r in replies}) == 1
    run_id = replies[0].json()["run_id"]
    assert http.get(f"/threads/{tid}/runs/{run_id}/join").json()["summary"]
    assert [r["run_id"] for r in http.get(f"/threads/{tid}/runs").json()] == [run_id]

    # The key again with another input: refused, nothing written.
    other = http.post(
        f"/threads/{tid}/runs", json={**body, "input": {"topic": "rain"}}, headers={"Idempotency-Key": key}
    )
    assert other.status_code == 409 and "Idempotency-Key" in other.json()["detail"]
    assert len(http.get(f"/threads/{tid}/runs").json()) == 1

    # Stateless, waited on, four at once: one thread, one run, one answer.
    key = uuid.uuid4().hex
    replies = _post_many(api_server.url, "/runs/wait", body, 4, key)
    assert {r.status_code for r in replies} == {200}, [r.text for r in replies]
    assert len({r.headers["content-location"] for r in replies}) == 1
    assert len({json.dumps(r.json(), sort_keys=True) for r in replies}) == 1


def test_the_same_resume_sent_to_two_servers_at_once_starts_one_run(
    remote: Remote, api_server: LiveServer
) -> None:
    here = api_server.http()
    worker = remote.spawn("C")  # runs a resume that lands on the remote server
    remote.ready(worker)
    tid = here.post("/threads", json={}).json()["thread_id"]
    first = here.post(
        f"/threads/{tid}/runs/wait", json={"assistant_id": "approval", "input": {"topic": "tea"}}
    )
    assert "__interrupt__" in first.json()
    resume = {"assistant_id": "approval", "command": {"resume": {"approved": True, "note": "ok"}}}

    def send(url: str) -> httpx.Response:
        with httpx.Client(base_url=url, headers={"x-api-key": KEY_A}, timeout=120) as http:
            return http.post(f"/threads/{tid}/runs", json=resume)

    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(send, [api_server.url, remote.server.url]))
    codes = sorted(r.status_code for r in replies)
    assert codes == [200, 409], [r.text for r in replies]
    won = next(r for r in replies if r.status_code == 200).json()
    _wait(
        lambda: here.get(f"/threads/{tid}/runs/{won['run_id']}").json()["status"] == "success",
        "the resume",
        remote,
    )
    assert len(here.get(f"/threads/{tid}/runs").json()) == 2
    assert here.get(f"/threads/{tid}/state").json()["values"]["final"].startswith("APPROVED")
    assert worker.terminate() == 0, remote.logs()


# ---------------------------------------------------------------- the bad-input matrix
def _keys(server: LiveServer) -> set[bytes]:
    """Every key in the server's Redis but liveness heartbeats (refreshed on their own)."""
    return {k for k in server.redis().scan_iter(count=1000) if b":server:" not in k}


BAD = [
    # (what, method, path, body, headers, status, words in the detail)
    (
        "unknown assistant",
        "POST",
        "/threads/{tid}/runs",
        {"assistant_id": "nope", "input": {"topic": "x"}},
        {},
        404,
        "assistant",
    ),
    (
        "wrong input type",
        "POST",
        "/threads/{tid}/runs",
        {"assistant_id": "summary", "input": {"topic": 5}},
        {},
        422,
        "topic",
    ),
    (
        "missing input field",
        "POST",
        "/threads/{tid}/runs",
        {"assistant_id": "summary", "input": {}},
        {},
        422,
        "topic",
    ),
    (
        "input and command",
        "POST",
        "/threads/{tid}/runs",
        {"assistant_id": "summary", "input": {"topic": "x"}, "command": {"resume": 1}},
        {},
        422,
        "not both",
    ),
    (
        "resume without an interrupt",
        "POST",
        "/threads/{tid}/runs",
        {"assistant_id": "summary", "command": {"resume": True}},
        {},
        409,
        "interrupt",
    ),
    (
        "unsupported stream mode",
        "POST",
        "/threads/{tid}/runs/stream",
        {"assistant_id": "summary", "input": {"topic": "x"}, "stream_mode": "events"},
        {},
        422,
        "stream_mode",
    ),
    (
        "negative seed",
        "POST",
        "/threads/{tid}/runs",
        {"assistant_id": "summary", "input": {"topic": "x"}, "seed": -1},
        {},
        422,
        "seed",
    ),
    (
        "unknown decode mode",
        "POST",
        "/threads/{tid}/runs",
        {"assistant_id": "summary", "input": {"topic": "x"}, "config": {"configurable": {"mode": "turbo"}}},
        {},
        422,
        "mode",
    ),
    (
        "unsupported multitask strategy",
        "POST",
        "/threads/{tid}/runs",
        {"assistant_id": "summary", "input": {"topic": "x"}, "multitask_strategy": "enqueue"},
        {},
        422,
        "multitask",
    ),
    (
        "unknown checkpoint to fork",
        "POST",
        "/threads/{tid}/runs",
        {"assistant_id": "summary", "input": {"topic": "x"}, "checkpoint_id": "1f0-nope"},
        {},
        404,
        "checkpoint",
    ),
    (
        "missing thread",
        "POST",
        "/threads/no-such-thread/runs",
        {"assistant_id": "summary", "input": {"topic": "x"}},
        {},
        404,
        "thread",
    ),
    (
        "another tenant's thread",
        "POST",
        "/threads/{tid}/runs",
        {"assistant_id": "summary", "input": {"topic": "x"}},
        {"x-api-key": KEY_B},
        404,
        "thread",
    ),
    (
        "no API key",
        "POST",
        "/threads/{tid}/runs",
        {"assistant_id": "summary", "input": {"topic": "x"}},
        {"x-api-key": ""},
        401,
        "API key",
    ),
    (
        "body too large",
        "POST",
        "/threads/{tid}/runs",
        {"assistant_id": "summary", "input": {"topic": "x" * 70_000}},
        {},
        413,
        "bytes",
    ),
    (
        "not JSON",
        "POST",
        "/threads/{tid}/runs",
        b"{not json",
        {"content-type": "application/json"},
        422,
        "JSON",
    ),
    (
        "bad idempotency key",
        "POST",
        "/threads/{tid}/runs",
        {"assistant_id": "summary", "input": {"topic": "x"}},
        {"Idempotency-Key": "k" * 201},
        422,
        "Idempotency-Key",
    ),
    (
        "stateless, invalid input",
        "POST",
        "/runs/wait",
        {"assistant_id": "summary", "input": {"topic": ""}},
        {},
        422,
        "topic",
    ),
    (
        "stateless, unknown assistant",
        "POST",
        "/runs",
        {"assistant_id": "nope", "input": {"topic": "x"}},
        {},
        404,
        "assistant",
    ),
    ("cancel an ended run", "POST", "/threads/{tid}/runs/{rid}/cancel", None, {}, 409, "nothing to cancel"),
    ("delete a missing run", "DELETE", "/threads/{tid}/runs/no-such-run", None, {}, 404, "run"),
]


@pytest.fixture(scope="module")
def idle_thread(api_server: LiveServer) -> tuple[str, str]:
    http = api_server.http()
    tid = http.post("/threads", json={}).json()["thread_id"]
    done = http.post(f"/threads/{tid}/runs/wait", json={"assistant_id": "summary", "input": {"topic": "ink"}})
    assert done.status_code == 200
    return tid, http.get(f"/threads/{tid}/runs").json()[0]["run_id"]


@pytest.mark.parametrize("what,method,path,body,headers,status,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_4xx_and_writes_nothing(
    api_server: LiveServer,
    idle_thread: tuple[str, str],
    what: str,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    status: int,
    words: str,
) -> None:
    tid, rid = idle_thread
    before = _keys(api_server)
    thread_before = api_server.redis().hgetall(api_server.services.store.thread_key(tid))
    with api_server.http() as http:
        send = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
        reply = http.request(method, path.format(tid=tid, rid=rid), headers=headers, **send)
    assert reply.status_code == status, (what, reply.status_code, reply.text)
    assert words.lower() in reply.json()["detail"].lower(), (what, reply.text)
    assert _keys(api_server) == before, what
    after = api_server.redis().hgetall(api_server.services.store.thread_key(tid))
    assert {k: v for k, v in after.items() if k != b"updated_ms"} == {
        k: v for k, v in thread_before.items() if k != b"updated_ms"
    }, what
