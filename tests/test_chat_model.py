"""``ChatElesium``: a LangChain chat model on the real engine, in LangChain and LangGraph code.

Checks what a LangChain user relies on: ``invoke`` matches ``Engine.generate`` token for token,
stop sequences and sampling settings are honoured, usage metadata counts tokens, streaming
callbacks see every token, ``with_structured_output`` returns a validated pydantic instance (by
constrained decoding), async invoke and stream work, and the model runs as a node of a plain
``StateGraph`` whose ``stream_mode="messages"`` carries the tokens.
"""

from __future__ import annotations

import asyncio
import operator
from typing import Annotated, Literal, TypedDict

import pydantic
import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph

from elesium.graphs.chat_model import ChatElesium, to_chat_messages
from elesium.inference.sampling import SamplingParams

PROMPT = "Name three colours of the rainbow."


class Triage(pydantic.BaseModel):
    category: Literal["billing", "technical", "account", "other"]
    priority: Literal["low", "medium", "high"]


class TokenRecorder(BaseCallbackHandler):
    """Collects ``on_llm_new_token`` calls, as a LangChain streaming UI would."""

    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


@pytest.fixture(scope="module")
def llm(engine) -> ChatElesium:
    return ChatElesium(engine=engine, max_tokens=24, mode="vanilla")


def test_invoke_matches_engine_and_reports_usage(engine, llm):
    message = llm.invoke([SystemMessage("You are brief."), HumanMessage(PROMPT)])
    direct = engine.generate([{"role": "system", "content": "You are brief."},
                              {"role": "user", "content": PROMPT}],
                             SamplingParams(max_tokens=24), mode="vanilla")
    assert isinstance(message, AIMessage)
    assert message.content == direct.text and message.content
    usage = message.usage_metadata
    assert usage["input_tokens"] == direct.prompt_tokens
    assert usage["output_tokens"] == direct.new_tokens
    assert usage["total_tokens"] == direct.prompt_tokens + direct.new_tokens
    assert message.response_metadata["finish_reason"] == direct.finish_reason
    assert message.response_metadata["mode"] == "vanilla"


def test_sampling_params_seed_and_stop(llm):
    hot = llm.bind(temperature=1.0, top_p=0.9, top_k=40, seed=11)
    a, b = hot.invoke(PROMPT), hot.invoke(PROMPT)
    assert a.content == b.content and a.response_metadata["seed"] == 11  # same seed, same answer
    c = llm.invoke(PROMPT, temperature=1.0, seed=12)
    assert c.response_metadata["seed"] == 12
    short = llm.invoke(PROMPT, max_tokens=3)
    assert short.usage_metadata["output_tokens"] <= 3 and short.response_metadata["finish_reason"] == "length"
    full = llm.invoke(PROMPT).content
    cut_at = full.split()[1]  # a word the greedy answer contains
    stopped = llm.invoke(PROMPT, stop=[cut_at])
    assert stopped.response_metadata["finish_reason"] == "stop"
    assert stopped.content == full[: full.index(cut_at)]
    with pytest.raises(ValueError, match="does not take"):
        llm.invoke(PROMPT, frequency_penalty=1.0)


def test_streaming_callbacks_receive_tokens(llm):
    recorder = TokenRecorder()
    chunks = list(llm.stream(PROMPT, config={"callbacks": [recorder]}))
    text = "".join(c.content for c in chunks)
    assert text == llm.invoke(PROMPT).content
    assert len([t for t in recorder.tokens if t]) >= 3 and "".join(recorder.tokens) == text
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert len(usage) == 1 and usage[0]["output_tokens"] > 0
    # ``streaming=True`` makes invoke stream too, so callbacks see tokens there as well.
    recorder2 = TokenRecorder()
    message = llm.model_copy(update={"streaming": True}).invoke(PROMPT, config={"callbacks": [recorder2]})
    assert message.content == text and "".join(recorder2.tokens) == text
    assert message.usage_metadata["output_tokens"] == usage[0]["output_tokens"]


def test_with_structured_output_returns_validated_model(llm):
    structured = llm.with_structured_output(Triage)
    result = structured.invoke("Classify this ticket as JSON. Ticket: 'I was charged twice, fix it now!'")
    assert isinstance(result, Triage)
    raw = llm.with_structured_output(Triage, include_raw=True).invoke("Classify: 'the app crashes on start'")
    assert isinstance(raw["parsed"], Triage) and raw["parsing_error"] is None
    assert Triage.model_validate_json(raw["raw"].content) == raw["parsed"]
    as_dict = llm.with_structured_output(Triage.model_json_schema()).invoke("Classify: 'cannot log in'")
    assert Triage.model_validate(as_dict)


def test_inside_a_plain_langgraph_graph(llm):
    class State(TypedDict):
        messages: Annotated[list[BaseMessage], operator.add]

    def chat(state: State) -> dict:
        return {"messages": [llm.invoke(state["messages"])]}

    graph = StateGraph(State)
    graph.add_node("chat", chat)
    graph.add_edge(START, "chat")
    graph.add_edge("chat", END)
    app = graph.compile()
    final = app.invoke({"messages": [HumanMessage(PROMPT)]})
    assert isinstance(final["messages"][-1], AIMessage) and final["messages"][-1].content
    # stream_mode="messages": LangGraph hands out the model's tokens as they are decoded.
    stream = app.stream({"messages": [HumanMessage(PROMPT)]}, stream_mode="messages")
    pieces = [chunk for chunk, meta in stream
              if meta.get("langgraph_node") == "chat" and isinstance(chunk, AIMessageChunk)]
    streamed = "".join(p.content for p in pieces)
    assert len([p for p in pieces if p.content]) >= 3 and streamed == final["messages"][-1].content


async def test_async_invoke_and_stream(llm):
    expected = llm.invoke(PROMPT).content
    message = await llm.ainvoke(PROMPT)
    assert message.content == expected
    chunks = [c async for c in llm.astream(PROMPT)]
    assert "".join(c.content for c in chunks) == expected and len(chunks) >= 3
    # Leaving the stream early frees the engine for the next call.
    async for _ in llm.astream(PROMPT):
        break
    again = await asyncio.wait_for(llm.ainvoke(PROMPT), timeout=300)
    assert again.content == expected
    structured = await llm.with_structured_output(Triage).ainvoke("Classify: 'refund my order'")
    assert isinstance(structured, Triage)


def test_message_conversion():
    chat = to_chat_messages([SystemMessage("s"), HumanMessage([{"type": "text", "text": "a"}, "b"]),
                             AIMessage("c")])
    assert chat == [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"},
                    {"role": "assistant", "content": "c"}]
    with pytest.raises(ValueError):
        to_chat_messages([])
