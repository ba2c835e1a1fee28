"""Tree speculative decoding on the real model: exact greedy output, cache compaction, records."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from elesium.inference.decoding.drafts import FactoredDrafts
from elesium.inference.decoding.speculative import TreeDecoder
from elesium.inference.decoding.tree import Tree, top_paths
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.drafters.files import default_heads_dir, load_heads
from elesium.inference.records import StepRecord, normalize_mode
from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.sampling import Sampler, SamplingParams
from helpers import node_path

# A static tree of the usual shape: the first 24 paths of Medusa's sparse tree for 4 heads ("mc_sim_7b_63").
STATIC_PATHS = ((0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4),
                (2, 0),
                (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2))
POLICIES = {
    "static": TreePolicy(kind="static", static_paths=STATIC_PATHS),
    "dynamic": TreePolicy(kind="dynamic", max_nodes=24),
}


@pytest.fixture
def spec_engine(restored_engine):
    """The session engine with its shipped heads; tests here change its heads and policy, which are
    restored."""
    assert restored_engine.heads is not None, "the shipped draft heads did not load for the bundled model"
    return restored_engine


def test_top_paths_equals_brute_force():
    rng = random.Random(3)
    scores = [sorted((math.log(rng.random()) for _ in range(4)), reverse=True) for _ in range(3)]
    every = [p for d in range(1, 4) for p in itertools.product(range(4), repeat=d)]
    value = {p: sum(scores[i][r] for i, r in enumerate(p)) for p in every}
    for budget in (1, 2, 5, 17, 40):
        tree = top_paths(FactoredDrafts.from_scores(scores), budget)
        best = sorted(every, key=value.__getitem__, reverse=True)[: budget - 1]
        assert set(tree.paths[1:]) == set(best)
        assert all(p[:-1] in set(tree.paths) for p in tree.paths[1:])  # prefix-closed


def test_mode_names_and_the_legacy_alias():
    assert [normalize_mode(m) for m in ("vanilla", "speculative", "typical", "medusa")] == [
        "vanilla", "speculative", "typical", "speculative"]
    for bad in ("fast", "Speculative", ""):
        with pytest.raises(ValueError, match="unknown decoding mode") as err:
            normalize_mode(bad)
        assert "\n" not in str(err.value) and "speculative (alias medusa)" in str(err.value)


def test_tree_structure():
    tree = Tree.from_paths([(1, 0), (0,), (0, 2)])  # (1,) is added as the missing prefix
    assert tree.paths == ((), (0,), (1,), (0, 2), (1, 0))
    assert tree.parents == (-1, 0, 0, 1, 2) and tree.depths == (0, 1, 1, 2, 2)
    assert tree.children[0] == (1, 2)
    anc = tree.ancestors()
    assert anc[3].tolist() == [True, True, False, True, False]
    assert node_path(tree, 4) == [0, 2, 4]
    assert tree.truncated(3).paths == ((), (0,), (1,))


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
@pytest.mark.parametrize("name", ["static", "dynamic"])
def test_greedy_speculative_equals_vanilla(spec_engine, mt_bench_prompts, name, kind):
    """Both shipped head kinds: the default Hydra heads and the Medusa heads kept beside them."""
    if kind == "medusa":
        spec_engine.heads = load_heads(default_heads_dir().with_name("smollm2-135m-instruct-medusa"),
                                       base_sha256=spec_engine.weights_info.sha256)
    assert spec_engine.heads.fuses_drafts == (kind != "hydra")
    spec_engine.policy = POLICIES[name]
    accepted = []
    for prompt in mt_bench_prompts[:3]:
        params = SamplingParams(max_tokens=40)
        vanilla = spec_engine.generate(prompt, params, mode="vanilla")
        spec = spec_engine.generate(prompt, params, mode="speculative")
        assert spec.token_ids == vanilla.token_ids
        assert spec.text == vanilla.text
        accepted.append(spec.mean_accepted)
    assert max(accepted) > 1.0  # the trained heads do get drafts accepted


@torch.inference_mode()
def test_kv_compaction_matches_sequential_cache(spec_engine):
    model = spec_engine.model
    prompt = spec_engine.encode_prompt("Write a short note to a colleague about a delayed report.")
    cache = model.new_cache(len(prompt) + 200)
    runner = ForwardRunner(model, cache, spec_engine.heads)
    decoder = TreeDecoder(runner, spec_engine.heads, SamplingParams(), Sampler(0), POLICIES["static"])
    committed = [decoder.prefill(prompt)]
    multi = 0
    for _ in range(8):
        tokens, record = decoder.step()
        committed += tokens
        multi += record.accepted_length > 1 and record.accepted_nodes != tuple(range(record.accepted_length))
    # Everything but the pending token is in the cache, in order.
    ids = prompt + committed[:-1]
    assert decoder.offset == len(ids)
    fresh = model.new_cache(len(ids) + 1)
    model(torch.tensor([ids]), torch.arange(len(ids)), fresh, 0)
    n = len(ids)
    for got, want in ((cache.k, fresh.k), (cache.v, fresh.v)):
        err = float((got[:, :, :, :n] - want[:, :, :, :n]).norm() / want[:, :, :, :n].norm())
        assert err < 1e-5
    assert multi > 0, "no step moved a non-contiguous path, so compaction was not exercised"


def test_step_records_describe_the_output(spec_engine):
    spec_engine.policy = POLICIES["dynamic"]
    seen: list[StepRecord] = []
    # "medusa" is the legacy name of the speculative mode: accepted, and recorded as "speculative".
    result = spec_engine.generate("List five uses of a paperclip.", SamplingParams(max_tokens=48),
                                  mode="medusa",
                                  on_step=seen.append)
    assert result.mode == "speculative"
    assert list(result.steps) == seen and seen
    emitted = [t for s in result.steps for t in s.tokens]
    assert tuple(emitted[: result.new_tokens - 1]) == result.token_ids[1:]
    for s in result.steps:
        assert s.mode == "speculative" and s.accepted_nodes[0] == 0
        assert s.accepted_length == len(s.tokens) == len(s.accepted_nodes)
        assert s.tree_size >= s.accepted_length and s.elapsed_s > 0
        depth = s.accepted_length - 1
        assert s.accepted_by_depth == tuple(d <= depth for d in range(1, s.tree_depth + 1))
        assert StepRecord.from_dict(s.to_dict()) == s
        assert StepRecord.from_dict(s.to_dict() | {"mode": "medusa"}) == s  # records stored before the rename


def test_seeded_sampling_replays_and_stops_mid_step(spec_engine):
    spec_engine.policy = POLICIES["dynamic"]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=42)
    a = spec_engine.generate("Describe a sunrise.", params, mode="speculative")
    b = spec_engine.generate("Describe a sunrise.", params, mode="speculative")
    assert a.token_ids == b.token_ids and a.seed == 42
    # Greedy with a stop string: speculative and vanilla stop at the same character.
    full = spec_engine.generate("Count from 1 to 30 with commas.", SamplingParams(max_tokens=60),
                                mode="vanilla")
    middle = len(full.text) // 2
    stop = full.text[middle:middle + 3]  # lands somewhere inside a speculative step, most likely
    v = spec_engine.generate("Count from 1 to 30 with commas.", SamplingParams(max_tokens=60, stop=(stop,)),
                             mode="vanilla")
    m = spec_engine.generate("Count from 1 to 30 with commas.", SamplingParams(max_tokens=60, stop=(stop,)),
                             mode="speculative")
    assert m.text == v.text == full.text[: full.text.index(stop)]
    assert m.finish_reason == v.finish_reason == "stop"


def test_context_limit_is_respected(spec_engine):
    from elesium.inference.engine import Engine

    small = Engine(spec_engine.model, spec_engine.tokenizer, weights=spec_engine.weights_info,
                   heads=spec_engine.heads, policy=POLICIES["static"], max_len=80)
    prompt = "Tell me a long story about the sea."
    n_prompt = len(small.encode_prompt(prompt))
    vanilla = small.generate(prompt, SamplingParams(max_tokens=500), mode="vanilla")
    spec = small.generate(prompt, SamplingParams(max_tokens=500), mode="speculative")
    assert vanilla.finish_reason == spec.finish_reason == "length"
    # The cache holds every token but the last; both modes fill the context exactly.
    assert n_prompt + vanilla.new_tokens == 80 + 1
    assert spec.token_ids == vanilla.token_ids
