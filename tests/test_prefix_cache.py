"""The prefix cache serves exactly what the prefill would compute again, and only that.

Held to: the prefill's keys, values and hidden states bit for bit with and without a hit (the float32
reference and the default engine), generations' tokens greedy and seeded in both decoding modes, the
index (longest prefix, never the block holding the last prompt token, LRU within a byte budget), its
counters at ``/metrics`` and its setting.
"""

from __future__ import annotations

import pytest
import torch

from elesium.config import Settings, SettingsError
from elesium.inference.runtime import forward as fwd
from elesium.inference.runtime.model import KVCache
from elesium.inference.runtime.prefix_cache import PrefixCache, block_keys
from elesium.inference.sampling import SamplingParams
from tests.helpers import tiny_model

SYSTEM = ("You are the support assistant of Acme Cloud, a hosting company. Answer in two sentences at most, "
          "politely, and never promise refunds; point billing questions to the billing portal. ") * 4
QUESTIONS = ("How do I reset my password?", "Why is my invoice higher this month?",
             "Can I export my data to CSV?")


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _fresh_prefill(runner: fwd.ForwardRunner, ids: list[int], cache: PrefixCache | None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``runner.prefill(ids)`` with ``cache`` attached, into a zeroed cache; its hidden states, K and V."""
    saved_cache, saved_prefix = runner.cache, runner.prefix_cache
    c = runner.model.config
    kv = KVCache(c, 1, 512, runner.device, saved_cache.k.dtype)
    runner.cache, runner.prefix_cache = kv, cache
    try:
        with torch.inference_mode():
            hidden = runner.prefill(ids)
    finally:
        runner.cache, runner.prefix_cache = saved_cache, saved_prefix
    n = len(ids)
    return hidden.clone(), kv.k[:, :, :, :n].clone(), kv.v[:, :, :, :n].clone()


@pytest.mark.parametrize("fixture", ["engine", "default_engine"])
def test_a_hit_gives_the_prefills_own_bits(fixture: str, request: pytest.FixtureRequest) -> None:
    engine = request.getfixturevalue(fixture)
    runner = engine.runner
    first, second = (engine.encode_prompt(_messages(q)) for q in QUESTIONS[:2])
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= 2 * fwd.PREFILL_CHUNK, "the test needs two whole shared blocks"
    alone = _fresh_prefill(runner, second, None)
    cache = PrefixCache(64 << 20, fwd.PREFILL_CHUNK)
    _fresh_prefill(runner, first, cache)
    assert (cache.hits, len(cache)) == (0, len(first) // fwd.PREFILL_CHUNK)
    reused = _fresh_prefill(runner, second, cache)
    assert cache.hits == shared // fwd.PREFILL_CHUNK * fwd.PREFILL_CHUNK
    for a, b in zip(alone, reused, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["vanilla", "speculative"])
def test_generations_are_the_same_with_and_without_hits(default_engine, mode: str) -> None:
    engine = default_engine
    runs = [(q, SamplingParams(max_tokens=20)) for q in QUESTIONS]
    runs.append((QUESTIONS[0], SamplingParams(max_tokens=20, temperature=0.7, top_p=0.95, seed=7)))

    def outputs() -> list[tuple[int, ...]]:
        return [engine.generate(_messages(q), p, mode=mode).token_ids for q, p in runs]

    prefix = engine.prefix_cache
    assert prefix is not None and engine.runner.prefix_cache is prefix
    engine.runner.prefix_cache = None
    try:
        without = outputs()
    finally:
        engine.runner.prefix_cache = prefix
    prefix.clear()
    hits = prefix.hits
    with_hits = outputs()
    assert prefix.hits - hits >= (len(runs) - 1) * 2 * fwd.PREFILL_CHUNK  # every run after the first hit
    assert with_hits == without


def _filled(block: int, tokens: int, seed: int = 0) -> tuple[KVCache, torch.Tensor]:
    model = tiny_model(seed)
    cache = KVCache(model.config, 1, 64, "cpu", torch.float32)
    torch.manual_seed(seed)
    cache.k.normal_()
    cache.v.normal_()
    return cache, torch.randn(tokens, model.config.hidden_size)


def test_longest_prefix_and_never_the_last_tokens_block() -> None:
    cache = PrefixCache(1 << 20, block=4)
    ids = list(range(100, 112))  # three whole blocks
    kv, hidden = _filled(4, 12)
    cache.store(ids, kv, hidden, 0)
    assert len(cache) == 3
    assert len(cache.match(ids)) == 2  # the third block holds the last token: recomputed
    assert len(cache.match(ids + [7])) == 3
    assert len(cache.match(ids[:4] + [1, 2, 3, 4, 5])) == 1  # diverges in the second block
    assert cache.match([1] + ids) == []  # a shifted prompt shares no block
    got = cache.match(ids + [7])
    assert torch.equal(got[1].k, kv.k[:, 0, :, 4:8]) and torch.equal(got[2].hidden, hidden[8:12])
    assert (cache.queries, cache.hits) == (12 + 13 + 9 + 13 + 13, 4 * (2 + 3 + 1 + 3))


def test_least_recently_used_blocks_go_first_and_prefix_heads_last() -> None:
    kv, hidden = _filled(4, 8)
    one = PrefixCache(1 << 20, block=4)
    one.store(list(range(8)), kv, hidden, 0)
    per_block = one.bytes // 2
    cache = PrefixCache(3 * per_block, block=4)
    a, b = list(range(8)), list(range(50, 58))
    cache.store(a, kv, hidden, 0)
    cache.store(b, kv, hidden, 0)  # four blocks over a budget of three: a's tail goes
    assert len(cache) == 3 and cache.bytes <= cache.capacity_bytes
    assert len(cache.match(a + [0])) == 1 and len(cache.match(b + [0])) == 2
    assert block_keys(a, 4, 2)[0] != block_keys(b, 4, 2)[0]
    assert PrefixCache(per_block - 1, block=4).store(a, kv, hidden, 0) is None  # too small: keeps nothing


def test_metrics_and_setting(default_engine) -> None:
    from prometheus_client import generate_latest

    from elesium.api.metrics import Metrics

    prefix = default_engine.prefix_cache
    text = generate_latest(Metrics(engine=default_engine).registry).decode()
    assert float(_sample(text, "elesium_prefix_cache_queries")) == float(prefix.queries) > 0
    assert float(_sample(text, "elesium_prefix_cache_hits")) == float(prefix.hits)
    assert Settings.from_env({"ELESIUM_PREFIX_CACHE_MB": "0"}).prefix_cache_mb == "0"
    with pytest.raises(SettingsError, match="ELESIUM_PREFIX_CACHE_MB"):
        Settings.from_env({"ELESIUM_PREFIX_CACHE_MB": "lots"})


def test_zero_turns_it_off() -> None:
    from elesium.inference.engine import Engine

    model = tiny_model(3)
    assert Engine(model, None, prefix_cache_mb=0).prefix_cache is None  # type: ignore[arg-type]
    on = Engine(model, None, prefix_cache_mb=1)  # type: ignore[arg-type]
    assert on.prefix_cache is not None and on.runner.prefix_cache is on.prefix_cache


def _sample(text: str, name: str) -> str:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return line.split()[-1]
