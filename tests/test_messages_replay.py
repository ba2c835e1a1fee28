"""A graph that keeps LangChain messages in its state (``MessagesState``) replays identical.

LangGraph's ``add_messages`` and LangChain's chat models label messages with random ids, so a replay
compares them up to a consistent renaming (``MessageIds``); everything else in a message still has to
match. The first tests need no model; the last serves a ``MessagesState`` project graph calling
ChatElesium on the real engine and replays a two-run thread both ways.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph

from api_server import KEY_A, live_server, server_settings
from elesium.graphs.replay import MessageIds, compare_checkpoints, first_difference

pytest_plugins = ["state_fixtures"]


def _msg(id_: str | None, content: str, kind: str = "human") -> dict[str, Any]:
    return {"content": content, "additional_kwargs": {}, "response_metadata": {}, "type": kind, "name": None,
            "id": id_}


def test_message_ids_compare_up_to_a_consistent_renaming() -> None:
    ids = MessageIds()
    first = {"messages": [_msg("a", "hi"), _msg("b", "yo", "ai")]}
    renamed = {"messages": [_msg("x", "hi"), _msg("y", "yo", "ai")]}
    assert first_difference(first, renamed, messages=ids) is None
    # Later checkpoints of the thread keep the renaming: a, b stay x, y.
    later = {"messages": [*first["messages"], _msg("c", "more")]}
    assert first_difference(later, {"messages": [_msg("x", "hi"), _msg("y", "yo", "ai"), _msg("z", "more")]},
                            messages=ids) is None
    assert first_difference(later, {"messages": [_msg("y", "hi"), _msg("x", "yo", "ai"), _msg("z", "more")]},
                            messages=ids) == ("messages[0].id", "a", "y")
    # Two recorded messages cannot become one replayed message.
    assert first_difference(first, {"messages": [_msg("p", "hi"), _msg("p", "yo", "ai")]},
                            messages=MessageIds()) == ("messages[1].id", "b", "p")
    # Everything else still compares exactly, and a missing id is a difference.
    assert first_difference(first, {"messages": [_msg("x", "hi"), _msg("y", "no", "ai")]},
                            messages=MessageIds()) == ("messages[1].content", "yo", "no")
    assert first_difference(first, {"messages": [_msg(None, "hi"), _msg("y", "yo", "ai")]},
                            messages=MessageIds()) == ("messages[0].id", "a", None)
    # Only messages are renamed; other ids, and every id without a renaming, compare as they are.
    plain = {"id": "a", "type": "ticket", "content": "x"}
    assert first_difference(plain, {**plain, "id": "b"}, messages=MessageIds()) == ("id", "a", "b")
    assert first_difference(first, renamed) == ("messages[0].id", "a", "x")
    # A recorded update naming a message names the replayed one.
    removal = {"messages": [{"type": "remove", "id": "b", "content": ""}, _msg("new", "hello")]}
    assert ids.to_replayed(removal) == {"messages": [{"type": "remove", "id": "y", "content": ""},
                                                     _msg("new", "hello")]}


def _echo_graph() -> Any:
    def reply(state: MessagesState) -> dict[str, Any]:
        return {"messages": [AIMessage(content="you said: " + str(state["messages"][-1].content))]}

    builder = StateGraph(MessagesState)
    builder.add_node("reply", reply)
    builder.add_edge(START, "reply")
    builder.add_edge("reply", END)
    return builder.compile(checkpointer=InMemorySaver())


def _checkpoints(graph: Any, thread: str) -> list[str]:
    history = graph.get_state_history({"configurable": {"thread_id": thread}})
    return [s.config["configurable"]["checkpoint_id"] for s in reversed(list(history))]


def test_a_messages_graph_run_twice_compares_equal_and_a_changed_reply_does_not() -> None:
    graph = _echo_graph()
    for thread, text in (("one", "hello"), ("two", "hello"), ("three", "goodbye")):
        graph.invoke({"messages": [{"role": "user", "content": text}]},
                     {"configurable": {"thread_id": thread}})
    one, two, three = (_checkpoints(graph, t) for t in ("one", "two", "three"))
    assert len(one) == 3
    div, compared = compare_checkpoints("r", graph, "one", one, graph, "two", two, {})
    assert div is None and compared == 3  # the same messages under other random ids
    div, _ = compare_checkpoints("r", graph, "one", one, graph, "three", three, {})
    assert div is not None and div.field == "checkpoint.__start__.messages[0].content"


CHAT_GRAPH = '''
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, MessagesState, StateGraph

from elesium.graphs import get_run_context
from elesium.graphs.chat_model import ChatElesium


def reply(state: MessagesState, config: RunnableConfig) -> dict:
    llm = ChatElesium(engine=get_run_context(config).engine, temperature=0.7, max_tokens=8)
    return {"messages": [llm.invoke(state["messages"])]}


builder = StateGraph(MessagesState)
builder.add_node("reply", reply)
builder.add_edge(START, "reply")
builder.add_edge("reply", END)
graph = builder.compile()
'''


def test_a_messages_state_project_graph_replays_identical(tmp_path: Path, engine: Any,
                                                          state_server: Any) -> None:
    """Two runs on one thread (the second sees the first's messages), ChatElesium's replies in the state:
    both replay modes say identical, with the thread's messages compared under one renaming."""
    from langgraph_sdk import get_sync_client

    from elesium.graphs.project import load_project

    (tmp_path / "messages_replay_graph.py").write_text(CHAT_GRAPH)
    (tmp_path / "langgraph.json").write_text(json.dumps(
        {"dependencies": ["."], "graphs": {"chat": "./messages_replay_graph.py:graph"}}))
    registry = load_project(tmp_path / "langgraph.json").registry
    queue = f"messages-{uuid.uuid4().hex[:8]}"  # its own queue: other live servers share this Redis
    with live_server(server_settings(state_server.url, queue_name=queue), engine, registry) as server:
        client = get_sync_client(url=server.url, api_key=KEY_A)
        thread = client.threads.create()["thread_id"]
        for text in ("Name a colour.", "And another one?"):
            client.runs.wait(thread, "chat", input={"messages": [{"role": "user", "content": text}]},
                             config={"configurable": {"run_seed": 5}})
        runs = client.runs.list(thread)
        assert [r["status"] for r in runs] == ["success", "success"], runs
        messages = client.threads.get_state(thread)["values"]["messages"]
        assert [m["type"] for m in messages] == ["human", "ai", "human", "ai"]
        assert all(m["id"] for m in messages) and all(m["content"] for m in messages)
        assert not {"elapsed_s", "steps"} & set(messages[1]["response_metadata"])  # could not replay
        last = runs[0]["run_id"]  # newest first
        with server.http() as http:
            for mode in ("reexecute", "recorded"):
                report = http.post(f"/threads/{thread}/runs/{last}/replay", json={"mode": mode},
                                   timeout=300).json()
                assert report["verdict"] == "identical", (mode, json.dumps(report["divergence"]))
                assert len(report["runs_replayed"]) == 2 and report["checkpoints_compared"] >= 6
                assert report["calls_compared"] == 2
