"""Batched serving (issue 38): many generations share each decoding step, and each gets exactly the tokens
it gets alone.

The batched forward is held to the one-sequence step bit for bit (eager against eager on a small random
model, compiled against compiled on the real model); the engine's step loop is held to the engine without
a batcher on 16 prompts of mixed lengths that join at staggered steps, greedy and seeded, vanilla and
speculative; a closed generation leaves at the next step and frees its slot.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import types
from typing import Any

import pytest
import torch

from elesium.config import Settings
from elesium.errors import SettingsError
from elesium.inference.batcher import EngineBusyError
from elesium.inference.engine import resolve_max_batch
from elesium.inference.runtime.batched_step import BatchedCpuStep, batched_decode_forward
from elesium.inference.runtime.cpu_step import step_forward, window_for
from elesium.inference.runtime.slot_pool import SlotPool
from elesium.inference.sampling import SamplingParams
from helpers import rowwise_tiny_model


def test_batched_forward_rows_equal_the_one_sequence_step_eagerly():
    """Reference check on random inputs: each row of one batched forward against ``step_forward`` on
    that sequence alone (its own cache, its own window), bit for bit, for random offsets and slot subsets."""
    model = rowwise_tiny_model()
    pool = SlotPool(model.config, 6, 256, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(1)
    for s in range(6):
        pool.reserve(s, 256)
        pool.k[s].copy_(torch.randn(pool.k[s].shape, generator=gen))
        pool.v[s].copy_(torch.randn(pool.v[s].shape, generator=gen))
    with torch.inference_mode():
        for trial in range(6):
            b = 2 + trial % 5
            slots = torch.randperm(6, generator=gen)[:b]
            offsets = torch.randint(0, 240, (b,), generator=gen)
            tokens = torch.randint(0, 40, (b, 1), generator=gen)
            width = window_for(int(offsets.max()) + 1, 256)
            logits, greedy, keys, values = batched_decode_forward(
                model, tokens, offsets, slots, pool.k[:, :, 0, :, :width], pool.v[:, :, 0, :, :width])
            for row in range(b):
                s, off = int(slots[row]), int(offsets[row])
                own = window_for(off + 1, 256)  # the window the sequence reads alone: narrower
                cache = pool.cache(s)
                _, solo_logits, solo_greedy, solo_k, solo_v = step_forward(
                    model, tokens[row:row + 1], torch.tensor([off]), torch.tensor(off),
                    cache.k[:, :, :, :own], cache.v[:, :, :, :own], model.causal(1))
                assert torch.equal(logits[row], solo_logits[0, 0]), (trial, row)
                assert int(greedy[row]) == int(solo_greedy[0, 0])
                assert torch.equal(keys[:, row], solo_k[:, 0]) and torch.equal(values[:, row], solo_v[:, 0])


def test_batched_step_writes_each_rows_keys_at_its_own_slot_and_offset():
    model = rowwise_tiny_model()
    pool = SlotPool(model.config, 4, 256, torch.device("cpu"), torch.float32)
    for s in range(4):
        pool.reserve(s, 256)
    before_k = pool.k.clone()
    step = BatchedCpuStep(model, pool, compiled=False)
    step.decode([5, 7, 9], [10, 0, 42], [3, 1, 2])
    changed = (pool.k != before_k).any(dim=(1, 2, 3, 5)).nonzero().tolist()  # [slot, position]
    assert sorted(changed) == [[1, 0], [2, 42], [3, 10]]
    with pytest.raises(ValueError, match="2 or more rows"):
        step.decode([5], [3], [0])


def test_slot_pool_zeroes_positions_on_first_use_only():
    model = rowwise_tiny_model()
    pool = SlotPool(model.config, 2, 256, torch.device("cpu"), torch.float32)
    pool.reserve(0, 40)
    assert not pool.k[0, :, :, :, :40].any()
    pool.k[0, :, :, :, :40] = 1.0
    pool.reserve(0, 30)  # already zeroed: never zeroed again (that would erase a running sequence)
    assert bool((pool.k[0, :, :, :, :40] == 1.0).all())
    pool.reserve(0, 64)
    assert not pool.k[0, :, :, :, 40:64].any() and bool((pool.k[0, :, :, :, :40] == 1.0).all())


# -- the real model, compiled -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def batched(default_engine):
    """The default engine with its batched step compiled (Engine.warm_up, as ``elesium serve`` does)."""
    if default_engine.batcher is None:
        pytest.fail("the default CPU engine should batch (compiled step, ELESIUM_MAX_BATCH auto)")
    default_engine.warm_up()
    return default_engine


def test_compiled_batched_rows_equal_the_compiled_one_sequence_step(batched, mt_bench_prompts):
    """The graphs that serve: each row of the compiled batched step against the compiled one-token step
    the engine runs for a sequence alone, bit for bit, with contexts of different lengths side by side."""
    engine, batcher = batched, batched.batcher
    pool, runner = batcher.pool, engine.runner
    prompts = [engine.encode_prompt(p)[: 20 + 37 * i] for i, p in enumerate(mt_bench_prompts[:5])]
    slots = [0, 3, 1, 4, 2]
    solo: list[torch.Tensor] = []
    with torch.inference_mode():
        for slot, ids in zip(slots, prompts, strict=True):
            pool.reserve(slot, window_for(len(ids) + 512, pool.max_len))
            runner.cache = pool.cache(slot)
            try:
                runner.prefill(ids)
                solo.append(runner.decode([ids[-1]], [len(ids)], len(ids)).logits[0].clone())
            finally:
                runner.cache = engine.cache
    assert batcher._step is not None
    for subset in ([0, 1], [0, 1, 2, 3, 4], [4, 2, 0]):
        logits, greedy = batcher._step.decode([prompts[i][-1] for i in subset],
                                              [len(prompts[i]) for i in subset], [slots[i] for i in subset])
        for row, i in enumerate(subset):
            assert torch.equal(logits[row], solo[i]), (subset, i)
            assert int(greedy[row]) == int(solo[i].argmax())


CASES = [("vanilla", None), ("vanilla", 0.7), ("speculative", None), ("speculative", 0.7)]


def _params(i: int) -> tuple[str, SamplingParams]:
    mode, temperature = CASES[i % len(CASES)]
    if temperature is None:
        return mode, SamplingParams(max_tokens=20, temperature=0.0)
    return mode, SamplingParams(max_tokens=20, temperature=temperature, top_p=0.95, seed=1000 + i)


def test_sixteen_staggered_generations_get_their_solo_tokens(batched, mt_bench_prompts):
    """16 prompts of mixed lengths, greedy and seeded T = 0.7, vanilla and speculative, each joining a few
    steps after the one before: every generation's tokens equal the ones it gets from the engine with no
    batcher at all (one generation at a time on its own cache, as before batching)."""
    engine, batcher = batched, batched.batcher
    if "speculative" not in engine.modes:
        pytest.fail("the default engine should load its shipped heads (speculative mode)")
    prompts = [p[: 40 + 61 * (i % 7)] for i, p in enumerate(mt_bench_prompts[:16])]
    engine.batcher = None
    try:
        solo = [engine.generate(p, _params(i)[1], mode=_params(i)[0]).token_ids
                for i, p in enumerate(prompts)]
    finally:
        engine.batcher = batcher
    steps_before, largest_before = batcher.batched_steps, batcher.largest_batch
    batcher.largest_batch = 0
    got: dict[int, tuple[int, ...]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            deadline = time.monotonic() + 120
            while batcher.batched_steps + batcher.solo_steps < base + 2 * i and time.monotonic() < deadline:
                time.sleep(0.001)  # join at a later step than the one before
            mode, params = _params(i)
            got[i] = engine.generate(prompts[i], params, mode=mode).token_ids
        except BaseException as exc:  # reported below
            errors.append(exc)

    base = batcher.batched_steps + batcher.solo_steps
    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert batcher.batched_steps > steps_before and batcher.largest_batch >= 4, "they did not batch"
    batcher.largest_batch = max(batcher.largest_batch, largest_before)
    for i in range(16):
        assert got[i] == solo[i], (i, _params(i))
    assert batcher.running == 0 and batcher.waiting == 0


def test_a_closed_generation_leaves_at_the_next_step(batched, mt_bench_prompts):
    """Close one of three running generations from another thread while the step loop runs: its slot is
    free within one step, and the other two still get their solo tokens."""
    engine, batcher = batched, batched.batcher
    params = SamplingParams(max_tokens=40, temperature=0.0)
    prompts = mt_bench_prompts[20:23]
    engine.batcher = None
    try:
        solo = [engine.generate(p, params, mode="vanilla").token_ids for p in prompts[1:]]
    finally:
        engine.batcher = batcher
    streams = [engine.stream(p, params, mode="vanilla") for p in prompts]
    got: dict[int, tuple[int, ...]] = {}
    seen = collections.Counter()

    def consume(i: int) -> None:
        with streams[i] as stream:
            for chunk in stream:
                seen[i] += len(chunk.token_ids)
            if i:
                got[i] = stream.result.token_ids

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while seen[0] < 5 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert batcher.running == 3
    steps_at_close = batcher.batched_steps + batcher.solo_steps
    streams[0].close()
    while streams[0].state != "closed" and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert streams[0].state == "closed"
    assert batcher.batched_steps + batcher.solo_steps - steps_at_close <= 1
    assert batcher.running <= 2
    for t in threads:
        t.join(120)
    assert seen[0] < 40 and [got[1], got[2]] == solo
    assert batcher.running == 0


def test_hidden_states_run_on_the_step_loop_between_steps(batched, mt_bench_prompts):
    """A probe's forward (``hidden_states``) while generations decode: the same tensor as with the engine
    idle, and it runs on the loop's thread, not beside it."""
    engine = batched
    ids = engine.encode_prompt(mt_bench_prompts[30])[:80]
    alone = engine.hidden_states(ids, [0, 12, 30])
    params = SamplingParams(max_tokens=30, temperature=0.0)
    stream = engine.stream(mt_bench_prompts[31], params, mode="vanilla")
    with stream:
        next(stream)
        beside = engine.hidden_states(ids, [0, 12, 30])
    assert torch.equal(alone, beside)


