"""Deadlines (issue 38, item 1): ``SamplingParams.deadline_s`` ends a generation at the first step boundary
after it with the tokens it has, a generation still queued leaves the queue at its deadline, and a run's
record keeps where the cut fell, so re-executing the run cuts at the same token however fast the machine.

On the real model: what a cut keeps is a prefix of what the model decodes without one, so the tokens are
the model's, in both modes, alone on the engine and inside the step loop.
"""

from __future__ import annotations

import threading
import time

import pytest

from elesium.graphs.execution import RunEngine
from elesium.inference.batcher import Batcher
from elesium.inference.sampling import SamplingParams
from elesium.inference.types import CallTag, GenerationRequest, generate

pytest_plugins = ["state_fixtures", "api_server"]

PROMPT = "Write a long story about a lighthouse keeper and the storm that changed his life."


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_deadline_is_a_positive_number_of_seconds(bad):
    with pytest.raises(ValueError, match="deadline_s"):
        SamplingParams(deadline_s=bad)


def _cut_after_some_tokens(engine, mode: str, deadline_s: float) -> tuple[list[int], object]:
    """Consume a stream until it has a few tokens, then stop asking until its deadline has passed."""
    stream = engine.stream(PROMPT, SamplingParams(max_tokens=48, deadline_s=deadline_s), mode=mode)
    seen: list[int] = []
    for chunk in stream:
        seen.extend(chunk.token_ids)
        if len(seen) >= 4:
            break_at = stream._run.deadline  # sleep past it: the next ask finds it passed
            time.sleep(max(0.0, break_at - time.perf_counter()) + 0.01)
            seen.extend(t for c in stream for t in c.token_ids)  # chunks already final, then the cut
            break
    return seen, stream


@pytest.mark.parametrize("mode", ["vanilla", "speculative"])
def test_a_deadline_cuts_at_a_step_boundary_keeping_the_models_tokens(engine, mode):
    if mode not in engine.modes:
        pytest.fail(f"the bundled engine should offer {mode} (shipped heads)")
    full = engine.generate(PROMPT, SamplingParams(max_tokens=48), mode=mode).token_ids
    seen, stream = _cut_after_some_tokens(engine, mode, deadline_s=8.0)
    result = stream.result
    assert result.finish_reason == "deadline"
    assert list(result.token_ids) == seen
    assert 4 <= len(seen) < len(full)
    assert tuple(seen) == full[:len(seen)]
    assert not engine.busy  # the gate is free for the next generation


def test_a_generation_queued_past_its_deadline_leaves_the_queue(engine):
    """Alone on the engine (its FIFO gate): the second generation waits behind the first, and at its
    deadline it ends with no tokens and leaves the queue, while the first still runs."""
    first = engine.stream(PROMPT, SamplingParams(max_tokens=48), mode="vanilla")
    it = iter(first)
    next(it)  # holds the engine
    started = time.perf_counter()
    queued = generate(engine, GenerationRequest(PROMPT, SamplingParams(max_tokens=8, deadline_s=0.3),
                                                mode="vanilla"))
    waited = time.perf_counter() - started
    assert queued.finish_reason == "deadline" and queued.token_ids == () and queued.text == ""
    assert 0.3 <= waited < 5.0
    assert engine.waiting == 0 and first.state == "running"
    first.close()
    assert not engine.busy


def test_inside_the_step_loop_a_deadline_frees_the_slot(engine):
    """With a batcher of one slot: a queued generation leaves at its deadline (woken by it, not by a
    freed slot), and a running one cut by its deadline gives its slot back at once."""
    saved = engine.batcher
    engine.batcher = batcher = Batcher(engine, 1, compiled=False)
    try:
        holder = engine.stream(PROMPT, SamplingParams(max_tokens=48, deadline_s=3.0), mode="vanilla")
        it = iter(holder)
        next(it)
        assert batcher.running == 1
        out: dict[str, object] = {}

        def wait_in_queue() -> None:
            params = SamplingParams(max_tokens=8, deadline_s=0.3)
            out["gen"] = generate(engine, GenerationRequest(PROMPT, params, mode="vanilla"))

        t = threading.Thread(target=wait_in_queue)
        started = time.perf_counter()
        t.start()
        t.join(10)
        waited = time.perf_counter() - started
        queued = out["gen"]
        assert queued.finish_reason == "deadline" and queued.token_ids == ()  # type: ignore[attr-defined]
        assert 0.3 <= waited < 5.0
        assert batcher.waiting == 0 and batcher.running == 1 and holder.state == "running"

        time.sleep(max(0.0, holder._run.deadline - time.perf_counter()) + 0.01)
        rest = [t for c in it for t in c.token_ids]
        assert holder.result.finish_reason == "deadline"
        assert len(holder.result.token_ids) >= 1 + len(rest)
        assert batcher.running == 0  # the slot is free for the next admission
        full = engine.generate(PROMPT, SamplingParams(max_tokens=48), mode="vanilla").token_ids
        assert holder.result.token_ids == full[:len(holder.result.token_ids)]
    finally:
        engine.batcher = saved


