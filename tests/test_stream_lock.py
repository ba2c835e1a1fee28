"""A stream owns the engine only while it runs: leaving it in any way frees the engine at once, the
caller's code never runs in inference mode, and queued generations run in arrival order."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from elesium.inference.sampling import SamplingParams

PROMPT = "List the planets of the solar system."
OTHER = "Name three colours."
TIMEOUT_S = 120  # generous for a loaded 2-core CI machine; a deadlock never finishes at all


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, list]:
    box: list = []

    def target() -> None:
        try:
            box.append(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def wait_for(condition, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n)


def test_break_after_three_chunks_frees_the_engine_for_this_and_other_threads(engine):
    stream = engine.stream(PROMPT, greedy(24), mode="vanilla")
    seen: list[int] = []
    for i, chunk in enumerate(stream):
        seen.extend(chunk.token_ids)
        if i == 2:
            break
    # Freed at once, although `stream` is still referenced here.
    assert stream.state == "closed" and not engine.busy
    with pytest.raises(RuntimeError, match="closed before it finished"):
        stream.result

    start = time.monotonic()
    again = engine.generate(PROMPT, greedy(len(seen)), mode="vanilla")  # same thread
    assert time.monotonic() - start < TIMEOUT_S
    assert list(again.token_ids) == seen  # the abandoned run left nothing behind in the cache

    thread, box = in_thread(engine.generate, PROMPT, greedy(len(seen)), mode="vanilla")
    thread.join(TIMEOUT_S)
    assert not thread.is_alive(), "generate on another thread deadlocked"
    assert list(box[0].token_ids) == seen


def test_caller_code_runs_outside_inference_mode(engine):
    modes_in_callback: list[bool] = []
    stream = engine.stream(PROMPT, greedy(4), mode="vanilla",
                           on_step=lambda record: modes_in_callback.append(torch.is_inference_mode_enabled()))
    body_modes = [torch.is_inference_mode_enabled() for _ in stream]
    assert body_modes and not any(body_modes)
    assert modes_in_callback and not any(modes_in_callback)
    assert stream.state == "done" and stream.result.new_tokens == 4 and not engine.busy


def test_dropped_stream_is_released_by_garbage_collection(engine):
    stream = engine.stream(PROMPT, greedy(24), mode="vanilla")
    next(stream)  # advanced without a for loop: only dropping the stream itself can free it
    assert engine.busy
    del stream
    assert not engine.busy
    assert engine.generate(OTHER, greedy(2), mode="vanilla").new_tokens == 2


def test_close_context_manager_and_exceptions_release(engine):
    with engine.stream(PROMPT, greedy(24), mode="vanilla") as stream:
        next(stream)
        assert engine.busy
    assert stream.state == "closed" and not engine.busy

    stream = engine.stream(PROMPT, greedy(24), mode="vanilla")
    with pytest.raises(KeyError):
        for _ in stream:
            raise KeyError("the caller's own bug")
    assert stream.state == "closed" and not engine.busy


def test_close_from_another_thread_stops_after_the_current_step(engine):
    stream = engine.stream(PROMPT, greedy(48), mode="vanilla")
    closed_in: list[float] = []

    def on_step(record) -> None:
        # Runs on the owner's thread inside next(): the owner is busy in the step right now.
        if record.step == 1 and not closed_in:
            thread, _ = in_thread(stream.close)
            start = time.monotonic()
            thread.join(TIMEOUT_S)
            closed_in.append(time.monotonic() - start)
            assert engine.busy  # the step is not over: the cache still belongs to this run

    stream._run.on_step = on_step
    chunks = list(stream)
    assert closed_in and closed_in[0] < 5  # close() does not wait for the step
    assert sum(len(c.token_ids) for c in chunks) <= 2  # prefill + step 0; step 1's output is dropped
    assert stream.state == "closed" and not engine.busy


def test_closing_a_queued_stream_takes_it_out_of_the_queue(engine):
    owner = engine.stream(PROMPT, greedy(24), mode="vanilla")
    next(owner)
    queued = engine.stream(OTHER, greedy(8), mode="vanilla")
    thread, box = in_thread(lambda: [c.text for c in queued])
    wait_for(lambda: engine.waiting == 1)
    queued.close()
    thread.join(TIMEOUT_S)
    assert not thread.is_alive() and box == [[]] and queued.state == "closed"
    assert engine.waiting == 0 and engine.busy  # the owner still holds the engine
    owner.close()
    assert not engine.busy


def test_concurrent_generations_run_in_arrival_order_with_sequential_outputs(engine):
    prompts = ["Name three colours.", "Say hello in French.", "What is 2 + 2?"]
    sequential = [engine.generate(p, greedy(4), mode="vanilla").token_ids for p in prompts[1:]]

    finished: list[int] = []
    owner = engine.stream(prompts[0], greedy(4), mode="vanilla")
    next(owner)  # holds the engine while the others queue up
    threads = []
    for i, prompt in enumerate(prompts[1:], start=1):
        def job(prompt=prompt, i=i):
            result = engine.generate(prompt, greedy(4), mode="vanilla")
            finished.append(i)
            return result
        threads.append(in_thread(job))
        wait_for(lambda i=i: engine.waiting == i)
    rest = list(owner)
    assert owner.state == "done" and owner.result.new_tokens == 4 and rest
    for thread, _ in threads:
        thread.join(TIMEOUT_S)
        assert not thread.is_alive()
    assert finished == [1, 2]
    assert [box[0].token_ids for _, box in threads] == sequential
    assert not engine.busy