def test_a_full_queue_refuses_new_generations(batched):
    batcher = batched.batcher
    kept = batcher.max_waiting
    batcher.max_waiting = 0
    try:
        with pytest.raises(EngineBusyError, match="retry later"):
            batched.stream("Hello", SamplingParams(max_tokens=2))
    finally:
        batcher.max_waiting = kept


def test_only_the_compiled_cpu_step_batches(engine, batched, caplog):
    """The float32 reference engine (eager SDPA steps) has no batched twin that equals its one-sequence
    step, so it serves one generation at a time, and says so when a batch was asked for; ``max_batch``
    sizes the compiled step's batch."""
    assert engine.batcher is None and batched.batcher is not None
    with caplog.at_level(logging.WARNING, logger="elesium"):
        assert resolve_max_batch("auto", engine.runner) == 1
        assert not caplog.records
        assert resolve_max_batch("8", engine.runner) == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"max_batch 8 not applied: the {type(engine.runner).__name__} steps one sequence at a time (no "
        "batched twin of its step); this engine serves one generation at a time"]
    assert resolve_max_batch("auto", batched.runner) == 16 and resolve_max_batch("3", batched.runner) == 3
    assert resolve_max_batch("1", batched.runner) == 1  # 1: no batcher, the gate as before
    with pytest.raises(SettingsError, match="ELESIUM_MAX_BATCH"):
        Settings(max_batch="0")


