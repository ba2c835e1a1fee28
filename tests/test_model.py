"""The base-model runtime: correct logits however the tokens are fed in."""

from __future__ import annotations

import random

import pytest
import torch

from elesium.inference.decoding.tree import Tree
from helpers import node_path


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def full_logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(len(ids) + 8)
    hidden = model(torch.tensor([ids]), torch.arange(len(ids)), cache, 0)[0]
    return model.logits(hidden)


def test_greedy_answer_contains_paris(engine):
    from elesium.inference.sampling import SamplingParams

    result = engine.generate("What is the capital of France?", SamplingParams(max_tokens=32), mode="vanilla")
    assert "Paris" in result.text
    assert result.finish_reason in ("eos", "length")


@torch.inference_mode()
def test_incremental_decode_matches_full_forward(engine):
    model = engine.model
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Explain photosynthesis briefly."}])[:40]
    expected = full_logits(model, ids)
    cache = model.new_cache(64)
    split = 25
    got = [model.logits(model(torch.tensor([ids[:split]]), torch.arange(split), cache, 0)[0])]
    for pos in range(split, len(ids)):
        got.append(model.logits(model(torch.tensor([[ids[pos]]]), torch.tensor([pos]), cache, pos)[0]))
    got_all = torch.cat(got)
    assert rel_err(got_all, expected) < 1e-4
    assert torch.equal(got_all.argmax(-1), expected.argmax(-1))


def random_tree(rng: random.Random, size: int) -> Tree:
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    depths = [0] * size
    for i in range(1, size):
        depths[i] = depths[parents[i]] + 1
    return Tree(tuple(parents), tuple(depths), tuple([-1] + [0] * (size - 1)))


@pytest.mark.parametrize("seed", [0, 1])
@torch.inference_mode()
def test_tree_forward_matches_sequential_paths(engine, seed):
    """The invariant speculative decoding rests on: one masked forward == each path decoded alone."""
    rng = random.Random(seed)
    model = engine.model
    prefix = engine.tokenizer.encode_chat([{"role": "user", "content": "List three colours."}])
    tree = random_tree(rng, 20)
    tokens = [rng.randrange(model.config.vocab_size) for _ in range(tree.size)]
    cache = model.new_cache(len(prefix) + tree.size + 8)
    model(torch.tensor([prefix]), torch.arange(len(prefix)), cache, 0)
    hidden = model(torch.tensor([tokens]), tree.positions(len(prefix)), cache, len(prefix),
                   tree.ancestors())[0]
    tree_logits = model.logits(hidden)
    for node in range(tree.size):
        path = node_path(tree, node)
        expected = full_logits(model, prefix + [tokens[n] for n in path])[-1]
        assert rel_err(tree_logits[node], expected) < 1e-4, f"node {node} (depth {tree.depths[node]})"


@torch.inference_mode()
def test_batched_padded_forward_matches_single(engine):
    model = engine.model
    prompts = [[1, 4093, 198, 6004, 2], [1, 4093, 198, 19556, 905, 30, 2, 198, 1]]
    width = max(map(len, prompts))
    cache = model.new_cache(width + 4, batch=2)
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    valid = torch.zeros(2, cache.max_len, dtype=torch.bool)
    positions = torch.zeros(2, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        valid[b, width - len(p):width] = True
        positions[b, width - len(p):] = torch.arange(len(p))
    hidden = model(tokens, positions, cache, 0, kv_valid=valid)
    for b, p in enumerate(prompts):
        assert rel_err(model.logits(hidden[b, -1]), full_logits(model, p)[-1]) < 1e-4


@torch.inference_mode()
def test_hf_export_round_trip(engine, weights, tmp_path):
    from elesium.inference.runtime.model import build_model
    from elesium.inference.weights.hf_files import read_hf_dir, write_hf_dir
    from elesium.inference.weights.loading import load_weights

    write_hf_dir(tmp_path, weights.config, engine.model.hf_state(), weights.tokenizer)
    config, state = read_hf_dir(tmp_path)
    assert config == weights.config
    again = build_model(config, state)
    ids = weights.tokenizer.encode_chat([{"role": "user", "content": "Hello!"}])
    assert torch.equal(full_logits(again, ids), full_logits(engine.model, ids))
    reloaded = load_weights(tmp_path)  # the public path, tokenizer included
    assert reloaded.tokenizer.encode_chat([{"role": "user", "content": "Hello!"}]) == ids


def test_unpermute_inverts_llama_cpp_permute():
    import numpy as np

    from elesium.inference.weights.gguf_file import unpermute_qk

    def permute(w, n_head):  # llama.cpp's convert script
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert np.array_equal(unpermute_qk(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


def test_weight_cache_is_used(weights, tmp_path, monkeypatch):
    from elesium.inference.weights import loading

    first = loading.load_weights(None, tmp_path)
    assert len(list((tmp_path / "weights").iterdir())) == 1

    def no_gguf(*_args, **_kwargs):
        raise AssertionError("the GGUF was re-read although a cache entry exists")

    monkeypatch.setattr(loading, "read_gguf", no_gguf)
    second = loading.load_weights(None, tmp_path)
    assert second.sha256 == first.sha256 == weights.sha256
    assert second.config == first.config
    name = "model.layers.3.self_attn.q_proj.weight"
    assert torch.equal(second.state[name], first.state[name])
