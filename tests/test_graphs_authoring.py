"""The authoring layer: seeds, prompts, versions, the registry, LLM nodes streaming through LangGraph.

LLM-node tests run the real bundled model with a few tokens; versions are hashed from real graphs.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Any

import pytest
from langchain_core.messages import AIMessageChunk
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel

from elesium.graphs import (
    Registry,
    UnknownWorkflowError,
    Workflow,
    WorkflowState,
    default_registry,
    derive_seed,
    llm_node,
    run_config,
)
from elesium.graphs.audit import call_tokens
from elesium.graphs.context import MissingRunContextError
from elesium.graphs.prompts import PromptRenderError, render
from elesium.graphs.structured import OutputSpec, match_choice
from elesium.inference.records import StepRecord
from elesium.state import AcceptanceEntry, AcceptanceLog, Retention, RunRecord, RunRegistry

pytest_plugins = ["state_fixtures"]


class Echo(BaseModel):
    topic: str


class EchoState(WorkflowState, total=False):
    topic: str
    answer: str
    rounds: int


def echo_builder(
    prompt: str = "Write one short sentence about {topic}.", max_tokens: int = 6, temperature: float = 0.0
) -> StateGraph:
    builder = StateGraph(EchoState)
    builder.add_node(
        llm_node(
            "write",
            prompt=prompt,
            output_key="answer",
            params={"max_tokens": max_tokens, "temperature": temperature},
        )
    )
    builder.add_edge(START, "write")
    builder.add_edge("write", END)
    return builder


# ---------------------------------------------------------------- seeds, prompts, outputs (no model)
def test_call_seeds_are_pure_functions_of_run_node_and_index() -> None:
    seeds = {derive_seed(s, n, i) for s in (0, 1) for n in ("a", "b", "ab") for i in (0, 1, 2)}
    assert len(seeds) == 18  # no two (run, node, index) share a seed
    assert all(0 <= s < 2**63 for s in seeds)
    # Pinned: the derivation is part of the replay contract; changing it breaks old runs' replays.
    assert (
        derive_seed(7, "draft_reply", 0)
        == int.from_bytes(
            __import__("hashlib").sha256(b"elesium-call-seed/1:7:11:draft_reply:0").digest()[:8], "big"
        )
        >> 1
    )
    with pytest.raises(ValueError):
        derive_seed(1, "x", -1)


def test_prompt_templates_render_both_syntaxes_and_name_missing_keys() -> None:
    state = {"subject": "Refund", "triage": {"category": "billing"}, "items": ["a", "b"]}
    assert render("{subject} / {triage[category]}", state) == "Refund / billing"
    assert render("{% for i in items %}{{ i }};{% endfor %}", state, "jinja2") == "a;b;"
    assert render(lambda s: s["subject"].upper(), state) == "REFUND"
    with pytest.raises(PromptRenderError, match="body"):
        render("{body}", state, node="n")
    with pytest.raises(PromptRenderError, match="body"):
        render("{{ body }}", state, "jinja2", node="n")


def test_output_specs_parse_and_fall_back() -> None:
    spec = OutputSpec.of(Echo)
    assert spec.parse('{"topic": "cats"}', constrained=True) == {"topic": "cats"}
    with pytest.raises(ValueError, match="token budget"):
        spec.parse('{"topic": "ca', constrained=True, truncated=True)
    choices = OutputSpec.of(["billing", "outage"])
    assert choices.parse("outage", constrained=True) == "outage"
    assert match_choice("I think this is an Outage, not billing", ["billing", "outage"]) == "outage"
    assert match_choice("no idea", ["billing", "outage"]) == "billing"
    with pytest.raises(ValueError):
        OutputSpec.of("billing")
    with pytest.raises(ValueError):
        OutputSpec.of(["a", "a"])


# ---------------------------------------------------------------- versions and the registry
def test_version_is_stable_and_changes_with_prompt_params_code_and_edges() -> None:
    base = Workflow.define("echo", echo_builder, Echo, description="d")
    assert (
        Workflow.define("echo", echo_builder, Echo, description="other text", label="L").version
        == base.version
    )
    assert re.fullmatch(r"[0-9a-f]{16}", base.version)
    other_prompt = Workflow.define("echo", lambda: echo_builder(prompt="Say {topic}."), Echo, description="d")
    other_params = Workflow.define("echo", lambda: echo_builder(max_tokens=7), Echo, description="d")
    assert len({base.version, other_prompt.version, other_params.version}) == 3

    def with_tail(code_variant: int) -> StateGraph:
        builder = echo_builder()

        def tail(state: EchoState) -> dict[str, Any]:
            return {"rounds": 1} if code_variant else {"rounds": 2}

        builder.add_node("tail", tail)
        builder.edges.discard(("write", END))
        builder.add_edge("write", "tail")
        builder.add_edge("tail", END)
        return builder

    # Same structure, same source text for both variants: the hash sees code, not closures' values...
    assert (
        Workflow.define("e", lambda: with_tail(0), Echo, description="").version
        == Workflow.define("e", lambda: with_tail(1), Echo, description="").version
    )
    # ...and an added node and its edges change it.
    assert Workflow.define("e", lambda: with_tail(0), Echo, description="").version != base.version


def test_shipped_versions_are_the_same_in_a_fresh_registry() -> None:
    from elesium.graphs.workflows import shipped

    assert {w.name: w.version for w in shipped()} == {w.name: w.version for w in default_registry().list()}


def test_registry_lookup_and_errors() -> None:
    registry = Registry()
    first = registry.register(Workflow.define("echo", echo_builder, Echo, description="d"))
    second = registry.register(
        Workflow.define("echo", lambda: echo_builder(max_tokens=9), Echo, description="d")
    )
    assert registry.get("echo") is second and registry.get("echo", first.version) is first
    assert [w.version for w in registry.list()] == [second.version]
    with pytest.raises(UnknownWorkflowError) as err:
        registry.get("nope")
    assert str(err.value) == "unknown workflow 'nope' (registered: echo)"
    with pytest.raises(UnknownWorkflowError, match="no version 'deadbeef'"):
        registry.get("echo", "deadbeef")
    schema = first.json_schema()
    assert schema["input"]["required"] == ["topic"] and "answer" in schema["state"]["properties"]


def test_define_rejects_states_without_the_call_counter_or_input_fields() -> None:
    from typing import TypedDict

    class Plain(TypedDict, total=False):
        topic: str

    def plain() -> StateGraph:
        b = StateGraph(Plain)
        b.add_node("n", lambda s: {})
        b.add_edge(START, "n")
        return b

    with pytest.raises(ValueError, match="llm_calls"):
        Workflow.define("p", plain, Echo, description="")

    class Other(BaseModel):
        missing: str

    with pytest.raises(ValueError, match="missing"):
        Workflow.define("p", echo_builder, Other, description="")


# ---------------------------------------------------------------- records written before workflows
def test_old_run_hashes_and_acceptance_entries_still_read(redis_url: str, key_prefix: str) -> None:
    registry = RunRegistry.from_url(redis_url, prefix=key_prefix)
    old = {
        b"run_id": b"r-old",
        b"workflow": b"w",
        b"workflow_version": b"1",
        b"input_hash": b"h",
        b"seeds": b"{}",
        b"status": b"succeeded",
        b"tenant": b"default",
        b"error": b"",
        b"created_at": datetime(2026, 1, 1, tzinfo=timezone.utc).isoformat().encode(),
        b"updated_at": datetime(2026, 1, 1, tzinfo=timezone.utc).isoformat().encode(),
        b"created_ms": b"1",
    }
    registry.client.hset(registry._run_key("r-old"), mapping=old)
    record = registry.get("r-old")
    assert record is not None and record.input is None and record.engine == {} and record.thread_id == ""
    new = RunRecord(
        run_id="r-new",
        workflow="w",
        workflow_version="1",
        input_hash="h",
        input={"q": "ü{"},
        engine={"model_sha256": "ab"},
        thread_id="t",
        calibrations={"n": "3"},
    )
    registry.create(new)
    assert registry.get("r-new").model_dump(exclude={"created_at", "updated_at"}) == new.model_dump(
        exclude={"created_at", "updated_at"}
    )

    log = AcceptanceLog.from_url(redis_url, prefix=key_prefix, retention=Retention(maxlen=None))
    rec = StepRecord(
        step=0, mode="vanilla", tree_size=1, tree_depth=0, accepted_length=1, accepted_nodes=(0,), tokens=(5,)
    )
    log.client.xadd(
        log.key("r"),
        {"v": "1", "run_id": "r", "node_id": "n", "step_id": "0", "record": json.dumps(rec.to_dict())},
    )
    log.append(
        AcceptanceEntry(
            run_id="r",
            node_id="n",
            step_id=1,
            record=rec,
            kind="call",
            call_index=2,
            call_seed=99,
            tokens=(5, 6),
        )
    )
    old_entry, call_entry = log.read("r")
    assert (old_entry.kind, old_entry.call_index, old_entry.tokens) == ("step", None, None)
    assert (call_entry.kind, call_entry.call_index, call_entry.call_seed, call_entry.tokens) == (
        "call",
        2,
        99,
        (5, 6),
    )
    assert log.summary("r").steps == 1  # the call entry is not a verification step


# ---------------------------------------------------------------- LLM nodes on the real model
def test_llm_node_needs_a_run_context(engine) -> None:
    with pytest.raises(MissingRunContextError, match="run_config"):
        echo_builder().compile().invoke({"topic": "cats"})


def test_tokens_stream_in_messages_and_custom_modes(engine) -> None:
    graph = echo_builder(max_tokens=6).compile()
    chunks: list[AIMessageChunk] = []
    custom: list[dict[str, Any]] = []
    final: dict[str, Any] = {}
    for mode, payload in graph.stream(
        {"topic": "cats"},
        run_config(engine, run_seed=1, run_id="s1"),
        stream_mode=["messages", "custom", "values"],
    ):
        if mode == "messages":
            message, meta = payload
            assert meta["langgraph_node"] == "write"
            chunks.append(message)
        elif mode == "custom":
            custom.append(payload)
        else:
            final = payload
    assert len(chunks) >= 2 and all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(c.content for c in chunks) == final["answer"]
    assert {c.id for c in chunks} == {"s1:write:0"}
    token_ids = [t for c in custom for t in c["token_ids"]]
    assert 2 <= len(token_ids) <= 6 and {c["node"] for c in custom} == {"write"}
    assert engine.tokenizer.decode(token_ids).strip() == final["answer"].strip()
    assert final["llm_calls"] == {"write": 1}


def test_call_index_counts_in_the_state_and_seeds_sampled_calls(
    engine, redis_url: str, key_prefix: str
) -> None:
    """A node called twice in a loop gets indices 0 and 1: two seeds, reproducible per run seed."""
    from elesium.state import RedisSaver

    def build() -> StateGraph:
        builder = echo_builder(prompt="Name a {topic}.", max_tokens=4, temperature=1.0)
        builder.add_node("count", lambda s: {"rounds": s.get("rounds", 0) + 1})
        builder.edges.discard(("write", END))
        builder.add_edge("write", "count")
        builder.add_conditional_edges("count", lambda s: END if s["rounds"] >= 2 else "write")
        return builder

    log = AcceptanceLog.from_url(redis_url, prefix=key_prefix, retention=Retention(maxlen=None))
    saver = RedisSaver.from_url(redis_url, prefix=f"{key_prefix}:cp")

    def run(run_id: str, seed: int) -> list[tuple[str, int, int, tuple[int, ...]]]:
        graph = build().compile(checkpointer=saver)
        out = graph.invoke({"topic": "colour"}, run_config(engine, run_seed=seed, run_id=run_id, log=log))
        assert out["llm_calls"] == {"write": 2}
        return call_tokens(log, run_id)

    first, again, other = run("a", 11), run("b", 11), run("c", 12)
    assert [(n, i, s) for n, i, s, _ in first] == [
        ("write", i, derive_seed(11, "write", i)) for i in range(2)
    ]
    assert first == again  # same run seed: same seeds, same sampled tokens
    assert [s for _, _, s, _ in other] != [s for _, _, s, _ in first]
    assert [t for *_, t in other] != [t for *_, t in first]  # temperature 1: other seeds, other tokens


async def test_tokens_stream_under_astream_too(engine) -> None:
    """Async callers (the API) get the same token chunks from the sync LLM node."""
    graph = echo_builder(max_tokens=4).compile()
    chunks = [
        message.content
        async for message, _ in graph.astream(
            {"topic": "dogs"}, run_config(engine, run_seed=2, run_id="a1"), stream_mode="messages"
        )
    ]
    final = await graph.ainvoke({"topic": "dogs"}, run_config(engine, run_seed=2, run_id="a2"))
    assert len(chunks) >= 2 and "".join(chunks) == final["answer"]