def test_hidden_states_cut_at_the_deepest_layer_and_remembered(engine, mt_bench_prompts):
    """Cutting the forward after the deepest block asked for changes no bit of the states asked for, and
    a repeated question is answered from the memo with an equal tensor the caller may change freely."""
    ids = engine.encode_prompt(mt_bench_prompts[40])[:60]
    with torch.inference_mode():
        cache = engine.model.new_cache(len(ids))
        collected: list[torch.Tensor] = []
        engine.model(torch.tensor([ids]), torch.arange(len(ids)), cache, 0, collect=collected)
        full = torch.stack([collected[i][0].float() for i in (3, 12)])
    misses, hits = engine.hidden_memo_misses, engine.hidden_memo_hits
    first = engine.hidden_states(ids, [3, 12])
    assert torch.equal(first, full)
    again = engine.hidden_states(ids, [3, 12])
    assert torch.equal(again, full)
    again.zero_()
    assert torch.equal(engine.hidden_states(ids, [3, 12]), full)
    assert (engine.hidden_memo_misses, engine.hidden_memo_hits) == (misses + 1, hits + 2)


def test_batched_rows_sample_the_base_models_distribution():
    """χ² of the batched sampler: rows of one batched forward, each finished by its own decoder with its
    own seed (``VanillaDecoder.take``, what the step loop calls), sample exactly the target distribution
    (temperature 0.8, top-p 0.9) of the logits the sequence has alone."""
    from elesium.inference.decoding.vanilla import VanillaDecoder
    from elesium.inference.sampling import Sampler, target_probs
    from spec_harness import chi_square_p

    model = rowwise_tiny_model(3)
    pool = SlotPool(model.config, 8, 256, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(5)
    context_k = torch.randn(pool.k[0].shape, generator=gen)
    context_v = torch.randn(pool.v[0].shape, generator=gen)
    for s in range(8):
        pool.reserve(s, 256)
        pool.k[s].copy_(context_k)
        pool.v[s].copy_(context_v)
    step = BatchedCpuStep(model, pool, compiled=False)
    params = SamplingParams(max_tokens=1000, temperature=0.8, top_p=0.9)
    decoders = [VanillaDecoder(None, params, Sampler(100 + s)) for s in range(8)]  # type: ignore[arg-type]
    counts: dict[int, int] = {}
    alone = None
    with torch.inference_mode():
        for _ in range(300):
            logits, greedy = step.decode([7] * 8, [30] * 8, list(range(8)))  # the same context every time
            for b, decoder in enumerate(decoders):
                token = decoder.take(logits[b], int(greedy[b]), 0.0)[0][0]
                counts[token] = counts.get(token, 0) + 1
        cache = pool.cache(0)
        alone = step_forward(model, torch.tensor([[7]]), torch.tensor([30]), torch.tensor(30),
                             cache.k[:, :, :, :256], cache.v[:, :, :, :256], model.causal(1))[1][0, 0]
    probs = target_probs(alone, params)
    expected = {t: float(p) for t, p in enumerate(probs.tolist()) if p > 0}
    assert chi_square_p(counts, expected, 2400) > 1e-3


def test_after_warm_up_no_request_compiles(batched, mt_bench_prompts):
    """What ``elesium serve`` promises by warming up at start: a burst of concurrent requests, with
    contexts on both sides of a window boundary (256 positions), compiles nothing, so no request waits
    on a compilation another one started."""
    from torch._dynamo.utils import counters

    engine = batched
    long_prompt = " ".join(mt_bench_prompts[50:56])  # past 256 tokens: a wider attention window
    prompts = [long_prompt, *mt_bench_prompts[60:65]]
    graphs_before = counters["stats"]["unique_graphs"]
    results: list[int] = []

    def run(prompt: str) -> None:
        results.append(len(engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0)).token_ids))

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == len(prompts) and len(engine.encode_prompt(long_prompt)) > 256
    assert counters["stats"]["unique_graphs"] == graphs_before


