"""The step loop's fast paths for vanilla step records, against the ones they replace.

``StepRecord.plain`` builds a vanilla step's record without the frozen dataclass's ``__init__``, and
``VanillaDecoder.take_chain`` takes a greedy chain's tokens in one call: the records they give must be the
records ``StepRecord(...)`` and ``take`` give, field for field and byte for byte once serialised (acceptance
entries are hash-chained by their bytes), and the decoder must end in the same state.
"""

from __future__ import annotations

import json
import random
from typing import Any, cast

import pytest

from elesium.inference.decoding.vanilla import VanillaDecoder
from elesium.inference.records import StepRecord
from elesium.inference.sampling import Sampler, SamplingParams


def _decoder(temperature: float = 0.0) -> VanillaDecoder:
    params = SamplingParams(max_tokens=64, temperature=temperature)
    decoder = VanillaDecoder(cast(Any, None), params, Sampler(7))  # taking tokens needs no runner
    decoder.offset, decoder.pending, decoder.steps = 40, 5, 3
    return decoder


@pytest.mark.parametrize("seed", range(5))
def test_plain_record_is_the_dataclass_record(seed: int) -> None:
    rng = random.Random(seed)
    step, token, elapsed = rng.randrange(10_000), rng.randrange(49_152), rng.random()
    fast = StepRecord.plain(step, token, elapsed)
    slow = StepRecord(step=step, mode="vanilla", tree_size=1, tree_depth=0, accepted_length=1,
                      accepted_nodes=(0,), tokens=(token,), accepted_by_depth=(), elapsed_s=elapsed)
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    assert json.dumps(fast.to_dict()) == json.dumps(slow.to_dict())
    assert StepRecord.from_dict(fast.to_dict()) == slow
    with pytest.raises(AttributeError):  # still frozen
        fast.step = 0  # type: ignore[misc]


def test_take_chain_is_take_token_by_token() -> None:
    chain = [17, 9, 4000, 2, 2]
    one, many = _decoder(), _decoder()
    singles = [one.take(None, t, 0.0) for t in chain]
    taken = many.take_chain(chain, 0.0)
    assert [tokens for tokens, _ in taken] == [tokens for tokens, _ in singles] == [[t] for t in chain]
    strip = [(r.step, r.tokens, r.mode, r.accepted_nodes) for _, r in taken]
    assert strip == [(r.step, r.tokens, r.mode, r.accepted_nodes) for _, r in singles]
    assert [r.step for _, r in taken] == [3, 4, 5, 6, 7]
    assert (many.offset, many.pending, many.steps) == (one.offset, one.pending, one.steps) == (45, 2, 8)
    assert many.take_chain([], 0.0) == [] and (many.offset, many.pending, many.steps) == (45, 2, 8)


def test_take_chain_refuses_a_sampled_decoder() -> None:
    with pytest.raises(ValueError, match="greedy"):
        _decoder(temperature=0.7).take_chain([1, 2], 0.0)
