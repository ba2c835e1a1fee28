"""Every method of langgraph-sdk's sync clients (assistants, threads, runs, store, crons) against a live
server (issue 39, item 2: protocol parity).

The client classes are introspected: a public method the SDK adds fails
:func:`test_every_sdk_method_is_covered` until it gets a check in :data:`SUPPORTED` or is listed in
:data:`UNSUPPORTED` with the 4xx it answers (the README's compatibility table says the same). Also
``GET /info`` (Studio), the Platform's ``messages`` stream semantics, and ``Thread.interrupts`` keyed by
task id.
"""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from langgraph_sdk import get_sync_client
from langgraph_sdk._sync.assistants import SyncAssistantsClient
from langgraph_sdk._sync.cron import SyncCronClient
from langgraph_sdk._sync.runs import SyncRunsClient
from langgraph_sdk._sync.store import SyncStoreClient
from langgraph_sdk._sync.threads import SyncThreadsClient
from langgraph_sdk.errors import APIStatusError, NotFoundError, UnprocessableEntityError

from api_server import KEY_A, KEY_B

pytest_plugins = ["state_fixtures", "api_server"]

CLIENTS = {
    "assistants": SyncAssistantsClient,
    "threads": SyncThreadsClient,
    "runs": SyncRunsClient,
    "store": SyncStoreClient,
    "crons": SyncCronClient,
}


def sdk_methods() -> set[str]:
    return {
        f"{name}.{method}"
        for name, cls in CLIENTS.items()
        for method, _ in inspect.getmembers(cls, inspect.isfunction)
        if not method.startswith("_")
    }