def test_re_execution_cuts_where_the_record_did(engine):
    """A call its deadline cut is re-executed up to the recorded length (``RunEngine(cuts=...)``), so the
    replay reproduces it token for token and says "deadline" again; one cut before its first token is
    served from the record; a call whose prompt changed is decoded as asked."""
    recorded = []
    tap = RunEngine(engine, on_call=recorded.append)
    params = SamplingParams(max_tokens=48, temperature=0.7, seed=11, deadline_s=8.0)
    handle = tap.start(GenerationRequest(PROMPT, params, mode="vanilla", tag=CallTag("write", 0)))
    seen: list[int] = []
    for chunk in handle:
        seen.extend(chunk.token_ids)
        if len(seen) >= 5:
            inner = handle.inner._run  # type: ignore[attr-defined]
            time.sleep(max(0.0, inner.deadline - time.perf_counter()) + 0.01)
    (call,) = recorded
    assert call.finish_reason == "deadline" and call.token_ids == seen and len(seen) < 48

    replayed = []
    again = RunEngine(engine, on_call=replayed.append, cuts=recorded)
    gen = generate(again, GenerationRequest(PROMPT, params, mode="vanilla", tag=CallTag("write", 0)))
    assert gen.finish_reason == "deadline"
    assert list(gen.token_ids) == call.token_ids and replayed[0].token_ids == call.token_ids

    empty = call.model_copy(update={"token_ids": [], "text": ""})
    served = generate(RunEngine(engine, cuts=[empty]),
                      GenerationRequest(PROMPT, params, mode="vanilla", tag=CallTag("write", 0)))
    assert served.finish_reason == "deadline" and served.token_ids == ()

    other = generate(RunEngine(engine, cuts=recorded),
                     GenerationRequest(PROMPT + " Make it sad.", params.__class__(max_tokens=3, seed=11),
                                       mode="vanilla", tag=CallTag("write", 0)))
    assert other.finish_reason == "length" and len(other.token_ids) == 3


def test_the_api_answers_a_cut_completion_as_length_and_refuses_a_bad_deadline(api_server):
    from api_server import KEY_A

    with api_server.http(KEY_A) as h:
        body = {"model": "elesium", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 64}
        r = h.post("/v1/chat/completions", json={**body, "deadline_s": 1e-6})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
        assert r.json()["usage"]["completion_tokens"] == 0
        for bad in (0, -1, "soon"):
            r = h.post("/v1/chat/completions", json={**body, "deadline_s": bad})
            assert r.status_code == 422 and "deadline_s" in r.text, r.text


def test_a_workflow_call_cut_by_its_deadline_replays_identical(api_server):
    """Through the API: the ``hurried`` workflow's call (400 tokens asked, 3 s allowed) waits 1.5 s behind
    another generation and is cut by its deadline; replay, on an idle engine, re-executes it to the
    recorded token, not to 3 s of its own (which would decode about twice as many), and says identical,
    re-executed and from the record."""
    from langgraph_sdk import get_sync_client

    from api_server import KEY_A

    engine = api_server.services.engine
    client = get_sync_client(url=api_server.url, api_key=KEY_A)
    tid = client.threads.create()["thread_id"]
    holder = engine.stream(PROMPT, SamplingParams(max_tokens=48), mode="vanilla")
    it = iter(holder)
    next(it)  # holds the engine while the run's call waits
    seeded = {"configurable": {"run_seed": 3}}
    waiter = threading.Thread(target=client.runs.wait, args=(tid, "hurried"),
                              kwargs={"input": {"topic": "a lighthouse"}, "config": seeded})
    waiter.start()
    time.sleep(1.5)
    holder.close()
    waiter.join(60)
    (run,) = client.runs.list(tid)
    assert run["status"] == "success"
    (call,) = api_server.services.store.calls(run["run_id"])
    assert call["finish_reason"] == "deadline" and 1 <= len(call["token_ids"]) < 400
    with api_server.http(KEY_A) as h:
        for mode in ("reexecute", "recorded"):
            r = h.post(f"/threads/{tid}/runs/{run['run_id']}/replay", json={"mode": mode})
            assert r.status_code == 200, r.text
            report = r.json()
            assert report["verdict"] == "identical", report["divergence"]
            assert report["tokens_compared"] == len(call["token_ids"])


def test_chat_elesium_takes_a_deadline(engine):
    from elesium.graphs.chat_model import ChatElesium

    llm = ChatElesium(engine=engine, max_tokens=32, deadline_s=1e-6)
    message = llm.invoke("Tell me about the sea.")
    assert message.response_metadata["finish_reason"] == "deadline" and message.content == ""
    unhurried = llm.invoke("Tell me about the sea.", deadline_s=600.0)
    assert unhurried.response_metadata["finish_reason"] in ("eos", "length") and unhurried.content
