"""Small workflows for the API tests: real LLM nodes on the real engine, an approval interrupt.

The shipped workflows (ticket-triage, expense-approval, incident-summary) are registered too.
``approval`` drafts a sentence (LLM), waits for a human at ``interrupt`` and finishes with the
decision; ``summary`` is one LLM node and ends. Token budgets are tiny so runs take well under a
second on the CPU. ``approval_changed`` is ``approval`` with another prompt: same name, new version
(the changed-workflow-version replay test).
"""

from __future__ import annotations

import operator
from typing import Annotated, Any

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt
from pydantic import BaseModel, Field

from elesium.graphs.llm import WorkflowState, call_llm, llm_node
from elesium.graphs.registry import Registry, Workflow
from elesium.inference.sampling import SamplingParams


class TopicIn(BaseModel):
    topic: str = Field(min_length=1, max_length=400)


class ApprovalState(WorkflowState, total=False):
    topic: str
    draft: str
    approved: bool
    approver_note: str
    final: str


class RelayState(WorkflowState, total=False):
    topic: str
    outline: str
    text: str


class SummaryState(WorkflowState, total=False):
    topic: str
    summary: str


def _approval_factory(prompt: str) -> Any:
    def factory() -> StateGraph:
        builder = StateGraph(ApprovalState)
        builder.add_node(llm_node("draft", prompt=prompt, output_key="draft", params={"max_tokens": 8}))

        def approve(state: ApprovalState) -> dict[str, Any]:
            decision = interrupt({"question": "approve this draft?", "draft": state.get("draft", "")})
            decision = decision if isinstance(decision, dict) else {"approved": bool(decision)}
            return {
                "approved": bool(decision.get("approved")),
                "approver_note": str(decision.get("note", "")),
            }

        def finish(state: ApprovalState) -> dict[str, Any]:
            verdict = "APPROVED" if state.get("approved") else "REJECTED"
            return {"final": f"{verdict}: {state.get('draft', '')}"}

        builder.add_node("approve", approve)
        builder.add_node("finish", finish)
        builder.add_edge(START, "draft")
        builder.add_edge("draft", "approve")
        builder.add_edge("approve", "finish")
        builder.add_edge("finish", END)
        return builder

    return factory


def _summary_factory() -> StateGraph:
    builder = StateGraph(SummaryState)
    builder.add_node(
        llm_node(
            "summarize",
            prompt="Say one short sentence about {topic}.",
            output_key="summary",
            params={"max_tokens": 8},
        )
    )
    builder.add_edge(START, "summarize")
    builder.add_edge("summarize", END)
    return builder


def approval(prompt: str = "Write one short sentence about {topic}.", name: str = "approval") -> Workflow:
    return Workflow.define(name, _approval_factory(prompt), TopicIn, description="draft, approve, finish")


def _story_factory() -> StateGraph:
    builder = StateGraph(SummaryState)
    builder.add_node(
        llm_node(
            "write",
            prompt="Tell a long story about {topic}.",
            output_key="summary",
            params={"max_tokens": 48},
        )
    )
    builder.add_edge(START, "write")
    builder.add_edge("write", END)
    return builder


def story() -> Workflow:
    """One longer generation (48 tokens): something to cancel or walk away from mid-way."""
    return Workflow.define("story", _story_factory, TopicIn, description="one long LLM call")


def _hurried_factory() -> StateGraph:
    builder = StateGraph(SummaryState)
    params = {"max_tokens": 400, "temperature": 0.7, "top_p": 0.95, "deadline_s": 3.0}
    builder.add_node(llm_node("write", prompt="Tell a very long story about {topic}.", output_key="summary",
                              params=params))
    builder.add_edge(START, "write")
    builder.add_edge("write", END)
    return builder


def hurried() -> Workflow:
    """One sampled call that its deadline (3 s) cuts long before its 400 tokens: replay must cut it at the
    recorded token, not at 3 s of its own."""
    return Workflow.define("hurried", _hurried_factory, TopicIn, description="one LLM call with a deadline")