class Ctx:
    """What the checks share: clients of tenants A and B, a finished thread and an interrupted one."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.a = get_sync_client(url=server.url, api_key=KEY_A)
        self.b = get_sync_client(url=server.url, api_key=KEY_B)
        self.tid = self.a.threads.create(metadata={"case": "parity"})["thread_id"]
        self.result = self.a.runs.wait(self.tid, "summary", input={"topic": "parity"})
        self.run_id = self.a.runs.list(self.tid)[0]["run_id"]


@pytest.fixture(scope="module")
def ctx(api_server) -> Ctx:
    return Ctx(api_server)


# ---------------------------------------------------------------- supported: one check per method
def assistants_search(c: Ctx) -> None:
    found = c.a.assistants.search(graph_id="summary")
    assert [x["graph_id"] for x in found] == ["summary"]
    assert len(c.a.assistants.search(limit=2)) == 2


def assistants_count(c: Ctx) -> None:
    assert c.a.assistants.count() == len(c.a.assistants.search(limit=100)) >= 2
    assert c.a.assistants.count(graph_id="summary") == 1


def assistants_get(c: Ctx) -> None:
    one = c.a.assistants.get("summary")
    assert one["graph_id"] == "summary" and c.a.assistants.get(one["assistant_id"]) == one


def assistants_get_graph(c: Ctx) -> None:
    graph = c.a.assistants.get_graph("summary")
    assert {"__start__", "__end__"} <= {n["id"] for n in graph["nodes"]} and graph["edges"]
    assert c.a.assistants.get_graph("summary", xray=True)["nodes"]
    assert c.a.assistants.get_graph("summary", xray=1)["nodes"]


def assistants_get_schemas(c: Ctx) -> None:
    schemas = c.a.assistants.get_schemas("summary")
    assert schemas["graph_id"] == "summary" and "topic" in schemas["input_schema"]["properties"]
    assert set(schemas) >= {
        "input_schema",
        "output_schema",
        "state_schema",
        "config_schema",
        "context_schema",
    }


def assistants_get_subgraphs(c: Ctx) -> None:
    assert c.a.assistants.get_subgraphs("summary") == {}
    assert c.a.assistants.get_subgraphs("summary", namespace="x", recurse=True) == {}
    with pytest.raises(NotFoundError):
        c.a.assistants.get_subgraphs("no-such-assistant")


def assistants_get_versions(c: Ctx) -> None:
    versions = c.a.assistants.get_versions("summary")
    assert [v["graph_id"] for v in versions] == ["summary"]


def threads_create(c: Ctx) -> None:
    tid = str(uuid.uuid4())
    made = c.a.threads.create(thread_id=tid, metadata={"k": 1})
    assert made["thread_id"] == tid and made["status"] == "idle" and made["metadata"] == {"k": 1}
    assert c.a.threads.create(thread_id=tid, if_exists="do_nothing")["metadata"] == {"k": 1}


def threads_get(c: Ctx) -> None:
    got = c.a.threads.get(c.tid)
    assert got["values"]["topic"] == "parity" and got["interrupts"] == {}
    with pytest.raises(NotFoundError):
        c.b.threads.get(c.tid)


def threads_update(c: Ctx) -> None:
    tid = c.a.threads.create()["thread_id"]
    assert c.a.threads.update(tid, metadata={"x": "y"})["metadata"] == {"x": "y"}


def threads_delete(c: Ctx) -> None:
    tid = c.a.threads.create()["thread_id"]
    c.a.threads.delete(tid)
    with pytest.raises(NotFoundError):
        c.a.threads.get(tid)


def threads_search(c: Ctx) -> None:
    assert [t["thread_id"] for t in c.a.threads.search(metadata={"case": "parity"})] == [c.tid]
    assert c.b.threads.search(metadata={"case": "parity"}) == []


def threads_count(c: Ctx) -> None:
    assert c.a.threads.count(metadata={"case": "parity"}) == 1


def threads_get_state(c: Ctx) -> None:
    state = c.a.threads.get_state(c.tid)
    assert state["values"]["topic"] == "parity" and state["next"] == []
    cid = state["checkpoint"]["checkpoint_id"]
    assert c.a.threads.get_state(c.tid, checkpoint_id=cid)["checkpoint"]["checkpoint_id"] == cid
    assert c.a.threads.get_state(c.tid, checkpoint={"checkpoint_id": cid})["values"] == state["values"]


def threads_update_state(c: Ctx) -> None:
    tid = c.a.threads.create()["thread_id"]
    c.a.runs.wait(tid, "summary", input={"topic": "before"})
    new = c.a.threads.update_state(tid, {"topic": "after"})
    assert new["checkpoint"]["checkpoint_id"]
    assert c.a.threads.get_state(tid)["values"]["topic"] == "after"


def threads_get_history(c: Ctx) -> None:
    history = c.a.threads.get_history(c.tid, limit=3)
    assert 1 <= len(history) <= 3 and history[0]["values"]["topic"] == "parity"


def runs_create(c: Ctx) -> None:
    tid = c.a.threads.create()["thread_id"]
    run = c.a.runs.create(tid, "summary", input={"topic": "created"}, metadata={"m": 1})
    assert run["status"] in ("pending", "running", "success") and run["metadata"] == {"m": 1}
    assert c.a.runs.join(tid, run["run_id"])["topic"] == "created"


def runs_wait(c: Ctx) -> None:
    assert c.result["topic"] == "parity" and c.result["summary"]


def runs_stream(c: Ctx) -> None:
    tid = c.a.threads.create()["thread_id"]
    parts = list(
        c.a.runs.stream(tid, "summary", input={"topic": "streams"}, stream_mode=["updates", "values"])
    )
    assert parts[0].event == "metadata" and parts[0].data["thread_id"] == tid
    assert any(p.event == "updates" for p in parts) and parts[-1].event == "values"


def runs_list(c: Ctx) -> None:
    runs = c.a.runs.list(c.tid)
    assert [r["run_id"] for r in runs] == [c.run_id] and runs[0]["status"] == "success"
    assert c.a.runs.list(c.tid, limit=1, offset=1) == []


def runs_get(c: Ctx) -> None:
    assert c.a.runs.get(c.tid, c.run_id)["status"] == "success"


def runs_join(c: Ctx) -> None:
    assert c.a.runs.join(c.tid, c.run_id) == c.result


def runs_join_stream(c: Ctx) -> None:
    parts = list(c.a.runs.join_stream(c.tid, c.run_id))
    assert parts and parts[0].event == "metadata" and parts[0].data["run_id"] == c.run_id


def runs_cancel(c: Ctx) -> None:
    tid = c.a.threads.create()["thread_id"]
    run = c.a.runs.create(tid, "story", input={"topic": "cancel me"})
    deadline = time.monotonic() + 60
    while c.a.runs.get(tid, run["run_id"])["status"] == "pending":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    c.a.runs.cancel(tid, run["run_id"], wait=True)
    assert c.a.runs.get(tid, run["run_id"])["status"] == "interrupted"


def runs_delete(c: Ctx) -> None:
    tid = c.a.threads.create()["thread_id"]
    c.a.runs.wait(tid, "summary", input={"topic": "deleted"})
    rid = c.a.runs.list(tid)[0]["run_id"]
    c.a.runs.delete(tid, rid)
    with pytest.raises(NotFoundError):
        c.a.runs.get(tid, rid)


def store_put_item(c: Ctx) -> None:
    c.a.store.put_item(["parity", "put"], key="k1", value={"n": 1})
    c.a.store.put_item(["parity", "put"], key="k1", value={"n": 2})  # an update keeps created_at
    item = c.a.store.get_item(["parity", "put"], key="k1")
    assert item["value"] == {"n": 2} and item["namespace"] == ["parity", "put"] and item["key"] == "k1"
    assert item["created_at"] <= item["updated_at"]
    with pytest.raises(UnprocessableEntityError):
        c.a.store.put_item([], key="k", value={})


def store_get_item(c: Ctx) -> None:
    c.a.store.put_item(["parity", "get"], key="k", value={"secret": "a"}, ttl=5)
    assert c.a.store.get_item(["parity", "get"], key="k")["value"] == {"secret": "a"}
    assert c.a.store.get_item(["parity", "get"], key="k", refresh_ttl=False)["key"] == "k"
    with pytest.raises(NotFoundError):
        c.b.store.get_item(["parity", "get"], key="k")  # another tenant's store
    with pytest.raises(NotFoundError):
        c.a.store.get_item(["parity", "get"], key="missing")
    r = c.server.redis()
    ttl = [r.pttl(k) for k in r.scan_iter(match="elesium:store:*item:*") if r.pttl(k) > 0]
    assert ttl and all(0 < t <= 5 * 60_000 for t in ttl)


def store_delete_item(c: Ctx) -> None:
    c.a.store.put_item(["parity", "del"], key="k", value={"v": 1})
    c.a.store.delete_item(["parity", "del"], key="k")
    with pytest.raises(NotFoundError):
        c.a.store.get_item(["parity", "del"], key="k")
    c.a.store.delete_item(["parity", "del"], key="k")  # deleting a missing item is no error


def store_search_items(c: Ctx) -> None:
    for i in range(5):
        c.a.store.put_item(
            ["parity", "search", "docs"], key=f"d{i}", value={"i": i, "kind": "even" if i % 2 == 0 else "odd"}
        )
    found = c.a.store.search_items(["parity", "search"], limit=100)["items"]
    assert sorted(x["key"] for x in found) == [f"d{i}" for i in range(5)]
    assert [x["key"] for x in found][0] == "d4"  # most recently updated first
    evens = c.a.store.search_items(["parity", "search"], filter={"kind": "even"})["items"]
    assert sorted(x["value"]["i"] for x in evens) == [0, 2, 4]
    big = c.a.store.search_items(["parity"], filter={"i": {"$gte": 3}})["items"]
    assert sorted(x["value"]["i"] for x in big) == [3, 4]
    page = c.a.store.search_items(["parity", "search"], limit=2, offset=1)["items"]
    assert [x["key"] for x in page] == [x["key"] for x in found[1:3]]
    assert c.b.store.search_items(["parity"])["items"] == []
    with pytest.raises(UnprocessableEntityError, match="embeddings"):
        c.a.store.search_items(["parity"], query="similar documents")


def store_list_namespaces(c: Ctx) -> None:
    c.a.store.put_item(["parity", "ns", "one"], key="k", value={})
    c.a.store.put_item(["parity", "ns", "two"], key="k", value={})
    names = c.a.store.list_namespaces(prefix=["parity", "ns"])["namespaces"]
    assert names == [["parity", "ns", "one"], ["parity", "ns", "two"]]
    assert c.a.store.list_namespaces(prefix=["parity", "ns"], max_depth=2)["namespaces"] == [["parity", "ns"]]
    assert c.a.store.list_namespaces(suffix=["two"])["namespaces"] == [["parity", "ns", "two"]]
    assert c.a.store.list_namespaces(prefix=["parity", "ns"], limit=1, offset=1)["namespaces"] == [
        ["parity", "ns", "two"]
    ]
    assert c.b.store.list_namespaces(prefix=["parity"])["namespaces"] == []


FAR = "0 0 1 1 *"  # the next 1 January: never fires during the tests on its own


def crons_create(c: Ctx) -> None:
    cron = c.a.crons.create(
        "summary", schedule=FAR, input={"topic": "cron"}, metadata={"case": "parity-cron"}
    )
    assert cron["schedule"] == FAR and cron["thread_id"] is None and cron["enabled"] is True
    assert cron["next_run_date"].startswith(f"{time.gmtime().tm_year + 1}-01-01T00:00:00")
    assert cron["payload"]["input"] == {"topic": "cron"}
    with pytest.raises(UnprocessableEntityError, match="schedule"):
        c.a.crons.create("summary", schedule="61 * * * *", input={"topic": "x"})
    with pytest.raises(UnprocessableEntityError, match="input"):
        c.a.crons.create("summary", schedule=FAR, input={"nope": 1})
    with pytest.raises(NotFoundError):
        c.a.crons.create("no-such-assistant", schedule=FAR, input={"topic": "x"})
    # The scheduler starts the run at the scheduled time (a tick at that time, as the server's loop does).
    scheduler = c.server.app.state.cron_scheduler
    due = _ms(cron["next_run_date"])
    started = scheduler.tick(due)
    assert len(started) == 1 and scheduler.tick(due) == []  # once per scheduled time
    threads = c.a.threads.search(metadata={"cron_id": cron["cron_id"]})
    assert len(threads) == 1
    assert c.a.runs.join(threads[0]["thread_id"], started[0])["topic"] == "cron"
    after = c.a.crons.search(metadata={"case": "parity-cron"})[0]
    assert _ms(after["next_run_date"]) > due
    c.a.crons.delete(cron["cron_id"])


def _ms(iso: str) -> int:
    from datetime import datetime

    return int(datetime.fromisoformat(iso).timestamp() * 1000)


def crons_create_for_thread(c: Ctx) -> None:
    tid = c.a.threads.create()["thread_id"]
    cron = c.a.crons.create_for_thread(tid, "summary", schedule=FAR, input={"topic": "thread cron"})
    assert cron["thread_id"] == tid
    started = c.server.app.state.cron_scheduler.tick(_ms(cron["next_run_date"]))
    assert len(started) == 1
    assert c.a.runs.join(tid, started[0])["topic"] == "thread cron"
    assert c.a.runs.get(tid, started[0])["metadata"]["cron_id"] == cron["cron_id"]
    with pytest.raises(NotFoundError):
        c.b.crons.create_for_thread(tid, "summary", schedule=FAR, input={"topic": "b"})
    c.a.crons.delete(cron["cron_id"])


def crons_update(c: Ctx) -> None:
    cron = c.a.crons.create("summary", schedule=FAR, input={"topic": "u"})
    new = c.a.crons.update(cron["cron_id"], schedule="30 6 * * 1-5", enabled=False, input={"topic": "v"})
    assert (
        new["schedule"] == "30 6 * * 1-5"
        and new["enabled"] is False
        and new["payload"]["input"] == {"topic": "v"}
    )
    with pytest.raises(NotFoundError):
        c.b.crons.update(cron["cron_id"], enabled=True)
    c.a.crons.delete(cron["cron_id"])


def crons_search(c: Ctx) -> None:
    one = c.a.crons.create("summary", schedule=FAR, input={"topic": "s"}, metadata={"case": "search"})
    two = c.a.crons.create("summary", schedule="5 4 * * *", input={"topic": "s"}, metadata={"case": "search"})
    found = c.a.crons.search(metadata={"case": "search"}, sort_by="next_run_date", sort_order="asc")
    assert [x["cron_id"] for x in found] == [two["cron_id"], one["cron_id"]]
    page = c.a.crons.search(assistant_id="summary", metadata={"case": "search"}, limit=1, offset=1)
    assert [x["cron_id"] for x in page] == [two["cron_id"]]  # default order: created_at
    assert c.a.crons.search(metadata={"case": "search"}, select=["cron_id"])[0].keys() == {"cron_id"}
    assert c.b.crons.search(metadata={"case": "search"}) == []
    for x in (one, two):
        c.a.crons.delete(x["cron_id"])


def crons_count(c: Ctx) -> None:
    cron = c.a.crons.create("summary", schedule=FAR, input={"topic": "c"}, metadata={"case": "count"})
    assert c.a.crons.count(metadata={"case": "count"}) == 1
    assert c.b.crons.count(metadata={"case": "count"}) == 0
    c.a.crons.delete(cron["cron_id"])


def crons_delete(c: Ctx) -> None:
    cron = c.a.crons.create("summary", schedule=FAR, input={"topic": "d"})
    with pytest.raises(NotFoundError):
        c.b.crons.delete(cron["cron_id"])
    c.a.crons.delete(cron["cron_id"])
    with pytest.raises(NotFoundError):
        c.a.crons.delete(cron["cron_id"])


SUPPORTED: dict[str, Callable[[Ctx], None]] = {
    f"{fn.__name__.split('_', 1)[0]}.{fn.__name__.split('_', 1)[1]}": fn
    for fn in (
        assistants_search, assistants_count, assistants_get, assistants_get_graph, assistants_get_schemas,
        assistants_get_subgraphs, assistants_get_versions,
        threads_create, threads_get, threads_update, threads_delete, threads_search, threads_count,
        threads_get_state, threads_update_state, threads_get_history,
        runs_create, runs_wait, runs_stream, runs_list, runs_get, runs_join, runs_join_stream, runs_cancel,
        runs_delete,
        store_put_item, store_get_item, store_delete_item, store_search_items, store_list_namespaces,
        crons_create, crons_create_for_thread, crons_update, crons_search, crons_count, crons_delete,
    )
}  # fmt: skip

# ---------------------------------------------------------------- not supported: the 4xx each answers
UNSUPPORTED: dict[str, tuple[int, Callable[[Ctx], Any]]] = {
    # assistants are the registered workflows (code, content-hashed): read-only
    "assistants.create": (404, lambda c: c.a.assistants.create("summary")),
    "assistants.update": (405, lambda c: c.a.assistants.update("summary", name="renamed")),
    "assistants.delete": (405, lambda c: c.a.assistants.delete("summary")),
    "assistants.set_latest": (404, lambda c: c.a.assistants.set_latest("summary", 1)),
    # a copy would be a thread without the runs that produced its state (not auditable); pruning is the
    # retention sweep's
    "threads.copy": (404, lambda c: c.a.threads.copy(c.tid)),
    "threads.prune": (405, lambda c: c.a.threads.prune([c.tid])),
    # thread-level streams: follow a run with runs.join_stream
    "threads.join_stream": (404, lambda c: list(c.a.threads.join_stream(c.tid))),
    "threads.stream": (404, lambda c: _v3_stream(c)),
    # one run per request
    "runs.create_batch": (404, lambda c: c.a.runs.create_batch([{"assistant_id": "summary", "input": {}}])),
    "runs.cancel_many": (404, lambda c: c.a.runs.cancel_many(thread_id=c.tid, run_ids=[c.run_id])),
}


def _v3_stream(c: Ctx) -> Any:
    """The v3 thread stream session (``threads.stream``) sends its commands to ``/threads/{id}/commands``."""
    assert c.a.threads.stream(c.tid, assistant_id="summary") is not None  # built locally, nothing sent
    with c.server.http(KEY_A) as http:
        response = http.post(f"/threads/{c.tid}/commands", json={"method": "run.input"})
    response.raise_for_status()


# ---------------------------------------------------------------- the tests
def test_every_sdk_method_is_covered():
    assert not set(SUPPORTED) & set(UNSUPPORTED)
    missing = sdk_methods() - set(SUPPORTED) - set(UNSUPPORTED)
    assert not missing, f"langgraph-sdk methods without a parity check: {sorted(missing)}"
    assert set(SUPPORTED) | set(UNSUPPORTED) <= sdk_methods(), "checks for methods the SDK no longer has"


@pytest.mark.parametrize("method", sorted(SUPPORTED))
def test_supported_method(ctx, method):
    SUPPORTED[method](ctx)


@pytest.mark.parametrize("method", sorted(UNSUPPORTED))
def test_unsupported_method_answers_its_4xx(ctx, method):
    status, call = UNSUPPORTED[method]
    with pytest.raises(Exception) as raised:  # noqa: PT011 - the status is what is checked
        call(ctx)
    err = raised.value
    got = getattr(err, "status_code", None) or getattr(getattr(err, "response", None), "status_code", None)
    assert got == status, f"{method}: {err!r}"
    assert isinstance(err, APIStatusError) or got == status


def test_info_answers_like_the_platform(api_server):
    with api_server.http(key=None) as http:  # public, as on the Platform (Studio connects with it)
        info = http.get("/info")
    assert info.status_code == 200
    body = info.json()
    assert body["version"] and body["langgraph_py_version"]
    assert body["flags"]["assistants"] is True and body["flags"]["crons"] is True
    assert body["flags"]["langsmith"] is False


def test_messages_stream_mode_sends_whole_messages_then_complete(ctx):
    """``messages``: metadata, then partials carrying the whole message so far, then complete; beside
    it ``messages-tuple`` keeps LangGraph's (chunk, metadata) pairs."""
    tid = ctx.a.threads.create()["thread_id"]
    parts = list(
        ctx.a.runs.stream(
            tid, "summary", input={"topic": "bees"}, stream_mode=["messages", "messages-tuple", "values"]
        )
    )
    events = [p.event for p in parts]
    meta = [p for p in parts if p.event == "messages/metadata"]
    partial = [p.data[0] for p in parts if p.event == "messages/partial"]
    complete = [p.data[0] for p in parts if p.event == "messages/complete"]
    tuples = [p.data for p in parts if p.event == "messages"]
    assert len(meta) == 1 and len(complete) == 1 and len(partial) == len(tuples) > 1
    mid = complete[0]["id"]
    assert list(meta[0].data) == [mid] and meta[0].data[mid]["metadata"]["langgraph_node"]
    assert events.index("messages/metadata") < events.index("messages/partial")
    assert events.index("messages/complete") > max(i for i, e in enumerate(events) if e == "messages/partial")
    so_far = ""
    for chunk, (tuple_chunk, tuple_meta) in zip(partial, tuples, strict=True):
        so_far += tuple_chunk["content"]  # messages-tuple: the delta
        assert chunk["content"] == so_far and chunk["id"] == mid and chunk["type"] == "AIMessageChunk"
        assert tuple_meta["langgraph_node"]
    assert complete[0]["content"] == so_far and complete[0]["type"] == "ai"
    final = [p.data for p in parts if p.event == "values"][-1]
    assert final["summary"].strip() == so_far.strip()


def test_thread_interrupts_are_keyed_by_task_id(ctx):
    tid = ctx.a.threads.create()["thread_id"]
    ctx.a.runs.wait(tid, "approval", input={"topic": "keys"})
    thread = ctx.a.threads.get(tid)
    state = ctx.a.threads.get_state(tid)
    tasks = {t["id"]: t["interrupts"] for t in state["tasks"] if t["interrupts"]}
    assert thread["status"] == "interrupted" and "" not in thread["interrupts"]
    assert thread["interrupts"] == tasks and len(tasks) == 1
    (interrupts,) = thread["interrupts"].values()
    assert interrupts[0]["id"] and interrupts[0]["value"]["draft"]
    assert state["interrupts"] == interrupts