def test_a_full_engine_queue_is_a_429_with_retry_after():
    import asyncio

    from elesium.api.errors import _detail

    response = asyncio.run(_detail(None, EngineBusyError("the engine is busy: retry later")))  # type: ignore[arg-type]
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert b"retry later" in response.body


def test_a_long_prompt_is_prefilled_between_the_running_generations_steps(batched, mt_bench_prompts):
    """A ~450-token prompt arriving while three generations decode is prefilled a few blocks per
    iteration (``PREFILL_BLOCKS``): the others keep getting tokens while it prefills, and every
    generation, the long one included, gets exactly its tokens from the engine with no batcher."""
    from elesium.inference.batcher import PREFILL_BLOCKS
    from elesium.inference.runtime.forward import PREFILL_CHUNK

    engine, batcher = batched, batched.batcher
    long_prompt = " ".join(mt_bench_prompts[20:32])
    assert len(engine.encode_prompt(long_prompt)) > (PREFILL_BLOCKS + 2) * PREFILL_CHUNK
    short = [(p[:120], SamplingParams(max_tokens=60, temperature=0.0)) for p in mt_bench_prompts[:3]]
    jobs = [*short, (long_prompt, SamplingParams(max_tokens=8, temperature=0.7, top_p=0.95, seed=5))]
    engine.batcher = None
    try:
        solo = [engine.generate(p, params, mode="vanilla").token_ids for p, params in jobs]
    finally:
        engine.batcher = batcher
    timings: list = []
    engine.add_observer(timings.append)
    engine.prefix_cache.clear()  # the solo run above must not serve the long prompt's blocks
    split_before = batcher.split_prefills
    got: dict[int, tuple[int, ...]] = {}
    try:
        streams = [engine.stream(p, params, mode="vanilla") for p, params in short]
        readers = [iter(s) for s in streams]
        for reader in readers:  # all three decoding before the long one arrives
            next(reader)

        def drain(i: int) -> None:
            with streams[i]:
                for _ in readers[i]:
                    pass
                got[i] = streams[i].result.token_ids

        threads = [threading.Thread(target=drain, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        got[3] = engine.generate(jobs[3][0], jobs[3][1], mode="vanilla").token_ids
        for t in threads:
            t.join(120)
    finally:
        engine.remove_observer(timings.append)
    assert got == dict(enumerate(solo))
    assert batcher.split_prefills > split_before, "the long prompt was prefilled in one piece"
    long_timing = next(t for t in timings if t.prompt_tokens == len(engine.encode_prompt(long_prompt)))
    during = [at for t in timings if t is not long_timing for at in t.token_at
              if long_timing.gate_at < at < long_timing.first_token_at]
    assert during, "no running generation got a token while the long prompt was prefilled"


class _Waiting:
    """What admission reads of a generation: its tenant, its mode, its sampling (a greedy speculative one
    decodes plainly when it shares the batch) and whether it was cancelled."""

    def __init__(self, name: str, tenant: str | None, mode: str = "vanilla", *, greedy: bool = False) -> None:
        self.name, self.tenant, self.mode, self._cancel = name, tenant, mode, False
        self.params = SamplingParams() if greedy else SamplingParams(temperature=0.7, seed=1)
        self.timing = types.SimpleNamespace(mode=mode)
        self.policy = None

    def __repr__(self) -> str:
        return self.name


def test_admission_is_fair_between_tenants(engine):
    """A tenant's burst queued first does not hold every slot: the next free slot goes to the tenant
    holding the fewest, earliest arrival among equals, first come first served within a tenant."""
    from elesium.inference.batcher import Batcher

    batcher = Batcher(engine, 3, compiled=False)
    a = [_Waiting(f"a{i}", "acme") for i in range(5)]
    b = [_Waiting(f"b{i}", "bolt") for i in range(2)]
    anon = _Waiting("anon", None)
    for run in [*a, *b, anon]:
        batcher._wanted[run] = None  # type: ignore[index]
    batcher._admit()
    assert list(batcher._slot) == [a[0], b[0], anon]
    batcher.release(a[0])  # type: ignore[arg-type]
    batcher._admit()
    assert list(batcher._slot)[-1] == a[1]  # acme holds none again: its next in line
    batcher.release(anon)  # type: ignore[arg-type]
    batcher._admit()
    assert list(batcher._slot)[-1] == a[2]  # acme 1, bolt 1: the earliest arrival of the two
    batcher.release(b[0])  # type: ignore[arg-type]
    batcher._admit()
    assert list(batcher._slot)[-1] == b[1]  # acme 2, bolt 0: bolt's, though acme's queued first
    a[3]._cancel = True
    batcher.release(a[1])  # type: ignore[arg-type]
    batcher._admit()
    assert list(batcher._slot)[-1] == a[4]  # a cancelled request is skipped


def test_speculative_newcomers_are_admitted_beside_a_tree(engine):
    """Heads with a drafter cache no longer hold one tree at a time (``Batcher._own_drafter``): two
    sampled speculative newcomers and a vanilla one all get slots; a greedy speculative one admitted beside
    them goes plain."""
    from elesium.inference.batcher import Batcher

    assert engine.runner.drafter_cache is not None, "the shipped heads draft with a cache of their own"
    batcher = Batcher(engine, 4, compiled=False)
    runs = [_Waiting("t0", "x", "speculative"), _Waiting("t1", "x", "speculative"), _Waiting("v", "x")]
    for run in runs:
        batcher._wanted[run] = None  # type: ignore[index]
    batcher._admit()
    assert list(batcher._slot) == runs
    plain = _Waiting("g", "x", "speculative", greedy=True)
    batcher._wanted[plain] = None  # type: ignore[index]
    batcher._admit()
    assert list(batcher._slot) == [*runs, plain] and plain.mode == "vanilla" == plain.timing.mode


def test_the_tenant_reaches_the_generation(engine):
    """``GenerationRequest.tenant`` is what admission reads, and it changes no token (not compared)."""
    from elesium.inference.types import GenerationRequest

    request = GenerationRequest("hello", SamplingParams(max_tokens=2), tenant="acme")
    assert request == GenerationRequest("hello", SamplingParams(max_tokens=2), tenant="bolt")
    stream = engine.start(request)
    with stream:
        assert stream._run.tenant == "acme"
        assert [c for c in stream]



def _stopping(engine: Any, prompt: str, params: SamplingParams, first: int) -> SamplingParams:
    """``params`` with a stop string that ends ``prompt``'s output alone inside its first 20 tokens: the first
    two tokens from ``first`` on that decode to visible text (call it with the batcher off)."""
    plain = engine.generate(prompt, params, mode="vanilla")
    stop = next(t for t in (engine.tokenizer.decode(list(plain.token_ids[i:i + 2])) for i in range(first, 20))
                if t.strip())
    return dataclasses.replace(params, stop=(stop,))

def test_decoding_ahead_of_slow_consumers_keeps_their_output(batched, mt_bench_prompts):
    """With ``lookahead`` on (CUDA's default, here on the CPU step) the loop decodes rows before their slow
    consumers ask: each generation still gets its solo tokens and step records, greedy and seeded, a stop
    string ends the output where it ends alone, a stream closed half-way frees its slot, and the rows
    decoded ahead are counted."""
    engine, batcher = batched, batched.batcher
    prompts = mt_bench_prompts[40:44]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    sampled = SamplingParams(max_tokens=24, temperature=0.7, top_p=0.95, seed=11)
    engine.batcher = None
    try:
        stopping = _stopping(engine, prompts[2], greedy, 6)
        cases = [greedy, sampled, stopping, greedy]
        solo = [engine.generate(p, q, mode="vanilla") for p, q in zip(prompts, cases, strict=True)]
    finally:
        engine.batcher = batcher
    assert solo[2].finish_reason == "stop"
    ahead_before = batcher.ahead_rows
    batcher.lookahead = 8
    got: dict[int, object] = {}
    errors: list[BaseException] = []

    def consume(i: int) -> None:
        try:
            with engine.stream(prompts[i], cases[i], mode="vanilla") as stream:
                for n, _ in enumerate(stream):
                    time.sleep(0.05)  # slower than a step: the loop runs ahead
                    if i == 3 and n == 4:
                        stream.close()
                got[i] = stream.result if i != 3 else stream.state
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    finally:
        batcher.lookahead = 0
    assert not errors, errors
    assert batcher.ahead_rows > ahead_before, "nothing was decoded ahead"
    for i in range(3):
        result = got[i]
        assert result.token_ids == solo[i].token_ids, i  # type: ignore[attr-defined]
        assert result.text == solo[i].text and result.finish_reason == solo[i].finish_reason, i  # type: ignore[attr-defined]
        assert [s.tokens for s in result.steps] == [s.tokens for s in solo[i].steps], i  # type: ignore[attr-defined]
    assert got[3] == "closed"
    deadline = time.monotonic() + 30
    while batcher.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batcher.running == 0 and batcher.waiting == 0



def test_a_consumer_decoded_ahead_gets_its_first_token_at_once(batched, mt_bench_prompts):
    """With ``lookahead`` on, a waiting consumer is woken every ``WAKE_EVERY`` tokens, except for its first
    token: that one is published as soon as the prefill made it, not after the loop decoded ``WAKE_EVERY``
    more (seven steps of a sampled row on CUDA). The output is still the solo output."""
    from elesium.inference.batcher import WAKE_EVERY

    engine, batcher = batched, batched.batcher
    prompt = mt_bench_prompts[50]
    params = SamplingParams(max_tokens=24, temperature=0.7, top_p=0.95, seed=5)
    engine.batcher = None
    try:
        solo = engine.generate(prompt, params, mode="vanilla")
    finally:
        engine.batcher = batcher
    assert len(solo.token_ids) > WAKE_EVERY
    batcher.lookahead = 16
    try:
        with engine.stream(prompt, params, mode="vanilla") as stream:
            chunks = iter(stream)
            next(chunks)
            published_at_first = len(stream._run._text.token_ids)
            for _ in chunks:
                pass
            result = stream.result
    finally:
        batcher.lookahead = 0
    assert result is not None and result.token_ids == solo.token_ids
    # Woken at its first token: the loop had made one or two more by the time this thread ran, never
    # the WAKE_EVERY it waited for before.
    assert 1 <= published_at_first < WAKE_EVERY, published_at_first


def test_consumers_woken_at_the_next_steps_launch_keep_their_output(batched, mt_bench_prompts):
    """With ``defer_wakes`` (CUDA's default, here on the CPU step) the consumers of rows decoded ahead are
    woken when the next batched step starts, not at the end of the iteration that made their tokens: every
    generation still gets its solo tokens, none is left asleep (all four finish), and the wakes were in
    fact handed out at a step's launch."""
    engine, batcher = batched, batched.batcher
    prompts = mt_bench_prompts[52:56]
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    sampled = SamplingParams(max_tokens=20, temperature=0.7, top_p=0.95, seed=13)
    cases = [greedy, sampled, greedy, sampled]
    engine.batcher = None
    try:
        solo = [engine.generate(p, q, mode="vanilla") for p, q in zip(prompts, cases, strict=True)]
    finally:
        engine.batcher = batcher
    assert batcher._step is not None
    step = batcher._step
    at_launch: list[int] = []  # wakes held when a step started

    def launched() -> None:
        at_launch.append(len(batcher._held_wakes))
        batcher._flush_wakes()

    got: dict[int, object] = {}
    errors: list[BaseException] = []

    def consume(i: int) -> None:
        try:
            with engine.stream(prompts[i], cases[i], mode="vanilla") as stream:
                for _ in stream:
                    pass
                got[i] = stream.result
        except BaseException as exc:  # reported below
            errors.append(exc)

    batcher.lookahead, batcher.defer_wakes, step.on_launch = 8, True, launched
    try:
        threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not any(t.is_alive() for t in threads), "a consumer was left asleep"
    finally:
        batcher.lookahead, batcher.defer_wakes, step.on_launch = 0, False, batcher._flush_wakes
    assert not errors, errors
    for i, result in sorted(got.items()):
        assert result.token_ids == solo[i].token_ids, i  # type: ignore[attr-defined]
        assert [s.tokens for s in result.steps] == [s.tokens for s in solo[i].steps], i  # type: ignore[attr-defined]
    assert len(got) == 4
    assert sum(at_launch) > 0, "no wake was held until a step's launch"
    assert not batcher._held_wakes


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_chains_keep_each_generations_solo_tokens(batched, mt_bench_prompts, overlap):
    """With chains on (CUDA's default ``CHAIN_STEPS``, here on the CPU step) the loop runs several greedy
    steps per batch, each step's picks fed back as the next step's input: every generation still gets its
    solo tokens and step records, one whose ``max_tokens`` is not a multiple of the chain keeps exactly that
    many, a stop string ends the output where it ends alone, and a sampled generation in the batch (its
    tokens need the host's draw) makes the batch take single steps until it leaves.

    With ``overlap`` (CUDA's default) each chain is launched from the last one's tokens before they are
    handed out, and read back by a later iteration; the sampled row lands the chain in flight, and slow
    consumers leave rows out of an iteration's work while their tokens are in flight."""
    engine, batcher = batched, batched.batcher
    prompts = mt_bench_prompts[44:49]
    greedy = SamplingParams(max_tokens=22, temperature=0.0)
    short = SamplingParams(max_tokens=7, temperature=0.0)
    sampled = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.95, seed=3)
    engine.batcher = None
    try:
        stopping = _stopping(engine, prompts[2], greedy, 9)
        cases = [greedy, short, stopping, sampled, greedy]
        solo = [engine.generate(p, q, mode="vanilla") for p, q in zip(prompts, cases, strict=True)]
    finally:
        engine.batcher = batcher
    assert solo[2].finish_reason == "stop" and len(solo[1].token_ids) == 7
    chained_before, overlapped_before = batcher.chained_steps, batcher.overlapped_chains
    batcher.lookahead, batcher.chain_steps, batcher.overlap = 8, 4, overlap
    got: dict[int, object] = {}
    errors: list[BaseException] = []

    def consume(i: int) -> None:
        try:
            with engine.stream(prompts[i], cases[i], mode="vanilla") as stream:
                for _ in stream:
                    time.sleep(0.02)
                got[i] = stream.result
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    finally:
        batcher.lookahead, batcher.chain_steps, batcher.overlap = 0, 1, False
    assert not errors, errors
    assert batcher.chained_steps > chained_before, "no batch ran as a chain"
    assert (batcher.overlapped_chains > overlapped_before) == overlap
    for i, alone in enumerate(solo):
        result = got[i]
        assert result.token_ids == alone.token_ids, i  # type: ignore[attr-defined]
        assert result.text == alone.text and result.finish_reason == alone.finish_reason, i  # type: ignore[attr-defined]
        assert [s.tokens for s in result.steps] == [s.tokens for s in alone.steps], i  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while (batcher.running or batcher._in_flight is not None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batcher.running == 0 and batcher.waiting == 0
    assert batcher._in_flight is None, "a chain was left in flight"

def test_greedy_speculative_generations_sharing_the_batch_decode_plainly(batched, mt_bench_prompts):
    """A greedy speculative generation admitted while another holds a slot decodes as a row of the shared
    forward (``PLAIN_WHEN_SHARING``), with exactly the tokens speculative decoding gives it alone; one that
    is alone keeps drafting, a sampled one keeps its trees (its seeded draws depend on them), and with the
    setting off every speculative request drafts."""
    engine, batcher = batched, batched.batcher
    greedy = SamplingParams(max_tokens=24)
    sampled = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.95, seed=5)
    prompts = [p[:300] for p in mt_bench_prompts[40:43]]
    engine.batcher = None
    try:
        solo = [engine.generate(p, greedy, mode="speculative").token_ids for p in prompts]
        solo_sampled = engine.generate(prompts[1], sampled, mode="speculative").token_ids
    finally:
        engine.batcher = batcher
    first = engine.stream(prompts[0], greedy, mode="speculative")
    it = iter(first)
    head = list(next(it).token_ids)  # alone in the batch: it keeps its trees, and holds its slot
    assert first.mode == "speculative"
    plain_before, rows_before = batcher.plain_rows, batcher.batched_rows
    got: dict[int, object] = {}

    def run(i: int) -> None:
        got[i] = engine.generate(prompts[i], greedy, mode="speculative")

    threads = [threading.Thread(target=run, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i].mode for i in (1, 2)] == ["vanilla", "vanilla"]  # type: ignore[attr-defined]
    assert [got[i].token_ids for i in (1, 2)] == solo[1:]  # type: ignore[attr-defined]
    assert batcher.plain_rows == plain_before + 2 and batcher.batched_rows > rows_before
    rest = [t for chunk in it for t in chunk.token_ids]
    assert tuple(head + rest) == solo[0] and first.result.mode == "speculative"
    # Beside a vanilla generation: a sampled request keeps its trees, and with the setting off a greedy one
    # does too.
    holder = engine.stream(prompts[0], greedy, mode="vanilla")
    held = iter(holder)
    next(held)
    try:
        kept = engine.generate(prompts[1], sampled, mode="speculative")
        assert kept.mode == "speculative" and kept.token_ids == solo_sampled
        batcher.plain_when_sharing = None
        drafting = engine.generate(prompts[2], greedy, mode="speculative")
        assert drafting.mode == "speculative" and drafting.token_ids == solo[2]
    finally:
        batcher.plain_when_sharing = 1
        holder.close()
    assert batcher.running == 0


def test_speculative_generations_take_turns_in_the_drafter_cache(batched, mt_bench_prompts):
    """Sampled speculative generations share the runner's one drafter cache (``Batcher._own_drafter``): a
    second one runs to its end while the first, part-way, waits on a slow reader (it used to wait for the
    first to finish), then a third and the first decode at the same time, taking turns step by step; each
    gets exactly its solo tokens and accepts exactly its solo drafts' nodes at every step, which it would
    not if it drafted from another's drafter state."""
    engine, batcher = batched, batched.batcher
    prompts = [p[:250] for p in mt_bench_prompts[44:47]]
    params = [SamplingParams(max_tokens=16, temperature=0.7, top_p=0.95, seed=70 + i) for i in range(3)]
    engine.batcher = None
    try:
        solo = [engine.generate(p, q, mode="speculative") for p, q in zip(prompts, params, strict=True)]
    finally:
        engine.batcher = batcher

    def steps(result: Any) -> list[tuple[Any, ...]]:  # the drafts' trace: which nodes each step accepted
        return [(s.tree_size, tuple(s.accepted_nodes), tuple(s.tokens)) for s in result.steps]

    swaps = batcher.drafter_swaps
    first = engine.stream(prompts[0], params[0], mode="speculative")
    it = iter(first)
    head = [t for _ in range(2) for t in next(it).token_ids]  # it has drafted, and holds its slot
    got: dict[int, Any] = {}

    def run(i: int) -> None:
        got[i] = engine.generate(prompts[i], params[i], mode="speculative")

    second = threading.Thread(target=run, args=(1,))
    second.start()
    second.join(120)
    assert 1 in got, "the second speculative generation waited for the first"
    third = threading.Thread(target=run, args=(2,))
    third.start()
    rest = [t for chunk in it for t in chunk.token_ids]
    third.join(120)
    assert tuple(head + rest) == solo[0].token_ids and first.result.mode == "speculative"
    assert steps(first.result) == steps(solo[0])
    for i in (1, 2):
        assert got[i].mode == "speculative" and got[i].token_ids == solo[i].token_ids, i
        assert steps(got[i]) == steps(solo[i]), i
    assert batcher.drafter_swaps >= swaps + 2, "the generations never took turns"
    assert batcher.running == 0 and not batcher._drafter_saved
