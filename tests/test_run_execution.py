"""The one run path (graphs/execution.py, issue 42): the engine as a run sees it, the checks every path
shares, and the catches that used to change what was recorded, each shown to surface now."""

from __future__ import annotations

import operator
import threading
from typing import Annotated, Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from elesium.graphs import execution as ex
from elesium.graphs.chat_model import ChatElesium
from elesium.inference.sampling import SamplingParams
from elesium.inference.types import CallTag, GenerationRequest, TextEngine, generate


def _request(engine: Any, text: str, *, tag: CallTag | None = None, max_tokens: int = 6) -> GenerationRequest:
    return GenerationRequest(text, SamplingParams(max_tokens=max_tokens), mode="vanilla", tag=tag)


def test_the_engine_and_the_run_engine_implement_the_public_interface(engine: Any) -> None:
    assert isinstance(engine, TextEngine)
    assert isinstance(ex.RunEngine(engine), TextEngine)


def test_a_tagged_call_is_recorded_under_its_tag_with_the_engines_tokens(engine: Any) -> None:
    seen: list[ex.LLMCall] = []
    run = ex.RunEngine(engine, on_call=seen.append)
    gen = generate(run, _request(engine, "Name a colour.", tag=CallTag("pick", 7)))
    alone = generate(engine, _request(engine, "Name a colour."))
    assert gen.token_ids == alone.token_ids
    assert [(c.node, c.call, tuple(c.token_ids)) for c in seen] == [("pick", 7, alone.token_ids)]
    assert run.calls == seen
    assert seen[0].prompt_sha256 == ex.prompt_digest(engine.encode_prompt("Name a colour."))


def test_recorded_mode_serves_the_record_and_a_call_it_lacks_is_a_divergence(engine: Any) -> None:
    live = ex.RunEngine(engine)
    first = generate(live, _request(engine, "Name a fruit.", tag=CallTag("n", 0)))
    replay = ex.RunEngine(engine, recorded=live.calls)
    served = generate(replay, _request(engine, "Name a fruit.", tag=CallTag("n", 0)))
    assert served.token_ids == first.token_ids
    with pytest.raises(ex.DivergenceError) as missing:
        replay.start(_request(engine, "Name a fruit.", tag=CallTag("n", 1)))
    assert (missing.value.divergence.node, missing.value.divergence.call) == ("n", 1)
    assert missing.value.divergence.field == "path"
    with pytest.raises(ex.DivergenceError) as other_prompt:
        ex.RunEngine(engine, recorded=live.calls).start(_request(engine, "Name a tree.", tag=CallTag("n", 0)))
    assert other_prompt.value.divergence.field == "prompt"


def test_cancel_closes_the_open_generation_and_stops_the_next(engine: Any) -> None:
    run = ex.RunEngine(engine)
    handle = run.start(_request(engine, "Write a long story about the sea.", tag=CallTag("s", 0),
                                max_tokens=200))
    chunks = iter(handle)
    next(chunks)
    run.cancel()
    with pytest.raises(ex.RunCancelled):
        for _ in chunks:
            pass
    assert run.calls == []  # a cancelled call is not recorded as finished
    assert not engine.busy  # the engine was released
    with pytest.raises(ex.RunCancelled):
        run.start(_request(engine, "Hello.", tag=CallTag("s", 1)))


class _Loop(TypedDict, total=False):
    topic: str
    notes: Annotated[list[str], operator.add]


def test_an_untagged_call_is_numbered_from_its_super_step_not_a_process_counter(engine: Any) -> None:
    """ChatElesium inside a node has no state counter: its index is (super-step, order in the task), which
    a resumed run reproduces."""
    run = ex.RunEngine(engine)

    def ask(state: _Loop) -> dict[str, Any]:
        llm = ChatElesium(engine=run, max_tokens=4, mode="vanilla")
        return {"notes": [llm.invoke("Hi").content, llm.invoke("Bye").content]}

    builder = StateGraph(_Loop)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_conditional_edges("ask", lambda s: "ask" if len(s["notes"]) < 4 else END)
    builder.compile().invoke({"topic": "x", "notes": []})
    stride = ex.UNTAGGED_STEP_STRIDE
    assert [(c.node, c.call) for c in run.calls] == [("ask", stride), ("ask", stride + 1),
                                                     ("ask", 2 * stride), ("ask", 2 * stride + 1)]


def test_a_failure_to_read_the_graph_position_surfaces_instead_of_keying_calls_by_question_mark(
        engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: any exception -> node "?", which then keyed the recorded call. Only "not in a graph" is "?"."""
    import langgraph.config

    def broken() -> Any:
        raise KeyError("configurable")

    monkeypatch.setattr(langgraph.config, "get_config", broken)
    with pytest.raises(KeyError):
        ex.RunEngine(engine).start(_request(engine, "Hi."))


def test_outside_a_graph_an_untagged_call_is_node_question_mark(engine: Any) -> None:
    run = ex.RunEngine(engine)
    generate(run, _request(engine, "Hi."))
    assert [(c.node, c.call) for c in run.calls] == [("?", 0)]


class _Unreadable:
    def get(self, run_id: str) -> Any:
        raise ConnectionError("registry down")


class _Record:
    def __init__(self, calibrations: dict[str, str]) -> None:
        self.calibrations = calibrations


class _Registry:
    def __init__(self, record: _Record | None) -> None:
        self.record = record

    def get(self, run_id: str) -> _Record | None:
        return self.record


def test_an_unreadable_run_registry_fails_the_attempt_instead_of_using_current_calibrations() -> None:
    """Was: logged, and the retried attempt went on with current calibrations (other trees, so other
    sampled tokens than the attempt it continues)."""
    with pytest.raises(ConnectionError):
        ex.recorded_calibrations(_Unreadable(), "r1")
    assert ex.recorded_calibrations(_Registry(_Record({"pick": "v2"})), "r1") == {"pick": "v2"}
    assert ex.recorded_calibrations(_Registry(None), "r1") == {}
    assert ex.recorded_calibrations(None, "r1") == {}


def test_check_engine_names_what_differs(engine: Any) -> None:
    recorded = engine.fingerprint("vanilla")
    ex.check_engine(engine, recorded, "vanilla", what="run r")
    ex.check_engine(engine, {}, "vanilla", what="run r")  # recorded before fingerprints: passes
    with pytest.raises(ex.EngineMismatchError) as err:
        ex.check_engine(engine, {**recorded, "dtype": "bfloat16"}, "vanilla", what="run r")
    assert err.value.differing == ["dtype"] and "dtype" in str(err.value)


class _FailingLearner:
    learn = True

    def __init__(self) -> None:
        self.called = threading.Event()

    def fold_run(self, workflow: str, run_id: str) -> None:
        self.called.set()
        raise RuntimeError("store down")


def test_learning_never_fails_the_run() -> None:
    learner = _FailingLearner()
    ex.learn(learner, "wf", "r1")
    assert learner.called.is_set()
