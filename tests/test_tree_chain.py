"""The self-feeding greedy tree step (runtime/tree_chain.py), run eagerly on the CPU.

On CUDA the step is captured in a graph; here its body runs as plain tensor code through the same
``start_tree_chain`` (warm-up included), so what the graph computes is checked without a GPU:
drafting, the device tree, verification, acceptance, the K/V moves of accepted paths and the state
the next step starts from. Greedy output must be vanilla's token for token, also when the chain
runs out of room and hands its state back to the host path.
"""

from __future__ import annotations

import pytest
import torch

from elesium.inference.decoding.speculative import TreeDecoder
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.decoding.vanilla import VanillaDecoder
from elesium.inference.drafters.attention_drafter import FeatureDrafter
from elesium.inference.drafters.hydra import HydraHeads
from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.sampling import Sampler, SamplingParams
from elesium.inference.training.drafter_training import drafter_loss, padded
from helpers import VOCAB, ChainRunner, tiny_model

PROMPT = [(5 * i + 1) % VOCAB for i in range(11)]


@pytest.fixture(scope="module")
def setup() -> tuple:
    """The tiny model and drafter-led Hydra heads, drafter and heads fitted to vanilla's continuation
    (so that drafts are accepted at every depth), and that continuation."""
    model = tiny_model(1, tie_word_embeddings=False)  # untied: its greedy text does not repeat one token
    torch.manual_seed(2)
    heads = HydraHeads(32, num_heads=3, num_layers=1, conditioning="chain")
    heads.drafter = FeatureDrafter.for_model(model.config)
    heads.eval().requires_grad_(False)
    params = SamplingParams(max_tokens=110)
    van = VanillaDecoder(ForwardRunner(model, model.new_cache(128)), params, Sampler(0))
    want = [van.prefill(PROMPT)]
    while len(want) < 110:
        want.extend(van.step(128 - van.offset)[0])
    seq = PROMPT + want
    tokens, valid = padded([seq], torch.device("cpu"))
    ids = torch.tensor(seq)
    hidden = model(ids[None], torch.arange(len(seq)), model.new_cache(len(seq)), 0)[0]
    k = heads.num_heads
    t = torch.arange(len(seq) - k - 1)
    path = ids[t[:, None] + 1 + torch.arange(k)]  # x_{t+1} .. x_{t+k}: what head j reads
    target = ids[t[:, None] + 2 + torch.arange(k)]  # x_{t+2} .. x_{t+k+1}: what head j guesses
    opt = torch.optim.AdamW([*heads.drafter.parameters(), *heads.heads.parameters()], lr=1e-2)
    with torch.enable_grad():
        heads.requires_grad_(True)
        for _ in range(20):
            logits = model.logits(heads.teacher_forced(model, hidden[t], path))  # [K, T, V]
            loss = drafter_loss(heads.drafter, model, tokens, valid) + torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), target.T.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        heads.requires_grad_(False)
    return model, heads, want


def decode(setup: tuple, max_tokens: int, nodes: int, runner: ChainRunner | None = None,
           temperature: float = 0.0, seed: int = 0,
           record_trees: bool = False) -> tuple[list[int], list, ChainRunner]:
    model, heads, _ = setup
    runner = runner or ChainRunner(model, model.new_cache(128), heads)
    policy = TreePolicy(kind="dynamic", max_nodes=nodes, topk=3, expand_width=4, adapt=False,
                        record_trees=record_trees)
    top_p = 0.95 if temperature else 1.0
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p)
    dec = TreeDecoder(runner, heads, params, Sampler(seed), policy)
    got = [dec.prefill(PROMPT)]
    records = []
    while len(got) < max_tokens:
        tokens, record = dec.step(128 - dec.offset)
        got.extend(tokens)
        records.append(record)
    return got[:max_tokens], records, runner


@torch.inference_mode()
@pytest.mark.parametrize("nodes", [6, 16])
def test_chained_greedy_tree_steps_equal_vanilla(setup: tuple, nodes: int) -> None:
    _, _, want = setup
    got, records, runner = decode(setup, 60, nodes)
    assert got == want[:60]
    assert len(runner.chains_started) == 1, "the chain should have carried the whole generation"
    lengths = [r.accepted_length for r in records]
    assert max(lengths) == 4, f"drafts should be accepted at every depth (accepted lengths {lengths})"
    if nodes < 10:
        assert min(lengths) < 4, f"small trees should also miss sometimes (accepted lengths {lengths})"
    # Accepted paths that are not the first nodes: their K/V had to move to contiguous slots.
    assert any(list(r.accepted_nodes) != list(range(r.accepted_length)) for r in records)
    assert all(r.tree_size == min(nodes, 1 + 3 * 13) for r in records)
    assert all(len(r.tokens) == r.accepted_length == len(r.accepted_nodes) for r in records)