def _relay_factory() -> StateGraph:
    builder = StateGraph(RelayState)
    builder.add_node(llm_node("outline", prompt="List three facts about {topic}.", output_key="outline",
                              params={"max_tokens": 24}))
    builder.add_node(llm_node("expand", prompt="Explain this: {outline}", output_key="text",
                              params={"max_tokens": 40}))
    builder.add_edge(START, "outline")
    builder.add_edge("outline", "expand")
    builder.add_edge("expand", END)
    return builder


def relay() -> Workflow:
    """Two LLM calls in two super-steps: a worker killed during the second resumes after the first."""
    return Workflow.define("relay", _relay_factory, TopicIn, description="two LLM calls in a row")


class LoopState(WorkflowState, total=False):
    topic: str
    notes: Annotated[list[str], operator.add]


def _loop_node(state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
    """One node that asks the model twice per visit, numbering its calls from the checkpointed state
    (as ``llm_node`` does): the case where a process-local call counter and the state disagree after a
    worker dies inside the node's second visit."""
    base = int((state.get("llm_calls") or {}).get("draft", 0))
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10)
    first = call_llm(config, node="draft", call_index=base, prompt=f"One fact about {state['topic']}.",
                     params=sampled)
    second = call_llm(config, node="draft", call_index=base + 1, prompt=f"Say more: {first.value}",
                      params=SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40))
    return {"notes": [first.value, second.value], "llm_calls": {"draft": 2}}


def _loop_factory() -> StateGraph:
    builder = StateGraph(LoopState)
    builder.add_node("draft", _loop_node)
    builder.add_edge(START, "draft")
    builder.add_conditional_edges("draft", lambda s: "draft" if len(s.get("notes") or []) < 4 else END)
    return builder


def loop() -> Workflow:
    """A node visited twice that calls the model twice per visit, sampled: four calls, indices 0..3."""
    return Workflow.define("loop", _loop_factory, TopicIn, description="two visits of a two-call node")


def summary() -> Workflow:
    return Workflow.define("summary", _summary_factory, TopicIn, description="one LLM call")


class EditableRegistry(Registry):
    """A registry a test can take a version out of: a deployment that no longer has the old code."""

    def drop(self, name: str, version: str) -> None:
        del self._by_name[name][version]
        if self._latest.get(name) == version:
            self._latest[name] = next(iter(self._by_name[name]))


def build_registry() -> EditableRegistry:
    from elesium.graphs.workflows import shipped

    registry = EditableRegistry()
    for workflow in (approval(), approval(name="approval-versioned"), summary(), story(), hurried(), relay(),
                     loop(),
                     *shipped()):
        registry.register(workflow)
    return registry


def make_worker_executor(args: Any, queue: Any) -> Any:
    """``elesium worker --executor api_workflows:make_worker_executor``: API runs of these workflows on
    the engine loaded as the tests' ``engine`` fixture loads it (the runs' fingerprints must match)."""
    from elesium.api.app import build_services
    from elesium.api.run_executor import ApiRunExecutor
    from elesium.api.settings import ApiSettings
    from elesium.inference.engine import Engine

    engine = Engine.load(device="cpu", dtype="float32", max_len=2048)
    return ApiRunExecutor(build_services(ApiSettings(redis_url=args.redis_url), engine, build_registry()))


def make_slow_worker_executor(args: Any, queue: Any) -> Any:
    """:func:`make_worker_executor` whose engine sleeps ``ELESIUM_TEST_STEP_DELAY`` seconds (worker
    environment) after each decode step: an LLM call lasts long enough for a test to kill the worker
    inside it. The sleep is in the step hook, after the step is decided, so no token, record or
    fingerprint changes."""
    import os
    import time

    executor = make_worker_executor(args, queue)
    engine = executor.svc.engine
    delay = float(os.environ.get("ELESIUM_TEST_STEP_DELAY", "0"))
    start = engine.start

    def slow_start(request: Any, *, on_step: Any = None) -> Any:
        def hook(record: Any) -> None:
            if on_step is not None:
                on_step(record)
            time.sleep(delay)

        return start(request, on_step=hook)

    engine.start = slow_start  # this worker's engine instance only
    return executor
