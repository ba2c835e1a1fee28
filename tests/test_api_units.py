"""Model-free pieces of the API: key parsing, settings, trace spans, replay comparisons, run channels."""

from __future__ import annotations

import asyncio

import pytest

from elesium.api.events import RunChannel
from elesium.api.settings import ApiSettings, parse_api_keys
from elesium.api.tracing import Tracing
from elesium.graphs.replay import LLMCall, compare_calls, first_difference


def test_parse_api_keys():
    assert parse_api_keys("k1=tenantA, k2=tenantB\n# comment\nk3 = tenantA") == {
        "k1": "tenantA",
        "k2": "tenantB",
        "k3": "tenantA",
    }
    for bad in ("k1", "=t", "k1=", "k1=a,k1=b"):
        with pytest.raises(ValueError):
            parse_api_keys(bad)


def test_settings_from_env(monkeypatch, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("filekey=ops\n")
    monkeypatch.setenv("ELESIUM_API_KEYS_FILE", str(keys))
    monkeypatch.setenv("ELESIUM_API_KEYS", "envkey=dev")
    monkeypatch.setenv("ELESIUM_OTEL_EXPORTER", "console")
    s = ApiSettings.from_env()
    assert s.api_keys == {"filekey": "ops", "envkey": "dev"} and s.auth and s.otel_exporter == "console"
    assert s.self_tuning is False  # off unless asked for
    monkeypatch.setenv("ELESIUM_SELF_TUNING", "on")
    assert ApiSettings.from_env().self_tuning is True
    monkeypatch.setenv("ELESIUM_SELF_TUNING", "sometimes")  # not silently "off"
    with pytest.raises(ValueError, match="ELESIUM_SELF_TUNING"):
        ApiSettings.from_env()
    monkeypatch.delenv("ELESIUM_SELF_TUNING")
    monkeypatch.setenv("ELESIUM_OTEL_EXPORTER", "jaeger")
    with pytest.raises(ValueError, match="ELESIUM_OTEL_EXPORTER"):
        ApiSettings.from_env()


def _call(node: str, call: int, tokens: list[int]) -> LLMCall:
    return LLMCall(
        node=node,
        call=call,
        seed=1,
        mode="vanilla",
        prompt_sha256="p" * 64,
        prompt_tokens=9,
        token_ids=tokens,
        text="x",
        finish_reason="length",
        steps=len(tokens) - 1,
    )


class _OneGeneration:
    """A model-free engine: every request yields one chunk, then a 3-token generation."""

    def start(self, request, *, on_step=None):
        from elesium.inference.records import Chunk, Generation

        class Handle:
            result = None

            def __iter__(self):
                yield Chunk("x", (1, 2, 3))
                self.result = Generation(text="x", token_ids=(1, 2, 3), prompt_tokens=9,
                                         finish_reason="length", mode="vanilla", seed=1, elapsed_s=0.001)

            def close(self):
                pass

        return Handle()


def test_trace_spans_per_run_node_and_llm_call():
    """Spans are opened as the graph runs: run, then each node on its task thread, then its LLM call."""
    from langgraph.graph import END, START, StateGraph
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from typing_extensions import TypedDict

    from elesium.inference.types import CallTag, GenerationRequest, generate

    class State(TypedDict, total=False):
        x: int
        y: int

    exporter = InMemorySpanExporter()
    tracing = Tracing(model="smol", span_exporter=exporter)
    with tracing.run("triage", run_id="run-1", thread_id="thread-1") as trace:
        engine = trace.engine(_OneGeneration())

        def draft(state: State) -> State:
            generate(engine, GenerationRequest("hi", tag=CallTag("draft", 0)))
            return {"x": 1}

        builder = StateGraph(State)
        builder.add_node("draft", draft)
        builder.add_node("route", lambda state: {"y": 2})
        builder.add_edge(START, "draft")
        builder.add_edge("draft", "route")
        builder.add_edge("route", END)
        builder.compile().invoke({}, {"callbacks": trace.callbacks})
        trace.outcome("succeeded")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {
        "invoke_workflow triage",
        "langgraph.node draft",
        "langgraph.node route",
        "chat smol",
        "prefill",
        "decode",
    }
    chat = spans["chat smol"]
    assert spans["prefill"].parent.span_id == spans["decode"].parent.span_id == chat.context.span_id
    assert chat.attributes["gen_ai.operation.name"] == "chat"
    assert (
        chat.attributes["gen_ai.usage.input_tokens"] == 9
        and chat.attributes["gen_ai.usage.output_tokens"] == 3
    )
    assert (chat.attributes["elesium.call.node"], chat.attributes["elesium.call.index"]) == ("draft", 0)
    assert chat.parent.span_id == spans["langgraph.node draft"].context.span_id
    assert spans["langgraph.node draft"].parent.span_id == spans["invoke_workflow triage"].context.span_id
    assert spans["invoke_workflow triage"].attributes["elesium.run.status"] == "succeeded"
    assert Tracing("none").tracer is None


def test_compare_calls_and_values():
    rec = [_call("a", 0, [1, 2, 3]), _call("b", 0, [4])]
    assert compare_calls("r", rec, [_call("a", 0, [1, 2, 3]), _call("b", 0, [4])]) == (None, 4)
    div, _ = compare_calls("r", rec, [_call("a", 0, [1, 9, 3]), _call("b", 0, [4])])
    assert (div.node, div.call, div.step, div.field, div.recorded, div.replayed) == (
        "a",
        0,
        1,
        "token_ids",
        2,
        9,
    )
    div, _ = compare_calls("r", rec, [_call("a", 0, [1, 2])])
    assert div.field == "token_ids.length"
    div, _ = compare_calls("r", rec, [*rec, _call("c", 0, [5])])
    assert (div.node, div.field) == ("c", "path")
    assert first_difference({"x": {"y": [1, 2]}}, {"x": {"y": [1, 3]}}) == ("x.y[1]", 2, 3)
    assert first_difference({"x": 1}, {"x": 1, "z": 2}) == ("z", None, 2)
    assert first_difference([1], [1]) is None


async def test_run_channel_followers_see_every_event_from_the_start():
    channel = RunChannel()
    channel.publish("metadata", {"run_id": "r"})
    seen: list[str] = []

    async def follow() -> None:
        async for event, _ in channel.follow():
            seen.append(event)

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.01)
    await asyncio.to_thread(channel.publish, "values", {})
    await asyncio.to_thread(channel.close)
    await asyncio.wait_for(task, 2)
    assert seen == ["metadata", "values"] and channel.closed_at is not None
    late = [e async for e, _ in channel.follow()]
    assert late == ["metadata", "values"]