@torch.inference_mode()
def test_a_chain_hands_back_when_the_cache_fills(setup: tuple) -> None:
    """Near the end of the cache no fixed-size step fits: the host path takes over from the chain's
    state (pending token, offset, the drafter's rows) and the output is still vanilla's."""
    _, _, want = setup
    got, records, runner = decode(setup, 110, 16)
    assert got == want
    chain_steps = sum(1 for r in records if r.predicted == 0.0 and r.tree_size == 16)
    assert 0 < chain_steps < len(records), "both the chain and the host path should have run"


@torch.inference_mode()
def test_a_second_generation_reuses_the_captured_step(setup: tuple) -> None:
    """The second chain of a runner replays the step captured for the first (no warm-up), from its own
    start state: its output is vanilla's too."""
    _, _, want = setup
    first, _, runner = decode(setup, 40, 6)
    graph = next(iter(runner.graphs.values()))[0]
    before = graph.replays
    second, _, _ = decode(setup, 40, 6, runner)
    assert first == second == want[:40]
    assert len(runner.graphs) == 1 and graph.replays > before


@torch.inference_mode()
def test_sampled_chain_replays_from_its_seed_and_hands_back(setup: tuple) -> None:
    """At T > 0 the chain samples on the device from the generation's own uniforms: the same seed gives
    the same tokens (also through a hand-back to the host path near a full cache, which continues
    from the Sampler after the chain's draws), a second setting gets its own graph, and another seed
    gives another text. Exactness itself: tests/test_exactness.py."""
    first, records, runner = decode(setup, 110, 16, temperature=0.8, seed=3)
    again, _, _ = decode(setup, 110, 16, runner, temperature=0.8, seed=3)
    other, _, _ = decode(setup, 110, 16, runner, temperature=0.8, seed=4)
    assert first == again and len(first) == 110
    assert other != first
    chain_steps = sum(1 for r in records if r.predicted == 0.0 and r.tree_size == 16)
    assert 0 < chain_steps < len(records), "both the chain and the host path should have run"
    assert any(r.accepted_length > 1 for r in records[:chain_steps]), "sampled drafts should be accepted"
    greedy, _, _ = decode(setup, 20, 16, runner)
    assert greedy == setup[2][:20]
    assert len(runner.graphs) == 2, "greedy and T = 0.8 each capture their own step"


@torch.inference_mode()
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_chain_records_its_trees_without_changing_a_token(setup: tuple, temperature: float) -> None:
    """With tree recording the chain captures a step of its own that also reads back every node's
    token, parent and draft probability; the tokens are the same as without it (sampled too), and each
    recorded tree holds the step's accepted path."""
    plain, plain_records, runner = decode(setup, 70, 16, temperature=temperature, seed=3)
    recorded, records, _ = decode(setup, 70, 16, runner, temperature=temperature, seed=3, record_trees=True)
    assert recorded == plain
    assert [r.tokens for r in records] == [r.tokens for r in plain_records]
    assert all(r.tree is None for r in plain_records)
    chain_steps = [r for r in records if r.predicted == 0.0 and r.tree_size == 16]
    assert chain_steps and all(r.tree is not None for r in records)
    for r in chain_steps:
        tree = r.tree
        assert len(tree.tokens) == len(tree.parents) == len(tree.probs) == r.tree_size
        assert tree.parents[0] == -1 and tree.probs[0] == 1.0
        assert all(0 <= tree.parents[n] < n for n in range(1, r.tree_size))
        assert all(0.0 <= p <= 1.0 for p in tree.probs)
        assert [tree.tokens[n] for n in r.accepted_nodes[1:]] == list(r.tokens[:-1])
        assert all(tree.parents[c] == p for p, c in zip(r.accepted_nodes, r.accepted_nodes[1:]))
    assert len(runner.graphs) == 2, "the recording step is captured of its own"
