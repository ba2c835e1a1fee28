"""Drafting no deeper than the tree can be (``TreePolicy.draft_levels``, ``HydraHeads.expand(levels)``).

A static chain of two drafts needs two levels of a four-head drafter; the other levels cost a head MLP
and a 49,152-wide ``lm_head`` product each and were thrown away. Drafting fewer levels must leave the
output vanilla's and the drafts the tree uses unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from elesium.inference.decoding.speculative import TreeDecoder
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.sampling import Sampler, SamplingParams
from test_tree_chain import PROMPT, setup  # noqa: F401  (setup is a fixture)


def run_static(setup: tuple, paths: tuple[tuple[int, ...], ...], tokens: int) -> tuple[list[int], list, list]:  # noqa: F811
    model, heads, _ = setup
    levels: list[int] = []
    advance = heads.advance

    def counting(k: int, *args: Any) -> Any:
        levels.append(k)
        return advance(k, *args)

    heads.advance = counting
    try:
        policy = TreePolicy(kind="static", static_paths=paths)
        dec = TreeDecoder(ForwardRunner(model, model.new_cache(128), heads), heads,
                          SamplingParams(max_tokens=tokens), Sampler(0), policy)
        got, records = [dec.prefill(PROMPT)], []
        while len(got) < tokens:
            step, record = dec.step(128 - dec.offset)
            got.extend(step)
            records.append(record)
    finally:
        del heads.advance
    return got[:tokens], records, levels


@torch.inference_mode()
def test_a_static_chain_drafts_only_its_depth_and_stays_vanilla(setup: tuple) -> None:  # noqa: F811
    _, heads, want = setup
    got, records, levels = run_static(setup, ((0,), (0, 0)), 50)
    assert got == want[:50]
    assert heads.num_heads == 3 and set(levels) == {0, 1}, f"levels drafted: {sorted(set(levels))}"
    assert max(r.accepted_length for r in records) == 3, "the chain's two drafts should be accepted"
    deep, _, deep_levels = run_static(setup, ((0,), (0, 0), (0, 0, 0)), 50)
    assert deep == want[:50] and set(deep_levels) == {0, 1, 2}
