"""Summarise a review in a few words: a plain LangGraph graph whose node calls ChatElesium.

Nothing Elesium-specific but the chat model: a TypedDict state, a node, a compiled graph. Served from
``langgraph.json``, the model decodes on the server's engine (``get_run_context(config).engine``: the
run's recording engine), so each call gets a seed derived from the run seed, acceptance-log entries,
and an identical re-execution replay, like an ``llm_node``.
"""

import os
from typing import TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from elesium.graphs import get_run_context
from elesium.graphs.chat_model import ChatElesium

MAX_TOKENS = int(os.environ.get("REVIEW_SUMMARY_MAX_TOKENS", "32"))  # from langgraph.json's "env"


class SummaryState(TypedDict, total=False):
    product: str
    text: str
    summary: str
    words: int


def summarise(state: SummaryState, config: RunnableConfig) -> dict:
    llm = ChatElesium(engine=get_run_context(config).engine, temperature=0.7, max_tokens=MAX_TOKENS)
    answer = llm.invoke([("system", "You summarise customer reviews in a few words."),
                         ("user", f"Review of a {state['product']}: {state['text']}\nSummary:")])
    return {"summary": answer.content.strip()}


def count_words(state: SummaryState) -> dict:  # a rule: code, not the model
    return {"words": len(state["summary"].split())}


builder = StateGraph(SummaryState)
builder.add_node("summarise", summarise)
builder.add_node("count_words", count_words)
builder.add_edge(START, "summarise")
builder.add_edge("summarise", "count_words")
builder.add_edge("count_words", END)
graph = builder.compile()
